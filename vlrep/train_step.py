"""The jitted train step and the train state, apart from the loop so that tools (the benchmark) can time the exact
step without the loop's input and logging dependencies (TensorFlow, clu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from vlrep import optim


def make_train_step(method, tx, schedules: dict, base_rng, frozen=()):
  """The step the loop jits: loss and gradients from the method, optimizer update, metrics.

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
