"""BERT's WordPiece tokenizer (uncased), reading a checkpoint folder's vocab.txt; no hub, no Rust dependency.

Basic tokenization as BERT: drop control characters, spaces around CJK characters, lowercase and strip accents,
split on whitespace and punctuation; then greedy longest-match-first WordPiece with '##' continuations, a word
that cannot be covered (or is longer than 100 characters) becoming [UNK]. Encoded captions are
[CLS] pieces [SEP] [PAD]...; the same `encode(text, max_len) -> (ids, truncated)` contract as the BPE tokenizer,
so the pipeline's `tokenize` op serves both.
"""

from __future__ import annotations

import os
import unicodedata

import numpy as np

from vlrep import errors
from vlrep.errors import BadFile
from vlrep.torch_files import MissingFile

MAX_WORD_CHARS = 100


def _is_punctuation(ch: str) -> bool:
  cp = ord(ch)
  # All non-letter/number ASCII counts as punctuation ('$', '`', '^'), as in BERT.
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
  return (
    0x4E00 <= cp <= 0x9FFF
    or 0x3400 <= cp <= 0x4DBF
    or 0x20000 <= cp <= 0x2A6DF
    or 0x2A700 <= cp <= 0x2B73F
    or 0x2B740 <= cp <= 0x2B81F
    or 0x2B820 <= cp <= 0x2CEAF
    or 0xF900 <= cp <= 0xFAFF
    or 0x2F800 <= cp <= 0x2FA1F
  )


def basic_tokenize(text: str, lower: bool = True) -> list[str]:
  """Whitespace/punctuation split with BERT's text cleaning, lowercasing and accent stripping."""
  out = []
  for ch in text:
    cp = ord(ch)
    if cp == 0 or cp == 0xFFFD:
      continue
    if ch in "\t\n\r" or unicodedata.category(ch) == "Zs":
      out.append(" ")
    elif unicodedata.category(ch).startswith("C"):
      continue
    elif _is_cjk(cp):
      out.append(f" {ch} ")
    else:
      out.append(ch)
  words = []
  for word in "".join(out).split():
    if lower:
      word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
    piece = ""
    for ch in word:
      if _is_punctuation(ch):
        if piece:
          words.append(piece)
        words.append(ch)
        piece = ""
      else:
        piece += ch
    if piece:
      words.append(piece)
  return words


class WordPieceTokenizer:
  """vocab.txt (one piece per line, the line number is the id) -> ids, with BERT's special tokens."""

  def __init__(self, vocab_path: str, lower: bool = True):
    if os.path.isdir(vocab_path):
      vocab_path = os.path.join(vocab_path, "vocab.txt")
    if not os.path.exists(vocab_path):
      raise MissingFile(f"WordPiece vocabulary {vocab_path!r} does not exist.")
    with errors.reading(vocab_path, what="WordPiece vocabulary (vocab.txt, UTF-8 text)"):
      with open(vocab_path, encoding="utf-8") as f:
        self.pieces = [line.rstrip("\n") for line in f]
    self.ids = {p: i for i, p in enumerate(self.pieces)}
    missing = [t for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") if t not in self.ids]
    if missing:
      raise BadFile(f"{vocab_path} lacks the special tokens {missing}: not a BERT vocabulary.")
    self.path, self.lower = vocab_path, lower
    self.pad_id, self.unk_id = self.ids["[PAD]"], self.ids["[UNK]"]
    self.cls_id, self.sep_id, self.mask_id = self.ids["[CLS]"], self.ids["[SEP]"], self.ids["[MASK]"]
    if self.pad_id != 0:
      raise BadFile(f"{vocab_path}: [PAD] must be id 0 (it is {self.pad_id}).")
    self.special_ids = frozenset(self.ids[p] for p in self.pieces if p.startswith("[") and p.endswith("]"))

  @property
  def vocab_size(self) -> int:
    return len(self.pieces)

  def word_pieces(self, word: str) -> list[str]:
    if len(word) > MAX_WORD_CHARS:
      return ["[UNK]"]
    pieces, start = [], 0
    while start < len(word):
      end = len(word)
      while end > start:
        piece = word[start:end] if start == 0 else "##" + word[start:end]
        if piece in self.ids:
          break
        end -= 1
      if end == start:
        return ["[UNK]"]
      pieces.append(piece)
      start = end
    return pieces

  def tokenize(self, text: str) -> list[str]:
    return [p for w in basic_tokenize(text, self.lower) for p in self.word_pieces(w)]

  def encode(self, text: str, max_len: int) -> tuple[np.ndarray, bool]:
    """[CLS] pieces [SEP] [PAD]... as int32[max_len]; long captions keep their first max_len-2 pieces."""
    ids = [self.ids[p] for p in self.tokenize(text)]
    truncated = len(ids) > max_len - 2
    ids = [self.cls_id] + ids[: max_len - 2] + [self.sep_id]
    out = np.zeros((max_len,), np.int32)
    out[: len(ids)] = ids
    return out, truncated

  def encode_words(self, words: list[str]) -> list[list[int]]:
    return [[self.ids[p] for w in basic_tokenize(word, self.lower) for p in self.word_pieces(w)] for word in words]

  def decode(self, ids) -> str:
    words: list[str] = []
    for i in ids:
      i = int(i)
      if i in (self.pad_id, self.cls_id):
        continue
      if i == self.sep_id:
        break
      p = self.pieces[i]
      if p.startswith("##") and words:
        words[-1] += p[2:]
      else:
        words.append(p)
    return " ".join(words)
