"""Linear probe: a linear classifier on a frozen backbone, for any TFDS image-classification dataset.

VirTex's protocol (appendix A.3): BatchNorm in inference mode, the linear layer initialised N(0, 0.01), SGD with
momentum 0.9, no weight decay, LR 0.3 with cosine decay, 100 epochs, batch 256, random-resized-crop + flip for
training and resize 256 / centre crop 224 for evaluation; top-1 accuracy. MCT's variant: LR 30, divided by 5 at
fixed epochs (`schedule='step'`, `milestones`). ICMLM's (appendix F.2; `trials` > 0): logistic regression on
pre-extracted, global-average-pooled last-layer features of resize-224 / centre-crop-224 images (no augmentation),
SGD with momentum 0.9, batch 1024, cosine annealing, the LR (log-uniform in [0.1, 100]) and weight decay (uniform
in [0, 1e-5]) searched over 25 trials (`train_linear_search`: all trials trained at once, each scored on held-out
training images, the best one's test accuracy reported).

Two modes:
  'features'  (the fast path) the training images' features are extracted once, with `pp_features` (the
              evaluation preprocessing unless set), and the classifier trains on them for all epochs.
  'images'    every step draws augmented images (`pp_train`) through the frozen backbone: the paper's protocol.
Config: dataset, data_dir, config_name, train_split, test_split, pp_train, pp_eval, pp_features, num_classes,
label_key, feature, mode, epochs, batch_size, lr, schedule ('cosine' | 'step'), milestones, step_factor,
momentum, weight_decay, init_std, seed, every_steps, random_init; the search (features mode): trials (0: none, `lr`
and `weight_decay` as given), lr_range (log-uniform), weight_decay_range (uniform), val_split (the split the trials
are scored on) or holdout_fraction (else that fraction of the training features, held out of training). The
search adds `top1_val` (the chosen trial's held-out top-1), `lr` and `weight_decay` (the chosen values).
num_classes 0: the dataset's ClassLabel at `label_key` says how many (your own image_folder classes).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tensorflow_datasets as tfds
from absl import logging

from vlrep.data import pipeline, records
from vlrep.errors import UserError
from vlrep.evaluators._inputs import EvalInputs, Model


def make_schedule(config, total_steps: int, steps_per_epoch: float):
  if config.get("schedule", "cosine") == "cosine":
    return optax.cosine_decay_schedule(config.lr, max(total_steps, 1))
  if config.schedule == "step":
    bounds = {int(round(m * steps_per_epoch)): config.get("step_factor", 0.2) for m in config.milestones}
    return optax.piecewise_constant_schedule(config.lr, bounds)
  raise ValueError(f"Unknown linear-probe schedule {config.schedule!r}; expected 'cosine' or 'step'.")


def train_linear(
  next_batch: Callable[[int], tuple[np.ndarray, np.ndarray]],
  dim: int,
  num_classes: int,
  total_steps: int,
  config,
  steps_per_epoch: float,
):
  """SGD on a linear layer; next_batch(step) -> (features [B, D], labels [B]). Returns (w, b)."""
  tx = optax.chain(
    optax.add_decayed_weights(config.get("weight_decay", 0.0)),
    optax.sgd(make_schedule(config, total_steps, steps_per_epoch), momentum=config.get("momentum", 0.9)),
  )
  key = jax.random.PRNGKey(config.get("seed", 0))
  params = {
    "w": config.get("init_std", 0.01) * jax.random.normal(key, (dim, num_classes)),
    "b": jnp.zeros((num_classes,)),
  }
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, x, y, weight):
    def loss_fn(p):
      logits = x @ p["w"] + p["b"]
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  loss = jnp.nan
  for i in range(total_steps):
    x, y, weight = next_batch(i)
    params, opt_state, loss = step(params, opt_state, x, y, weight)
  logging.info("Linear probe: %d steps, final batch loss %.4f", total_steps, float(loss))
  return np.asarray(params["w"]), np.asarray(params["b"])


def search_draws(config) -> tuple[np.ndarray, np.ndarray]:
  """The trials' (learning rates, weight decays): `trials` independent draws, LR log-uniform in `lr_range` and
  weight decay uniform in `weight_decay_range` (ICMLM's Optuna search space; drawn at random, not by Optuna's
  sequential TPE), seeded by `seed`."""
  rng = np.random.default_rng([config.get("seed", 0), 1])
  lo, hi = config.lr_range
  lrs = np.exp(rng.uniform(np.log(lo), np.log(hi), config.trials))
  wds = rng.uniform(*config.weight_decay_range, config.trials)
  return lrs.astype(np.float32), wds.astype(np.float32)


def train_linear_search(
  next_batch: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]],
  dim: int,
  num_classes: int,
  total_steps: int,
  lrs: np.ndarray,
  weight_decays: np.ndarray,
  config,
):
  """`train_linear` for T (LR, weight decay) pairs at once, on the same batches: SGD with momentum (PyTorch's: the
  decay added to the gradient, v = m v + g, w -= lr_t v), cosine annealing from each LR to 0 over `total_steps`.
  Returns (w [T, D, C], b [T, C]); a trial that diverged has non-finite entries."""
  lrs, wds = jnp.asarray(lrs, jnp.float32), jnp.asarray(weight_decays, jnp.float32)
  t = len(lrs)
  momentum = config.get("momentum", 0.9)
  key = jax.random.PRNGKey(config.get("seed", 0))
  w0 = config.get("init_std", 0.01) * jax.random.normal(key, (dim, num_classes))
  params = {"w": jnp.broadcast_to(w0, (t, dim, num_classes)), "b": jnp.zeros((t, num_classes))}
  velocity = jax.tree.map(jnp.zeros_like, params)
  decay = {"w": wds[:, None, None], "b": wds[:, None]}
  rate = {"w": lambda lr: lr[:, None, None], "b": lambda lr: lr[:, None]}

  @jax.jit
  def step(params, velocity, i, x, y, weight):
    def loss_fn(p):
      logits = jnp.einsum("bd,tdc->tbc", x, p["w"]) + p["b"][:, None]
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, y[None])  # [T, B]
      # Each trial's mean loss; summed, so each trial's parameters get their own loss's gradient.
      return jnp.sum(jnp.sum(nll * weight, 1) / jnp.maximum(jnp.sum(weight), 1.0))

    grads = jax.grad(loss_fn)(params)
    lr_i = lrs * 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(i, total_steps) / max(total_steps, 1)))
    velocity = {k: momentum * velocity[k] + grads[k] + decay[k] * params[k] for k in params}
    params = {k: params[k] - rate[k](lr_i) * velocity[k] for k in params}
    return params, velocity

  for i in range(total_steps):
    x, y, weight = next_batch(i)
    params, velocity = step(params, velocity, i, x, y, weight)
  return np.asarray(params["w"]), np.asarray(params["b"])


def topk_accuracy(logits: np.ndarray, labels: np.ndarray, k: int) -> float:
  top = np.argsort(-logits, axis=1)[:, :k]
  return float(np.mean(np.any(top == labels[:, None], axis=1)) * 100)


def dataset_num_classes(builder, label_key: str) -> int:
  """The number of classes of the dataset's ClassLabel at `label_key` (a top-level feature); a UserError naming
  the dataset's features when there is none."""
  features = builder.info.features
  feature = features[label_key] if label_key in features.keys() else None
  if not isinstance(feature, tfds.features.ClassLabel) or not feature.num_classes:
    raise UserError(
      f"{builder.name} has no ClassLabel {label_key!r} to count its classes (features: {sorted(features.keys())}); "
      "set num_classes in the evaluator's config."
    )
  return feature.num_classes


def extract_labeled(
  inputs: EvalInputs, builder, split, pp, label_key, batch_size, features_fn
) -> tuple[np.ndarray, np.ndarray]:
  """(features [N, D] float32, labels [N] int32) of a split, through features_fn, padding rows dropped."""
  feats, labels = [], []
  for local in inputs.batches(builder, split, pp, ("image", label_key), batch_size):
    f, batch = features_fn(local)
    m = batch["_mask"].astype(bool)
    feats.append(f[m].reshape(int(m.sum()), -1))
    labels.append(batch[label_key][m])
  if not feats:
    raise ValueError(f"Split {split!r} of {builder.name} yielded no images.")
  return np.concatenate(feats).astype(np.float32), np.concatenate(labels).astype(np.int32)


class Evaluator:
  """Evaluator: trains a linear classifier on frozen features; reports top-1 / top-5 accuracy (%)."""

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.feature_key = config.get("feature", "pre_logits")
    self.builder = inputs.builder(config)
    self.inputs = inputs
    self.label_key = config.get("label_key", "label")
    self.num_classes = config.get("num_classes") or dataset_num_classes(self.builder, self.label_key)
    if config.get("mode", "features") not in ("features", "images"):
      raise ValueError(f"Unknown linear-probe mode {config.mode!r}; expected 'features' or 'images'.")
    if config.get("trials", 0) and config.get("mode", "features") != "features":
      raise ValueError("The linear probe's search (trials > 0) trains on pre-extracted features: mode='features'.")
    if config.batch_size % jax.device_count():
      raise ValueError(f"Probe batch_size {config.batch_size} is not divisible by the {jax.device_count()} devices.")

  def _extract(self, split: str, pp: str, features_fn) -> tuple[np.ndarray, np.ndarray]:
    return extract_labeled(self.inputs, self.builder, split, pp, self.label_key, self.config.batch_size, features_fn)

  def evaluate(self, model: Model) -> dict[str, float]:
    c = self.config
    features_fn = model.extractor(self.feature_key)
    t0 = time.time()
    test_x, test_y = self._extract(c.test_split, c.pp_eval, features_fn)
    num_classes = self.num_classes
    if test_y.max() >= num_classes or test_y.min() < 0:
      raise ValueError(f"Labels outside [0, {num_classes}) in {c.dataset}/{c.test_split}: set num_classes.")
    name, fraction = records.split_name(c.train_split)
    n_train = int(round(self.builder.info.splits[name].num_examples * fraction))
    steps_per_epoch = n_train / c.batch_size
    total_steps = max(1, int(round(c.epochs * steps_per_epoch)))
    rng = np.random.default_rng(c.get("seed", 0))
    if c.get("trials", 0):
      return self._search(features_fn, test_x, test_y, rng, t0)
    if c.get("mode", "features") == "features":
      train_x, train_y = self._extract(c.train_split, c.get("pp_features") or c.pp_eval, features_fn)
      order = np.concatenate([rng.permutation(len(train_x)) for _ in range(int(np.ceil(c.epochs)) + 1)])
      ones = np.ones((c.batch_size,), np.float32)

      def next_batch(i):
        idx = order[i * c.batch_size : (i + 1) * c.batch_size]
        return train_x[idx], train_y[idx], ones[: len(idx)]
    else:
      stream = pipeline.train_stream(
        self.builder,
        {"split": c.train_split, "pp": c.pp_train},
        ("image", self.label_key),
        c.batch_size // self.inputs.num_hosts,
        seed=c.get("seed", 0),
        host_index=self.inputs.host,
        host_count=self.inputs.num_hosts,
        context=self.inputs.pp_context,
      )

      def next_batch(i):
        f, batch = features_fn(next(stream))
        return f.reshape(len(f), -1), batch[self.label_key].astype(np.int32), np.ones((len(f),), np.float32)

    t1 = time.time()
    w, b = train_linear(next_batch, test_x.shape[1], num_classes, total_steps, c, steps_per_epoch)
    if c.get("mode", "features") == "images":
      stream.close()
    logits = test_x @ w + b
    top1, top5 = topk_accuracy(logits, test_y, 1), topk_accuracy(logits, test_y, min(5, num_classes))
    logging.info(
      "Linear probe (%s): %d steps, features %.1fs, training %.1fs, top-1 %.2f, top-5 %.2f",
      c.get("mode", "features"),
      total_steps,
      t1 - t0,
      time.time() - t1,
      top1,
      top5,
    )
    return {"top1": top1, "top5": top5}

  def _search(self, features_fn, test_x, test_y, rng, t0) -> dict[str, float]:
    """ICMLM's protocol: `trials` (LR, weight decay) pairs trained at once on pre-extracted features, the one with
    the best held-out top-1 scored on the test split."""
    c = self.config
    train_x, train_y = self._extract(c.train_split, c.get("pp_features") or c.pp_eval, features_fn)
    if c.get("val_split"):
      val_x, val_y = self._extract(c.val_split, c.get("pp_features") or c.pp_eval, features_fn)
      train_idx = np.arange(len(train_x))
    else:
      held = rng.permutation(len(train_x))
      fraction = c.get("holdout_fraction", 0.01)
      n_val = max(1, int(round(fraction * len(train_x))))
      if n_val >= len(train_x):
        raise ValueError(f"holdout_fraction {fraction} leaves none of the {len(train_x)} training images to train on.")
      val_x, val_y = train_x[held[:n_val]], train_y[held[:n_val]]
      train_idx = np.sort(held[n_val:])  # indices, not a copy of the features (ImageNet's are ~10 GB)
    num_classes = self.num_classes
    steps_per_epoch = len(train_idx) / c.batch_size
    total_steps = max(1, int(round(c.epochs * steps_per_epoch)))
    order = np.concatenate([rng.permutation(train_idx) for _ in range(int(np.ceil(c.epochs)) + 1)])
    ones = np.ones((c.batch_size,), np.float32)

    def next_batch(i):
      idx = order[i * c.batch_size : (i + 1) * c.batch_size]
      return train_x[idx], train_y[idx], ones[: len(idx)]

    lrs, wds = search_draws(c)
    t1 = time.time()
    w, b = train_linear_search(next_batch, train_x.shape[1], num_classes, total_steps, lrs, wds, c)
    val_top1 = []
    for i in range(len(lrs)):
      finite = np.isfinite(w[i]).all() and np.isfinite(b[i]).all()
      val_top1.append(topk_accuracy(val_x @ w[i] + b[i], val_y, 1) if finite else -1.0)
    best = int(np.argmax(val_top1))  # the first of equal scores
    if val_top1[best] < 0:
      raise FloatingPointError(f"Every linear-probe trial diverged (LRs {lrs.min():.3g}..{lrs.max():.3g}).")
    logits = test_x @ w[best] + b[best]
    top1, top5 = topk_accuracy(logits, test_y, 1), topk_accuracy(logits, test_y, min(5, num_classes))
    logging.info(
      "Linear probe (search): %d trials x %d steps, %.1fs; chosen LR %.4g, weight decay %.3g (held-out top-1 %.2f, "
      "%d of %d trials diverged); top-1 %.2f, top-5 %.2f",
      len(lrs),
      total_steps,
      time.time() - t1,
      lrs[best],
      wds[best],
      val_top1[best],
      sum(v < 0 for v in val_top1),
      len(lrs),
      top1,
      top5,
    )
    return {
      "top1": top1,
      "top5": top5,
      "top1_val": val_top1[best],
      "lr": float(lrs[best]),
      "weight_decay": float(wds[best]),
    }
