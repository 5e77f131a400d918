"""SentencePiece BPE caption tokenizer, as VirTex builds it; `ensure_tokenizer` gives a run's tokenizer of any kind
(`tokenizer.kind`: 'bpe' this one, 'wordpiece' a BERT's, 'clip_bpe' CLIP's byte-level BPE (vlrep.data.clip_bpe),
'siglip' SigLIP's SentencePiece model (vlrep.data.siglip_tokenizer)).

Captions are lowercased and stripped of accents before training and before encoding. Splitting by Unicode
script keeps letters and punctuation in separate pieces (no 'dog?' tokens). Special ids are fixed so that
models and losses can rely on them: [PAD]=0, [UNK]=1, [SOS]=2, [EOS]=3, [MASK]=4.

An official VirTex vocabulary (kdexd/virtex's `coco_10k.model`: <unk>=0, which is also its padding, [SOS]=1,
[EOS]=2, [MASK]=3, pieces from 4) is read with `tokenizer.special_tokens='virtex'` (what `vlrep.interop.import_run`
sets):
its ids are presented in vlrep's layout (`virtex_vocabulary_order`), one more id than the file has (vlrep's [UNK]
slot, which the official layout lacks and the tokenizer never produces), and captions are cut as the official
code cuts them ([SOS] + pieces + [EOS], then the first max_len ids: a long caption loses its [EOS]).
"""

from __future__ import annotations

import io
import os
import re
import unicodedata
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm
from absl import logging

from vlrep import errors, safe_files
from vlrep.data import records
from vlrep.data.clip_bpe import ClipTokenizer
from vlrep.data.siglip_tokenizer import SiglipTokenizer
from vlrep.data.wordpiece import WordPieceTokenizer
from vlrep.errors import UserError
from vlrep.models.bert import resolve_path
from vlrep.models.special_tokens import EOS_ID, MASK_ID, NUM_SPECIAL, PAD_ID, SOS_ID, UNK_ID  # noqa: F401


def normalize_text(text: str) -> str:
  """Lowercase and strip accents (NFKD, drop combining marks)."""
  text = unicodedata.normalize("NFKD", text.lower())
  return "".join(c for c in text if not unicodedata.combining(c)).strip()


class MissingTokenizer(UserError, FileNotFoundError):
  """The configured vocabulary file does not exist and is not to be built here (a run loaded from a folder never
  builds one: its paths are only read)."""


def train_tokenizer(captions: Iterable[str], model_path: str, vocab_size: int) -> None:
  """Trains a BPE model on captions and writes `model_path` (atomically, through safe_files). Only a training
  config the user gives (`vlrep.main`, `vlrep.tools.build_vocab`) asks for it: its `tokenizer.path`, or beside the
  dataset its `data.data_dir` names."""
  sentences = [normalize_text(c) for c in captions if c and c.strip()]
  if not sentences:
    raise ValueError("Cannot train a tokenizer: no non-empty captions were given.")
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(sentences),
    model_writer=proto,
    model_type="bpe",
    vocab_size=vocab_size,
    # Small corpora (synthetic_scenes) cannot fill a 10K vocabulary: cap instead of failing.
    hard_vocab_limit=False,
    character_coverage=1.0,
    split_by_unicode_script=True,
    split_by_number=True,
    pad_id=PAD_ID,
    unk_id=UNK_ID,
    bos_id=SOS_ID,
    eos_id=EOS_ID,
    pad_piece="[PAD]",
    unk_piece="[UNK]",
    bos_piece="[SOS]",
    eos_piece="[EOS]",
    user_defined_symbols=["[MASK]"],
    normalization_rule_name="identity",
    num_threads=2,
    minloglevel=2,
  )
  safe_files.make_dirs(os.path.dirname(os.path.abspath(model_path)))
  safe_files.write_bytes(model_path, proto.getvalue())  # a fresh temporary file, renamed: no link followed
  logging.info("Wrote tokenizer %s (%d sentences, vocab %d).", model_path, len(sentences), vocab_size)


SPECIAL_TOKEN_LAYOUTS = ("vlrep", "virtex")
# The official VirTex vocabulary's special pieces (kdexd/virtex scripts/build_vocabulary.py: SentencePiece's <unk>
# at 0, control symbols [SOS], [EOS], [MASK] after it; its configs' UNK_INDEX (= padding) 0, SOS_INDEX 1, EOS_INDEX 2,
# MASK_INDEX 3).
VIRTEX_SPECIAL_PIECES = ("<unk>", "[SOS]", "[EOS]", "[MASK]")


def virtex_vocabulary_order(official_size: int) -> np.ndarray:
  """For each vlrep id of an official VirTex vocabulary of `official_size` pieces, the official id it stands for:
  [PAD] <- <unk> (the official padding), [UNK] <- none (-1), [SOS], [EOS], [MASK] <- 1, 2, 3, pieces 5.. <- 4..."""
  return np.concatenate([np.array([0, -1, 1, 2, 3]), np.arange(4, official_size)]).astype(np.int64)


def virtex_ids_to_vlrep(ids: np.ndarray) -> np.ndarray:
  """Official VirTex token ids -> vlrep ids (<unk>/padding -> [PAD])."""
  ids = np.asarray(ids)
  return np.where(ids == 0, PAD_ID, ids + 1).astype(np.int32)


class _VirTexVocabulary:
  """A SentencePiece processor of an official VirTex vocabulary presented in vlrep's id layout: what `Tokenizer.sp`
  is for one, so that every user of `tokenizer.sp` (pieces of ids, ids of pieces) sees vlrep's ids."""

  def __init__(self, sp: spm.SentencePieceProcessor):
    self._sp = sp
    self._order = virtex_vocabulary_order(sp.get_piece_size())

  def get_piece_size(self) -> int:
    return len(self._order)

  def to_official(self, ids) -> list[int]:
    return [int(self._order[i]) if self._order[i] >= 0 else 0 for i in ids]

  def encode(self, text, **kwargs):
    if isinstance(text, list):
      return [virtex_ids_to_vlrep(np.asarray(x, np.int64)).tolist() for x in self._sp.encode(text, **kwargs)]
    return virtex_ids_to_vlrep(np.asarray(self._sp.encode(text, **kwargs), np.int64)).tolist()

  def decode(self, ids) -> str:
    return self._sp.decode(self.to_official(ids))

  def id_to_piece(self, i: int) -> str:
    return "[UNK]" if int(i) == UNK_ID else self._sp.id_to_piece(self.to_official([int(i)])[0])

  def piece_to_id(self, piece: str) -> int:
    return int(virtex_ids_to_vlrep(np.array([self._sp.piece_to_id(piece)]))[0])


class Tokenizer:
  """Encodes captions to fixed-length id arrays [SOS] ... [EOS] [PAD]...; decodes back.

  special_tokens: 'vlrep' (a vocabulary vlrep built) or 'virtex' (an official VirTex vocabulary, its ids presented
  in vlrep's layout; see the module docstring)."""

  def __init__(self, model_path: str, special_tokens: str = "vlrep"):
    if special_tokens not in SPECIAL_TOKEN_LAYOUTS:
      raise ValueError(
        f"Unknown tokenizer special_tokens {special_tokens!r}; known: {', '.join(SPECIAL_TOKEN_LAYOUTS)}."
      )
    if not os.path.exists(model_path):
      raise MissingTokenizer(
        f"Tokenizer model {model_path!r} does not exist. Build it with "
        f"`python -m vlrep.tools.build_vocab --config=CONFIG` (training runs build it on first use)."
      )
    self.path = model_path
    self.special_tokens = special_tokens
    with errors.reading(model_path, what="SentencePiece vocabulary"):
      sp = spm.SentencePieceProcessor(model_file=model_path)
    if special_tokens == "virtex":
      found = tuple(sp.id_to_piece(i) for i in range(min(4, sp.get_piece_size())))
      if found != VIRTEX_SPECIAL_PIECES:
        raise errors.BadFile(
          f"{model_path} is not an official VirTex vocabulary: its first pieces are {found}, expected "
          f"{VIRTEX_SPECIAL_PIECES} (kdexd/virtex scripts/build_vocabulary.py)."
        )
      self.sp = _VirTexVocabulary(sp)
    else:
      self.sp = sp
      if sp.piece_to_id("[MASK]") != MASK_ID or sp.bos_id() != SOS_ID or sp.pad_id() != PAD_ID:
        raise errors.BadFile(f"{model_path} was not built by vlrep (special token ids differ).")

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  def encode(self, text: str, max_len: int) -> tuple[np.ndarray, bool]:
    """Returns (ids[max_len], truncated). Long captions keep their first max_len-2 pieces and [EOS] (an official
    VirTex vocabulary: their first max_len ids of [SOS] pieces [EOS], as the official code cuts them)."""
    ids = self.sp.encode(normalize_text(text))
    truncated = len(ids) > max_len - 2
    if self.special_tokens == "virtex":
      ids = ([SOS_ID] + ids + [EOS_ID])[:max_len]
    else:
      ids = [SOS_ID] + ids[: max_len - 2] + [EOS_ID]
    out = np.full((max_len,), PAD_ID, np.int32)
    out[: len(ids)] = ids
    return out, truncated

  def encode_words(self, words: list[str]) -> list[list[int]]:
    """Pieces of each word separately (no specials): the same pieces as in the sentence, since SentencePiece
    marks each word's start with its whitespace symbol either way."""
    return self.sp.encode([normalize_text(w) for w in words]) if words else []

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    if SOS_ID in ids[:1]:
      ids = ids[1:]
    if EOS_ID in ids:
      ids = ids[: ids.index(EOS_ID)]
    return self.sp.decode([i for i in ids if i >= NUM_SPECIAL or i == UNK_ID])


def default_path(config, builder) -> str:
  """Next to the dataset's files, so a vocabulary belongs to one dataset version, corpus split and field."""
  # 'train[:5%]' -> train_5pct, 'train[5%:]' (own data's training part) -> train_from5pct.
  split = re.sub(r"\[([\d.]+)%:\]", r"_from\1pct", config.corpus_split)
  split = split.replace("[", "_").replace("]", "").replace(":", "").replace("%", "pct")
  # The corpus field is part of the name: a narration vocabulary is not a caption vocabulary.
  key = "" if config.corpus_key == "captions" else f"_{config.corpus_key}"
  return os.path.join(builder.data_dir, f"vlrep_bpe{config.vocab_size}_{split}{key}.model")


TOKENIZER_KINDS = ("bpe", "wordpiece", "clip_bpe", "siglip")
# Published vocabularies an imported run keeps in its folder (never built here): tokenizer.kind -> the class that
# reads tokenizer.path.
PUBLISHED_KINDS = {"clip_bpe": ClipTokenizer, "siglip": SiglipTokenizer}


def ensure_tokenizer(config, builder) -> Tokenizer | WordPieceTokenizer | ClipTokenizer | SiglipTokenizer:
  """Loads the configured tokenizer; builds it from the training captions first if it is missing and
  `config.build_if_missing` (only process 0 writes; the others wait)."""

  kind = config.get("kind", "bpe")
  if kind == "wordpiece":
    # A pretrained BERT's own vocabulary (ICMLM): config.path is the checkpoint folder ('minilm' = the packaged MiniLM).
    return WordPieceTokenizer(resolve_path(config.path))
  if kind in PUBLISHED_KINDS:
    # CLIP's merges file or SigLIP's SentencePiece model (an imported run keeps its copy in the run folder).
    if not config.get("path"):
      raise ValueError(f"tokenizer.kind={kind!r} needs tokenizer.path (the vocabulary the model was trained with).")
    return PUBLISHED_KINDS[kind](os.path.expanduser(config.path))
  if kind != "bpe":
    raise ValueError(f"Unknown tokenizer kind {kind!r}; known: {', '.join(TOKENIZER_KINDS)}.")
  special_tokens = config.get("special_tokens", "vlrep")
  # A published vocabulary (vlrep.interop.import_run copies it into the run): never built here.
  if special_tokens != "vlrep":
    if not config.path:
      raise ValueError(f"tokenizer.special_tokens={special_tokens!r} needs tokenizer.path (the vocabulary file).")
    return Tokenizer(os.path.expanduser(config.path), special_tokens)
  path = config.path or default_path(config, builder)
  if records.as_process_0_sees(not os.path.exists(path)):
    if not config.build_if_missing:
      raise MissingTokenizer(
        f"Tokenizer {path!r} does not exist. Build it with `python -m vlrep.tools.build_vocab --config=CONFIG`, "
        "or set tokenizer.build_if_missing=True in a training config. (A run loaded from a folder never builds its "
        "tokenizer: the paths its files name are only read. Copy the run's vocabulary to that path.)"
      )
    if records.jax_process_index() == 0:
      logging.info("Building tokenizer %s from %s/%s '%s'.", path, builder.name, config.corpus_split, config.corpus_key)
      train_tokenizer(records.read_texts(builder, config.corpus_split, config.corpus_key), path, config.vocab_size)
    records.sync_hosts("tokenizer")
  return Tokenizer(path)
