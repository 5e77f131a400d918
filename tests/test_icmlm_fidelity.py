"""ICMLM against its paper's appendix F: the frozen-backbone warm-up (no parameter, optimizer-state or BatchNorm-
statistics change while frozen), RAdam as the official implementation computes it, the VGG16 and ResNet-50 recipe
arms, the VOC07 probe's 2x2 pooling, and the ImageNet logistic-regression probe with its hyperparameter search."""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from vlrep import optim, train_step
from vlrep.evaluators import EvalInputs, Model, linear_probe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))


# ---------------------------------------------------------------------------------------------------------
# warmup_frozen: a frozen group does not move, accumulate momentum or update its BatchNorm statistics.
# ---------------------------------------------------------------------------------------------------------
class _Backbone(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(7)(x)
    return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    return nn.Dense(3, name="head")(_Backbone(name="backbone")(x, train))


class _BNMethod:
  """The method contract around a backbone with BatchNorm and a head (a regression: every parameter has a
  gradient)."""

  model = _Net()

  def init(self, rng, batch):
    return self.model.init(rng, batch["x"], False)

  def loss(self, variables, batch, rng, train=True):
    out, state = self.model.apply(variables, batch["x"], train, mutable=["batch_stats"])
    return jnp.mean((out - batch["y"]) ** 2), {}, state


def _optim_config(name, frozen, **kw):
  base = dict(
    name=name,
    momentum=0.9,
    nesterov=False,
    weight_decay=1e-3,
    grad_clip_norm=1.0,
    lookahead_steps=0,
    lookahead_alpha=0.5,
    lr_groups=(("^backbone/", 0.05), (".*", 0.05)),
    frozen_steps=(("^backbone/", frozen),) if frozen else (),
    no_decay="",
    b1=0.9,
    b2=0.999,
    eps=1e-8,
  )
  return ml_collections.ConfigDict({**base, **kw})


def _backbone_optimizer_state(opt_state):
  """The optimizer's per-parameter state of the backbone (momentum, Adam moments): the leaves shaped as the
  backbone's parameters ((5, 7) and (7,); the head's are (7, 3) and (3,))."""
  return [leaf for leaf in jax.tree.leaves(opt_state) if leaf.shape in ((5, 7), (7,))]


@pytest.mark.parametrize("name", ["sgd", "adamw", "radam"])
def test_a_frozen_backbone_keeps_its_parameters_momentum_and_batchnorm_statistics(name):
  k = 3
  method = _BNMethod()
  rng = np.random.default_rng(0)
  batch = {"x": jnp.asarray(rng.normal(size=(16, 5)) + 1.0, jnp.float32)}
  batch["y"] = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
  key = jax.random.PRNGKey(0)
  config = _optim_config(name, k)
  params = method.init(key, batch)["params"]
  tx, schedules = optim.build(config, params, total_steps=10, warmup_steps=0)
  init = train_step.init_train_state(method, tx, key, batch)
  step = jax.jit(train_step.make_train_step(method, tx, schedules, key, optim.frozen_rules(config)))
  state = jax.tree.map(jnp.copy, init)
  leaves = lambda tree: jax.tree.leaves(tree)
  for i in range(k):
    state, metrics = step(state, batch)
    assert float(metrics["train/lr_group0_backbone"]) == 0.0
    for a, b in zip(leaves(state["params"]["backbone"]), leaves(init["params"]["backbone"]), strict=True):
      np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(state["model_state"]), leaves(init["model_state"]), strict=True):
      np.testing.assert_array_equal(a, b)  # BatchNorm statistics: the backbone's are the only ones
    moments = _backbone_optimizer_state(state["opt_state"])
    assert moments and all(not np.any(np.asarray(m)) for m in moments), i  # still zeros
    assert not np.array_equal(state["params"]["head"]["kernel"], init["params"]["head"]["kernel"])
  # The step that unfreezes: the backbone moves, at the schedule's LR for that step, and so does everything else.
  state, metrics = step(state, batch)
  assert float(metrics["train/lr_group0_backbone"]) == pytest.approx(float(schedules["group1_all"](k)))
  assert all(
    not np.array_equal(a, b)
    for a, b in zip(leaves(state["params"]["backbone"]), leaves(init["params"]["backbone"]), strict=True)
  )
  assert all(
    not np.array_equal(a, b) for a, b in zip(leaves(state["model_state"]), leaves(init["model_state"]), strict=True)
  )
  assert all(np.any(np.asarray(m)) for m in _backbone_optimizer_state(state["opt_state"]))


def test_after_the_freeze_the_group_steps_as_a_fresh_optimizer_at_the_runs_schedule():
  """From step N on the frozen group's optimizer is one created at step N whose schedule is the run's from N on:
  its first update is the optimizer's first step at LR schedule(N) (RAdam's: bias-corrected momentum, 1 step)."""
  params = {"backbone": {"w": jnp.ones(3)}, "head": {"w": jnp.ones(3)}}
  config = _optim_config("radam", 4, weight_decay=0.0, grad_clip_norm=0.0, schedule="step", step_at=(0.5,))
  tx, schedules = optim.build(config, params, total_steps=10, warmup_steps=0)
  state = tx.init(params)
  grads = {"backbone": {"w": jnp.array([1.0, -2.0, 0.5])}, "head": {"w": jnp.ones(3)}}
  for _ in range(4):
    updates, state = tx.update(grads, state, params)
    np.testing.assert_array_equal(updates["backbone"]["w"], 0.0)
  updates, state = tx.update(grads, state, params)
  # RAdam's first step: rho_1 < 5, so the update is -lr * m_hat = -lr * g; lr = 0.05 (the decay comes at step 5).
  np.testing.assert_allclose(updates["backbone"]["w"], -0.05 * grads["backbone"]["w"], rtol=1e-6)
  assert float(schedules["group0_backbone"](3)) == 0.0 and float(schedules["group0_backbone"](4)) == pytest.approx(0.05)
  # The LR after the freeze is the run's schedule at the run's step (plain SGD: the update is -lr * g).
  config = _optim_config("sgd", 4, momentum=0.0, weight_decay=0.0, grad_clip_norm=0.0, schedule="step", step_at=(0.5,))
  tx, _ = optim.build(config, params, total_steps=10, warmup_steps=0)
  state = tx.init(params)
  lrs = []
  for _ in range(8):
    updates, state = tx.update(grads, state, params)
    lrs.append(float(-updates["backbone"]["w"][0]))
  assert lrs == pytest.approx([0, 0, 0, 0, 0.05, 0.005, 0.005, 0.005])  # x0.1 at step 5 of 10
  with pytest.raises(ValueError, match="not among optim.lr_groups"):
    optim.frozen_rules(_optim_config("sgd", 0, frozen_steps=(("^nope/", 3),)))


def _official_radam(params, grads_seq, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
  """LiyuanLucasLiu/RAdam's `RAdam.step` (degenerated_to_sgd=True) in NumPy: decoupled decay p -= wd * lr * p."""
  p, m, v = np.array(params, np.float64), 0.0, 0.0
  n_max = 2 / (1 - b2) - 1
  for t, g in enumerate(grads_seq, 1):
    v = b2 * v + (1 - b2) * g * g
    m = b1 * m + (1 - b1) * g
    b2t = b2**t
    n_sma = n_max - 2 * t * b2t / (1 - b2t)
    p = p - wd * lr * p
    if n_sma >= 5:
      size = np.sqrt((1 - b2t) * (n_sma - 4) / (n_max - 4) * (n_sma - 2) / n_sma * n_max / (n_max - 2)) / (1 - b1**t)
      p = p - size * lr * m / (np.sqrt(v) + eps)
    else:
      p = p - lr / (1 - b1**t) * m
  return p


def test_radam_is_the_official_implementation_with_decoupled_weight_decay():
  rng = np.random.default_rng(0)
  grads_seq = [rng.normal(size=4) for _ in range(12)]  # through the rectification threshold (t = 6 for b2 0.999)
  start = rng.normal(size=4)
  config = _optim_config("radam", 0, weight_decay=1e-1, grad_clip_norm=0.0, lr_groups=((".*", 1e-2),))
  config.schedule, config.step_at = "step", ()
  params = {"w": jnp.asarray(start, jnp.float32)}
  tx, _ = optim.build(config, params, total_steps=100, warmup_steps=0)
  state = tx.init(params)
  for g in grads_seq:
    updates, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params["w"], _official_radam(start, grads_seq, 1e-2, 1e-1), rtol=2e-5)


# ---------------------------------------------------------------------------------------------------------
# The recipe's arms and its probe.
# ---------------------------------------------------------------------------------------------------------
def test_vgg16_arm_is_appendix_f1_and_the_resnet_arm_is_unchanged():
  import icmlm

  tp, tfm, att = (icmlm.get_config(f"variant={v},backbone=vgg16") for v in ("tp", "tfm", "att_fc"))
  for c in (tp, tfm, att):
    o = c.optim
    assert (o.name, o.weight_decay, o.schedule, tuple(o.step_at), o.step_factor) == (
      "radam",
      1e-3,
      "step",
      (0.8, 0.9),
      0.1,
    )
    assert tuple(lr for _, lr in o.lr_groups) == (1e-4, 1e-4)
    assert c.method.backbone.arch == "vgg16" and c.method.tfm_heads == c.method.att_heads == 12
  assert (tp.total_steps, tp.batch_size) == (100_000, 128)  # decays after 80K and 90K
  assert (tfm.total_steps, tfm.batch_size) == (att.total_steps, att.batch_size) == (200_000, 896)
  assert tuple(att.optim.frozen_steps) == (("^backbone/", 50_000),) and tuple(tfm.optim.frozen_steps) == ()
  assert tuple(icmlm.get_config("variant=att_fc,backbone=vgg16,warmup_frozen=0").optim.frozen_steps) == ()
  # The step schedule the optimizer builds from it: x0.1 after 80K and 90K of TP's 100K.
  _, schedules = optim.build(tp.optim, {"backbone": {"w": jnp.ones(1)}, "tp": {"w": jnp.ones(1)}}, 100_000, 0)
  lr = schedules["group0_backbone"]
  assert [float(lr(s)) for s in (0, 79_999, 80_000, 90_000)] == pytest.approx([1e-4, 1e-4, 1e-5, 1e-6])
  r50 = icmlm.get_config("variant=att_fc")
  assert (r50.optim.name, r50.optim.schedule, r50.total_steps, r50.batch_size) == ("sgd", "cosine", 500_000, 512)
  assert tuple(r50.optim.lr_groups) == (("^backbone/", 3e-2), (".*", 3e-2)) and tuple(r50.optim.frozen_steps) == ()
  # runlocal keeps its SGD (either backbone) and no default freeze.
  local = icmlm.get_config("runlocal,variant=att_fc,backbone=vgg16")
  assert (local.optim.name, local.optim.schedule, tuple(local.optim.frozen_steps)) == ("sgd", "cosine", ())


def test_recipe_probe_is_icmlms_2x2_voc07_protocol_and_runlocal_keeps_its_own():
  import icmlm
  from eval import voc07_svm

  paper = voc07_svm.get_config("variant=icmlm").evals.voc07_svm_icmlm
  for arg in ("variant=tfm", "variant=tp", "variant=att_fc,backbone=vgg16"):
    probe = icmlm.get_config(arg).evals.probe
    assert (probe.feature, probe.pooling, probe.l2_normalize, probe.folds) == ("grid", "2x2", True, 3)
    assert tuple(probe.costs) == tuple(paper.costs) and len(probe.costs) == 40
    assert probe.pp == paper.pp
  local = icmlm.get_config("runlocal,variant=tfm").evals.probe
  assert (local.feature, local.pooling, tuple(local.costs)) == ("pre_logits", "gap", (0.01, 0.1, 1.0, 10.0))


# ---------------------------------------------------------------------------------------------------------
# ICMLM's ImageNet protocol: logistic regression on pre-extracted features with a 25-trial search.
# ---------------------------------------------------------------------------------------------------------
def test_icmlm_linear_probe_config_is_appendix_f2():
  from eval import linear_probe as probe_config

  c = probe_config.get_config("variant=icmlm").evals.linear_probe_icmlm
  assert (c.dataset, c.mode, c.feature, c.pp_features) == ("imagenet2012", "features", "pre_logits", "")
  assert c.pp_eval == "decode|resize_small(224)|central_crop(224)|normalize"  # no augmentation
  assert (c.batch_size, c.momentum, c.schedule, c.trials) == (1024, 0.9, "cosine", 25)
  assert tuple(c.lr_range) == (0.1, 100.0) and tuple(c.weight_decay_range) == (0.0, 1e-5)
  lrs, wds = linear_probe.search_draws(c)
  assert len(lrs) == 25 and lrs.min() >= 0.1 and lrs.max() <= 100 and wds.min() >= 0 and wds.max() <= 1e-5
  assert np.log10(lrs).min() < 0 and np.log10(lrs).max() > 1  # log-uniform: both ends of [0.1, 100] are reached
  with pytest.raises(ValueError, match="pre-extracted features"):
    probe_config.get_config("variant=icmlm,mode=images")


def _write_imagenet_format(data_dir, name):
  """A tiny TFDS dataset in ImageNet's format ('image' uint8 HxWx3, 'label' ClassLabel; train / validation):
  flat-coloured images of 4 colours, one class each, of random sizes (so the protocol's resize and crop matter)."""
  import tensorflow_datasets as tfds

  rng = np.random.default_rng(0)
  colours = np.array([[220, 30, 30], [30, 200, 30], [30, 30, 220], [200, 200, 40]], np.uint8)

  def split(n):
    for i in range(n):
      label = i % 4
      h, w = rng.integers(226, 260, 2)
      image = np.clip(colours[label] + rng.integers(-25, 25, (h, w, 3)), 0, 255).astype(np.uint8)
      yield i, {"image": image, "label": label}

  features = tfds.features.FeaturesDict(
    {"image": tfds.features.Image(shape=(None, None, 3)), "label": tfds.features.ClassLabel(num_classes=4)}
  )
  tfds.dataset_builders.store_as_tfds_dataset(
    name=name,
    version="1.0.0",
    features=features,
    split_datasets={"train": list(split(64)), "validation": list(split(16))},
    data_dir=str(data_dir),
  )


def test_icmlm_linear_probe_learns_a_separable_imagenet_format_set_and_skips_diverged_trials(tmp_path, monkeypatch):
  """The evaluator end to end with the paper's settings (fewer epochs, a smaller batch): features extracted from
  224 x 224 centre crops of a dataset in ImageNet's format, 25 trials scored on held-out training images; the
  chosen one separates the classes; a trial that diverged is never chosen."""
  from eval import linear_probe as probe_config

  _write_imagenet_format(tmp_path, "tiny_imagenet_format")
  config = probe_config.get_config("variant=icmlm,num_classes=4,dataset=tiny_imagenet_format,epochs=8")
  probe = config.evals.linear_probe_icmlm
  probe.update(data_dir=str(tmp_path), batch_size=16, holdout_fraction=0.25)
  seen = []

  def features(batch, key):
    del key  # the stand-in has one feature
    images = np.asarray(batch["image"])
    seen.append(images.shape[1:])
    # A stand-in backbone: each channel's mean and a large constant (features far from unit scale).
    return np.concatenate([images.mean((1, 2)) * 20.0, np.full((len(images), 1), 30.0)], 1), batch

  model = Model(variables=None, features=features)
  evaluator = linear_probe.Evaluator(probe, EvalInputs())
  result = evaluator.evaluate(model)
  assert set(seen) == {(224, 224, 3)}
  assert result["top1"] == 100.0 and result["top1_val"] == 100.0
  lrs, wds = linear_probe.search_draws(probe)
  assert result["lr"] in lrs.tolist() and result["weight_decay"] in wds.tolist()
  # A trial that diverged (non-finite weights) is never chosen: poison all but the last one.
  real = linear_probe.train_linear_search

  def poisoned(*args):
    w, b = (np.array(a) for a in real(*args))
    w[:-1, 0, 0] = np.nan
    return w, b

  monkeypatch.setattr(linear_probe, "train_linear_search", poisoned)
  assert evaluator.evaluate(model)["lr"] == pytest.approx(float(lrs[-1]))
