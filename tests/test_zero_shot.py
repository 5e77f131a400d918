"""The zero-shot evaluator where the answer is known: toy methods whose towers (or caption likelihoods) point each
image at its own classes score top-1 100 and mAP 100; scores that cannot tell classes apart score chance; a method
without a text side is refused with the methods that have one. Nothing is trained; the one test through
`Evaluator(config, inputs).evaluate(model)` reads the tiny synthetic_scenes' probe_test (40 images) for the class
names and both label forms."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from ml_collections import ConfigDict

from vlrep.config_utils import config_module
from vlrep.errors import UserError
from vlrep.evaluators import EvalInputs, Model, zero_shot
from vlrep.models.special_tokens import EOS_ID, NUM_SPECIAL, PAD_ID, SOS_ID

SHAPES = ("circle", "square", "triangle", "star", "cross", "arrow", "crescent", "ring", "bar", "heart")
NUM_CLASSES = len(SHAPES)
OTHER_WORD = NUM_SPECIAL + 100  # every word that is no class name


class WordTokenizer:
  """One id per word: a class name's is NUM_SPECIAL + its index, any other word's OTHER_WORD."""

  def __init__(self, names=SHAPES):
    self.ids = {n: NUM_SPECIAL + i for i, n in enumerate(names)}

  def encode(self, text, max_len):
    words = [self.ids.get(w.strip(".,"), OTHER_WORD) for w in text.split()]
    ids = [SOS_ID, *words[: max_len - 2], EOS_ID]
    out = np.full((max_len,), PAD_ID, np.int32)
    out[: len(ids)] = ids
    return out, len(words) > max_len - 2


def class_hot(tokens, num_classes=NUM_CLASSES):
  """[K, L] prompt tokens -> [K, C]: which class names each prompt holds."""
  return jnp.sum(
    jnp.eye(num_classes)[jnp.clip(tokens - NUM_SPECIAL, 0, num_classes - 1)]
    * ((tokens >= NUM_SPECIAL) & (tokens < NUM_SPECIAL + num_classes))[..., None],
    axis=1,
  )


def unit(x):
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class Towers:
  """Contrastive toy: an image [B, C] is embedded as its own (multi-)class direction (or through `image_fn`), a
  prompt as its class name's."""

  def __init__(self, image_fn=lambda x: x):
    self.image_fn = image_fn

  def embed(self, variables, images=None, tokens=None):
    out = {}
    if images is not None:
      out["image"] = unit(self.image_fn(images))
    if tokens is not None:
      out["text"] = unit(class_hot(tokens))
    return out


class Captioner:
  """Captioner toy: log p(prompt | image) is 0 for a prompt naming the image's class and -5 for any other, less a
  little per token (so length normalisation has something to divide)."""

  def __init__(self, image_fn=lambda x: x):
    self.image_fn = image_fn

  def caption_log_likelihood(self, variables, images, tokens):
    match = jnp.sum(self.image_fn(images) * class_hot(tokens), axis=1)
    return 5.0 * jnp.minimum(match, 1.0) - 5.0 - 0.1 * jnp.sum(tokens != PAD_ID, axis=1)


class NoTextSide:
  def features(self, variables, images):
    return {"pre_logits": images}


def prompt_tokens(templates=zero_shot.DEFAULT_TEMPLATES, names=SHAPES, max_len=16):
  texts = zero_shot.prompts(names, templates)
  return np.stack([WordTokenizer(names).encode(t, max_len)[0] for t in texts])


def score(method, images, templates=zero_shot.DEFAULT_TEMPLATES, **config):
  s = zero_shot.scorer(method, ConfigDict(dict(batch_size=8, prompts_per_call=16, **config)))
  classes = s.classes({}, prompt_tokens(templates), len(templates))
  return np.concatenate([s.scores({}, images[i : i + 8], classes) for i in range(0, len(images), 8)])


def test_prompts_fill_every_template_per_class_with_articles():
  assert zero_shot.prompts(["arrow", "bar"], ("a photo of a {}.", "{} here")) == [
    "a photo of an arrow.",
    "arrow here",
    "a photo of a bar.",
    "bar here",
  ]
  assert zero_shot.prompts(["arrow"], ("a {}",), articles=False) == ["a arrow"]
  with pytest.raises(UserError, match="templates"):
    zero_shot.prompts(["arrow"], ("no placeholder",))


def test_towers_that_know_the_classes_score_100_in_both_label_forms():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 10, 37)  # not a multiple of the batch: the last batch is short
  single = zero_shot.zero_shot_metrics(score(Towers(), np.eye(10, dtype=np.float32)[labels]), labels)
  assert single == {"top1": 100.0, "chance": 10.0}
  # Multi-label, VOC form: 1 present, 0 difficult (left out), -1 absent; the image shows its present and difficult
  # classes. And the same as a 0/1 multi-hot.
  voc = rng.choice([1, 0, -1], size=(60, 10), p=[0.3, 0.1, 0.6])
  voc[0] = 1  # every class has a positive
  images = (voc >= 0).astype(np.float32)
  multi = zero_shot.zero_shot_metrics(score(Towers(), images), voc)
  assert multi["map"] == pytest.approx(100.0)
  assert multi["chance"] == pytest.approx(100 * np.mean([np.mean(voc[voc[:, c] != 0, c] > 0) for c in range(10)]))
  hot = (voc > 0).astype(np.uint8)
  assert zero_shot.zero_shot_metrics(score(Towers(), hot.astype(np.float32)), hot)["map"] == pytest.approx(100.0)


def test_scores_that_cannot_tell_classes_apart_score_chance():
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 10, 400)
  voc = np.where(rng.random((400, 10)) < 0.3, 1, -1)
  # Degenerate: every image and prompt embedded alike. Ties share the credit, so top-1 is exactly chance, and a
  # constant ranking's AP is each class's positive rate.
  constant = score(Towers(lambda x: jnp.ones_like(x)), np.eye(10, dtype=np.float32)[labels])
  assert np.ptp(constant) < 1e-6
  assert zero_shot.zero_shot_metrics(constant, labels) == {"top1": pytest.approx(10.0), "chance": 10.0}
  flat = zero_shot.zero_shot_metrics(constant, voc)
  assert flat["map"] == pytest.approx(flat["chance"])
  # Shuffled: images embedded as random directions, unrelated to their labels.
  noise = rng.normal(size=(400, 10)).astype(np.float32)
  shuffled = zero_shot.zero_shot_metrics(score(Towers(), noise), labels)
  assert 5.0 < shuffled["top1"] < 15.0
  multi = zero_shot.zero_shot_metrics(score(Towers(), noise), voc)
  assert abs(multi["map"] - multi["chance"]) < 6.0


def test_a_captioner_whose_likelihood_favours_the_right_class_scores_100():
  labels = np.random.default_rng(2).integers(0, 10, 21)
  images = np.eye(10, dtype=np.float32)[labels]
  for length_normalize in (False, True):
    scores = score(Captioner(), images, length_normalize=length_normalize)
    assert zero_shot.zero_shot_metrics(scores, labels)["top1"] == 100.0
  # The scores are the mean over templates of the prompts' log-likelihoods, each / its token count when normalised.
  tokens = prompt_tokens()
  assert zero_shot.prompt_lengths(tokens[:1]).tolist() == [6]  # "a photo of a circle." + [EOS], after [SOS]
  plain = score(Captioner(), images[:1], class_posterior=False)
  normalised = score(Captioner(), images[:1], length_normalize=True, class_posterior=False)
  ll = np.asarray(Captioner().caption_log_likelihood({}, np.repeat(images[:1], len(tokens), 0), tokens))[None]
  assert plain == pytest.approx(zero_shot.template_mean(ll, 4))
  assert normalised == pytest.approx(zero_shot.template_mean(ll, 4, zero_shot.prompt_lengths(tokens)))
  # By default each image's scores are its log posterior over the classes: they exponentiate to a distribution.
  posterior = score(Captioner(), images[:1])
  assert posterior == pytest.approx(plain - np.log(np.exp(plain).sum()))
  assert np.exp(posterior).sum() == pytest.approx(1.0)


def test_the_class_posterior_cancels_an_images_own_likelihood_scale():
  """A busy scene (more objects) makes every short prompt less likely: raw log-likelihoods then rank images by how
  busy they are first, by whether they hold the class only among equally busy ones (multi-label mAP far from 100).
  The posterior over classes ranks them by the class again (mAP 100); top-1 is the same either way."""
  rng = np.random.default_rng(3)
  multi_hot = (rng.random((40, NUM_CLASSES)) < 0.3).astype(np.float32)
  multi_hot[np.arange(40), rng.integers(0, NUM_CLASSES, 40)] = 1.0  # every image holds a class

  class BusyCaptioner(Captioner):
    """Each present class adds 5 to its prompt's likelihood; each object present takes 20 from every prompt's."""

    def caption_log_likelihood(self, variables, images, tokens):
      return super().caption_log_likelihood(variables, images, tokens) - 20.0 * jnp.sum(images, axis=1)

  raw = score(BusyCaptioner(), multi_hot, class_posterior=False)
  posterior = score(BusyCaptioner(), multi_hot)
  raw_map = zero_shot.zero_shot_metrics(raw, multi_hot)
  assert raw_map["map"] < 60.0, raw_map
  assert zero_shot.zero_shot_metrics(posterior, multi_hot)["map"] == pytest.approx(100.0)
  single = multi_hot.argmax(axis=1)
  assert np.array_equal(raw.argmax(axis=1), posterior.argmax(axis=1))
  assert zero_shot.zero_shot_metrics(posterior, single)["top1"] == zero_shot.zero_shot_metrics(raw, single)["top1"]


def test_a_method_without_a_text_side_is_refused_naming_those_with_one():
  with_one = r"\(embed: clip, loctex, mct\) and captioners \(caption_log_likelihood: virtex\)"
  with pytest.raises(UserError, match=r"NoTextSide has none.*" + with_one):
    zero_shot.scorer(NoTextSide(), ConfigDict())
  with pytest.raises(UserError, match="NoTextSide has no caption_log_likelihood"):
    zero_shot.scorer(NoTextSide(), ConfigDict(dict(scoring="caption")))
  assert isinstance(zero_shot.scorer(Captioner(), ConfigDict()), zero_shot._Captioner)


def tiny_evals(**settings) -> dict:
  """configs/eval/zero_shot.py:runlocal on the tiny synthetic_scenes (both label forms), batches of 16."""
  module = config_module(os.path.join(ROOT, "configs", "eval", "x"), "zero_shot.py")
  evals = module.get_config("runlocal").evals
  for cfg in evals.values():
    cfg.update(data_dir=os.environ["VLREP_TEST_DATA_DIR"], config_name="tiny", batch_size=16, **settings)
  return evals


def known_images(run, cfg):
  """(pixel sums [N], class indicator rows [N, C]) of the split `cfg` reads: a one-hot row per image for a class
  id, its present and difficult classes for VOC-form targets."""
  sums, rows = [], []
  for batch in run.batches(run.builder(cfg), cfg.split, cfg.pp, ("image", cfg.label_key), 40):
    m = batch["_mask"].astype(bool)
    sums.append(batch["image"][m].reshape(m.sum(), -1).sum(1))
    y = batch[cfg.label_key][m]
    rows.append(np.eye(NUM_CLASSES)[y] if y.ndim == 1 else (y >= 0).astype(float))
  return np.concatenate(sums), np.concatenate(rows)


def looked_up(sums, rows):
  """images -> the label row of the known image with the nearest pixel sum (jittable)."""
  sums, rows = jnp.asarray(sums), jnp.asarray(rows, jnp.float32)
  return lambda images: rows[jnp.argmin(jnp.abs(images.reshape(len(images), -1).sum(1)[:, None] - sums), axis=1)]


@pytest.mark.parametrize("toy", [Towers, Captioner])
def test_the_evaluator_reads_class_names_and_both_label_forms_of_synthetic_scenes(toy):
  evals = tiny_evals()
  model = Model(variables={}, features=None)
  got = {}
  for name, cfg in evals.items():
    sums, rows = known_images(EvalInputs(), cfg)
    assert len(np.unique(np.round(sums, 2))) == len(sums) == 40  # each image found by its pixel sum
    evaluator = zero_shot.Evaluator(cfg, EvalInputs(tokenizer=WordTokenizer(), method=toy(looked_up(sums, rows))))
    assert evaluator.class_names == list(SHAPES)
    got[name] = evaluator.evaluate(model)
  assert got["zero_shot"] == {"top1": 100.0, "chance": 10.0}
  assert got["zero_shot_multi"]["map"] == pytest.approx(100.0) and 0 < got["zero_shot_multi"]["chance"] < 100
  # A run without a tokenizer, or with a method without a text side, is refused when the evaluator is built.
  with pytest.raises(UserError, match="tokenizer"):
    zero_shot.Evaluator(evals["zero_shot"], EvalInputs(method=toy()))
  with pytest.raises(UserError, match="text side"):
    zero_shot.Evaluator(evals["zero_shot"], EvalInputs(tokenizer=WordTokenizer(), method=NoTextSide()))
