"""Detectron2's ResNet (export only): a run's backbone renamed as Detectron2 names it (layerN -> res{N+1}, bnK ->
convK.norm, downsample.0/1 -> shortcut / shortcut.norm, stem keys under `stem.`), pickled as
{"model": {name: numpy array}, "__author__": ..., "matching_heuristics": True}; `MODEL.WEIGHTS=backbone.pkl` in the
configs of configs/detectron2/ loads it (Detectron2 adds its `backbone.bottom_up.` prefix itself).

  python -m vlrep.interop.export --workdir=DIR --format=detectron2 --out=backbone.pkl
"""

from __future__ import annotations

import pickle

from vlrep import safe_files
from vlrep.interop import keymaps
from vlrep.interop.formats import torchvision
from vlrep.pytorch import detectron2_keys

DESCRIPTION = "Detectron2 ResNet weights (.pkl, MODEL.WEIGHTS)"
OUT_SUFFIXES = (".pkl",)


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run's backbone in Detectron2's names to `out` (.pkl); returns {'keys', 'parameters', 'step'}."""
  del overwrite  # one file, replaced atomically
  variables = torchvision.exportable_backbone(run)
  sd = torchvision.state_dict(variables["params"], variables["batch_stats"], torchvision.imported_counters(run))
  sd = detectron2_keys.detectron2_state_dict(sd)
  root = keymaps.out_root(out)
  safe_files.make_dirs(root)
  with safe_files.open_atomic(out, "wb", root=root) as f:
    pickle.dump({"model": dict(sd), "__author__": f"vlrep ({run.path})", "matching_heuristics": True}, f)
  return {"keys": len(sd), "parameters": keymaps.parameter_count(sd), "step": run.step}
