"""Vision Transformer (Dosovitskiy et al., 2021) in big_vision's parameter layout, as a vlrep backbone.

The parameter tree is big_vision's `vit.py` (`embedding`, `cls`, `pos_embedding`,
`Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0}`,
`Transformer/encoder_norm`, `MAPHead_0`), so a big_vision checkpoint's image tower is this module's variables, and
the other formats (open_clip, Hugging Face CLIP and SigLIP, timm) are renamings of it (vlrep/interop).

Beside big_vision's options, the few that CLIP's and SigLIP's published towers need to compute exactly what they
computed: a LayerNorm before the encoder (`pre_norm`, CLIP's `ln_pre`), the activation of the MLPs (`mlp_act`:
big_vision's and SigLIP's tanh-approximated GELU, open_clip's exact GELU, OpenAI's QuickGELU), the LayerNorm
epsilon and the patch embedding's bias. CLIP's class token carries a position embedding of its own; here it is
folded into `cls` (the class token is used nowhere else), so the position embeddings are the patches' only, as
big_vision's.

The backbone contract (as resnet.ResNet's): `__call__(images, train) -> (grid [B, h, w, C], aux)` with
`aux['pre_logits']` the pooled vector [B, C] (class token, global average or MAP head, after the final LayerNorm),
`aux['tokens']` the encoder's output sequence and `aux['stage4']` the grid. A learned position embedding
saved for another grid (another resolution or patch size's image) is resized bilinearly when applied, so a
checkpoint loads at any resolution its patches divide (`resize_posemb`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vlrep.models import remat as remat_lib

# big_vision's variants: name -> (width, depth, mlp_dim, num_heads).
VARIANTS = {
  "Ti": (192, 12, 768, 3),
  "S": (384, 12, 1536, 6),
  "M": (512, 12, 2048, 8),
  "B": (768, 12, 3072, 12),
  "L": (1024, 24, 4096, 16),
  "So400m": (1152, 27, 4304, 16),
  "H": (1280, 32, 5120, 16),
  "g": (1408, 40, 6144, 16),
}
PATCH_SIZES = (8, 14, 16, 32)
POOL_TYPES = ("tok", "gap", "map")
POSEMBS = ("learn", "sincos2d")
MLP_ACTS = ("gelu_tanh", "gelu", "quick_gelu")

_NAME = re.compile(r"vit_(ti|s|m|b|l|so400m|h|g)(\d+)\Z", re.IGNORECASE)


def config_for(name: str, **overrides) -> dict:
  """The backbone config section of a named ViT: 'vit_ti8', 'vit_s16', 'vit_b16', 'vit_b32', 'vit_l14', ...
  (variant, then patch size), with `overrides` (pool_type, posemb, ...) on top."""
  m = _NAME.match(name)
  if not m:
    raise ValueError(
      f"Unknown ViT {name!r}: write vit_<variant><patch>, variant one of {', '.join(VARIANTS)} (any case), "
      f"patch one of {PATCH_SIZES}, e.g. vit_b16."
    )
  variant = {k.lower(): k for k in VARIANTS}[m.group(1).lower()]
  patch = int(m.group(2))
  if patch not in PATCH_SIZES:
    raise ValueError(f"{name}: patch size {patch} is not one of {PATCH_SIZES}.")
  width, depth, mlp_dim, heads = VARIANTS[variant]
  section = dict(
    arch="vit", width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads, patch_size=patch, pool_type="gap"
  )
  section.update(overrides)
  return section


def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.0) -> jnp.ndarray:
  """big_vision's fixed 2-D sin-cos position embedding, [1, h * w, width] (MoCo v3's)."""
  if width % 4:
    raise ValueError(f"A sin-cos 2-D position embedding needs a width divisible by 4; got {width}.")
  y, x = np.mgrid[:h, :w]
  omega = np.arange(width // 4) / max(width // 4 - 1, 1)
  omega = 1.0 / temperature**omega
  y = np.einsum("m,d->md", y.flatten(), omega)
  x = np.einsum("m,d->md", x.flatten(), omega)
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return jnp.asarray(pe, jnp.float32)[None]


def resize_posemb(posemb, grid: tuple[int, int]):
  """A learned position embedding [1, h0 * w0, C] (a square grid) resized bilinearly to `grid` (h, w): what a
  checkpoint trained at one resolution needs at another (big_vision's resample_posemb)."""
  n, c = posemb.shape[1], posemb.shape[2]
  side = math.isqrt(n)
  if side * side != n:
    raise ValueError(f"A position embedding of {n} positions is not a square grid; it cannot be resized.")
  if (side, side) == tuple(grid):
    return posemb
  pe = posemb.reshape(side, side, c).astype(jnp.float32)
  pe = jax.image.resize(pe, (grid[0], grid[1], c), method="bilinear", antialias=False)
  return pe.reshape(1, grid[0] * grid[1], c).astype(posemb.dtype)


def activation(name: str):
  if name == "gelu_tanh":
    return lambda x: nn.gelu(x, approximate=True)
  if name == "gelu":
    return lambda x: nn.gelu(x, approximate=False)
  if name == "quick_gelu":
    return lambda x: x * jax.nn.sigmoid(1.702 * x)
  raise ValueError(f"Unknown MLP activation {name!r}; known: {MLP_ACTS}.")


class MlpBlock(nn.Module):
  mlp_dim: int | None = None  # 4 * width when None
  dropout: float = 0.0
  act: str = "gelu_tanh"
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    d = x.shape[-1]
    dense = lambda n, name: nn.Dense(
      n,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6),
      name=name,
    )
    x = dense(self.mlp_dim or 4 * d, "Dense_0")(x)
    x = activation(self.act)(x)
    x = nn.Dropout(rate=self.dropout)(x, deterministic)
    return dense(d, "Dense_1")(x)


def _attention(num_heads: int, dtype, name: str = "MultiHeadDotProductAttention_0"):
  return nn.MultiHeadDotProductAttention(
    num_heads=num_heads,
    dtype=dtype,
    param_dtype=jnp.float32,
    kernel_init=nn.initializers.xavier_uniform(),
    deterministic=True,
    force_fp32_for_softmax=True,  # bf16 logits lose the softmax's small differences; the rest stays in dtype
    name=name,
  )


class Encoder1DBlock(nn.Module):
  """One pre-LN transformer layer: x + attention(LN(x)), then + MLP(LN(x))."""

  num_heads: int
  mlp_dim: int | None = None
  dropout: float = 0.0
  act: str = "gelu_tanh"
  ln_eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None, deterministic: bool = True):
    norm = lambda name: nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, param_dtype=jnp.float32, name=name)
    y = norm("LayerNorm_0")(x)
    y = _attention(self.num_heads, self.dtype)(y, y, mask=mask)
    y = nn.Dropout(rate=self.dropout)(y, deterministic)
    x = x + y
    y = norm("LayerNorm_1")(x)
    y = MlpBlock(self.mlp_dim, self.dropout, self.act, self.dtype, name="MlpBlock_0")(y, deterministic)
    y = nn.Dropout(rate=self.dropout)(y, deterministic)
    return x + y


class Encoder(nn.Module):
  """`depth` Encoder1DBlocks (`encoderblock_{i}`) and the final LayerNorm (`encoder_norm`); big_vision's."""

  depth: int
  num_heads: int
  mlp_dim: int | None = None
  dropout: float = 0.0
  act: str = "gelu_tanh"
  ln_eps: float = 1e-6
  dtype: Any = jnp.float32
  remat: str = "none"

  @nn.compact
  def __call__(self, x, mask=None, deterministic: bool = True):
    # A block is called as block(x, mask, deterministic): `deterministic` (argument 3, after self) is static.
    block = remat_lib.wrap(Encoder1DBlock, self.remat, static_argnums=(3,))
    for i in range(self.depth):
      x = block(
        self.num_heads, self.mlp_dim, self.dropout, self.act, self.ln_eps, self.dtype, name=f"encoderblock_{i}"
      )(x, mask, deterministic)
    return nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, param_dtype=jnp.float32, name="encoder_norm")(x)


class MAPHead(nn.Module):
  """Multihead attention pooling (big_vision's MAPHead; SigLIP's image pooling): a learned probe attends over the
  tokens, then + MLP(LN(.))."""

  num_heads: int
  mlp_dim: int | None = None
  act: str = "gelu_tanh"
  ln_eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    n, _, d = x.shape
    probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d), jnp.float32)
    probe = jnp.tile(probe, [n, 1, 1]).astype(self.dtype)
    x = _attention(self.num_heads, self.dtype, name="MultiHeadDotProductAttention_0")(probe, x)
    y = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, param_dtype=jnp.float32, name="LayerNorm_0")(x)
    x = x + MlpBlock(self.mlp_dim, 0.0, self.act, self.dtype, name="MlpBlock_0")(y)
    return x[:, 0]


class ViT(nn.Module):
  """A ViT backbone (module docstring). Attributes:
  width, depth, mlp_dim, num_heads: the transformer's sizes (VARIANTS; `config_for('vit_b16')`).
  patch_size: square patches of this many pixels (8, 14, 16, 32), embedded by a strided convolution.
  pool_type: 'tok' (a class token; its final state), 'gap' (the mean of the patch tokens) or 'map' (a MAPHead).
  posemb: 'learn' (learned, N(0, 1/width) at init; resized for another grid) or 'sincos2d' (fixed).
  pre_norm: a LayerNorm on the embedded tokens before the encoder (CLIP's ln_pre).
  mlp_act: 'gelu_tanh' (big_vision, SigLIP), 'gelu' (exact; open_clip), 'quick_gelu' (OpenAI's CLIP).
  ln_eps: every LayerNorm's epsilon (1e-6 big_vision and SigLIP; 1e-5 CLIP).
  patch_bias: the patch embedding's bias (big_vision and SigLIP have one; CLIP has none).
  dropout: after the position embedding and inside every block (0 in every recipe here).
  remat: rematerialisation of each encoder block (vlrep.models.remat).
  """

  width: int = 768
  depth: int = 12
  mlp_dim: int | None = 3072
  num_heads: int = 12
  patch_size: int = 16
  pool_type: str = "gap"
  posemb: str = "learn"
  pre_norm: bool = False
  mlp_act: str = "gelu_tanh"
  ln_eps: float = 1e-6
  patch_bias: bool = True
  dropout: float = 0.0
  dtype: Any = jnp.float32
  remat: str = "none"

  @property
  def num_features(self) -> int:
    return self.width

  @nn.compact
  def __call__(self, images, train: bool = False):
    if self.pool_type not in POOL_TYPES:
      raise ValueError(f"Unknown ViT pool_type {self.pool_type!r}; known: {POOL_TYPES}.")
    if self.posemb not in POSEMBS:
      raise ValueError(f"Unknown ViT posemb {self.posemb!r}; known: {POSEMBS}.")
    p = self.patch_size
    if images.shape[1] % p or images.shape[2] % p:
      raise ValueError(f"A ViT with {p}-pixel patches needs image sides divisible by {p}; got {images.shape[1:3]}.")
    x = nn.Conv(
      self.width,
      (p, p),
      strides=(p, p),
      padding="VALID",
      use_bias=self.patch_bias,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      name="embedding",
    )(images.astype(self.dtype))
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c)
    if self.posemb == "learn":
      if self.has_variable("params", "pos_embedding"):  # saved for some grid: resized to this one
        pe = resize_posemb(self.get_variable("params", "pos_embedding"), (h, w))
      else:
        pe = self.param("pos_embedding", nn.initializers.normal(stddev=1 / math.sqrt(c)), (1, h * w, c), jnp.float32)
    else:
      pe = posemb_sincos_2d(h, w, c)
    x = x + pe.astype(x.dtype)
    if self.pool_type == "tok":
      cls = self.param("cls", nn.initializers.zeros, (1, 1, c), jnp.float32)
      x = jnp.concatenate([jnp.tile(cls.astype(x.dtype), [n, 1, 1]), x], axis=1)
    if self.pre_norm:
      x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, param_dtype=jnp.float32, name="pre_norm")(x)
    x = nn.Dropout(rate=self.dropout)(x, not train)
    x = Encoder(
      self.depth,
      self.num_heads,
      self.mlp_dim,
      self.dropout,
      self.mlp_act,
      self.ln_eps,
      self.dtype,
      remat_lib.check(self.remat),
      name="Transformer",
    )(x, deterministic=not train)
    tokens = x
    patches = x[:, 1:] if self.pool_type == "tok" else x
    if self.pool_type == "tok":
      pooled = x[:, 0]
    elif self.pool_type == "gap":
      pooled = jnp.mean(patches.astype(jnp.float32), axis=1)
    else:
      pooled = MAPHead(self.num_heads, self.mlp_dim, self.mlp_act, self.ln_eps, self.dtype, name="MAPHead_0")(x)
    grid = patches.reshape(n, h, w, c)
    return grid, {"tokens": tokens, "stage4": grid, "pre_logits": pooled.astype(jnp.float32)}


def from_config(section, **kwargs) -> ViT:
  """`ViT(**section without 'arch', **kwargs)` for a backbone config section with arch='vit'."""
  return ViT(**{k: v for k, v in dict(section).items() if k != "arch"}, **kwargs)
