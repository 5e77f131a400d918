"""OpenAI CLIP's ModifiedResNet (Radford et al., 2021; open_clip's `open_clip.modified_resnet.ModifiedResNet`) as a
vlrep backbone (`arch='modified_resnet'`): the ResNet-50 (RN50, RN101, RN50x4, ...) of CLIP's ResNet image towers.

How it differs from torchvision's ResNet (vlrep.models.resnet): a stem of three 3x3 convolutions (stride 2, then
1, 1; widths width/2, width/2, width), each with BatchNorm and ReLU, then a 2x2 average pool instead of a max pool;
anti-aliased strided bottlenecks: the 3x3 convolution has stride 1 and a 2x2 average pool follows it, and the
shortcut of a strided block average-pools before its 1x1 convolution. BatchNorm epsilon 1e-5, ReLUs. CLIP pools
the final grid with attention (vlrep.models.clip.AttentionPool, CLIPModel's `pool='attention'`), which belongs to
the CLIP model, not to this backbone.

Parameter names follow open_clip's (`conv1`..`conv3`, `bn1`..`bn3`, `layer1_block0/conv1`, `.../downsample_conv`,
`.../downsample_bn`), so its state dict is a renaming (vlrep.interop.formats.open_clip).

The backbone contract (resnet.ResNet's): `__call__(images, train) -> (grid [B, H/32, W/32, width * 32],
{'stage1'..'stage4', 'pre_logits'})`, `pre_logits` the grid's global average (what probes read; CLIP's own image
embedding is the attention pool's).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from vlrep.models import remat as remat_lib
from vlrep.models.resnet import GroupedBatchNorm

# open_clip's configs: name -> (blocks per stage, stem width).
VARIANTS = {
  "RN50": ((3, 4, 6, 3), 64),
  "RN101": ((3, 4, 23, 3), 64),
  "RN50x4": ((4, 6, 10, 6), 80),
  "RN50x16": ((6, 8, 18, 8), 96),
  "RN50x64": ((3, 15, 36, 10), 128),
}
EXPANSION = 4


def _avg_pool(x, stride: int):
  """torch.nn.AvgPool2d(stride): a stride x stride window, no padding, the last odd row and column dropped."""
  return nn.avg_pool(x, (stride, stride), strides=(stride, stride), padding="VALID") if stride > 1 else x


class Bottleneck(nn.Module):
  """conv1 1x1, conv2 3x3 (stride 1), average pool (stride), conv3 1x1 to width * 4; the shortcut average-pools and
  projects when the stride or width changes; ReLU after the sum."""

  width: int
  stride: int
  norm: Any
  conv: Any

  @nn.compact
  def __call__(self, x, train: bool):
    residual = x
    y = self.conv(self.width, (1, 1), name="conv1")(x)
    y = self.norm(name="bn1")(y, train, relu=True)
    y = self.conv(self.width, (3, 3), padding=((1, 1), (1, 1)), name="conv2")(y)
    y = self.norm(name="bn2")(y, train, relu=True)
    y = _avg_pool(y, self.stride)
    y = self.conv(self.width * EXPANSION, (1, 1), name="conv3")(y)
    if self.stride > 1 or x.shape[-1] != self.width * EXPANSION:
      residual = self.conv(self.width * EXPANSION, (1, 1), name="downsample_conv")(_avg_pool(x, self.stride))
      residual = self.norm(name="downsample_bn")(residual, train)
    return self.norm(name="bn3")(y, train, residual=residual, relu=True)


class ModifiedResNet(nn.Module):
  """CLIP's ModifiedResNet (module docstring).

  Attributes:
    layers: bottlenecks per stage (RN50: 3, 4, 6, 3; VARIANTS).
    width: the stem's output width; stage s has inner width width * 2**s and output width * 2**s * 4.
    bn_group_size, bn_momentum: as resnet.ResNet's (statistics groups of this many examples; 0: the whole batch).
    remat: rematerialisation of each bottleneck (vlrep.models.remat); the stem is not rematerialised.
  """

  layers: tuple[int, ...] = (3, 4, 6, 3)
  width: int = 64
  bn_group_size: int = 0
  bn_momentum: float = 0.9
  dtype: Any = jnp.float32
  remat: str = "none"

  @property
  def num_features(self) -> int:
    return self.width * 8 * EXPANSION

  @nn.compact
  def __call__(self, x, train: bool = False):
    if len(self.layers) != 4 or min(self.layers) < 1:
      raise ValueError(f"A ModifiedResNet has 4 stages of at least one block; layers={tuple(self.layers)}.")
    kernel_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
    conv = functools.partial(
      nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32, kernel_init=kernel_init
    )
    norm = functools.partial(
      GroupedBatchNorm, group_size=self.bn_group_size, momentum=self.bn_momentum, epsilon=1e-5, dtype=self.dtype
    )
    x = x.astype(self.dtype)
    stem = ((self.width // 2, 2), (self.width // 2, 1), (self.width, 1))
    for i, (features, stride) in enumerate(stem, start=1):
      x = conv(features, (3, 3), strides=(stride, stride), padding=((1, 1), (1, 1)), name=f"conv{i}")(x)
      x = norm(name=f"bn{i}")(x, train, relu=True)
    x = _avg_pool(x, 2)
    # A block is called as block(x, train): `train` (argument 2, after self) is static under remat.
    block_cls = remat_lib.wrap(Bottleneck, remat_lib.check(self.remat), static_argnums=(2,))
    aux = {}
    for stage, num_blocks in enumerate(self.layers):
      for b in range(num_blocks):
        stride = 2 if stage > 0 and b == 0 else 1
        x = block_cls(self.width * 2**stage, stride, norm, conv, name=f"layer{stage + 1}_block{b}")(x, train)
      aux[f"stage{stage + 1}"] = x
    aux["pre_logits"] = jnp.mean(x.astype(jnp.float32), axis=(1, 2))
    return x, aux


def from_config(section, **kwargs) -> ModifiedResNet:
  """`ModifiedResNet(**section without 'arch', **kwargs)` for a backbone config section with arch='modified_resnet'
  (`layers` as a tuple: a saved config gives a list)."""
  fields = {k: v for k, v in dict(section).items() if k != "arch"}
  if "layers" in fields:
    fields["layers"] = tuple(int(n) for n in fields["layers"])
  return ModifiedResNet(**fields, **kwargs)
