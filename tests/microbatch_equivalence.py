"""One train step of every method with `microbatches=1` and with `microbatches=4` on the same global batch (the tiny
configs' real training input, the loop's own step): what tests/test_microbatches.py compares, on this process's
devices (one) or, run as a script, on 8 simulated ones.

Every variant is made exact where microbatches would otherwise change the maths, and says how: dropout off (each
microbatch draws its own masks), BatchNorm in groups of 8 examples (a microbatch holds whole groups; a whole-batch
BatchNorm, as MCT's head BatchNorm, would take its statistics per microbatch: MCT's variant has none), plain SGD at
learning rate 1 (the update is minus the gradient, so equal parameters mean equal gradients; Adam's first step divides a
gradient by its own size, which turns a rounding difference near zero into a full step).

  python tests/microbatch_equivalence.py OUT.json [VARIANT ...]   (XLA_FLAGS sets the device count)
"""

import functools
import importlib
import json
import os
import sys

import jax
import numpy as np
import optax

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from vlrep import run_setup, sharding, train_step  # noqa: E402
from vlrep.data import pipeline  # noqa: E402

BATCH = 256  # 8 devices x 4 microbatches x 8 examples: one BatchNorm group per device and microbatch
GROUP = 8
MICROBATCHES = 4

# name: (tiny config module[:its argument], config overrides)
VARIANTS = {
  "virtex_bicaptioning": ("tiny_virtex", {}),
  "virtex_captioning": ("tiny_virtex", {"method.task": "captioning"}),
  "virtex_token_classification": ("tiny_virtex", {"method.task": "token_classification"}),
  "virtex_masked_lm": ("tiny_virtex", {"method.task": "masked_lm"}),
  "virtex_cappa": ("tiny_virtex", {"method.task": "cappa"}),
  "clip": ("tiny_clip", {}),
  "siglip": ("tiny_clip", {"method.loss": "sigmoid"}),
  "siglip_chunked": ("tiny_clip", {"method.loss": "sigmoid", "method.loss_chunks": 4}),
  "loctex": ("tiny_loctex", {}),
  "loctex_groups": ("tiny_loctex", {"method.contrastive_group_size": 16}),
  # MCT's head BatchNorm (runlocal's head_batchnorm=('inter',)) takes its statistics over the whole batch, with no
  # groups: per microbatch it would differ, so this variant has none.
  "mct": ("tiny_mct", {"method.queue_size": 2 * BATCH, "method.head_batchnorm": ()}),
  "icmlm": ("tiny_icmlm", {}),
  "vlbert": ("tiny_vlbert", {}),
  # ViLBERT with the alignment objective: each example's negative pairs it with the next example's image (drawn in
  # `prepare`, over the global batch).
  "vilbert_alignment": ("tiny_vlbert:arch=vilbert", {"method.alignment_weight": 1.0}),
  # VQA fine-tuning: its batches carry per-question counts (stat_*, B x questions long) beside per-image fields.
  "vlbert_vqa": ("tiny_vlbert:stage=finetune,task=vqa", {}),
  "classifier": ("tiny_finetune", {}),
  # Parameters, gradients and optimizer state split over the devices (ZeRO-3 style), as `sharding.params='fsdp'`.
  "virtex_fsdp": ("tiny_virtex", {"sharding.params": "fsdp"}),
  "clip_fsdp": ("tiny_clip", {"sharding.params": "fsdp"}),
}


def _no_dropout(tree: dict) -> None:
  for k, v in tree.items():
    if isinstance(v, dict):
      _no_dropout(v)
    elif "dropout" in k and isinstance(v, float):
      tree[k] = 0.0


def _groups_of(tree: dict, size: int) -> None:
  for k, v in tree.items():
    if isinstance(v, dict):
      _groups_of(v, size)
    elif k == "bn_group_size":
      tree[k] = size


def variant_config(name: str, remat: str = "none"):
  module, overrides = VARIANTS[name]
  module, _, arg = module.partition(":")
  config = importlib.import_module(module).get_config(arg or None)
  for key, value in overrides.items():
    node = config
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  method = config.method.to_dict()
  _no_dropout(method)
  _groups_of(method, GROUP)
  config.method = method
  config.batch_size = BATCH
  config.remat = remat
  return config


def one_step(name: str, microbatches: int, remat: str = "none") -> dict:
  """{'loss', 'metrics', 'params', 'model_state', 'start'} (numpy) after one step of `name` from its initial state
  on the first training batch, with `microbatches` and the `remat` policy."""
  config = variant_config(name, remat)
  builder, inputs = run_setup.build(config, for_training=True)
  method = inputs.method
  mesh = sharding.make_mesh()
  batch_sh = sharding.batch_sharding(mesh)
  errors = train_step.step_errors(config, train_step.batch_shards(batch_sh))
  assert not errors, errors
  stream = pipeline.train_stream(
    builder, config.data, method.fields, BATCH, seed=0, host_index=0, host_count=1, context=inputs.pp_context
  )
  local = next(iter(stream))
  batch = sharding.global_batch(local, batch_sh)
  key = jax.random.PRNGKey(0)
  tx = optax.sgd(1.0)
  init = lambda k, b: train_step.init_train_state(method, tx, k, b)  # noqa: E731
  # The loop's layout: replicated, or FSDP down to small leaves (the tiny models' are all small).
  state_sh = sharding.state_shardings(
    mesh,
    jax.eval_shape(init, key, batch),
    config.sharding.params,
    fsdp_min_size=256,
    rules=config.sharding.get("rules", ()),
  )
  state = jax.jit(init, out_shardings=state_sh)(key, batch)
  pretrained = getattr(method, "pretrained_variables", None)
  if pretrained is not None and not hasattr(method, "pretrained_runs"):
    values = pretrained({})
    state["params"] = _written(state["params"], values.get("params", {}))
  start = jax.tree.map(np.asarray, state["params"])
  step = jax.jit(
    train_step.make_train_step(method, tx, {}, jax.random.PRNGKey(1), (), microbatches, batch_sh),
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, None),
  )
  new, metrics = step(state, batch)
  return {
    "loss": float(metrics["train/loss"]),
    "metrics": {k: float(v) for k, v in metrics.items()},
    "params": jax.tree.map(np.asarray, new["params"]),
    "model_state": jax.tree.map(np.asarray, new["model_state"]),
    "start": start,
  }


@functools.cache
def whole_batch_step(name: str) -> dict:
  """`one_step(name, 1)`, computed once per process (every comparison starts from it)."""
  return one_step(name, 1)


def _written(tree, values):
  if not isinstance(values, dict):
    return np.asarray(values, dtype=np.asarray(tree).dtype)
  return {k: _written(v, values[k]) if k in values else v for k, v in tree.items()}


def differences(name: str, remat: str = "none") -> dict:
  """How far `microbatches=4` (with the `remat` policy) is from 1 (without): the loss's relative difference, each
  metric's, the largest parameter difference over the largest update, and the largest model-state difference over
  its scale."""
  one, four = whole_batch_step(name), one_step(name, MICROBATCHES, remat)
  flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
  pairs = lambda x, y: zip(flat(x), flat(y), strict=True)  # noqa: E731
  update = max(float(np.max(np.abs(a - s))) for (_, a), (_, s) in pairs(one["params"], one["start"]))
  params = max(float(np.max(np.abs(a - b))) for (_, a), (_, b) in pairs(one["params"], four["params"]))
  state_diffs = [
    float(np.max(np.abs(a.astype(np.float64) - b))) / max(1.0, float(np.max(np.abs(a))))
    for (_, a), (_, b) in zip(flat(one["model_state"]), flat(four["model_state"]), strict=True)
    if np.issubdtype(a.dtype, np.floating) and a.size
  ]
  metrics = {
    k: abs(four["metrics"][k] - v) / max(abs(v), 1e-6)
    for k, v in one["metrics"].items()
    if not k.startswith("train/lr")
  }
  return {
    "loss": one["loss"],
    "loss_relative": abs(four["loss"] - one["loss"]) / max(abs(one["loss"]), 1e-12),
    "update": update,
    "params_over_update": params / max(update, 1e-30),
    "model_state": max(state_diffs, default=0.0),
    "metrics": metrics,
    "devices": jax.device_count(),
  }


if __name__ == "__main__":
  out, names = sys.argv[1], sys.argv[2:] or list(VARIANTS)
  results = {}
  for n in names:
    try:
      results[n] = differences(n)
    except Exception as e:  # noqa: BLE001 -- reported per variant; the test names it
      results[n] = {"error": f"{type(e).__name__}: {e}"}
  with open(out, "w") as f:
    json.dump(results, f, indent=1)
