"""The PyTorch hand-off of a run's backbone (export only): a folder holding `backbone.safetensors` (torchvision's
names and layout) and `backbone.json` (the arguments of `vlrep.pytorch.resnet.ResNet` that rebuild it, and the
source run), what the detection evaluator's worker and the Detectron2 driver read.

  python -m vlrep.interop.export --workdir=RUN --checkpoint=best --format=backbone --out=FOLDER

Unlike --format=torchvision, any ResNet stem exports (vlrep's PyTorch ResNet builds the small stem too).
"""

from __future__ import annotations

import os

from safetensors import safe_open

from vlrep import runs
from vlrep.interop import keymaps
from vlrep.interop.formats import torchvision
from vlrep.pytorch import handoff

DESCRIPTION = "the PyTorch hand-off folder: backbone.safetensors + backbone.json (vlrep.pytorch.resnet.ResNet)"
OUT_SUFFIXES = ()  # a folder


def export(run: runs.Run, out: str, overwrite: bool = False) -> dict:
  """Writes the hand-off of `run`'s backbone into the folder `out` (its two files replaced atomically; other files
  there are left alone). Returns {'keys', 'parameters', 'step', 'files'}."""
  del overwrite  # the two files are replaced whole; nothing else in the folder is touched
  if os.path.lexists(out) and not os.path.isdir(out) or os.path.islink(out):
    raise keymaps.NotExportable(f"--out={out} is a file or a link; --format=backbone writes a folder.")
  arch = run.config.method.get("backbone", {}).get("arch", "resnet")
  torchvision.require_resnet(arch, run.path, "the PyTorch hand-off (vlrep.pytorch.resnet.ResNet)")
  _, variables = keymaps.refusal(runs.backbone_of, run)
  counters = torchvision.imported_counters(run)
  torchvision.write_backbone(variables, run.config.method, out, counters=counters, source=run.path)
  with safe_open(os.path.join(out, handoff.HANDOFF_WEIGHTS), framework="numpy") as f:
    keys = len(list(f.keys()))
  parameters = sum(int(v.size) for v in _leaves(variables["params"]))
  files = [handoff.HANDOFF_WEIGHTS, handoff.HANDOFF_INFO]
  return {"keys": keys, "parameters": parameters, "step": run.step, "files": files}


def _leaves(tree: dict) -> list:
  return [x for v in tree.values() for x in (_leaves(v) if isinstance(v, dict) else [v])]
