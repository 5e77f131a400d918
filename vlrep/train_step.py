"""The jitted train step and the train state, apart from the loop so that tools (the benchmark) can time the exact
step without the loop's input and logging dependencies (TensorFlow, clu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vlrep import methods, optim
from vlrep.models import remat

# config.remat's choices, what each residual block and transformer layer keeps for its backward pass (the table
# lives beside the models that apply it).
REMAT_POLICIES = remat.POLICIES


def make_train_step(method, tx, schedules: dict, base_rng, frozen=(), microbatches: int = 1, batch_sharding=None):
  """The step the loop jits: loss and gradients from the method, optimizer update, metrics.

  microbatches > 1 (`config.microbatches`; the method must split its loss, `methods.SplitsItsLoss`): the global
  batch is taken in that many microbatches, one update from all of them, equal to the whole batch's update
  (`microbatched_gradients`). `batch_sharding`: how the batch arrives (a NamedSharding over `data`), so each
  microbatch is spread over every device.

  frozen (`optim.frozen_rules`): while a parameter group is frozen, its gradients are zero before the norm (they
  neither count in the clip nor in `grad_norm`, as parameters without gradients) and the model state under the same
  paths (BatchNorm statistics) keeps its values; `tx` (`optim.frozen_for`) leaves the group and its optimizer
  state untouched.
  """

  def train_step(state, batch):
    rng = jax.random.fold_in(base_rng, state["step"])

    def loss_fn(params):
      loss, metrics, new_model_state = method.loss({"params": params, **state["model_state"]}, batch, rng, True)
      return loss, (metrics, new_model_state)

    if microbatches > 1:
      loss, metrics, new_model_state, grads = microbatched_gradients(
        method, state["params"], state["model_state"], batch, rng, microbatches, batch_sharding
      )
    else:
      (loss, (metrics, new_model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    if frozen:
      grads = optim.hold_frozen(state["step"], grads, jax.tree.map(jnp.zeros_like, grads), frozen)
      new_model_state = {
        k: optim.hold_frozen(state["step"], v, state["model_state"][k], frozen) if k in state["model_state"] else v
        for k, v in new_model_state.items()
      }
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new = {
      "step": state["step"] + 1,
      "params": params,
      "model_state": {**state["model_state"], **new_model_state},
      "opt_state": opt_state,
    }
    # A non-finite loss leaves the state untouched (the loop stops at the next check), so no NaN ever
    # reaches a checkpoint.
    finite = jnp.isfinite(loss)
    new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, {**state, "step": state["step"] + 1})
    metrics = {f"train/{k}": v for k, v in metrics.items()}
    metrics["train/loss"] = loss
    metrics["train/grad_norm"] = grad_norm
    for name, schedule in schedules.items():
      metrics[f"train/lr_{name}"] = schedule(state["step"])
    for k, v in batch.items():
      if k.startswith("stat_"):
        metrics[f"data/{k[5:]}_count"] = jnp.sum(v.astype(jnp.int32))
    return new, metrics

  return train_step


def batch_shards(batch_sharding) -> int:
  """How many parts the batch's leading dimension is split into over the devices (1 without a sharding)."""
  if not isinstance(batch_sharding, NamedSharding) or not batch_sharding.spec or batch_sharding.spec[0] is None:
    return 1
  axes = batch_sharding.spec[0] if isinstance(batch_sharding.spec[0], tuple) else (batch_sharding.spec[0],)
  return int(np.prod([batch_sharding.mesh.shape[a] for a in axes]))


def step_errors(config, shards: int) -> list[str]:
  """What is wrong with `config`'s step settings on `shards` batch shards: `remat` must name a policy, and with
  `microbatches` > 1 the batch must split into equal parts on every device, each holding whole BatchNorm groups
  (`bn_group_size` anywhere in the method's config). [] when nothing is."""
  remat = config.get("remat", "none")
  errors = [] if remat in REMAT_POLICIES else [f"remat={remat!r}: one of {', '.join(map(repr, REMAT_POLICIES))}."]
  n = config.get("microbatches", 1)
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    return [*errors, f"microbatches={n!r}: a whole number, 1 (the whole batch at once) or more."]
  if n == 1:
    return errors
  b = int(config.batch_size)
  if b % (shards * n):
    return [
      *errors,
      f"batch_size={b} does not split into microbatches={n} equal parts on each of {shards} devices: it must be "
      f"a multiple of {shards * n}.",
    ]
  piece = b // (shards * n)
  for path, size in _group_sizes(config.method.to_dict() if hasattr(config.method, "to_dict") else config.method):
    if size and piece % size:
      errors.append(
        f"method.{path}={size}: a microbatch holds {piece} examples per device, which is not whole BatchNorm "
        f"groups; choose a batch_size or microbatches giving a multiple of {size} per device."
      )
  return errors


def whole_batch_norms(config) -> list[str]:
  """The method's BatchNorms over the whole batch (`bn_group_size=0` anywhere in its config, MCT's
  `head_batchnorm`): with `config.microbatches` > 1 they take their statistics per microbatch instead."""
  method = config.method.to_dict() if hasattr(config.method, "to_dict") else dict(config.method)
  # VL-BERT's region extractor (method.visual) is frozen and runs with its running statistics.
  out = [f"method.{path}=0" for path, size in _group_sizes(method) if not size and not path.startswith("visual.")]
  if method.get("head_batchnorm"):
    out.append(f"method.head_batchnorm={tuple(method['head_batchnorm'])}")
  return out


def _group_sizes(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _group_sizes(v, f"{prefix}{k}.")
    elif k == "bn_group_size":
      yield f"{prefix}{k}", int(v or 0)


def microbatched_gradients(method, params, model_state, batch, rng, n: int, batch_sharding=None):
  """(loss, metrics, new model state, gradients) of the whole batch, taken in `n` microbatches.

  1. The method's draws over the whole batch (`prepare`); the batch is split so that microbatch m holds the m-th
     n-th of every device's examples (a device's contiguous examples stay together: BatchNorm groups intact).
  2. Forward pass microbatch by microbatch, keeping only `per_example`'s outputs (embeddings, per-token losses):
     no activations are kept.
  3. `combine` over the whole batch's outputs, and its gradient with respect to them (and to the parameters it
     reads, a learned temperature).
  4. Microbatch by microbatch again: `per_example`'s forward with its VJP, pulled back from step 3's gradient of
     that microbatch's outputs, summed. Loss and metrics are `combine`'s of these outputs.
  Where `combine` is linear in the outputs (sums of per-example losses over counts fixed by the batch), its gradient
  does not read them and XLA removes step 2. Dropout draws per microbatch (`fold_in(rng, m)` for microbatch m);
  BatchNorm's running statistics are the mean of the microbatches' (equal to the whole batch's where groups are set, as
  each microbatch holds whole groups); a whole-batch BatchNorm (`bn_group_size=0`) takes its statistics per microbatch.
  """
  if not isinstance(method, methods.SplitsItsLoss):
    raise ValueError(
      f"microbatches={n}: method {methods.name_of(method)!r} does not split its loss into per_example and combine "
      "(vlrep.methods.SplitsItsLoss); train it with microbatches=1."
    )
  # Counts the input pipeline keeps per question, not per example (VQA's stat_*), are not split: the step's data
  # metrics read them from the whole batch, and no method reads them.
  sizes = {x.shape[0] for k, x in batch.items() if not k.startswith("stat_")}
  batch = {k: x for k, x in batch.items() if not k.startswith("stat_") or x.shape[0] in sizes}
  batch = methods.prepare(method, batch, rng)
  shards = batch_shards(batch_sharding)
  split, merge = _splitter(batch, n, shards, batch_sharding)
  parts = jax.tree.map(split, batch)
  index = jnp.arange(n)

  def variables(p):
    return {"params": p, **model_state}

  def forward(_, xs):
    part, m = xs
    outputs, _ = method.per_example(variables(params), part, jax.random.fold_in(rng, m), True)
    _check_outputs(method, outputs)
    return None, outputs

  _, outputs = jax.lax.scan(forward, None, (parts, index))

  def combined_loss(p, outputs):
    return method.combine(variables(p), outputs, batch)[0]

  _, pullback = jax.vjp(combined_loss, params, jax.tree.map(merge, outputs))
  combine_grads, output_grads = pullback(jnp.ones((), jnp.float32))

  def backward(total, xs):
    part, d_outputs, m = xs

    def part_outputs(p):
      return method.per_example(variables(p), part, jax.random.fold_in(rng, m), True)

    outputs, part_pullback, state = jax.vjp(part_outputs, params, has_aux=True)
    (grads,) = part_pullback(d_outputs)
    return jax.tree.map(jnp.add, total, grads), (outputs, state)

  grads, (outputs, states) = jax.lax.scan(backward, combine_grads, (parts, jax.tree.map(split, output_grads), index))
  loss, metrics, batch_state = method.combine(variables(params), jax.tree.map(merge, outputs), batch)
  example_state = jax.tree.map(lambda x: jnp.mean(x, 0).astype(x.dtype), states)
  return loss, metrics, methods.merge_states(example_state, batch_state), grads


def _splitter(batch, n: int, shards: int, batch_sharding):
  """(split, merge): [B, ...] -> [n, B/n, ...], microbatch m = the m-th n-th of each of the `shards` parts of the
  batch, laid out over the devices as the batch is; and back."""
  sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
  if len(sizes) != 1:
    raise ValueError(f"A microbatched step needs every batch field to have one leading size; got {sorted(sizes)}.")
  (b,) = sizes
  if b % (shards * n):
    raise ValueError(f"The batch of {b} does not split into {n} microbatches on each of {shards} devices.")
  piece = b // (shards * n)
  layout = None
  if isinstance(batch_sharding, NamedSharding) and shards > 1:
    layout = NamedSharding(batch_sharding.mesh, P(None, batch_sharding.spec[0]))

  def split(x):
    rest = x.shape[1:]
    y = x.reshape(shards, n, piece, *rest).swapaxes(0, 1).reshape(n, shards * piece, *rest)
    return jax.lax.with_sharding_constraint(y, layout) if layout is not None else y

  def merge(y):
    rest = y.shape[2:]
    return y.reshape(n, shards, piece, *rest).swapaxes(0, 1).reshape(b, *rest)

  return split, merge


def _check_outputs(method, outputs) -> None:
  for path, x in jax.tree_util.tree_flatten_with_path(outputs)[0]:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      raise TypeError(
        f"{methods.name_of(method)}.per_example's output {jax.tree_util.keystr(path)} is {x.dtype}: outputs are "
        "differentiated, so each is a floating array (cast masks and counts to float32)."
      )


def init_train_state(method, tx, rng, batch) -> dict:
  """The train state: step, params, other model state (BatchNorm statistics), optimizer state."""
  variables = method.init(rng, batch)
  params = variables["params"]
  return {
    "step": jnp.zeros([], jnp.int32),
    "params": params,
    "model_state": {k: v for k, v in variables.items() if k != "params"},
    "opt_state": tx.init(params),
  }
