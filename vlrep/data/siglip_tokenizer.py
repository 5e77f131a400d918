"""SigLIP's tokenizer: a SentencePiece model (big_vision's and Hugging Face's `spiece.model`, e.g. the C4 English
32K vocabulary of the published SigLIP checkpoints) read as transformers' `SiglipTokenizer` reads it, so an imported
SigLIP text tower sees the ids it was trained on.

What `SiglipTokenizer(...)(text, padding='max_length', max_length=L, truncation=True)` gives, and this class's
`encode(text, L)` too: the text canonicalised (lowercased, ASCII punctuation removed, runs of whitespace made one
space, stripped), its pieces (at most L - 1), `</s>` appended and `</s>` (SigLIP's padding id) up to L. The literal
strings `</s>` and `<unk>` in a text are those tokens, as transformers splits them out before canonicalising
(the whitespace around them dropped, the text after them without a word-start mark). SigLIP's text tower pools the
last position, so texts are always padded to the tower's full length.

The interface is vlrep.data.tokenizers.Tokenizer's (`vocab_size`, `encode`, `encode_words`, `decode`);
`tokenizer.kind='siglip'` with `tokenizer.path` the model file selects it.
"""

from __future__ import annotations

import os
import re
import string

import numpy as np
import sentencepiece as spm

from vlrep import errors
from vlrep.errors import UserError

WORD_START = "\u2581"  # SentencePiece's whitespace mark
EOS_PIECE = "</s>"
UNK_PIECE = "<unk>"
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class MissingSiglipVocabulary(UserError, FileNotFoundError):
  """The configured SentencePiece model file does not exist."""


def canonicalize(text: str) -> str:
  """transformers' SiglipTokenizer.canonicalize_text (big_vision's tokenizer input): lowercase, no ASCII
  punctuation, single spaces, stripped."""
  text = text.lower().translate(_PUNCTUATION)
  return re.sub(r"\s+", " ", text).strip()


class SiglipTokenizer:
  """Encodes texts to SigLIP's fixed-length ids (pieces, `</s>`, `</s>` padding); decodes back."""

  def __init__(self, model_path: str):
    if not os.path.exists(model_path):
      raise MissingSiglipVocabulary(
        f"SigLIP SentencePiece model {model_path!r} does not exist (a Hugging Face SigLIP folder's spiece.model, or "
        "big_vision's vocabulary file)."
      )
    self.path = model_path
    with errors.reading(model_path, what="SentencePiece model"):
      self.sp = spm.SentencePieceProcessor(model_file=model_path)
    self.eos_id = self._special_id(EOS_PIECE)
    self.unk_id = self._special_id(UNK_PIECE)
    self.pad_id = self.eos_id  # transformers' SiglipTokenizer pads with </s>
    self._unk_length = len(self.sp.encode(UNK_PIECE, out_type=str))
    self._specials = re.compile(r"\s*(" + "|".join(re.escape(p) for p in (EOS_PIECE, UNK_PIECE)) + r")\s*")

  def _special_id(self, piece: str) -> int:
    i = self.sp.piece_to_id(piece)
    if self.sp.id_to_piece(i) != piece:
      raise errors.BadFile(f"{self.path} has no {piece!r} piece: not a SigLIP (T5-style) SentencePiece model.")
    return int(i)

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  def _chunk_pieces(self, chunk: str) -> list[str]:
    # transformers encodes '<unk>' + text and drops the pieces of '<unk>': the text's pieces as they follow
    # another token (a leading word-start mark kept only where the text has one).
    pieces = self.sp.encode(UNK_PIECE + canonicalize(chunk), out_type=str)
    return pieces[self._unk_length :] if len(pieces) >= self._unk_length else pieces

  def pieces(self, text: str) -> list[int]:
    """The ids of a text's pieces, without `</s>` (transformers' `tokenize` then `convert_tokens_to_ids`)."""
    text = WORD_START + text.replace(WORD_START, " ")
    parts = self._specials.split(text)  # odd entries: the special tokens
    tokens: list[str] = []
    for i, part in enumerate(parts):
      if i % 2:
        tokens.append(part)
      elif part:
        tokens += self._chunk_pieces(part)
    if len(tokens) > 1 and tokens[0] == WORD_START and tokens[1] in (EOS_PIECE, UNK_PIECE):
      tokens = tokens[1:]
    return [int(self.sp.piece_to_id(t)) for t in tokens]

  def encode(self, text: str, max_len: int) -> tuple[np.ndarray, bool]:
    """(ids [max_len] int32, truncated): the first max_len - 1 pieces, `</s>`, `</s>` padding."""
    ids = self.pieces(text)
    truncated = len(ids) > max_len - 1
    ids = ids[: max_len - 1] + [self.eos_id]
    out = np.full((max_len,), self.pad_id, np.int32)
    out[: len(ids)] = ids
    return out, truncated

  def encode_words(self, words: list[str]) -> list[list[int]]:
    """Pieces of each word separately (no `</s>`): each word as it starts a text, with its word-start mark, as
    within a sentence."""
    return [self.pieces(w) for w in words]

  def decode(self, ids) -> str:
    """The text of ids up to the first `</s>`."""
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[: ids.index(self.eos_id)]
    return self.sp.decode(ids)
