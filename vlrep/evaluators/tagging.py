"""Multi-label image tagging on a frozen backbone, scored by mIOU@K (MCT's table 5 protocol, Yuan et al. 2021).

  tag space   every tag gets a PMI embedding computed on the training split: positive pointwise mutual
              information of tag co-occurrence, PPMI(i, j) = max(0, log(N n_ij / (n_i n_j))) over the N training
              images (n_i images with tag i, n_ij with both), factorised by SVD into U_d sqrt(S_d) with
              d = `tag_dim` (4096 on Stock; at most the number of tags). A tag never seen in training has no
              embedding and is never predicted (`unseen_tags` counts them).
  target      an image's l2-normalised mean of its tags' embeddings; images without tags are skipped (counted)
  model       a 2-layer MLP (hidden 2048, ReLU) on the frozen feature (`feature`, 'pre_logits'), trained with
              the cosine loss 1 - cos(MLP(x), target), Adam
  metric      the predicted tags are the K tags whose embeddings are most cosine-similar to MLP(x);
              mIOU@K = mean over test images with tags of |pred ∩ gt| / |pred ∪ gt|, in %, for K in `ks`
              ('miou5', ...). `prior_miouK` predicts the K most frequent training tags for every image: the
              floor a backbone has to beat.

Config: dataset, data_dir, config_name, train_split, test_split, pp (must give 'image' and the multi-hot
`tags_key`, e.g. '...|tags(num_tags=80)'), tags_key, feature, batch_size, tag_dim, hidden, epochs, lr,
train_batch_size, ks, seed, train_limit, test_limit, every_steps, random_init.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from vlrep.data import records
from vlrep.evaluators._inputs import EvalInputs, Model


def ppmi_matrix(tags: np.ndarray) -> np.ndarray:
  """[V, V] positive PMI of tag co-occurrence from a multi-hot [N, V] matrix; 0 where a pair never co-occurs."""
  t = (np.asarray(tags) > 0).astype(np.float64)
  co = t.T @ t  # n_ij; the diagonal is n_i
  count = np.diag(co)
  with np.errstate(divide="ignore", invalid="ignore"):
    pmi = np.log(len(t) * co / np.outer(count, count))
  return np.where(np.isfinite(pmi) & (co > 0), np.maximum(pmi, 0.0), 0.0)


def ppmi_embeddings(tags: np.ndarray, dim: int) -> np.ndarray:
  """[V, min(dim, V)] tag embeddings U_d sqrt(S_d) from the SVD of `ppmi_matrix(tags)`."""
  u, s, _ = np.linalg.svd(ppmi_matrix(tags))
  d = min(dim, len(s))
  return (u[:, :d] * np.sqrt(s[:d])).astype(np.float32)


def _unit(x, eps=1e-12):
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def mean_iou_at_k(scores: np.ndarray, gt: np.ndarray, k: int) -> float:
  """mean_i |top-k(scores_i) ∩ gt_i| / |top-k ∪ gt_i| in %, over rows with at least one gt tag."""
  gt = np.asarray(gt) > 0
  top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  pred = np.zeros_like(gt)
  np.put_along_axis(pred, top, True, axis=1)
  inter, union = np.sum(pred & gt, 1), np.sum(pred | gt, 1)
  rows = gt.any(1)
  return float(100.0 * np.mean(inter[rows] / union[rows])) if rows.any() else float("nan")


class TagMLP(nn.Module):
  hidden: int
  out: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.out, name="fc2")(nn.relu(nn.Dense(self.hidden, name="fc1")(x)))


def train_tag_mlp(features: np.ndarray, targets: np.ndarray, config) -> tuple[TagMLP, dict, float]:
  """Fits the MLP to unit `targets` with the cosine loss; returns (model, params, last epoch's mean loss)."""
  c = config
  model = TagMLP(c.get("hidden", 2048), targets.shape[1])
  bs = min(c.get("train_batch_size", 256), len(features))
  steps_per_epoch = max(1, len(features) // bs)
  tx = optax.adam(optax.cosine_decay_schedule(c.get("lr", 1e-3), c.get("epochs", 30) * steps_per_epoch))
  params = model.init(jax.random.PRNGKey(c.get("seed", 0)), jnp.asarray(features[:1]))["params"]
  opt_state = tx.init(params)
  x, y = jnp.asarray(features), jnp.asarray(targets)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, idx):
    def loss_fn(p):
      pred = model.apply({"params": p}, x[idx])
      cos = jnp.sum(pred * y[idx], -1) * jax.lax.rsqrt(jnp.maximum(jnp.sum(pred * pred, -1), 1e-12))
      return jnp.mean(1.0 - cos)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(c.get("seed", 0))
  epoch_loss = float("nan")
  for _ in range(c.get("epochs", 30)):
    order = rng.permutation(len(features))
    losses = []
    for s in range(steps_per_epoch):
      params, opt_state, loss = step(params, opt_state, jnp.asarray(order[s * bs : (s + 1) * bs]))
      losses.append(loss)
    epoch_loss = float(np.mean(jax.device_get(losses)))
    if not np.isfinite(epoch_loss):
      raise FloatingPointError(f"Tagging MLP training diverged (loss {epoch_loss}).")
  return model, params, epoch_loss


def fit_and_score(train_x, train_tags, test_x, test_tags, config) -> dict[str, float]:
  """The protocol on extracted features and multi-hot tags: PMI space, MLP, mIOU@K and the prior's."""
  c = config
  train_tags, test_tags = np.asarray(train_tags) > 0, np.asarray(test_tags) > 0
  tagged_train, tagged_test = train_tags.any(1), test_tags.any(1)
  if not tagged_train.any() or not tagged_test.any():
    raise ValueError(f"No tagged images in {c.get('train_split')!r} or {c.get('test_split')!r}; check pp's tags op.")
  emb = ppmi_embeddings(train_tags[tagged_train], c.get("tag_dim", 4096))
  seen = train_tags.any(0)
  targets = _unit(train_tags[tagged_train].astype(np.float32) @ emb)
  model, params, loss = train_tag_mlp(train_x[tagged_train], targets, c)
  pred = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, test_x[tagged_test]))
  scores = _unit(pred) @ _unit(emb).T
  scores[:, ~seen] = -np.inf  # a tag without an embedding is never predicted
  prior = np.broadcast_to(train_tags.sum(0).astype(np.float64), test_tags[tagged_test].shape)
  out = {}
  for k in c.get("ks", (5, 10, 15, 20)):
    out[f"miou{k}"] = mean_iou_at_k(scores, test_tags[tagged_test], k)
    out[f"prior_miou{k}"] = mean_iou_at_k(prior, test_tags[tagged_test], k)
  out.update(train_loss=loss, unseen_tags=float((~seen).sum()))
  out.update(untagged_train=float((~tagged_train).sum()), untagged_test=float((~tagged_test).sum()))
  return out


class Evaluator:
  """Evaluator: PMI tag space, MLP on frozen features, mIOU@K on the test split."""

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.feature_key = config.get("feature", "pre_logits")
    self.builder = inputs.builder(config)
    self.inputs = inputs
    if config.batch_size % jax.device_count():
      raise ValueError(f"tagging batch_size {config.batch_size} is not divisible by the {jax.device_count()} devices.")

  def _extract(self, split: str, limit: int, features_fn: Callable):
    c = self.config
    key = c.get("tags_key", "tags")
    split = records.first_examples(self.builder, split, limit)
    feats, tags = [], []
    for local in self.inputs.batches(self.builder, split, c.pp, ("image", key), c.batch_size):  # fmt: skip
      f, batch = features_fn(local)
      m = batch["_mask"].astype(bool)
      feats.append(f[m].reshape(int(m.sum()), -1))
      tags.append(np.asarray(batch[key])[m])
    if not feats:
      raise ValueError(f"Split {split!r} of {c.dataset} yielded no images for tagging.")
    x = np.concatenate(feats).astype(np.float32)
    if not np.isfinite(x).all():
      raise FloatingPointError(f"The backbone gave non-finite features on {split!r}; the checkpoint is broken.")
    return x, np.concatenate(tags) > 0

  def evaluate(self, model: Model) -> dict[str, float]:
    c = self.config
    features_fn = model.extractor(self.feature_key)
    t0 = time.time()
    train_x, train_tags = self._extract(c.train_split, c.get("train_limit", 0), features_fn)
    test_x, test_tags = self._extract(c.test_split, c.get("test_limit", 0), features_fn)
    out = fit_and_score(train_x, train_tags, test_x, test_tags, c)
    logging.info(
      "Tagging on %d train / %d test images (%.1fs): %s",
      len(train_x) - int(out["untagged_train"]),
      len(test_x) - int(out["untagged_test"]),
      time.time() - t0,
      ", ".join(f"mIOU@{k} {out[f'miou{k}']:.1f} (prior {out[f'prior_miou{k}']:.1f})" for k in c.get("ks", ())),
    )
    return out
