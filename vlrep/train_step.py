"""The jitted train step and the train state, apart from the loop so that tools (the benchmark) can time the exact
step without the loop's input and logging dependencies (TensorFlow, clu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from vlrep import optim


def make_train_step(method, tx, schedules: dict, base_rng, clip_norm: float = 0.0, frozen=()):
  """The step the loop jits: loss and gradients from the method, optimizer update, metrics.

  clip_norm > 0 (`optim.step_clip_norm`): the step clips the gradient by its global norm itself, with the norm it
  also reports, so the norm is taken once (`tx` then has no clip of its own).
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

    (loss, (metrics, new_model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    if frozen:
      grads = optim.hold_frozen(state["step"], grads, jax.tree.map(jnp.zeros_like, grads), frozen)
      new_model_state = {
        k: optim.hold_frozen(state["step"], v, state["model_state"][k], frozen) if k in state["model_state"] else v
        for k, v in new_model_state.items()
      }
    grad_norm = optax.tree.norm(grads)
    if clip_norm:
      grads = optim.clip_by_norm(grads, grad_norm, clip_norm)
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


PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def prng_impl(config):
  """The context in which a run makes and uses its random keys: `config.rng_impl` (default threefry2x32).

  'rbg' and 'unsafe_rbg' draw dropout masks with the accelerator's random-bit generator, cheaper than threefry on
  GPUs; the masks differ from threefry's (same distribution), so a run's seed gives other numbers under them."""
  impl = config.get("rng_impl", "threefry2x32") or "threefry2x32"
  if impl not in PRNG_IMPLS:
    raise ValueError(f"Unknown rng_impl {impl!r}; known: {', '.join(PRNG_IMPLS)}.")
  return jax.default_prng_impl(impl)


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
