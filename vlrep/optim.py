"""Optimizer from config: parameter groups by regex (own peak LR each), no-decay regex, warmup + cosine
schedules, gradient clipping, and LookAhead.

Config (`config.optim`):
  name            'sgd' (momentum, PyTorch semantics: decay added to the gradient), 'adamw' or 'radam' (Rectified
                  Adam, Liu et al. 2020, with the official implementation's decoupled weight decay, as AdamW).
  lr_groups       [(regex, peak_lr), ...] matched in order against 'module/submodule/param' paths.
  no_decay        regex of parameters without weight decay.
  warmup_steps / total_steps come from the loop (converted from epochs there).
  lookahead_steps k (0 disables) and lookahead_alpha.
  frozen_steps    [(lr_groups regex, N), ...]: that group is frozen for the first N steps: no update, and its
                  optimizer state (momentum, Adam moments, their step count) untouched, as if the optimizer met
                  the group only at step N (`frozen_for`); its schedule is still the run's (LR at step N is the
                  schedule's value there). The train step also keeps those parameters' gradients out of the
                  norm (clip and metric) and their model state (BatchNorm statistics) unchanged (`hold_frozen`).
  schedule        'cosine' (default) or 'step' (x step_factor at each fraction of training in step_at).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax


def param_paths(params) -> Any:
  """A pytree like params whose leaves are 'a/b/c' path strings."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), params
  )


def group_labels(params, lr_groups) -> tuple[Any, dict[str, float]]:
  """Labels each parameter with the first matching group; errors on a parameter no group matches."""
  patterns = [
    (f"group{i}_{re.sub(r'[^A-Za-z0-9]+', '_', rx).strip('_') or 'all'}", re.compile(rx), lr)
    for i, (rx, lr) in enumerate(lr_groups)
  ]

  def label(path):
    for name, rx, _ in patterns:
      if rx.search(path):
        return name
    raise ValueError(f"Parameter {path!r} matches none of optim.lr_groups {[g[0] for g in lr_groups]}.")

  return jax.tree.map(label, param_paths(params)), {name: lr for name, _, lr in patterns}


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, end_fraction: float = 0.0):
  """Linear warmup from 0 to `peak`, then cosine decay to `end_fraction * peak` at `total_steps`."""
  warmup_steps = min(warmup_steps, total_steps)
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, peak, max(warmup_steps, 1)),
      optax.cosine_decay_schedule(peak, max(total_steps - warmup_steps, 1), alpha=end_fraction),
    ],
    [warmup_steps],
  )


class LookaheadState(NamedTuple):
  inner: Any
  slow: Any
  count: jnp.ndarray


def lookahead(inner: optax.GradientTransformation, sync_period: int, alpha: float) -> optax.GradientTransformation:
  """LookAhead (Zhang et al.): every `sync_period` steps, slow += alpha * (fast - slow) and fast = slow.

  Unlike optax.lookahead, the model parameters are a single tree: the fast weights between syncs, the slow
  weights right after one (as PyTorch implementations do), so the loop, evaluators and export see plain params.
  """

  def init(params):
    return LookaheadState(inner.init(params), jax.tree.map(jnp.asarray, params), jnp.zeros([], jnp.int32))

  def update(grads, state, params):
    updates, inner_state = inner.update(grads, state.inner, params)
    fast = optax.apply_updates(params, updates)
    count = state.count + 1
    sync = count % sync_period == 0
    slow = jax.tree.map(lambda s, f: jnp.where(sync, s + alpha * (f - s), s), state.slow, fast)
    new_params = jax.tree.map(lambda s, f: jnp.where(sync, s, f), slow, fast)
    return jax.tree.map(lambda n, p: n - p, new_params, params), LookaheadState(inner_state, slow, count)

  return optax.GradientTransformation(init, update)


class FrozenForState(NamedTuple):
  count: jnp.ndarray  # steps seen, frozen ones included
  inner: Any


def frozen_for(inner: optax.GradientTransformation, steps: int) -> optax.GradientTransformation:
  """`inner` that does nothing for its first `steps` steps: zero updates, its state passed through unchanged (no
  momentum or moment accumulation, its own step count stays 0). From step `steps` on it runs as if created then,
  so a schedule inside it must be shifted by `steps` (`build` does)."""

  def init(params):
    return FrozenForState(jnp.zeros([], jnp.int32), inner.init(params))

  def update(updates, state, params=None):
    frozen = state.count < steps
    new_updates, new_inner = inner.update(updates, state.inner, params)
    new_updates = jax.tree.map(lambda u: jnp.where(frozen, jnp.zeros_like(u), u), new_updates)
    new_inner = jax.tree.map(lambda n, o: jnp.where(frozen, o, n), new_inner, state.inner)
    return new_updates, FrozenForState(optax.safe_int32_increment(state.count), new_inner)

  return optax.GradientTransformation(init, update)


def frozen_rules(config: ml_collections.ConfigDict) -> tuple[tuple[str, int], ...]:
  """(regex, N) for every lr_groups regex, in order, N its `frozen_steps` (0: never frozen); () without frozen
  groups. A path belongs to the first regex it matches, as a parameter belongs to its lr group."""
  frozen = dict(config.get("frozen_steps", ()) or ())
  if not any(frozen.values()):
    return ()
  unknown = set(frozen) - {rx for rx, _ in config.lr_groups}
  if unknown:
    raise ValueError(f"optim.frozen_steps names {sorted(unknown)}, which are not among optim.lr_groups' regexes.")
  return tuple((rx, int(frozen.get(rx, 0))) for rx, _ in config.lr_groups)


def hold_frozen(step, new, old, rules):
  """`new`, with each leaf whose path ('a/b/c') first matches a `frozen_rules` regex whose N is > `step` replaced
  by its `old` value (a path matching no regex is never frozen). The train step keeps a frozen group's gradients at
  zero with it (old = zeros) and its model state (BatchNorm statistics, whose paths mirror the parameters')
  unchanged."""
  if not rules:
    return new
  compiled = [(re.compile(rx), n) for rx, n in rules]

  def frozen_until(path):
    return next((n for rx, n in compiled if rx.search(path)), 0)

  def pick(path, n_leaf, o_leaf):
    n = frozen_until(path)
    return jnp.where(step < n, o_leaf, n_leaf) if n else n_leaf

  return jax.tree.map(pick, param_paths(new), new, old)


def build(config: ml_collections.ConfigDict, params, total_steps: int, warmup_steps: int):
  """Returns (optax transformation, {group: schedule}) for `params`."""
  labels, peaks = group_labels(params, config.lr_groups)
  if config.get("schedule", "cosine") == "cosine":
    schedules = {name: warmup_cosine(peak, warmup_steps, total_steps) for name, peak in peaks.items()}
  elif config.schedule == "step":
    # Multiply by `step_factor` at each fraction of training in `step_at` (e.g. epochs 70 and 90 of 100).
    bounds = {int(round(f * total_steps)): config.get("step_factor", 0.1) for f in config.step_at}
    schedules = {
      name: optax.join_schedules(
        [
          optax.linear_schedule(0.0, peak, max(warmup_steps, 1)),
          optax.piecewise_constant_schedule(peak, {b - warmup_steps: f for b, f in bounds.items()}),
        ],
        [max(warmup_steps, 1)],
      )
      if warmup_steps
      else optax.piecewise_constant_schedule(peak, bounds)
      for name, peak in peaks.items()
    }
  else:
    raise ValueError(f"Unknown LR schedule {config.schedule!r}; expected 'cosine' or 'step'.")
  # frozen_steps [(lr_groups regex, N)]: that group is frozen for its first N steps (ICMLM warms its heads up with
  # the backbone frozen): its transformation is wrapped in `frozen_for` (no update, no state change), which starts
  # counting at step N, so its schedule is shifted by N; the reported schedule is 0 until N, then the run's.
  group_names = list(peaks)
  frozen = {}
  for rx, n in frozen_rules(config):
    if n:
      frozen[group_names[[grx for grx, _ in config.lr_groups].index(rx)]] = n
  base_schedules = dict(schedules)
  for name, n in frozen.items():
    schedules[name] = lambda step, sched=base_schedules[name], n=n: jnp.where(step < n, 0.0, sched(step))

  def inner_schedule(name):
    n = frozen.get(name, 0)
    return (lambda count, sched=base_schedules[name], n=n: sched(count + n)) if n else base_schedules[name]

  def freeze(name, tx):
    return frozen_for(tx, frozen[name]) if name in frozen else tx

  no_decay = re.compile(config.no_decay) if config.no_decay else None
  decay_mask = jax.tree.map(lambda p: not (no_decay and no_decay.search(p)), param_paths(params))

  if config.name == "sgd":

    def group_tx(name):
      tx = optax.sgd(inner_schedule(name), momentum=config.momentum or None, nesterov=config.nesterov)
      return freeze(name, tx)

    parts = [optax.add_decayed_weights(config.weight_decay, mask=decay_mask)] if config.weight_decay else []
    parts.append(optax.multi_transform({n: group_tx(n) for n in schedules}, labels))
  elif config.name in ("adamw", "radam"):

    def group_tx(name):
      if config.name == "adamw":
        scale = optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps)
      else:
        # optax's RAdam rectification (threshold 5: plain bias-corrected momentum until the variance is
        # tractable, as the official implementation's `degenerated_to_sgd`); its weight decay is decoupled, as
        # that implementation's (p -= lr * wd * p), i.e. AdamW's.
        scale = optax.scale_by_radam(b1=config.b1, b2=config.b2, eps=config.eps)
      tx = optax.chain(
        scale,
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(inner_schedule(name)),
      )
      return freeze(name, tx)

    parts = [optax.multi_transform({n: group_tx(n) for n in schedules}, labels)]
  else:
    raise ValueError(f"Unknown optimizer {config.name!r}; known: sgd, adamw, radam")
  if config.grad_clip_norm:
    parts.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
  tx = optax.chain(*parts)
  if config.lookahead_steps:
    tx = lookahead(tx, config.lookahead_steps, config.lookahead_alpha)
  return tx, schedules
