"""CLIP's byte-level BPE tokenizer (OpenAI's `simple_tokenizer.py`, open_clip's `SimpleTokenizer`), read from its
merges file `bpe_simple_vocab_16e6.txt.gz` (shipped inside `open-clip-torch` and OpenAI's `clip` package; an
imported run keeps a copy in its folder), with the interface of vlrep.data.tokenizers.Tokenizer.

Text is cleaned as open_clip's default ('lower'): `ftfy.fix_text`, HTML entities unescaped twice, whitespace runs
made one space, lowercased. It is split by CLIP's pattern (contractions, letter runs, single digits, runs of other
symbols; `regex`'s Unicode classes), each piece's UTF-8 bytes mapped to printable characters and merged by the
file's ranked merges. Ids: the 256 byte symbols, the same with the end-of-word mark `</w>`, one per merge, then
<start_of_text> 49406 and <end_of_text> 49407 (the vocabulary's last id: CLIP's text tower pools at the highest id).
A text is [<start_of_text>] + pieces + [<end_of_text>], padded with 0 (which is also the piece '!': padding is told
by position, after <end_of_text>); a text longer than the context keeps its first context - 1 ids and ends with
<end_of_text>, as open_clip.tokenize cuts it.

No torch and no open_clip are imported: `installed_vocabulary()` only finds the file inside an installed open_clip
package (for the importer to copy).
"""

from __future__ import annotations

import functools
import gzip
import html
import importlib.util
import os

import ftfy
import numpy as np
import regex

from vlrep import errors
from vlrep.errors import BadFile

VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
# The merges CLIP uses: the file's lines 1 .. 49152 - 256 - 2 (after its '#version' header), so that the
# vocabulary is 2 * 256 byte symbols + 48894 merges + 2 special tokens = 49408 ids.
NUM_MERGES = 49152 - 256 - 2
START_OF_TEXT = "<start_of_text>"
END_OF_TEXT = "<end_of_text>"
VOCAB_SIZE = 2 * 256 + NUM_MERGES + 2
SOT_ID = VOCAB_SIZE - 2  # 49406
EOT_ID = VOCAB_SIZE - 1  # 49407
PAD_ID = 0
CONTEXT_LENGTH = 77
_PATTERN = regex.compile(
  rf"{START_OF_TEXT}|{END_OF_TEXT}|'s|'t|'re|'ve|'m|'ll|'d|[\p{{L}}]+|[\p{{N}}]|[^\s\p{{L}}\p{{N}}]+",
  regex.IGNORECASE,
)


class MissingVocabulary(errors.UserError, FileNotFoundError):
  """No CLIP merges file where one was looked for."""


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
  """Each byte -> a printable character (the bytes that are printable Latin-1 characters stand for themselves; the
  others are mapped to 256 + n), so that BPE works on strings without whitespace or control characters."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs), strict=True))


def clean(text: str) -> str:
  """open_clip's 'lower' cleaning: ftfy, HTML entities unescaped twice, whitespace collapsed, lowercased."""
  text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
  return " ".join(text.split()).lower()


def installed_vocabulary() -> str | None:
  """The merges file inside an installed open_clip package (found, not imported), or None."""
  spec = importlib.util.find_spec("open_clip")
  if spec is None or not spec.submodule_search_locations:
    return None
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, VOCAB_FILE)
    if os.path.isfile(path):
      return path
  return None


def read_merges(path: str) -> list[tuple[str, str]]:
  """The ranked merges CLIP uses from a `bpe_simple_vocab_16e6.txt.gz` file; anything else is a BadFile naming it."""
  if not os.path.exists(path):
    raise MissingVocabulary(f"No CLIP vocabulary file {path} (open_clip's {VOCAB_FILE}).")
  hint = f"Pass CLIP's merges file, {VOCAB_FILE} (inside the open-clip-torch package)."
  with errors.reading(path, what="CLIP BPE merges file (gzip)", hint=hint):
    with gzip.open(path) as f:
      lines = f.read(64 * 2**20).decode("utf-8").split("\n")
  merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
  bad = next((i for i, m in enumerate(merges) if len(m) != 2), None)
  if len(merges) < NUM_MERGES or bad is not None:
    where = f"line {bad + 2} is {' '.join(merges[bad])!r}" if bad is not None else f"it has {len(merges)} merges"
    raise BadFile(f"{path} is not CLIP's merges file: {where}; CLIP's has {NUM_MERGES} pairs after a header line.")
  return merges


class ClipTokenizer:
  """CLIP's BPE tokenizer (module docstring), with vlrep.data.tokenizers.Tokenizer's interface."""

  def __init__(self, path: str):
    self.path = path
    merges = read_merges(path)
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [START_OF_TEXT, END_OF_TEXT]
    self.encoder = {piece: i for i, piece in enumerate(vocab)}
    self.decoder = vocab
    self.ranks = {m: i for i, m in enumerate(merges)}
    self.byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    self._cache = {START_OF_TEXT: START_OF_TEXT, END_OF_TEXT: END_OF_TEXT}

  @property
  def vocab_size(self) -> int:
    return len(self.decoder)

  def _bpe(self, token: str) -> list[str]:
    """The pieces of one pre-split token (its bytes as characters), merged by rank, the last marked `</w>`."""
    if token in self._cache:
      return self._cache[token].split(" ")
    word = tuple(token[:-1]) + (token[-1] + "</w>",)
    while len(word) > 1:
      pairs = set(zip(word[:-1], word[1:], strict=True))
      best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
      if best not in self.ranks:
        break
      merged, i = [], 0
      while i < len(word):
        if i < len(word) - 1 and (word[i], word[i + 1]) == best:
          merged.append(word[i] + word[i + 1])
          i += 2
        else:
          merged.append(word[i])
          i += 1
      word = tuple(merged)
    self._cache[token] = " ".join(word)
    return list(word)

  def pieces(self, text: str) -> list[int]:
    """The ids of a text's pieces (cleaned; no start or end token)."""
    encode = bytes_to_unicode()
    ids = []
    for token in _PATTERN.findall(clean(text)):
      ids.extend(self.encoder[p] for p in self._bpe("".join(encode[b] for b in token.encode("utf-8"))))
    return ids

  def encode(self, text: str, max_len: int = CONTEXT_LENGTH) -> tuple[np.ndarray, bool]:
    """(ids int32 [max_len], truncated): <start_of_text> pieces <end_of_text>, padded with 0; a longer text keeps
    its first max_len - 1 ids and <end_of_text> (open_clip.tokenize)."""
    if max_len < 2:
      raise ValueError(f"A CLIP text needs at least 2 positions (start and end of text); max_len={max_len}.")
    ids = [SOT_ID, *self.pieces(text), EOT_ID]
    truncated = len(ids) > max_len
    if truncated:
      ids = ids[: max_len - 1] + [EOT_ID]
    out = np.full((max_len,), PAD_ID, np.int32)
    out[: len(ids)] = ids
    return out, truncated

  def encode_words(self, words: list[str]) -> list[list[int]]:
    """The pieces of each word alone (no special tokens): a word's pieces in a sentence, since CLIP's pattern
    splits at spaces and every word ends with `</w>` either way."""
    return [self.pieces(w) for w in words]

  def decode(self, ids) -> str:
    """The text of ids (after <start_of_text>, up to <end_of_text>), pieces joined, `</w>` read as a space."""
    ids = [int(i) for i in ids]
    if ids[:1] == [SOT_ID]:
      ids = ids[1:]
    if EOT_ID in ids:
      ids = ids[: ids.index(EOT_ID)]
    text = "".join(self.decoder[i] for i in ids if 0 <= i < SOT_ID)
    raw = bytearray(self.byte_decoder[c] for c in text)
    return raw.decode("utf-8", errors="replace").replace("</w>", " ").strip()

  def id_to_piece(self, i: int) -> str:
    return self.decoder[int(i)]
