"""Detectron2 plugin: ResNet backbones with an extra BatchNorm on each output feature map (LocTex sec. 4.2-4.3,
following MoCo). Import it from detectron2's tools/train_net.py, then set MODEL.BACKBONE.NAME to
build_resnet_backbone_extra_bn (C4) or build_resnet_fpn_backbone_extra_bn (FPN). Needs detectron2; vlrep itself
never imports it.
"""

from detectron2.layers import get_norm
from detectron2.modeling import BACKBONE_REGISTRY
from detectron2.modeling.backbone import FPN, Backbone, build_resnet_backbone
from detectron2.modeling.backbone.fpn import LastLevelMaxPool
from torch import nn


class NormalisedOutputs(Backbone):
  def __init__(self, body, norm: str):
    super().__init__()
    self.body = body
    self.norms = nn.ModuleDict({k: get_norm(norm, s.channels) for k, s in body.output_shape().items()})
    self._out_features = list(body.output_shape())

  def forward(self, x):
    return {k: self.norms[k](v) for k, v in self.body(x).items()}

  def output_shape(self):
    return self.body.output_shape()


@BACKBONE_REGISTRY.register()
def build_resnet_backbone_extra_bn(cfg, input_shape):
  return NormalisedOutputs(build_resnet_backbone(cfg, input_shape), cfg.MODEL.RESNETS.NORM)


@BACKBONE_REGISTRY.register()
def build_resnet_fpn_backbone_extra_bn(cfg, input_shape):
  return FPN(
    bottom_up=build_resnet_backbone_extra_bn(cfg, input_shape),
    in_features=cfg.MODEL.FPN.IN_FEATURES,
    out_channels=cfg.MODEL.FPN.OUT_CHANNELS,
    norm=cfg.MODEL.FPN.NORM,
    top_block=LastLevelMaxPool(),
    fuse_type=cfg.MODEL.FPN.FUSE_TYPE,
  )
