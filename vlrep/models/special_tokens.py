"""The special token ids every vlrep tokenizer uses and the models rely on (padding masks, decoding starts and
stops, masked-token inputs). The caption tokenizer (vlrep.data.tokenizers) is built around them."""

PAD_ID, UNK_ID, SOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3, 4
NUM_SPECIAL = 5
