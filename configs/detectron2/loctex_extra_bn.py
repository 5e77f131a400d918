"""Detectron2 plugin: the extra BatchNorm of LocTex's C4 transfer (sec. 4.2-4.3, "following He et al." = MoCo),
placed where MoCo puts it: after the res5 stage of the C4 ROI head (MoCo's `Res5ROIHeadsExtraNorm`, from
moco/detection/train_net.py), normalising the per-region res5 features before the box predictor and mask head.
The backbone (res2-res4) is unchanged.

Import it from detectron2's tools/train_net.py (`import loctex_extra_bn`), then set
MODEL.ROI_HEADS.NAME to Res5ROIHeadsExtraNorm (the LocTex configs here do). The norm is MODEL.RESNETS.NORM
(SyncBN in these configs). Needs detectron2 and torch; vlrep itself never imports this file
(tests/test_loctex.py loads it against stand-ins for the two detectron2 names it uses).
"""

from detectron2.layers import get_norm
from detectron2.modeling.roi_heads import ROI_HEADS_REGISTRY, Res5ROIHeads

NAME = "Res5ROIHeadsExtraNorm"


@ROI_HEADS_REGISTRY.register()
class Res5ROIHeadsExtraNorm(Res5ROIHeads):
  """Res5ROIHeads whose res5 block ends with an extra norm layer (MoCo's, same module name "norm").

  A classmethod, as Detectron2 >= 0.3 calls `cls._build_res5_block(cfg)` from `from_config` (older versions
  call it on the instance, which a classmethod also serves)."""

  @classmethod
  def _build_res5_block(cls, cfg):
    seq, out_channels = super()._build_res5_block(cfg)
    seq.add_module("norm", get_norm(cfg.MODEL.RESNETS.NORM, out_channels))
    return seq, out_channels
