"""Preprocessing ops of the vision-and-language study (VisualBERT / ViLBERT): regions from boxes, text pairs from
captions, questions or entailment statements, BERT pair tokenization, and task targets.

An image carries several texts (5 captions, ~5 questions, 4 statements on synthetic_scenes); `vl_pairs` puts
`num` of them side by side ([num] strings with `pair_mask`), sampled per step for training or all of them, in
order, for evaluation. The model encodes each image's regions once and pairs them with each of its texts.
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow as tf

from vlrep.data import records, registry, vqa_answers

SOURCES = ("captions", "qa", "entailment", "plot")


@registry.register
def get_regions_from_objects(max_regions: int = 10, key: str = "objects"):
  """`boxes` float32[R, 4] (ymin, xmin, ymax, xmax in [0, 1]), `box_mask` bool[R] and `region_labels`
  int32[R] (-1 for padding) from the object annotations (synthetic_scenes, COCO), the first R objects. A dataset
  without objects gets R empty boxes (for the 'grid' region mode, which ignores them)."""

  def op(ex):
    ex = dict(ex)
    if key not in ex:
      ex["boxes"] = tf.zeros([max_regions, 4], tf.float32)
      ex["box_mask"] = tf.zeros([max_regions], tf.bool)
      ex["region_labels"] = tf.fill([max_regions], -1)
      return ex
    boxes = tf.cast(ex[key]["bbox"][:max_regions], tf.float32)
    labels = tf.cast(ex[key]["label"][:max_regions], tf.int32)
    n = tf.shape(boxes)[0]
    ex["boxes"] = tf.ensure_shape(tf.pad(boxes, [[0, max_regions - n], [0, 0]]), [max_regions, 4])
    ex["box_mask"] = tf.ensure_shape(tf.range(max_regions) < n, [max_regions])
    ex["region_labels"] = tf.ensure_shape(tf.pad(labels, [[0, max_regions - n]], constant_values=-1), [max_regions])
    return ex

  return op


@registry.register
def get_vl_pairs(source: str = "captions", num: int = 1, sample: bool = True, answer_as_text_b: bool = False):
  """`text_a`, `text_b` string[num], `answers` string[num, H], `label` int32[num], `pair_mask` bool[num].

  source: 'captions' (text_a = a caption), 'qa' (text_a = a question, answers = its H human answers: 10 for VQA
  2.0 and VizWiz, '' padded, 1 on synthetic_scenes; with `answer_as_text_b` one of them, sampled while training,
  is also the second segment: the study's "[CLS] question [SEP] answer" pretraining input), 'entailment'
  (text_a = a statement, label = entailment / contradiction / neutral), 'plot' (MM-IMDB: text_a = the plot).
  sample: a random `num` of the image's texts (training); otherwise its first `num`, in order (evaluation).
  Images with fewer texts are padded with empty, masked pairs; an image with none has pair_mask all False.
  """
  if source not in SOURCES:
    raise ValueError(f"Unknown vl_pairs source {source!r}; known: {SOURCES}")

  def op(ex):
    ex = dict(ex)
    if source == "captions":
      texts = ex["captions"]
      answers = tf.fill(tf.shape(texts), "")[:, None]
      labels = tf.zeros(tf.shape(texts), tf.int32)
    elif source == "qa":
      texts = ex["questions"]["question"]
      if "answers" in ex["questions"]:  # VQA 2.0 / VizWiz: the ten human answers [Q, 10] ('' padded)
        answers = ex["questions"]["answers"]
      else:  # synthetic_scenes: one answer per question
        answers = ex["questions"]["answer"][:, None]
      labels = tf.zeros(tf.shape(texts), tf.int32)
    elif source == "plot":  # MM-IMDB: the plot is the image's one text; the genres are the image's targets
      texts = ex["plot"][None]
      answers = tf.fill([1, 1], "")
      labels = tf.zeros([1], tf.int32)
    else:
      texts, labels = ex["entailment"]["statement"], tf.cast(ex["entailment"]["label"], tf.int32)
      answers = tf.fill(tf.shape(texts), "")[:, None]
    n = tf.shape(texts)[0]
    order = tf.range(n)
    if sample:
      rng = registry.next_rng(ex)
      order = tf.argsort(tf.random.stateless_uniform([n], rng))
    order = order[:num]
    k = tf.shape(order)[0]

    def take(values, fill):
      got = tf.gather(values, order)
      pad = tf.fill(tf.concat([[num - k], tf.shape(values)[1:]], 0), fill)
      return tf.concat([got, pad], 0)

    humans = answers.shape[-1]
    ex["text_a"] = tf.ensure_shape(take(texts, ""), [num])
    ex["answers"] = tf.ensure_shape(take(answers, ""), [num, humans])
    if answer_as_text_b:  # "[CLS] question [SEP] answer": one of the human answers, sampled while training
      pick = tf.zeros([num], tf.int32)
      if sample and humans > 1:
        given = tf.maximum(tf.reduce_sum(tf.cast(ex["answers"] != "", tf.int32), -1), 1)  # answers are '' padded
        draw = tf.random.stateless_uniform([num], tf.random.experimental.stateless_fold_in(rng, 1))
        pick = tf.minimum(tf.cast(draw * tf.cast(given, tf.float32), tf.int32), given - 1)
      ex["text_b"] = tf.gather(ex["answers"], pick, batch_dims=1)
    else:
      ex["text_b"] = tf.fill([num], "")
    ex["label"] = tf.ensure_shape(take(labels, 0), [num])
    ex["pair_mask"] = tf.ensure_shape(tf.range(num) < k, [num])
    return ex

  return op


@registry.register
def get_multihot_targets(num_classes: int, key: str = "genres", out: str = "targets", num: int = 1):
  """float32[num, num_classes] multi-hot targets from an image's label list (MM-IMDB's genres), repeated for the
  image's `num` text pairs (MM-IMDB has one: its plot)."""

  def op(ex):
    ex = dict(ex)
    labels = tf.cast(tf.reshape(ex[key], [-1]), tf.int32)
    hot = tf.reduce_max(tf.one_hot(labels, num_classes, dtype=tf.float32), 0)
    hot = tf.where(tf.size(labels) > 0, hot, tf.zeros([num_classes]))  # reduce_max of nothing is -inf
    ex[out] = tf.ensure_shape(tf.tile(hot[None], [num, 1]), [num, num_classes])
    return ex

  return op


@registry.register
def get_onehot_targets(num_classes: int, key: str = "label", out: str = "targets"):
  """float32[..., num_classes] one-hot targets from integer labels (SNLI-VE's 3 classes)."""

  def op(ex):
    ex = dict(ex)
    ex[out] = tf.one_hot(tf.cast(ex[key], tf.int32), num_classes, dtype=tf.float32)
    return ex

  return op


def encode_pair(tokenizer, text_a: str, text_b: str, max_len: int) -> tuple[np.ndarray, np.ndarray, bool]:
  """[CLS] a [SEP] (b [SEP]) as int32[max_len] ids and type ids (0 for a's segment, 1 for b's); when too long,
  the longer segment loses its last pieces first (BERT's truncation)."""
  a = [tokenizer.ids[p] for p in tokenizer.tokenize(text_a)]
  b = [tokenizer.ids[p] for p in tokenizer.tokenize(text_b)] if text_b else []
  budget = max_len - 3 if b else max_len - 2
  truncated = len(a) + len(b) > budget
  while len(a) + len(b) > budget:
    if len(a) >= len(b):
      a.pop()
    else:
      b.pop()
  ids = [tokenizer.cls_id] + a + [tokenizer.sep_id]
  types = [0] * len(ids)
  if b:
    ids += b + [tokenizer.sep_id]
    types += [1] * (len(b) + 1)
  out, out_types = np.zeros((max_len,), np.int32), np.zeros((max_len,), np.int32)
  out[: len(ids)], out_types[: len(types)] = ids, types
  return out, out_types, truncated


@registry.register_host
def get_tokenize_pairs(max_len: int, a: str = "text_a", b: str = "text_b", context=None):
  """BERT WordPiece pair tokenization on the host: `tokens` and `type_ids` int32[..., max_len] for string arrays
  `a` and `b` of any shape. Flags `stat_truncated` and `stat_empty` (a real pair whose text is empty: its
  pair_mask is cleared, so it is skipped and counted)."""
  tokenizer = (context or {}).get("tokenizer")
  if tokenizer is None or not hasattr(tokenizer, "cls_id"):
    raise ValueError("tokenize_pairs() needs a WordPiece tokenizer (tokenizer.kind='wordpiece'), given in context.")

  def fn(batch):
    batch = dict(batch)
    texts_a, texts_b = np.asarray(batch[a]), np.asarray(batch[b])
    shape = texts_a.shape
    dec = lambda t: t.decode("utf-8") if isinstance(t, bytes) else str(t)
    pairs = zip(texts_a.reshape(-1), texts_b.reshape(-1), strict=True)
    flat = [encode_pair(tokenizer, dec(x), dec(y), max_len) for x, y in pairs]
    batch["tokens"] = np.stack([f[0] for f in flat]).reshape(shape + (max_len,))
    batch["type_ids"] = np.stack([f[1] for f in flat]).reshape(shape + (max_len,))
    empty = np.array([not dec(x).strip() for x in texts_a.reshape(-1)]).reshape(shape)
    mask = np.asarray(batch["pair_mask"], bool)
    batch["stat_truncated"] = (np.array([f[2] for f in flat]).reshape(shape) & mask).reshape(-1)
    batch["stat_empty"] = (empty & mask).reshape(-1)
    batch["pair_mask"] = mask & ~empty
    return batch

  return registry.HostOp((a, b, "pair_mask"), ("tokens", "type_ids", "pair_mask", "stat_truncated", "stat_empty"), fn)


@registry.register_host
def get_answer_targets(key: str = "answers", out: str = "targets", context=None):
  """VQA soft scores float32[..., A] over the run's answer vocabulary (`context['answer_vocab']`) from the human
  answers string[..., H]. `stat_answer_oov` counts real questions none of whose answers is in the vocabulary
  (all-zero targets: trained towards 'none of these', scored 0 by the metric)."""
  vocab = (context or {}).get("answer_vocab")
  if not vocab:
    raise ValueError("answer_targets() needs the run's answer vocabulary; set config.answers (see configs/vlbert.py).")
  index = {a: i for i, a in enumerate(vocab)}

  def fn(batch):
    batch = dict(batch)
    answers = np.asarray(batch[key])
    lead = answers.shape[:-1]
    dec = lambda t: t.decode("utf-8") if isinstance(t, bytes) else str(t)
    per_question = answers.reshape(-1, answers.shape[-1])
    rows = [vqa_answers.soft_scores([dec(h) for h in humans if dec(h)], index) for humans in per_question]
    batch[out] = np.stack([r[0] for r in rows]).reshape(lead + (len(vocab),))
    mask = np.asarray(batch["pair_mask"], bool)
    batch["stat_answer_oov"] = (~np.array([r[1] for r in rows]).reshape(lead) & mask).reshape(-1)
    return batch

  return registry.HostOp((key, "pair_mask"), (out, "stat_answer_oov"), fn)


@registry.register_host
def get_generated_captions(path: str, key: str = "image_id", out: str = "text_a", context=None):
  """Replaces the captions of each image by those a captioner generated for it (`vlrep.tools.caption
  --output=PATH`: JSON {image_id: [captions]}); pair k takes generated caption k mod (number generated). Images
  missing from the file keep no text (pair_mask cleared) and are counted in `stat_no_generated`."""
  del context
  with open(path) as f:
    generated = {str(k): v for k, v in json.load(f).items()}
  if not generated:
    raise ValueError(f"{path} holds no generated captions.")

  def fn(batch):
    batch = dict(batch)
    ids = np.asarray(batch[key]).reshape(-1)
    mask = np.asarray(batch["pair_mask"], bool)
    texts = np.empty(mask.shape, dtype=object)
    missing = np.zeros(mask.shape, bool)
    for i, image_id in enumerate(ids):
      caps = generated.get(str(int(image_id)), [])
      for k in range(mask.shape[1]):
        texts[i, k] = caps[k % len(caps)] if caps else ""
      missing[i] = not caps
    batch[out] = texts
    batch["stat_no_generated"] = (missing & mask).reshape(-1)
    batch["pair_mask"] = mask & ~missing
    return batch

  return registry.HostOp((key, "pair_mask"), (out, "pair_mask", "stat_no_generated"), fn)


def read_answers(builder, split: str) -> list[list[str]]:
  """Every question's human answers in a split (the answer vocabulary's corpus), images skipped undecoded."""
  ds = records.examples(builder, split)
  out = []
  key = "answers" if "answers" in builder.info.features["questions"].feature.keys() else "answer"  # VQA 2.0 / synthetic
  for answers in ds.map(lambda e: e["questions"][key]).as_numpy_iterator():
    answers = answers.reshape(len(answers), -1)
    out.extend([[a.decode("utf-8") for a in row if a] for row in answers])  # '' pads missing human answers
  return out


def answer_vocab(config, builder) -> list[str]:
  """The run's answer vocabulary: the `config.size` most frequent answers of `config.split` (VQA's 3129)."""
  from absl import logging

  answers = read_answers(builder, config.split)
  if not answers:
    raise ValueError(f"{builder.name}/{config.split} has no questions to build an answer vocabulary from.")
  vocab = vqa_answers.build_answer_vocab(answers, config.size, config.get("min_count", 1))
  index = set(vocab)
  covered = sum(any(vqa_answers.normalize_answer(a) in index for a in humans) for humans in answers)
  logging.info(
    "Answer vocabulary: %d answers from %d questions of %s/%s; %.1f%% of the questions have an answer in it.",
    len(vocab),
    len(answers),
    builder.name,
    config.split,
    100.0 * covered / len(answers),
  )
  return vocab
