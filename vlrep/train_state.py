"""A run's train state, created directly in its sharded layout: fresh (plus a method's pretrained values and
`init_from`'s backbone) or restored from the newest intact checkpoint. The loop (vlrep.train) calls `layout`,
`fresh` and `restore`; this module reads other runs' checkpoints for it, so methods never do."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from vlrep import checkpoint as ckpt_lib
from vlrep import methods, runs, sharding
from vlrep.train_step import init_train_state


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a run's state is made and where it lives: `init(rng, batch) -> state`, its shapes (`abstract`) and the
  sharding of every leaf on the mesh."""

  init: Callable[[jax.Array, dict], dict]
  abstract: Any
  shardings: Any


def layout(method, tx, mesh, sharding_config: ml_collections.ConfigDict, rng, batch) -> Layout:
  """The state's layout, from a shape-only (abstract) initialisation: nothing is allocated."""
  init = functools.partial(init_train_state, method, tx)
  abstract = jax.eval_shape(init, rng, batch)
  shardings = sharding.state_shardings(mesh, abstract, sharding_config.params, rules=sharding_config.get("rules", ()))
  return Layout(init, abstract, shardings)


def fresh(layout: Layout, method, tx, rng, batch, init_from: str = "") -> dict:
  """A new state, created in its sharding; then the method's pretrained values (e.g. ICMLM's frozen BERT) and, with
  `init_from`, another run's backbone written into it."""
  state = jax.jit(layout.init, out_shardings=layout.shardings)(rng, batch)
  state = load_pretrained_variables(state, pretrained_variables_of(method), tx, layout.shardings)
  if init_from:
    state = init_from_checkpoint(state, init_from, tx, layout.shardings)
  return state


def restore(ckpt: ckpt_lib.Checkpointer, workdir: str, layout: Layout) -> tuple[int, dict, dict]:
  """(step, state, the run's summary so far) from the newest checkpoint that restores; older ones are tried when
  the newest is damaged (each skip logged)."""
  abstract = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), layout.abstract, layout.shardings
  )
  step, state, meta, skipped = ckpt.restore_newest_intact(abstract)
  for skipped_step, why in skipped:
    logging.warning("Checkpoint at step %d does not restore (%s): skipped.", skipped_step, why)
  logging.info("Resumed from step %d in %s.", step, workdir)
  return step, state, dict(meta.get("summary", {}))


def pretrained_variables_of(method) -> dict:
  """A method's pretrained values (`methods.UsesPretrained`), given the runs it names (`methods.NamesPretrainedRuns`:
  {name: workdir}), each loaded here at its best checkpoint: methods read checkpoints only through the loop."""
  if not isinstance(method, methods.UsesPretrained):
    return {}
  wanted = method.pretrained_runs() if isinstance(method, methods.NamesPretrainedRuns) else {}
  return method.pretrained_variables({name: runs.load_run(path, "best") for name, path in wanted.items()})


def load_pretrained_variables(state: dict, pretrained: dict, tx, state_sh) -> dict:
  """Writes a method's pretrained values (numpy trees under 'params' / 'model_state', e.g. ICMLM's frozen BERT)
  into a fresh state, in its sharding; then re-initialises the optimizer state. A subtree whose structure is the
  model's is checked whole (every path and shape); a dict that names only some of a subtree's entries (MCT's
  momentum copy: {'momentum': {'params': {'textual': ...}}}) is descended into, each named entry checked."""
  if not pretrained:
    return state

  def put(a, s):
    a = np.asarray(a, np.float32)
    return jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx])

  def merge(current, given, shardings, where):
    if not isinstance(given, dict) or not isinstance(current, dict):
      ckpt_lib.check_signature(ckpt_lib.signature(given), ckpt_lib.signature(current), where)
      return jax.tree.map(put, given, shardings)
    try:
      ckpt_lib.check_signature(ckpt_lib.signature(given), ckpt_lib.signature(current), where)
      logging.info("Loaded pretrained %s (%d tensors).", where, len(jax.tree.leaves(given)))
      return jax.tree.map(put, given, shardings)
    except ValueError:
      if set(given) == set(current):  # the same entries with other shapes or paths: report the mismatch
        raise
    out = dict(current)
    for name, tree in given.items():
      if name not in current:
        raise ValueError(f"Pretrained values for {where}/{name}, which this model does not have.")
      out[name] = merge(current[name], tree, shardings[name], f"{where}/{name}")
    return out

  new = dict(state)
  for part, trees in pretrained.items():
    new[part] = merge(state[part], trees, state_sh[part], part)
  if "params" in pretrained:
    new["opt_state"] = jax.jit(tx.init, out_shardings=state_sh["opt_state"])(new["params"])
  return new


def init_from_architecture(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """`init_from=RUN`: the backbone architecture keys (depth, width, stem, ...) this run takes from RUN where they
  differ from `config`'s, as {key: RUN's value}, so any config can start from any run's backbone (e.g.
  finetune.py:runlocal from the quick start's ResNet-10); its BatchNorm grouping stays this config's. When
  resuming, the architecture is the one this run saved, so RUN is not read again. `config` is only read (the loop
  builds the model from a copy with these keys: train.config_as_trained); said in the log when it differs."""
  if not config.get("init_from") or "backbone" not in config.get("method", {}):
    return {}
  try:
    source, saved = workdir, runs.read_config(workdir, resuming=True)  # resuming: what this run was built with
  except (FileNotFoundError, RuntimeError):
    source, saved = config.init_from, runs.read_config(config.init_from)
  if "backbone" not in saved.method:
    raise ValueError(f"init_from={config.init_from}: that run's model has no 'backbone' to start from.")
  want = runs.backbone_architecture(saved.method.backbone)
  have = runs.backbone_architecture(config.method.backbone)
  if want["arch"] != have["arch"]:
    raise ValueError(
      f"init_from={config.init_from}: that run's backbone is a {want['arch']} and this config's a {have['arch']}; "
      "a backbone starts only from one of its own kind (choose the config's backbone to match)."
    )
  changed = {k: (have[k], v) for k, v in want.items() if have[k] != v}
  if changed:
    logging.info(
      "init_from: the backbone takes the architecture of %s: %s.",
      source,
      ", ".join(f"{k}={new!r} (config: {old!r})" for k, (old, new) in changed.items()),
    )
  return {k: new for k, (_, new) in changed.items()}


def init_from_checkpoint(state: dict, workdir: str, tx, state_sh) -> dict:
  """Copies the visual backbone (parameters and BatchNorm statistics) of another run's best checkpoint into a
  fresh state, then re-initialises the optimizer state from the new parameters (LookAhead keeps a copy)."""
  run = runs.load_run(workdir, "best")
  src_params, src_stats = runs.backbone_of(run)[1]["params"], run.model_state.get("batch_stats", {})
  if "backbone" not in state["params"]:
    raise ValueError("init_from needs a model with a 'backbone'; this config's model has none.")
  want = ckpt_lib.signature(state["params"]["backbone"])
  ckpt_lib.check_signature(ckpt_lib.signature(src_params), want, run.path)
  params = dict(state["params"], backbone=jax.tree.map(jnp.asarray, src_params))
  model_state = dict(state["model_state"])
  if "backbone" in src_stats:
    model_state["batch_stats"] = dict(model_state.get("batch_stats", {}), backbone=src_stats["backbone"])
  new = {**state, "params": params, "model_state": model_state}
  new = jax.device_put(new, state_sh)
  new["opt_state"] = jax.jit(tx.init, out_shardings=state_sh["opt_state"])(new["params"])
  logging.info("Backbone initialised from %s (step %d).", run.path, run.step)
  return new
