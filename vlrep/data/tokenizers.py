"""SentencePiece BPE caption tokenizer, as VirTex builds it.

Captions are lowercased and stripped of accents before training and before encoding. Splitting by Unicode
script keeps letters and punctuation in separate pieces (no 'dog?' tokens). Special ids are fixed so that
models and losses can rely on them: [PAD]=0, [UNK]=1, [SOS]=2, [EOS]=3, [MASK]=4.
"""

from __future__ import annotations

import io
import os
import unicodedata
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm
from absl import logging

from vlrep.data import records
from vlrep.data.wordpiece import WordPieceTokenizer
from vlrep.models.bert import resolve_path
from vlrep.models.special_tokens import EOS_ID, MASK_ID, NUM_SPECIAL, PAD_ID, SOS_ID, UNK_ID  # noqa: F401


def normalize_text(text: str) -> str:
  """Lowercase and strip accents (NFKD, drop combining marks)."""
  text = unicodedata.normalize("NFKD", text.lower())
  return "".join(c for c in text if not unicodedata.combining(c)).strip()


def train_tokenizer(captions: Iterable[str], model_path: str, vocab_size: int) -> None:
  """Trains a BPE model on captions and writes `model_path` (atomically)."""
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
  os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
  tmp = model_path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(proto.getvalue())
  os.replace(tmp, model_path)
  logging.info("Wrote tokenizer %s (%d sentences, vocab %d).", model_path, len(sentences), vocab_size)


class Tokenizer:
  """Encodes captions to fixed-length id arrays [SOS] ... [EOS] [PAD]...; decodes back."""

  def __init__(self, model_path: str):
    if not os.path.exists(model_path):
      raise FileNotFoundError(
        f"Tokenizer model {model_path!r} does not exist. Build it with "
        f"`python -m vlrep.tools.build_vocab --config=CONFIG` (training runs build it on first use)."
      )
    self.path = model_path
    self.sp = spm.SentencePieceProcessor(model_file=model_path)
    if self.sp.piece_to_id("[MASK]") != MASK_ID or self.sp.bos_id() != SOS_ID or self.sp.pad_id() != PAD_ID:
      raise ValueError(f"{model_path} was not built by vlrep (special token ids differ).")

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  def encode(self, text: str, max_len: int) -> tuple[np.ndarray, bool]:
    """Returns (ids[max_len], truncated). Long captions keep their first max_len-2 pieces and [EOS]."""
    ids = self.sp.encode(normalize_text(text))
    truncated = len(ids) > max_len - 2
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
  split = config.corpus_split.replace("[", "_").replace("]", "").replace(":", "").replace("%", "pct")
  # The corpus field is part of the name: a narration vocabulary is not a caption vocabulary.
  key = "" if config.corpus_key == "captions" else f"_{config.corpus_key}"
  return os.path.join(builder.data_dir, f"vlrep_bpe{config.vocab_size}_{split}{key}.model")


def ensure_tokenizer(config, builder) -> Tokenizer:
  """Loads the configured tokenizer; builds it from the training captions first if it is missing and
  `config.build_if_missing` (only process 0 writes; the others wait)."""

  if config.get("kind", "bpe") == "wordpiece":
    # A pretrained BERT's own vocabulary (ICMLM): config.path is the checkpoint folder ('minilm' = the packaged MiniLM).
    return WordPieceTokenizer(resolve_path(config.path))
  if config.get("kind", "bpe") != "bpe":
    raise ValueError(f"Unknown tokenizer kind {config.kind!r}; known: bpe, wordpiece.")
  path = config.path or default_path(config, builder)
  if not os.path.exists(path):
    if not config.build_if_missing:
      raise FileNotFoundError(
        f"Tokenizer {path!r} does not exist. Build it with `python -m vlrep.tools.build_vocab --config=CONFIG`, "
        "or set tokenizer.build_if_missing=True."
      )
    if records.jax_process_index() == 0:
      logging.info("Building tokenizer %s from %s/%s '%s'.", path, builder.name, config.corpus_split, config.corpus_key)
      train_tokenizer(records.read_texts(builder, config.corpus_split, config.corpus_key), path, config.vocab_size)
    records.sync_hosts("tokenizer")
  return Tokenizer(path)
