"""A torchvision-layout ResNet written with `torch` alone (no torchvision), for checking exports.

Module names and the v1.5 layout (stride on the 3x3 conv) are torchvision's, so a state_dict from
`vlrep.interop.export` loads with strict=True; `forward` returns the final grid (NCHW) and its global average.
Depths, widths and stems are vlrep's ResNet's (including the test-only depth 10, width multipliers and the small
stem: one 3x3 convolution of stride 1 or 2 and no max-pool, whose `conv1.weight` is (width, 3, 3, 3); its
`maxpool` is an identity, so the module's children keep torchvision's order and names for feature extractors such
as torchvision's `IntermediateLayerGetter`). Imports torch alone: no JAX or Flax, so a PyTorch process (the
detection evaluator's worker) loads it without them.
"""

from __future__ import annotations

import torch
from torch import nn

from vlrep.models.resnet_layout import BASIC_BLOCK_DEPTHS, DEPTHS


class Bottleneck(nn.Module):
  expansion = 4

  def __init__(self, cin: int, width: int, stride: int, inner_multiplier: int = 1, norm=nn.BatchNorm2d):
    super().__init__()
    inner = width * inner_multiplier  # torchvision's width_per_group / 64 (2 for wide_resnet50_2)
    self.conv1 = nn.Conv2d(cin, inner, 1, bias=False)
    self.bn1 = norm(inner)
    self.conv2 = nn.Conv2d(inner, inner, 3, stride, 1, bias=False)
    self.bn2 = norm(inner)
    self.conv3 = nn.Conv2d(inner, width * 4, 1, bias=False)
    self.bn3 = norm(width * 4)
    self.relu = nn.ReLU()
    self.downsample = None
    if stride != 1 or cin != width * 4:
      self.downsample = nn.Sequential(nn.Conv2d(cin, width * 4, 1, stride, bias=False), norm(width * 4))

  def forward(self, x):
    y = self.relu(self.bn1(self.conv1(x)))
    y = self.relu(self.bn2(self.conv2(y)))
    y = self.bn3(self.conv3(y))
    return self.relu(y + (self.downsample(x) if self.downsample is not None else x))


class BasicBlock(nn.Module):
  expansion = 1

  def __init__(self, cin: int, width: int, stride: int, norm=nn.BatchNorm2d):
    super().__init__()
    self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
    self.bn1 = norm(width)
    self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
    self.bn2 = norm(width)
    self.relu = nn.ReLU()
    self.downsample = None
    if stride != 1 or cin != width:
      self.downsample = nn.Sequential(nn.Conv2d(cin, width, 1, stride, bias=False), norm(width))

  def forward(self, x):
    y = self.relu(self.bn1(self.conv1(x)))
    y = self.bn2(self.conv2(y))
    return self.relu(y + (self.downsample(x) if self.downsample is not None else x))


class ResNet(nn.Module):
  """`norm` builds each BatchNorm from its channel count (the benchmark's reference passes grouped BatchNorm;
  the detection evaluator torchvision's FrozenBatchNorm2d). `stem`, `stem_stride`: as vlrep's ResNet's."""

  def __init__(
    self,
    depth: int = 50,
    width: int = 64,
    inner_multiplier: int = 1,
    norm=nn.BatchNorm2d,
    stem: str = "imagenet",
    stem_stride: int = 2,
  ):
    super().__init__()
    if depth not in DEPTHS:
      raise ValueError(f"Unsupported ResNet depth {depth}; supported: {sorted(DEPTHS)}")
    block = BasicBlock if depth in BASIC_BLOCK_DEPTHS else Bottleneck
    if inner_multiplier != 1 and block is BasicBlock:
      raise ValueError(f"inner_multiplier={inner_multiplier} needs bottleneck blocks (depth 26 or more).")
    if stem == "imagenet":
      if stem_stride != 2:
        raise ValueError(f"stem_stride={stem_stride} applies to stem='small'; the ImageNet stem's is 2.")
      conv1, pool = nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.MaxPool2d(3, 2, 1)
    elif stem == "small":
      if stem_stride not in (1, 2):
        raise ValueError(f"stem_stride must be 1 or 2 for stem='small'; got {stem_stride}.")
      conv1, pool = nn.Conv2d(3, width, 3, stem_stride, 1, bias=False), nn.Identity()
    else:
      raise ValueError(f"Unknown ResNet stem {stem!r}; known: 'imagenet', 'small'.")
    # Assigned in torchvision's order: children are registered (and iterated by feature extractors) in this order.
    self.conv1 = conv1
    self.bn1 = norm(width)
    self.relu = nn.ReLU()
    self.maxpool = pool
    cin = width
    self.stage_channels = []  # each stage's output channels (what a feature pyramid over the stages reads)
    for stage, blocks in enumerate(DEPTHS[depth]):
      layers = []
      for b in range(blocks):
        extra = {"inner_multiplier": inner_multiplier, "norm": norm} if block is Bottleneck else {"norm": norm}
        layers.append(block(cin, width * 2**stage, 2 if stage > 0 and b == 0 else 1, **extra))
        cin = width * 2**stage * block.expansion
      setattr(self, f"layer{stage + 1}", nn.Sequential(*layers))
      self.stage_channels.append(cin)

  def forward(self, x):
    x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return x, torch.flatten(x.mean((2, 3)), 1)
