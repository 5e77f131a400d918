"""Backbone operations with hand-written gradients that read and write the activations fewer times than XLA's
automatic ones (speed switches `backbone.fused_bn_act` and `backbone.fast_max_pool`; docs/speed.md). Same maths
as the plain path: tests/test_speed_levers.py compares values and gradients.

batch_norm_act: training-mode BatchNorm over groups of examples, then + residual, then ReLU, as one function whose
  backward takes one reduction pass per BatchNorm (the per-group sums of dz and dz * x_hat together) and one
  elementwise pass for dx; the saved output gives the ReLU mask, so no pre-activation is kept.
max_pool_3x3_s2: the ImageNet stem's 3x3 stride-2 max-pool (padding 1) whose backward routes each output's
  gradient to the first maximum of its window (as XLA's select-and-scatter does) with nine strided masks summed
  in one elementwise pass, instead of a select-and-scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _grouped(x, group_size: int):
  b = x.shape[0]
  return x.reshape((b // group_size, group_size) + x.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def batch_norm_act(x, scale, bias, residual, group_size: int, relu: bool, epsilon: float):
  """(relu(BN(x) * scale + bias + residual) in x's dtype, group means [G, C], group variances [G, C]).

  x [B, ..., C]; batch statistics over groups of `group_size` consecutive examples (biased variance, f32);
  `residual` is None or an array like x; `relu` False leaves the sum as it is. The statistics outputs carry no
  gradient (they feed the running averages only)."""
  return _forward(x, scale, bias, residual, group_size, relu, epsilon)[0]


def _forward(x, scale, bias, residual, group_size, relu, epsilon):
  xg = _grouped(x.astype(jnp.float32), group_size)
  axes = tuple(range(1, xg.ndim - 1))
  mean = xg.mean(axes, keepdims=True)
  var = jnp.maximum((xg * xg).mean(axes, keepdims=True) - mean * mean, 0.0)
  rstd = jax.lax.rsqrt(var + epsilon)
  z = ((xg - mean) * rstd).reshape(x.shape) * scale + bias
  if residual is not None:
    z = z + residual.astype(jnp.float32)
  out = (jnp.maximum(z, 0.0) if relu else z).astype(x.dtype)
  c = x.shape[-1]
  stats = (mean.reshape(-1, c), var.reshape(-1, c))
  # () marks a residual (its cotangent is returned), None its absence; neither is an array.
  return (out, *stats), (x, scale, bias, mean, rstd, out, None if residual is None else ())


def _backward(group_size, relu, epsilon, saved, cotangents):
  x, scale, bias, mean, rstd, out, residual_marker = saved
  d_out = cotangents[0].astype(jnp.float32)  # the statistics' cotangents are ignored (they feed no loss)
  dz = jnp.where(out > 0, d_out, 0.0) if relu else d_out
  xhat = (_grouped(x.astype(jnp.float32), group_size) - mean) * rstd
  dzg = _grouped(dz, group_size)
  axes = tuple(range(1, xhat.ndim - 1))
  # One pass over (dz, x): both per-group sums come from the same read.
  sum_dz = dzg.sum(axes, keepdims=True)
  sum_dz_xhat = (dzg * xhat).sum(axes, keepdims=True)
  n = xhat[0, ..., 0].size
  dx = (scale * rstd) * (dzg - sum_dz / n - xhat * (sum_dz_xhat / n))
  d_scale = sum_dz_xhat.reshape(-1, x.shape[-1]).sum(0)
  d_bias = sum_dz.reshape(-1, x.shape[-1]).sum(0)
  d_residual = None if residual_marker is None else dz.astype(x.dtype)
  return dx.reshape(x.shape).astype(x.dtype), d_scale.astype(scale.dtype), d_bias.astype(bias.dtype), d_residual


def _fwd(x, scale, bias, residual, group_size, relu, epsilon):
  return _forward(x, scale, bias, residual, group_size, relu, epsilon)


batch_norm_act.defvjp(_fwd, _backward)


_OFFSETS = [(i, j) for i in range(3) for j in range(3)]  # XLA's window order: the first maximum takes the gradient


def _windows(x):
  """The nine strided views [B, Ho, Wo, C] of x padded by one -inf row and column on each side."""
  b, h, w, c = x.shape
  ho, wo = (h - 1) // 2 + 1, (w - 1) // 2 + 1
  xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-jnp.inf)
  return [xp[:, i : i + 2 * ho - 1 : 2, j : j + 2 * wo - 1 : 2] for i, j in _OFFSETS]


@jax.custom_vjp
def max_pool_3x3_s2(x):
  """flax.linen.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1))) for NHWC x."""
  return functools.reduce(jnp.maximum, _windows(x))


def _pool_fwd(x):
  y = max_pool_3x3_s2(x)
  return y, (x, y)


def _pool_bwd(saved, dy):
  x, y = saved
  b, h, w, c = x.shape
  taken = jnp.zeros(y.shape, bool)
  dx = jnp.zeros((b, h + 2, w + 2, c), dy.dtype)
  for (i, j), window in zip(_OFFSETS, _windows(x), strict=True):
    first = (window == y) & ~taken
    taken = taken | first
    # Output (p, q) reads padded input (2p + i, 2q + j): interior padding 1 spreads the gradient back to it.
    spread = jax.lax.pad(
      jnp.where(first, dy, 0).astype(dy.dtype),
      jnp.zeros([], dy.dtype),
      ((0, 0, 0), (i, h + 2 - i - (2 * y.shape[1] - 1), 1), (j, w + 2 - j - (2 * y.shape[2] - 1), 1), (0, 0, 0)),
    )
    dx = dx + spread
  return (dx[:, 1 : h + 1, 1 : w + 1],)


max_pool_3x3_s2.defvjp(_pool_fwd, _pool_bwd)
