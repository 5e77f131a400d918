"""A run's working directory: restoring its checkpoints without the training data (`load_run`), its frozen
backbone (`backbone_of`, `backbone_fn`: BatchNorm in inference mode, float32, as every transfer evaluation uses),
and its flat metrics file (`write_summary`). Shared by the loop, `vlrep.evaluate`, export, the tools and the
notebook; it imports only the models and sharding, so any of them can import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from ml_collections import ConfigDict

from vlrep import sharding
from vlrep.models import resnet, vgg
from vlrep.removed_switches import drop_removed_switches


@dataclasses.dataclass
class Run:
  """A restored checkpoint: its training config, parameters and model state (numpy), step and where."""

  config: ConfigDict
  params: dict
  model_state: dict
  step: int
  path: str
  meta: dict

  @property
  def variables(self) -> dict:
    return {"params": self.params, **self.model_state}


def load_run(workdir: str, checkpoint: str = "best") -> Run:
  """Restores WORKDIR's 'best' or 'latest' checkpoint, or the one of a given step (as a string of digits).

  'best' falls back to 'latest' when the run kept no best checkpoint (no evaluator had a best metric) or when
  its best checkpoint does not restore (damaged files); 'latest' falls back to the newest step that restores.
  Each fallback is logged with the error that caused it; a step asked for by number never falls back.
  """
  workdir, dirs = _run_dirs(workdir)
  if checkpoint.isdigit():
    step = int(checkpoint)
    directory = next((d for d in dirs.values() if step in _steps_in(d)), None)
    if directory is None:
      available = sorted(set(_steps_in(dirs["best"]) + _steps_in(dirs["latest"])))
      raise FileNotFoundError(f"{workdir} has no checkpoint of step {step}; available steps: {available}")
    return _restore_run(directory, step)
  if checkpoint not in dirs:
    raise ValueError(f"--checkpoint must be 'best', 'latest' or a step number, got {checkpoint!r}.")
  failures = []
  for directory, step in _candidates(workdir, dirs, checkpoint):
    try:
      run = _restore_run(directory, step)
    except Exception as e:  # noqa: BLE001 -- a damaged checkpoint: the next candidate, said in the log
      path, why = os.path.join(directory, str(step)), f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
      failures.append(f"{path}: {why}")
      logging.warning("Checkpoint %s does not restore (%s); trying the next one.", path, why)
      continue
    return run
  raise RuntimeError(f"No checkpoint of {workdir} restores:\n  " + "\n  ".join(failures))


def read_config(workdir: str, resuming: bool = False, checkpoint: str = "best") -> ConfigDict:
  """The training config a run saved with its newest checkpoint (best or latest; `checkpoint='latest'`: the
  periodic ones only, what a resumed run continues), read without restoring any weights: cheap enough for a config
  file to resolve what it inherits from another run. Removed speed switches are dropped (`resuming`: one that
  changed the optimizer state is an error; removed_switches)."""
  workdir, dirs = _run_dirs(workdir)
  failures = []
  for directory, step in _candidates(workdir, dirs, checkpoint):
    try:
      meta = _restore_meta(directory, step)
    except Exception as e:  # noqa: BLE001 -- a damaged checkpoint's metadata: the next candidate
      failures.append(f"{os.path.join(directory, str(step))}: {type(e).__name__}: {str(e)[:200]}")
      continue
    return ConfigDict(drop_removed_switches(meta["config"], resuming=resuming))
  raise RuntimeError(f"No checkpoint of {workdir} has a readable config:\n  " + "\n  ".join(failures))


def _run_dirs(workdir):
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"No run directory {workdir}.")
  return workdir, {"best": os.path.join(workdir, "best"), "latest": os.path.join(workdir, "checkpoints")}


def _steps_in(d):
  return sorted(int(s) for s in os.listdir(d) if s.isdigit()) if os.path.isdir(d) else []


def _candidates(workdir, dirs, checkpoint):
  """(directory, step) to try, newest first: the best checkpoints (for 'best'), then the latest ones."""
  candidates = [(dirs["best"], s) for s in _steps_in(dirs["best"])[::-1]] if checkpoint == "best" else []
  candidates += [(dirs["latest"], s) for s in _steps_in(dirs["latest"])[::-1]]
  if not candidates:
    raise FileNotFoundError(f"{workdir} has no checkpoint (looked in {dirs[checkpoint]}). Train with vlrep.main first.")
  return candidates


def _restore_meta(directory: str, step: int) -> dict:
  mngr = ocp.CheckpointManager(directory)
  try:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  finally:
    mngr.close()


def _restore_run(directory: str, step: int) -> Run:
  meta = _restore_meta(directory, step)
  # Onto this process's first device, whatever device count and sharding wrote the checkpoint.
  state_path = os.path.join(directory, str(step), "state")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  checkpointer = ocp.StandardCheckpointer()
  abstract = jax.tree.map(
    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), checkpointer.metadata(state_path).item_metadata
  )
  state = checkpointer.restore(state_path, abstract)
  to_np = lambda tree: {k: to_np(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}
  return Run(
    config=ConfigDict(drop_removed_switches(meta["config"])),
    params=to_np(state["params"]),
    model_state=to_np(state.get("model_state", {})),
    step=step,
    path=os.path.join(directory, str(step)),
    meta=meta,
  )


def backbone_of(run: Run) -> tuple[Any, dict]:
  """(ResNet module in float32, its variables) of a run; a clear error when the checkpoint has no backbone."""
  if "backbone" not in run.params:
    raise ValueError(
      f"The checkpoint {run.path} has no visual backbone (top-level parameters: {sorted(run.params)}); "
      "transfer evaluation and export need a model with a 'backbone' ResNet."
    )
  cfg = dict(run.config.method.get("backbone", {}))
  if cfg.get("arch", "resnet") == "vgg16":
    module = vgg.VGG16(width=cfg.get("width", 64))
  else:
    module = resnet.ResNet(**resnet_kwargs(cfg))
  variables = {"params": run.params["backbone"]}
  stats = run.model_state.get("batch_stats", {}).get("backbone")
  if stats is not None:
    variables["batch_stats"] = stats
  return module, variables


# The keys of a `method.backbone` section that fix its architecture (what its weights' shapes depend on), with the
# value an omitted key means. BatchNorm grouping is a training choice, not architecture.
BACKBONE_ARCHITECTURE = {
  "arch": "resnet",
  "depth": 50,
  "width": 64,
  "inner_multiplier": 1,
  "stem": "imagenet",
  "stem_stride": 2,
}


def backbone_architecture(cfg) -> dict:
  """The architecture of a backbone config section, every key of BACKBONE_ARCHITECTURE filled in."""
  return {k: cfg.get(k, default) for k, default in BACKBONE_ARCHITECTURE.items()}


def resnet_kwargs(cfg) -> dict:
  """The keyword arguments of `resnet.ResNet` that rebuild a backbone config section (a run's `method.backbone`)
  for inference (no BN groups); the section's omitted keys take ResNet's defaults."""
  return dict(
    depth=cfg.get("depth", 50),
    width=cfg.get("width", 64),
    inner_multiplier=cfg.get("inner_multiplier", 1),
    bn_group_size=0,
    stem=cfg.get("stem", "imagenet"),
    stem_stride=cfg.get("stem_stride", 2),
  )


def sharded_features(features, mesh):
  """THE feature extraction of every backbone evaluation (the training loop's and vlrep.evaluate's):
  `features(variables, images) -> {name: array}` jitted once, the batch sharded over the mesh's data axis.
  Returns extract(variables, local batch dict with 'image', name) -> (global features np, global batch np)."""
  batch_sharding = sharding.batch_sharding(mesh)

  def apply(variables, batch, key):
    return features(variables, batch["image"])[key], batch

  jitted = jax.jit(apply, static_argnums=2, out_shardings=sharding.replicated(mesh))

  def extract(variables, local_batch, key):
    f, b = jitted(variables, sharding.global_batch(local_batch, batch_sharding), key)
    return np.asarray(f), {k: np.asarray(v) for k, v in b.items()}

  return extract


def backbone_fn(run: Run, mesh=None):
  """features_fn(local batch, key) -> (global features np, global batch np) of a run's backbone, with key one of
  'pre_logits', 'grid', 'stage1'..'stage4'; what evaluators call."""
  module, variables = backbone_of(run)
  mesh = mesh or sharding.make_mesh()

  def features(v, images):
    grid, aux = module.apply(v, images, False)
    return {"grid": grid, **aux}

  extract = sharded_features(features, mesh)
  variables = jax.device_put(variables, sharding.replicated(mesh))
  return lambda local_batch, key: extract(variables, local_batch, key)


def write_summary(workdir: str, values: dict[str, Any]) -> None:
  """Merges flat metrics into WORKDIR/summary.json (atomically; other tools add their own keys)."""
  path = os.path.join(workdir, "summary.json")
  summary = {}
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
  summary.update(
    {k: (float(v) if isinstance(v, (np.floating, np.integer, jax.Array)) else v) for k, v in values.items()}
  )
  with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  os.replace(path + ".tmp", path)
