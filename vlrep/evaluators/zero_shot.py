"""Zero-shot classification with a method's text side, no training: each class's name, put into prompt templates, is
matched against each image.

Class names are the dataset's TFDS ClassLabel names (`class_key`, e.g. 'label' or 'objects/label'; underscores
read as spaces) unless the config lists `class_names`. Each name fills every template of `templates` ('{}' marks
the name; with `articles`, 'a' before a vowel becomes 'an'), and the prompts are encoded with the run's tokenizer.
How an image and a class are scored depends on what the method has (`scoring='auto'` picks the first):

  embed                    contrastive towers (CLIP, SigLIP, LocTex, MCT): a class's embedding is the mean over
                           templates of its prompts' l2-normalised text embeddings, normalised again; the score is
                           its cosine with the image's embedding.
  caption_log_likelihood   captioners (VirTex): the score is the mean over templates of log p(prompt | image), the
                           prompt's tokens after [SOS] up to [EOS] teacher-forced; with `length_normalize`, each
                           log-likelihood is divided by its prompt's token count first (so a class whose name has
                           more pieces is not penalised for its length). With `class_posterior` (the default), the
                           scores are then each image's log posterior over the classes (a log-softmax over classes,
                           a uniform prior): an image's own likelihood scale, e.g. a busy scene making every short
                           prompt less likely, cancels, so one class's scores rank images by that class; top-1 is
                           unchanged (the same order within each image).

Metrics follow the label field the preprocessing gives (`label_key`): one class id per image (a scalar ClassLabel,
or synthetic_scenes' `largest_object_label`) gives `top1` (%; a tie at the top shares its credit among the tied
classes, so a scorer that cannot tell classes apart scores chance) and `chance` (100 / classes); a vector per image
(`voc_labels`' 1 present / 0 difficult / -1 absent, difficult images left out of that class's AP; or a 0/1
multi-hot) gives `map` (the mean over classes of scikit-learn's average precision, %) and `chance` (the mean
positive rate, %: a random ranking's expected AP).

Config: dataset, data_dir, config_name, split, pp (must give 'image' and `label_key`), label_key, class_key,
class_names, templates, articles, max_len (prompt tokens), scoring ('auto' | 'embed' | 'caption'),
length_normalize, class_posterior, batch_size, prompts_per_call (captioners: prompts scored per jitted call), limit
(first N images; 0 = all), every_steps.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from vlrep import methods, modules
from vlrep.data import records
from vlrep.errors import UserError
from vlrep.evaluators._inputs import EvalInputs, Model
from vlrep.evaluators.voc07_svm import average_precision
from vlrep.models import special_tokens

# Selecting a checkpoint by these is selection on the split they score (the config's `split`).
TEST_METRICS = ("top1", "map")

DEFAULT_TEMPLATES = (
  "a photo of a {}.",
  "a picture of a {}.",
  "an image of a {}.",
  "a photo of the {}.",
)
DEFAULT_MAX_LEN = 24  # prompt tokens: every template with a class name of a few words
SCORINGS = ("auto", "embed", "caption")
_SCORING_ATTR = {"embed": "embed", "caption": "caption_log_likelihood"}


# -- prompts and class names --------------------------------------------------------------------------------------
def prompts(class_names, templates, articles: bool = True) -> list[str]:
  """Every class's name in every template, class-major: [c0 t0, c0 t1, ..., c1 t0, ...]."""
  if not templates or any("{}" not in t for t in templates):
    raise UserError(f"zero_shot templates must be a non-empty list of strings with '{{}}'; got {list(templates)!r}.")
  out = []
  for name in class_names:
    for template in templates:
      text = template.format(name)
      out.append(re.sub(r"\b([Aa]) (?=[aeiouAEIOU])", r"\1n ", text) if articles else text)
  return out


def _feature_at(features, key: str):
  """The feature at a '/'-separated path, looking through Sequences; (feature, whether a Sequence was crossed)."""
  feature, in_sequence = features, False
  for part in key.split("/"):
    while isinstance(feature, tfds.features.Sequence):
      feature, in_sequence = feature.feature, True
    if not isinstance(feature, tfds.features.FeaturesDict) or part not in feature.keys():
      return None, in_sequence
    feature = feature[part]
  while isinstance(feature, tfds.features.Sequence):
    feature, in_sequence = feature.feature, True
  return feature, in_sequence


def class_label_keys(features, prefix: str = "") -> list[str]:
  """The '/'-paths of every ClassLabel in a dataset's features."""
  while isinstance(features, tfds.features.Sequence):
    features = features.feature
  if isinstance(features, tfds.features.ClassLabel):
    return [prefix]
  if not isinstance(features, tfds.features.FeaturesDict):
    return []
  return [k for name in features.keys() for k in class_label_keys(features[name], f"{prefix}/{name}".lstrip("/"))]


def class_names(builder, class_key: str) -> list[str]:
  """The names of the ClassLabel at `class_key` in the dataset's features, underscores read as spaces."""
  feature, _ = _feature_at(builder.info.features, class_key)
  if not isinstance(feature, tfds.features.ClassLabel) or not feature.names:
    raise UserError(
      f"zero_shot: {builder.name} has no named ClassLabel at class_key={class_key!r}; its ClassLabels are "
      f"{class_label_keys(builder.info.features) or 'none'} (or list the classes in class_names)."
    )
  return [n.replace("_", " ") for n in feature.names]


# -- scores --------------------------------------------------------------------------------------------------------
def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def class_embeddings(text_emb: np.ndarray, num_templates: int) -> np.ndarray:
  """[C * T, D] prompt embeddings (class-major) -> [C, D]: the mean of each class's normalised prompt embeddings,
  normalised."""
  per_class = l2_normalize(np.asarray(text_emb, np.float64)).reshape(-1, num_templates, text_emb.shape[-1])
  return l2_normalize(per_class.mean(axis=1))


def template_mean(prompt_scores: np.ndarray, num_templates: int, lengths: np.ndarray | None = None) -> np.ndarray:
  """[N, C * T] per-prompt log-likelihoods (class-major) -> [N, C], the mean over templates; divided by each
  prompt's token count first when `lengths` [C * T] is given."""
  s = np.asarray(prompt_scores, np.float64)
  if lengths is not None:
    s = s / np.maximum(np.asarray(lengths, np.float64), 1.0)
  return s.reshape(len(s), -1, num_templates).mean(axis=2)


def class_posterior(scores: np.ndarray) -> np.ndarray:
  """[N, C] log-likelihoods -> [N, C] log p(class | image) under a uniform class prior: a log-softmax over classes."""
  s = np.asarray(scores, np.float64)
  top = s.max(axis=1, keepdims=True)
  return s - top - np.log(np.exp(s - top).sum(axis=1, keepdims=True))


def prompt_lengths(tokens: np.ndarray) -> np.ndarray:
  """The tokens a caption log-likelihood sums over: those after [SOS], up to and including [EOS]."""
  return (np.asarray(tokens) != special_tokens.PAD_ID).sum(axis=1) - 1


# -- metrics -------------------------------------------------------------------------------------------------------
def top1_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
  """Top-1 (%) of [N, C] scores for [N] class ids; an image whose true class ties with k others at the top gets
  1 / (k + 1): the expected accuracy of breaking the tie at random."""
  top = scores == scores.max(axis=1, keepdims=True)
  hit = top[np.arange(len(labels)), labels]
  return float(np.mean(hit / top.sum(axis=1)) * 100)


def mean_average_precision(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """(mAP, chance) in % of [N, C] scores for [N, C] targets: 1 present, -1 absent, 0 difficult (left out of that
  class's AP), or a 0/1 multi-hot when no target is negative. Classes without a positive are skipped; chance is
  the mean over the scored classes of their positive rate (a random ranking's expected AP)."""
  labels = np.asarray(labels).astype(np.int64)
  if labels.min(initial=0) >= 0:
    labels = np.where(labels > 0, 1, -1)
  aps, rates = [], []
  for c in range(labels.shape[1]):
    keep = labels[:, c] != 0
    y = labels[keep, c]
    if not (y > 0).any():
      continue
    aps.append(average_precision(scores[keep, c], y))
    rates.append(float(np.mean(y > 0)))
  if not aps:
    return float("nan"), float("nan")
  return float(np.mean(aps) * 100), float(np.mean(rates) * 100)


def zero_shot_metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """{top1, chance} for [N] class ids, {map, chance} for [N, C] multi-label targets."""
  labels = np.asarray(labels)
  num_classes = scores.shape[1]
  if labels.ndim == 1:
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
      raise UserError(f"zero_shot: class ids outside [0, {num_classes}): the labels do not match the class names.")
    return {"top1": top1_accuracy(scores, labels.astype(np.int64)), "chance": 100.0 / num_classes}
  if labels.ndim == 2 and labels.shape[1] == num_classes:
    m, chance = mean_average_precision(scores, labels)
    return {"map": m, "chance": chance}
  raise UserError(
    f"zero_shot: labels of shape {labels.shape[1:]} per image for {num_classes} classes: expected one class id "
    f"(single-label) or one target per class (multi-label)."
  )


# -- the method's text side ----------------------------------------------------------------------------------------
def methods_with_text_side() -> dict[str, list[str]]:
  """{scoring: [vlrep's methods whose `Method` class has its function]}, each method looked up as any other."""
  classes = {name: modules.get("methods", name, "method").Method for name in modules.available("methods")}
  return {
    scoring: [name for name, cls in classes.items() if callable(getattr(cls, attr, None))]
    for scoring, attr in _SCORING_ATTR.items()
  }


def scoring_of(method, wanted: str = "auto") -> str:
  """'embed' or 'caption': how `method` scores images against prompts; a UserError for a method without that."""
  if wanted not in SCORINGS:
    raise UserError(f"zero_shot scoring={wanted!r}; expected one of {SCORINGS}.")
  for scoring in ("embed", "caption") if wanted == "auto" else (wanted,):
    if callable(getattr(method, _SCORING_ATTR[scoring], None)):
      return scoring
  have = methods_with_text_side()
  name = methods.name_of(method)
  raise UserError(
    f"Zero-shot classification needs a method with a text side, and this run's {name} has "
    f"{'no ' + _SCORING_ATTR[wanted] if wanted != 'auto' else 'none'}. Methods with one: contrastive towers "
    f"(embed: {', '.join(have['embed']) or 'none'}) and captioners (caption_log_likelihood: "
    f"{', '.join(have['caption']) or 'none'})."
  )


class _Contrastive:
  """Cosine of each image's embedding with each class's mean prompt embedding."""

  def __init__(self, method, batch_size: int):
    self.batch_size = batch_size
    self.embed_images = jax.jit(lambda v, x: method.embed(v, images=x)["image"])
    self.embed_texts = jax.jit(lambda v, t: method.embed(v, tokens=t)["text"])

  def texts(self, variables, tokens: np.ndarray) -> np.ndarray:
    """[N, D] text embeddings of [N, L] prompt tokens, in batches of at most `batch_size`."""
    n = len(tokens)
    size = min(self.batch_size, n)
    # Padded with copies of the last prompt to one shape (one compile); an all-padding row could pool to NaN.
    padded = np.concatenate([tokens, np.repeat(tokens[-1:], -n % size, 0)])
    emb = np.concatenate(
      [np.asarray(self.embed_texts(variables, padded[i : i + size])) for i in range(0, len(padded), size)]
    )
    return emb[:n]

  def classes(self, variables, tokens: np.ndarray, num_templates: int) -> np.ndarray:
    return class_embeddings(self.texts(variables, tokens), num_templates)

  def scores(self, variables, images, classes: np.ndarray) -> np.ndarray:
    return l2_normalize(np.asarray(self.embed_images(variables, images), np.float64)) @ classes.T


class _Captioner:
  """Mean over templates of the prompts' log-likelihoods given each image (as each image's posterior over the
  classes with `posterior`)."""

  def __init__(self, method, prompts_per_call: int, length_normalize: bool, posterior: bool):
    self.per_call = prompts_per_call
    self.length_normalize = length_normalize
    self.posterior = posterior

    def grid(v, images, tokens):  # [B, ...], [K, L] -> [B, K]: every image with every prompt
      pairs = lambda t: method.caption_log_likelihood(v, images, jnp.broadcast_to(t, (images.shape[0], t.shape[0])))
      return jax.lax.map(pairs, tokens).T

    self.grid = jax.jit(grid)

  def classes(self, variables, tokens: np.ndarray, num_templates: int):
    del variables
    n = len(tokens)
    size = min(self.per_call, n)
    padded = np.concatenate([tokens, np.repeat(tokens[-1:], -n % size, 0)])  # one shape: one compile
    return padded, size, n, num_templates, prompt_lengths(tokens) if self.length_normalize else None

  def scores(self, variables, images, classes) -> np.ndarray:
    padded, size, n, num_templates, lengths = classes
    ll = np.concatenate(
      [np.asarray(self.grid(variables, images, padded[i : i + size])) for i in range(0, len(padded), size)], axis=1
    )
    scores = template_mean(ll[:, :n], num_templates, lengths)
    return class_posterior(scores) if self.posterior else scores


def scorer(method, config):
  """The scorer of `method`'s text side: `classes(variables, prompt tokens, templates)` once, then
  `scores(variables, images, classes) -> [B, C]` per batch of images."""
  kind = scoring_of(method, config.get("scoring", "auto"))
  if kind == "embed":
    return _Contrastive(method, config.get("batch_size", 256))
  return _Captioner(
    method,
    config.get("prompts_per_call", 64),
    config.get("length_normalize", False),
    config.get("class_posterior", True),
  )


# -- the evaluator -------------------------------------------------------------------------------------------------
class Evaluator:
  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    if inputs.tokenizer is None:
      raise UserError("The zero_shot evaluator needs the run's tokenizer (config.tokenizer) to encode its prompts.")
    self.scorer = scorer(inputs.method, config)
    self.tokenizer = inputs.tokenizer
    self.builder = inputs.builder(config)
    self.inputs = inputs
    self.label_key = config.get("label_key", "label")
    names = config.get("class_names") or class_names(self.builder, config.get("class_key") or self.label_key)
    self.class_names = [str(n) for n in names]
    self.templates = tuple(config.get("templates") or DEFAULT_TEMPLATES)
    texts = prompts(self.class_names, self.templates, config.get("articles", True))
    encoded = [self.tokenizer.encode(t, config.get("max_len", DEFAULT_MAX_LEN)) for t in texts]
    cut = [t for t, (_, truncated) in zip(texts, encoded, strict=True) if truncated]
    if cut:
      max_len = config.get("max_len", DEFAULT_MAX_LEN)
      logging.warning("zero_shot: %d prompts cut to max_len=%d, e.g. %r", len(cut), max_len, cut[0])
    self.tokens = np.stack([ids for ids, _ in encoded]).astype(np.int32)

  def evaluate(self, model: Model) -> dict[str, float]:
    from jax.experimental import multihost_utils

    c = self.config
    t0 = time.time()
    classes = self.scorer.classes(model.variables, self.tokens, len(self.templates))
    split = records.first_examples(self.builder, c.split, c.get("limit", 0))
    scores, labels, real = [], [], []
    for batch in self.inputs.batches(self.builder, split, c.pp, ("image", self.label_key), c.batch_size):
      scores.append(self.scorer.scores(model.variables, batch["image"], classes))
      labels.append(np.asarray(batch[self.label_key]))
      real.append(batch["_mask"].astype(bool))
    if not scores:
      raise ValueError(f"Split {c.split!r} of {self.builder.name} yielded no images.")
    # Every host's shard, in host order, then only real images.
    gather = lambda x: np.asarray(multihost_utils.process_allgather(np.concatenate(x))).reshape(
      (-1,) + np.concatenate(x).shape[1:]
    )
    scores, labels, real = gather(scores), gather(labels), gather(real)
    out = zero_shot_metrics(scores[real], labels[real])
    logging.info(
      "Zero-shot on %d images, %d classes x %d templates (%.1fs): %s",
      int(real.sum()),
      len(self.class_names),
      len(self.templates),
      time.time() - t0,
      ", ".join(f"{k} {v:.2f}" for k, v in out.items()),
    )
    return out
