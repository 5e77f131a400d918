"""VGG16 without its fully-connected layers (the ICMLM paper's main backbone), with BatchNorm after each conv.

Returns the grid after pool5 (7x7 for 224 input, 512 x width/64 channels) and the same named intermediates as
`resnet.ResNet` ('stage1'..'stage5', 'pre_logits'), so methods and evaluators use either backbone alike.
Exporting to torchvision/Detectron2 supports ResNets only.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

# Output channels of the 13 conv layers per stage (VGG16, configuration D), before the width multiplier.
STAGES = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


class VGG16(nn.Module):
  width: int = 64  # channels of the first stage; 64 is VGG16
  bn_momentum: float = 0.9
  dtype: Any = jnp.float32

  @property
  def num_features(self) -> int:
    return STAGES[-1][-1] * self.width // 64

  @nn.compact
  def __call__(self, x, train: bool = False):
    conv = functools.partial(
      nn.Conv,
      kernel_size=(3, 3),
      padding=1,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      kernel_init=nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
    )
    aux = {}
    x = x.astype(self.dtype)
    for s, channels in enumerate(STAGES):
      for i, c in enumerate(channels):
        x = conv(c * self.width // 64, name=f"conv{s + 1}_{i + 1}")(x)
        x = nn.BatchNorm(
          use_running_average=not train, momentum=self.bn_momentum, dtype=self.dtype, name=f"bn{s + 1}_{i + 1}"
        )(x)
        x = nn.relu(x)
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
      aux[f"stage{s + 1}"] = x
    aux["pre_logits"] = jnp.mean(x.astype(jnp.float32), axis=(1, 2))
    return x, aux
