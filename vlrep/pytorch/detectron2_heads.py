"""Detectron2 ROI heads vlrep's Detectron2 configs name, registered by the driver (vlrep.pytorch.detectron2_transfer)
before it builds a model.

LocTex's C4 transfer (sec. 4.2-4.3, "following He et al." = MoCo) adds a BatchNorm where MoCo puts it: after the res5
stage of the C4 ROI head (MoCo's `Res5ROIHeadsExtraNorm`, from moco/detection/train_net.py), normalising the
per-region res5 features before the box predictor and mask head; the backbone (res2-res4) is unchanged. The LocTex
configs of configs/detectron2/ set MODEL.ROI_HEADS.NAME to it; its norm is MODEL.RESNETS.NORM.

Detectron2 is an optional dependency (built from its source): it is imported when a head is registered, not when
this module is, so the package imports without it.
"""

from __future__ import annotations

LOCTEX_EXTRA_NORM = "Res5ROIHeadsExtraNorm"
_REGISTERED: dict[str, type] = {}  # Detectron2's registry refuses a second class of one name: once per process


def register_loctex_extra_norm() -> type:
  """Res5ROIHeadsExtraNorm, registered in Detectron2's ROI_HEADS_REGISTRY (once per process): Res5ROIHeads whose
  res5 block ends with an extra norm layer (MoCo's, same module name "norm").

  `_build_res5_block` is a classmethod, as Detectron2 >= 0.3 calls `cls._build_res5_block(cfg)` from `from_config`
  (older versions call it on the instance, which a classmethod also serves)."""
  if LOCTEX_EXTRA_NORM in _REGISTERED:
    return _REGISTERED[LOCTEX_EXTRA_NORM]
  from detectron2.layers import get_norm
  from detectron2.modeling.roi_heads import ROI_HEADS_REGISTRY, Res5ROIHeads

  class Res5ROIHeadsExtraNorm(Res5ROIHeads):
    @classmethod
    def _build_res5_block(cls, cfg):
      seq, out_channels = super()._build_res5_block(cfg)
      seq.add_module("norm", get_norm(cfg.MODEL.RESNETS.NORM, out_channels))
      return seq, out_channels

  _REGISTERED[LOCTEX_EXTRA_NORM] = ROI_HEADS_REGISTRY.register()(Res5ROIHeadsExtraNorm)
  return Res5ROIHeadsExtraNorm
