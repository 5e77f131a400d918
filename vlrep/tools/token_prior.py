"""The image-blind floor of VirTex's token-classification loss on a config's training captions.

  python -m vlrep.tools.token_prior --config=configs/virtex.py:runlocal

The normalised multi-label cross-entropy (each caption's token set shares the target mass uniformly) is
minimised, without looking at images, by the captions' average target distribution q. A token classifier whose
loss plateaus near this value has learned the caption prior only.
"""

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from vlrep.data import pipeline, records, tokenizers

config_flags.DEFINE_config_file("config", None, "Run config.", lock_config=True)
FLAGS = flags.FLAGS


def image_blind_loss(token_sets: list[set[int]], vocab_size: int) -> float:
  q = np.zeros(vocab_size)
  for s in token_sets:
    for i in s:
      q[i] += 1 / len(s)
  q /= len(token_sets)
  return float(np.mean([np.mean([-np.log(q[i]) for i in s]) for s in token_sets]))


def main(argv):
  del argv

  c = FLAGS.config
  builder = pipeline.get_builder(c.data.name, c.data.data_dir, c.data.get("config_name"))
  tok = tokenizers.ensure_tokenizer(c.tokenizer, builder)
  sets = []
  for text in records.read_texts(builder, c.tokenizer.corpus_split, c.tokenizer.corpus_key):
    ids, _ = tok.encode(text, c.method.max_len)
    s = {int(i) for i in ids if i >= tokenizers.NUM_SPECIAL}
    if s:
      sets.append(s)
  print(
    f"{len(sets)} captions, vocabulary {tok.vocab_size}: image-blind loss {image_blind_loss(sets, tok.vocab_size):.3f}"
    f" (uniform {np.log(tok.vocab_size):.3f})"
  )


if __name__ == "__main__":
  app.run(main)
