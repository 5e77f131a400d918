"""ResNet (v1.5, NHWC) with torchvision-compatible structure and stable parameter names.

Names follow torchvision (`conv1`, `bn1`, `layer1_block0/conv2`, `.../downsample_conv`) so that export to a
PyTorch state_dict is a renaming. BatchNorm statistics are computed over groups of `bn_group_size` examples:
VirTex uses per-GPU BatchNorm with 32 images per GPU; defining the group by examples rather than by devices
gives the same maths on 1 CPU, 8 devices or a pod, and a group size of 0 means one group over the global
batch (synchronised, cross-device BatchNorm).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from vlrep.models import remat as remat_lib
from vlrep.models.resnet_layout import DEPTHS


class GroupedBatchNorm(nn.Module):
  """BatchNorm whose batch statistics are taken over groups of `group_size` consecutive examples, then
  `+ residual` and ReLU when asked.

  Training applies the statistics as one multiply-add, `x * a + b` with per-channel `a = scale / std` and
  `b = bias - mean * a`: the same maths as `(x - mean) / std * scale + bias` up to float rounding, and 4% faster
  for the VirTex step on an H200 (fewer reduction passes in its gradient; docs/speed.md), where the other forms
  measured beside it lost."""

  group_size: int = 0
  momentum: float = 0.9
  epsilon: float = 1e-5
  dtype: Any = jnp.float32
  scale_init: Any = nn.initializers.ones

  @nn.compact
  def __call__(self, x, train: bool, residual=None, relu: bool = False):
    c = x.shape[-1]
    scale = self.param("scale", self.scale_init, (c,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
    ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((c,), jnp.float32))
    ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((c,), jnp.float32))
    if train:
      b = x.shape[0]
      g = self.group_size if self.group_size and self.group_size < b else b
      if b % g:
        raise ValueError(f"Batch {b} is not divisible by the BatchNorm group size {g}.")
      xg = x.astype(jnp.float32).reshape((b // g, g) + x.shape[1:])
      axes = tuple(range(1, xg.ndim - 1))
      mean = xg.mean(axes, keepdims=True)
      var = jnp.maximum((xg * xg).mean(axes, keepdims=True) - mean * mean, 0.0)
      if not self.is_initializing():
        n = g * x[0, ..., 0].size  # elements per channel in one group
        unbiased = var.mean(0).reshape(c) * n / max(n - 1, 1)
        ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean.mean(0).reshape(c)
        ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * unbiased
      a = jax.lax.rsqrt(var + self.epsilon) * scale
      y = (xg * a + (bias - mean * a)).reshape(x.shape)
    else:
      y = (x.astype(jnp.float32) - ra_mean.value) * jax.lax.rsqrt(ra_var.value + self.epsilon) * scale + bias
    out = y.astype(self.dtype)
    if residual is not None:
      out = residual + out
    return nn.relu(out) if relu else out


def _last_bn(zero_init: bool) -> dict:
  """The last BatchNorm of a residual branch starts at scale 0 with zero_init (torchvision's zero_init_residual,
  which VirTex's official code sets): each block starts as the identity."""
  return {"scale_init": nn.initializers.zeros} if zero_init else {}


class Bottleneck(nn.Module):
  width: int
  stride: int
  norm: Any
  conv: Any
  expansion: int = 4
  inner_multiplier: int = 1  # Wide ResNet: the 1x1 / 3x3 inner width is width * this; the output stays width * 4
  zero_init_last_bn: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    residual = x
    inner = self.width * self.inner_multiplier
    y = self.conv(inner, (1, 1), name="conv1")(x)
    y = self.norm(name="bn1")(y, train, relu=True)
    y = self.conv(inner, (3, 3), strides=(self.stride, self.stride), padding=((1, 1), (1, 1)), name="conv2")(y)
    y = self.norm(name="bn2")(y, train, relu=True)
    y = self.conv(self.width * self.expansion, (1, 1), name="conv3")(y)
    if residual.shape[-1] != y.shape[-1] or self.stride != 1:
      residual = self.conv(
        self.width * self.expansion, (1, 1), strides=(self.stride, self.stride), name="downsample_conv"
      )(residual)
      residual = self.norm(name="downsample_bn")(residual, train)
    return self.norm(name="bn3", **_last_bn(self.zero_init_last_bn))(y, train, residual=residual, relu=True)


class BasicBlock(nn.Module):
  width: int
  stride: int
  norm: Any
  conv: Any
  expansion: int = 1
  zero_init_last_bn: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    residual = x
    y = self.conv(self.width, (3, 3), strides=(self.stride, self.stride), padding=((1, 1), (1, 1)), name="conv1")(x)
    y = self.norm(name="bn1")(y, train, relu=True)
    y = self.conv(self.width, (3, 3), padding=((1, 1), (1, 1)), name="conv2")(y)
    if residual.shape[-1] != y.shape[-1] or self.stride != 1:
      residual = self.conv(self.width, (1, 1), strides=(self.stride, self.stride), name="downsample_conv")(residual)
      residual = self.norm(name="downsample_bn")(residual, train)
    return self.norm(name="bn2", **_last_bn(self.zero_init_last_bn))(y, train, residual=residual, relu=True)


class ResNet(nn.Module):
  """ResNet returning the final spatial grid and named intermediates.

  Attributes:
    depth: 10 (tests) and 18 use basic blocks; 26, 50, 101 and 152 use bottlenecks.
    width: channels of the stem and, times 4, of the first stage's output (64 standard).
    inner_multiplier: the bottlenecks' inner width over the standard one: 2 for Wide ResNet-50-2 (VirTex's
      "ResNet-50 w2x", torchvision's wide_resnet50_2, Detectron2's WIDTH_PER_GROUP=128); features stay 2048-d.
    bn_group_size: examples per BatchNorm statistics group (0 = whole batch).
    stem: 'imagenet' (7x7 stride-2 convolution and a 3x3 stride-2 max-pool: every real recipe, and the only stem
      torchvision's and Detectron2's ResNets have) or 'small' (one 3x3 convolution of stride `stem_stride`, no
      max-pool: for small images, where the ImageNet stem's 4x downsampling leaves a shape a few cells wide).
    stem_stride: the small stem's stride (1 or 2); the ImageNet stem's is fixed.
    zero_init_last_bn: start the last BatchNorm of every residual branch at scale 0 (torchvision's
      zero_init_residual; VirTex's official backbone sets it).
    remat: rematerialisation of each residual block (vlrep.models.remat): 'none' keeps every activation for the
      backward pass; 'dots' keeps each block's convolution outputs and recomputes its BatchNorms, ReLUs and
      residual sum; 'full' keeps only each block's input and runs the block again in the backward pass. The stem
      is not rematerialised. Parameters, BatchNorm statistics and their updates are the same under every policy.
  Returns:
    (features [B, H/32, W/32, C] (H/8 or H/16 with the small stem), {'stage1'..'stage4', 'pre_logits' [B, C]}).
  """

  depth: int = 50
  width: int = 64
  inner_multiplier: int = 1
  bn_group_size: int = 0
  bn_momentum: float = 0.9
  dtype: Any = jnp.float32
  stem: str = "imagenet"
  stem_stride: int = 2
  zero_init_last_bn: bool = False
  remat: str = "none"

  @property
  def bottleneck(self) -> bool:
    return self.depth not in (10, 18)

  @property
  def num_features(self) -> int:
    return self.width * 8 * (4 if self.bottleneck else 1)

  @nn.compact
  def __call__(self, x, train: bool = False):
    if self.depth not in DEPTHS:
      raise ValueError(f"Unsupported ResNet depth {self.depth}; supported: {sorted(DEPTHS)}")
    kernel_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
    conv = functools.partial(
      nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32, kernel_init=kernel_init
    )
    norm = functools.partial(
      GroupedBatchNorm, group_size=self.bn_group_size, momentum=self.bn_momentum, dtype=self.dtype
    )
    aux = {}
    x = x.astype(self.dtype)
    if self.stem == "imagenet":
      if self.stem_stride != 2:
        raise ValueError(f"stem_stride={self.stem_stride} applies to stem='small'; the ImageNet stem's is 2.")
      x = conv(self.width, (7, 7), strides=(2, 2), padding=((3, 3), (3, 3)), name="conv1")(x)
      x = norm(name="bn1")(x, train, relu=True)
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    elif self.stem == "small":
      if self.stem_stride not in (1, 2):
        raise ValueError(f"stem_stride must be 1 or 2 for stem='small'; got {self.stem_stride}.")
      s = self.stem_stride
      x = conv(self.width, (3, 3), strides=(s, s), padding=((1, 1), (1, 1)), name="conv1")(x)
      x = norm(name="bn1")(x, train, relu=True)
    else:
      raise ValueError(f"Unknown ResNet stem {self.stem!r}; known: 'imagenet', 'small'.")
    if self.inner_multiplier != 1 and not self.bottleneck:
      raise ValueError(f"inner_multiplier={self.inner_multiplier} needs bottleneck blocks (depth 26 or more).")
    # A block is called as block(x, train): `train` (argument 2, after self) is static under remat.
    wrap = lambda block: remat_lib.wrap(block, self.remat, static_argnums=(2,))
    block_cls = functools.partial(wrap(BasicBlock), zero_init_last_bn=self.zero_init_last_bn)
    if self.bottleneck:
      block_cls = functools.partial(
        wrap(Bottleneck), inner_multiplier=self.inner_multiplier, zero_init_last_bn=self.zero_init_last_bn
      )
    for stage, num_blocks in enumerate(_stage_sizes(self.depth)):
      for b in range(num_blocks):
        stride = 2 if stage > 0 and b == 0 else 1
        x = block_cls(self.width * 2**stage, stride, norm, conv, name=f"layer{stage + 1}_block{b}")(x, train)
      aux[f"stage{stage + 1}"] = x
    aux["pre_logits"] = jnp.mean(x.astype(jnp.float32), axis=(1, 2))
    return x, aux


def _stage_sizes(depth: int) -> Sequence[int]:
  return DEPTHS[depth]


def from_config(section, **kwargs) -> ResNet:
  """`ResNet(**section, **kwargs)` for a backbone config section (`method.backbone`); a key ResNet does not take
  is its TypeError (a run's saved config has them dropped first: runs.without_unknown_keys)."""
  return ResNet(**dict(section), **kwargs)
