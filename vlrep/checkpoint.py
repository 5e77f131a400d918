"""Checkpoints with Orbax: periodic 'latest' checkpoints (keep N), a 'best' one by an eval metric, automatic
resume, and a model-signature check so that a checkpoint from a different model is a clear error.

Layout: WORKDIR/checkpoints/<step>/{state, meta} and WORKDIR/best/<step>/{state, meta}. `meta` holds the
parameter shapes and the run's config. Orbax writes into a temporary directory and renames it when complete,
so a run killed mid-save leaves the previous checkpoint intact. A checkpoint damaged afterwards (truncated or
corrupted files) fails to restore: `restore_newest_intact` then falls back to the newest one that restores,
naming what it skipped and moving each skipped step aside to `checkpoints/damaged_<step>` (kept for inspection,
out of the way of the resumed run's saves), and refuses to start from scratch while checkpoints exist.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from vlrep import safe_files
from vlrep.errors import UserError
from vlrep.optim import param_paths


def signature(params) -> dict[str, list[int]]:
  paths = jax.tree.leaves(param_paths(params))
  shapes = [list(np.shape(x)) for x in jax.tree.leaves(params)]
  return dict(zip(paths, shapes, strict=True))


class ModelMismatchError(UserError, ValueError):
  """The checkpoint holds another model's parameters (never a reason to fall back to an older checkpoint). The
  user's to fix (another config or workdir): vlrep.main prints it and exits 2, no traceback."""


class CheckpointSaveError(RuntimeError):
  """A save failed (disk full, permissions, a vanished filesystem); the checkpoints already written are intact."""


class NoIntactCheckpointError(RuntimeError):
  """Checkpoints exist but none restores: starting from step 0 would silently discard them."""


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
  raise ModelMismatchError("\n".join(lines))


class Checkpointer:
  """Periodic + best checkpoints of one run."""

  def __init__(self, workdir: str, keep: int = 2, async_save: bool = True):
    self.workdir = workdir
    for sub in ("checkpoints", "best"):  # orbax writes through folders: none may be a link planted in the run
      safe_files.check_inside(os.path.join(workdir, sub), workdir)
    opts = lambda n: ocp.CheckpointManagerOptions(
      max_to_keep=n,
      create=True,
      enable_async_checkpointing=async_save,
    )
    self.latest = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=opts(keep))
    self.best = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "best")), options=opts(1))

  def latest_step(self) -> int | None:
    return self.latest.latest_step()

  def save(self, step: int, state: Any, meta: dict, best: bool = False) -> None:
    """Saves (asynchronously when configured: an earlier save's failure surfaces here or in `wait`)."""
    mngr = self.best if best else self.latest
    try:
      mngr.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
      )
    except Exception as e:  # noqa: BLE001 -- every failure gets the same actionable message
      raise self._save_error(step, mngr, e) from e

  def _save_error(self, step: int, mngr, error: Exception) -> CheckpointSaveError:
    # Orbax writes into a temporary directory and renames it when complete: a failed save leaves no partial step.
    intact = sorted(int(p) for p in os.listdir(mngr.directory) if p.isdigit()) if os.path.isdir(mngr.directory) else []
    return CheckpointSaveError(
      f"Saving a checkpoint (step {step}) to {mngr.directory} failed: {type(error).__name__}: {error}\n"
      f"The checkpoints already there (steps {intact or 'none'}) are untouched. Free disk space or fix the "
      "directory's permissions, then rerun the same command: it resumes from the newest of them."
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

  def restore_newest_intact(self, abstract_state: Any) -> tuple[int, Any, dict, list[tuple[int, str]]]:
    """The newest periodic checkpoint that restores: (step, state, meta, [(skipped step, why)]). A checkpoint
    of another model is an error (ModelMismatchError), not skipped; if every checkpoint fails to restore,
    NoIntactCheckpointError names them all."""
    skipped: list[tuple[int, str]] = []
    for step in sorted(self.latest.all_steps(), reverse=True):
      try:
        state, meta = self.restore(step, abstract_state)
      except ModelMismatchError:
        raise
      except Exception as e:  # noqa: BLE001 -- any read failure of one checkpoint: try the one before it
        skipped.append((step, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]))
        continue
      self._set_aside([s for s, _ in skipped])
      return step, state, meta, skipped
    where = os.path.join(self.workdir, "checkpoints")
    lines = [f"  step {step}: {why}" for step, why in skipped]
    raise NoIntactCheckpointError(
      f"No checkpoint in {where} restores, so the run would start again from step 0:\n" + "\n".join(lines) + "\n"
      "Move the damaged step directories away to start over, or point --workdir elsewhere."
    )

  def _set_aside(self, steps) -> None:
    """Renames damaged step directories to damaged_<step> (one process; the others wait), so that the resumed run
    can save those steps again; nothing is deleted."""
    if not steps:
      return
    if jax.process_index() == 0:
      root = os.path.join(self.workdir, "checkpoints")
      for step in steps:
        target = os.path.join(root, f"damaged_{step}")
        n = 1
        while os.path.exists(target):
          target, n = os.path.join(root, f"damaged_{step}.{n}"), n + 1
        os.rename(os.path.join(root, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("vlrep_checkpoints_set_aside")
    self.latest.reload()

  def wait(self) -> None:
    for mngr in (self.latest, self.best):
      try:
        mngr.wait_until_finished()
      except Exception as e:  # noqa: BLE001 -- an asynchronous save's failure
        raise self._save_error(mngr.latest_step() or 0, mngr, e) from e

  def close(self) -> None:
    self.latest.close()
    self.best.close()
