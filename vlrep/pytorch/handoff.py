"""The backbone hand-off from the JAX side to PyTorch: one folder, two files, read here for both detection routes
(the torchvision worker, vlrep.pytorch.detection_worker, and the Detectron2 driver).

  backbone.safetensors   the backbone in torchvision ResNet names and layout (float32; BatchNorm running statistics
                         and num_batches_tracked), safetensors: no pickle
  backbone.json          {"architecture": the keyword arguments of vlrep.pytorch.resnet.ResNet that rebuild it
                         (ARCHITECTURE_KEYS), "source": where the weights came from}

`vlrep.interop.formats.torchvision.write_backbone` writes them (the detection evaluator in process; the interop
export command, `vlrep.interop.export` with --format=backbone, from a run folder). Torch-free (numpy and vlrep's
checked safetensors reader), so the Detectron2 driver checks a hand-off before torch or Detectron2 is imported.
"""

from __future__ import annotations

import json
import os

import numpy as np

from vlrep import errors, torch_files
from vlrep.errors import BadFile

HANDOFF_WEIGHTS = "backbone.safetensors"
HANDOFF_INFO = "backbone.json"
# vlrep.pytorch.resnet.ResNet's arguments, each with the types a backbone.json may give it.
ARCHITECTURE_KEYS = {"depth": int, "width": int, "inner_multiplier": int, "stem": str, "stem_stride": int}
_INFO_LIMIT = 1 << 16  # bytes: a backbone.json is a few hundred


def read_info(folder: str) -> dict:
  """backbone.json of the hand-off in `folder`, checked: {"architecture": {every ARCHITECTURE_KEYS key}, "source":
  str}; anything else is one BadFile naming the file."""
  path = os.path.join(folder, HANDOFF_INFO)
  with errors.reading(path, "backbone hand-off description (backbone.json)"):
    if os.path.getsize(path) > _INFO_LIMIT:
      raise BadFile(f"{path} has {os.path.getsize(path):,} bytes; a backbone.json has a few hundred.")
    with open(path, encoding="utf-8") as f:
      info = json.load(f)
  arch = info.get("architecture") if isinstance(info, dict) else None
  if (
    not isinstance(arch, dict)
    or set(arch) != set(ARCHITECTURE_KEYS)
    or not all(isinstance(arch[k], t) and not isinstance(arch[k], bool) for k, t in ARCHITECTURE_KEYS.items())
    or not isinstance(info.get("source", ""), str)
  ):
    raise BadFile(
      f"{path}: not a backbone hand-off description; expected {{'architecture': {{{', '.join(ARCHITECTURE_KEYS)}}}, "
      f"'source': str}}, got {str(info)[:300]}."
    )
  return {"architecture": dict(arch), "source": info.get("source", "")}


def read_weights(folder: str) -> dict[str, np.ndarray]:
  """backbone.safetensors of the hand-off in `folder` as {torchvision name: numpy array}, read by vlrep's checked
  reader (its header checked against the file before any tensor is read)."""
  return torch_files.load_safetensors(os.path.join(folder, HANDOFF_WEIGHTS))
