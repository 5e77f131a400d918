"""torchvision ResNet key names -> Detectron2 ResNet key names (what Detectron2's convert-torchvision-to-d2 does).

Plain string renaming over a {name: array} dict: no torch, no JAX. The Detectron2 driver builds its weights with it
from the hand-off (backbone.safetensors), and `vlrep.interop.export --format=detectron2` writes its .pkl with it.
"""

from __future__ import annotations

import re
from collections import OrderedDict


def detectron2_state_dict(torchvision_sd: dict) -> OrderedDict:
  """torchvision ResNet names -> Detectron2 ResNet names: layerN -> res{N+1}, bnK -> convK.norm, downsample.0/1 ->
  shortcut / shortcut.norm, the stem's conv1 and bn1 under `stem.`; BatchNorm counters (num_batches_tracked, which
  Detectron2's FrozenBatchNorm/BN do not load) and a classifier (fc) are left out."""
  out = OrderedDict()
  for key, value in torchvision_sd.items():
    if key.endswith("num_batches_tracked") or key.startswith("fc."):
      continue
    k = key
    k = re.sub(r"^layer(\d)", lambda m: f"res{int(m.group(1)) + 1}", k)
    k = re.sub(r"\.bn(\d)\.", r".conv\1.norm.", k)
    k = k.replace(".downsample.0.", ".shortcut.").replace(".downsample.1.", ".shortcut.norm.")
    if k.startswith("conv1.") or k.startswith("bn1."):
      k = "stem." + k.replace("bn1.", "conv1.norm.")
    out[k] = value
  return out
