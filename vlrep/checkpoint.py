"""Checkpoints with Orbax: periodic 'latest' checkpoints (keep N), a 'best' one by an eval metric, automatic
resume, and a model-signature check so that a checkpoint from a different model is a clear error.

Layout: WORKDIR/checkpoints/<step>/{state, meta} and WORKDIR/best/<step>/{state, meta}. `meta` holds the
parameter shapes and the run's config. Orbax writes into a temporary directory and renames it when complete,
so a run killed mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from vlrep.optim import param_paths


def signature(params) -> dict[str, list[int]]:
  paths = jax.tree.leaves(param_paths(params))
  shapes = [list(np.shape(x)) for x in jax.tree.leaves(params)]
  return dict(zip(paths, shapes, strict=True))


def check_signature(saved: dict, current: dict, where: str) -> None:
  if saved == current:
    return
  missing = sorted(set(current) - set(saved))
  extra = sorted(set(saved) - set(current))
  shape = sorted(k for k in set(saved) & set(current) if saved[k] != current[k])
  lines = [f"The checkpoint in {where} was written by a different model than this config builds:"]
  if shape:
    lines += [f"  {k}: checkpoint {tuple(saved[k])} vs model {tuple(current[k])}" for k in shape[:5]]
  if missing:
    lines.append(f"  {len(missing)} parameters missing from the checkpoint, e.g. {missing[:3]}")
  if extra:
    lines.append(f"  {len(extra)} parameters only in the checkpoint, e.g. {extra[:3]}")
  lines.append("Use a fresh --workdir, or the config the checkpoint was trained with.")
  raise ValueError("\n".join(lines))


class Checkpointer:
  """Periodic + best checkpoints of one run."""

  def __init__(self, workdir: str, keep: int = 2, async_save: bool = True):
    self.workdir = workdir
    opts = lambda n: ocp.CheckpointManagerOptions(
      max_to_keep=n,
      create=True,  # noqa: E731
      enable_async_checkpointing=async_save,
    )
    self.latest = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=opts(keep))
    self.best = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "best")), options=opts(1))

  def latest_step(self) -> int | None:
    return self.latest.latest_step()

  def save(self, step: int, state: Any, meta: dict, best: bool = False) -> None:
    mngr = self.best if best else self.latest
    mngr.save(
      step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
    )

  def restore(self, step: int, abstract_state: Any, best: bool = False) -> tuple[Any, dict]:
    """Restores into `abstract_state`'s structure and shardings after checking the model signature."""
    mngr = self.best if best else self.latest
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    check_signature(
      meta.get("signature", {}), signature(abstract_state["params"]), os.path.join(mngr.directory, str(step))
    )
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    return restored["state"], meta

  def wait(self) -> None:
    self.latest.wait_until_finished()
    self.best.wait_until_finished()

  def close(self) -> None:
    self.latest.close()
    self.best.close()
