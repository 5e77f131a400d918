"""A 1x1 convolution fused with the BatchNorm work around it, as Pallas kernels (speed switch
`backbone.pallas_conv1x1`; docs/speed.md).

In a ResNet bottleneck the 1x1 convolutions move most of the activation bytes, and XLA runs each BatchNorm as
separate passes over them: a reduction for the statistics of the convolution's output, and an elementwise
BatchNorm-apply + ReLU whose output is written only to be read again by the next convolution. cuDNN's fused
ResNet kernels (NVIDIA's MLPerf ResNet-50) fold both into the convolution; `conv1x1_bn_stats` does the same for
1x1 convolutions, which are matrix products over channels:

  forward   y = act(x) @ w, with act(x) = relu(x * s + t) per BatchNorm group (the previous BatchNorm's apply,
            read in the product's prologue) or x itself, and the per-group sums of y and y^2 (the next
            BatchNorm's statistics) from the product's epilogue: one read of x, one write of y.
  backward  g = dy + d_sum + 2 y d_sumsq (the statistics' cotangents) is formed while loading dy;
            dgrad   da = g @ w^T, with the ReLU mask, the scale s and the per-group sums that the previous
                    BatchNorm's backward needs (of d_pre and d_pre * x) in its epilogue;
            wgrad   dw = act(x)^T @ g, recomputing act(x) from x instead of storing it.

Same maths as `act` followed by a matrix product and the sums in f32 (tests/test_speed_levers.py). The kernels
are written for Pallas' Triton backend (GPUs); on CPU they run in Pallas' interpreter, which is how CI checks
them, and their Triton lowering is checked on CPU too. Each tile of rows lies inside one BatchNorm group, so a
tile's group is its index over the group's tile count.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import PartitionSpec as P

F32 = jnp.float32
PROGRAMS_TARGET = 264  # wgrad's split of the rows: about two programs per streaming multiprocessor of an H100


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Block sizes: rows (bm), input channels (bk), output channels (bn); num_warps and num_stages for Triton."""

  bm: int = 128
  bk: int = 64
  bn: int = 128
  num_warps: int = 4
  num_stages: int = 3


def _largest_power_of_two_divisor(n: int, cap: int) -> int:
  d = 1
  while d * 2 <= cap and n % (d * 2) == 0:
    d *= 2
  return d


def choose_tiles(m: int, k: int, n: int, rows_per_group: int, cap: Tiles = Tiles(), min_block: int = 16) -> Tiles:
  """The largest power-of-two blocks up to `cap` that divide the shapes (and the rows of one group). Triton's
  matrix products need every block dimension to be at least 16 (`min_block`; the interpreter takes any): a shape
  that does not allow it is an error."""
  bm = _largest_power_of_two_divisor(rows_per_group, cap.bm)
  bk = _largest_power_of_two_divisor(k, cap.bk)
  bn = _largest_power_of_two_divisor(n, cap.bn)
  if min(bm, bk, bn) < min_block:
    raise ValueError(
      f"backbone.pallas_conv1x1 needs rows per BatchNorm group ({rows_per_group}), input channels ({k}) and output "
      f"channels ({n}) divisible by {min_block}; got blocks {bm}x{bk}x{bn}. Turn the switch off for this shape."
    )
  if m % rows_per_group:
    raise ValueError(f"{m} rows are not a whole number of BatchNorm groups of {rows_per_group} rows.")
  return dataclasses.replace(cap, bm=bm, bk=bk, bn=bn)


def _interpret() -> bool:
  backend = jax.default_backend()
  if backend == "tpu":
    raise ValueError("backbone.pallas_conv1x1 is a GPU (Triton) kernel; turn it off on TPUs.")
  return backend == "cpu"  # Pallas' interpreter: how CI checks the kernels' maths


def _act(x, s, t, act: bool):
  """relu(x * s + t) in f32 (x's tile and its group's [1, K] scale and shift), or x in f32."""
  return jnp.maximum(x.astype(F32) * s + t, 0.0) if act else x.astype(F32)


def _stat_grad(dy, y, dsum, dsq):
  """The total cotangent of y: its own, plus what flows back through the group's sum and sum of squares."""
  return dy.astype(F32) + dsum + 2.0 * y.astype(F32) * dsq


def _mm(a, b, contract=((1,), (0,))):
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=F32)


def _forward_kernel(x_ref, w_ref, s_ref, t_ref, y_ref, psum_ref, psq_ref, *, bk: int, act: bool):
  """One [bm, bn] tile of y = act(x) @ w and its column sums (of y and y^2) over the tile's rows."""
  bm, bn = y_ref.shape

  def body(kb, acc):
    cols = pl.ds(kb * bk, bk)
    a = _act(x_ref[:, cols], s_ref[:, cols], t_ref[:, cols], act).astype(w_ref.dtype)
    return acc + _mm(a, w_ref[cols, :])

  acc = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, jnp.zeros((bm, bn), F32))
  y = acc.astype(y_ref.dtype)
  y_ref[...] = y
  yf = y.astype(F32)  # statistics of the stored (rounded) output, as the plain path takes them
  psum_ref[...] = jnp.sum(yf, axis=0, keepdims=True)
  psq_ref[...] = jnp.sum(yf * yf, axis=0, keepdims=True)


def _dgrad_kernel(
  dy_ref, y_ref, dsum_ref, dsq_ref, w_ref, x_ref, s_ref, t_ref, dx_ref, pdt_ref, pds_ref, *, bn: int, act: bool
):
  """One [bm, bk] tile of dx: (g @ w^T) through the ReLU mask and the scale, and the per-tile sums the previous
  BatchNorm's backward needs (of d_pre and d_pre * x)."""
  bm, bk = dx_ref.shape

  def body(nb, acc):
    cols = pl.ds(nb * bn, bn)
    g = _stat_grad(dy_ref[:, cols], y_ref[:, cols], dsum_ref[:, cols], dsq_ref[:, cols]).astype(w_ref.dtype)
    return acc + _mm(g, w_ref[:, cols], ((1,), (1,)))

  da = jax.lax.fori_loop(0, dy_ref.shape[1] // bn, body, jnp.zeros((bm, bk), F32))
  if act:
    x = x_ref[...].astype(F32)
    s = s_ref[...]
    d_pre = jnp.where(x * s + t_ref[...] > 0, da, 0.0)
    dx_ref[...] = (d_pre * s).astype(dx_ref.dtype)
    pdt_ref[...] = jnp.sum(d_pre, axis=0, keepdims=True)
    pds_ref[...] = jnp.sum(d_pre * x, axis=0, keepdims=True)
  else:
    dx_ref[...] = da.astype(dx_ref.dtype)
    pdt_ref[...] = jnp.zeros(pdt_ref.shape, F32)
    pds_ref[...] = jnp.zeros(pds_ref.shape, F32)


def _wgrad_kernel(
  x_ref, s_ref, t_ref, dy_ref, y_ref, dsum_ref, dsq_ref, dw_ref, *, bm: int, tiles_per_group: int, act: bool
):
  """One [bk, bn] tile of one row split's share of dw = act(x)^T @ g, act(x) recomputed from x."""
  bk, bn = dw_ref.shape
  split_rows = x_ref.shape[0]
  first_tile = pl.program_id(2) * (split_rows // bm)

  def body(rb, acc):
    rows = pl.ds(rb * bm, bm)
    group = pl.ds((first_tile + rb) // tiles_per_group, 1)
    a = _act(x_ref[rows, :], s_ref[group, :], t_ref[group, :], act).astype(x_ref.dtype)
    g = _stat_grad(dy_ref[rows, :], y_ref[rows, :], dsum_ref[group, :], dsq_ref[group, :]).astype(x_ref.dtype)
    return acc + _mm(a, g, ((0,), (0,)))

  dw_ref[...] = jax.lax.fori_loop(0, split_rows // bm, body, jnp.zeros((bk, bn), F32))


def _row_splits(row_tiles: int, other_programs: int) -> int:
  """How many parts wgrad splits the rows into: enough programs to fill the device, each part whole tiles."""
  want = max(1, PROGRAMS_TARGET // max(other_programs, 1))
  return max(d for d in range(1, min(want, row_tiles) + 1) if row_tiles % d == 0)


def _params(tiles: Tiles):
  return pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _forward(x, w, s, t, rows_per_group, act, tiles):
  m, k = x.shape
  n = w.shape[1]
  bm, bn = tiles.bm, tiles.bn
  tiles_per_group = rows_per_group // bm
  group_of_tile = lambda i, j: (i // tiles_per_group, 0)  # noqa: E731
  y, psum, psq = pl.pallas_call(
    functools.partial(_forward_kernel, bk=tiles.bk, act=act),
    grid=(m // bm, n // bn),
    in_specs=[
      pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
      pl.BlockSpec((k, bn), lambda i, j: (0, j)),
      pl.BlockSpec((1, k), group_of_tile),
      pl.BlockSpec((1, k), group_of_tile),
    ],
    out_specs=[
      pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      pl.BlockSpec((1, bn), lambda i, j: (i, j)),
      pl.BlockSpec((1, bn), lambda i, j: (i, j)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((m, n), x.dtype),
      jax.ShapeDtypeStruct((m // bm, n), F32),
      jax.ShapeDtypeStruct((m // bm, n), F32),
    ],
    compiler_params=_params(tiles),
    interpret=_interpret(),
    name="conv1x1_bn_stats_fwd",
  )(x, w, s, t)
  groups = m // rows_per_group
  return y, psum.reshape(groups, tiles_per_group, n).sum(1), psq.reshape(groups, tiles_per_group, n).sum(1)


def _backward(rows_per_group, act, tiles, saved, cotangents):
  x, w, s, t, y = saved
  dy, dsum, dsq = cotangents
  m, k = x.shape
  n = w.shape[1]
  bm, bk, bn = tiles.bm, tiles.bk, tiles.bn
  tiles_per_group = rows_per_group // bm
  groups = m // rows_per_group
  dsum, dsq = dsum.astype(F32), dsq.astype(F32)
  group_rows = lambda i, j: (i // tiles_per_group, 0)  # noqa: E731
  group_cols = lambda i, j: (i // tiles_per_group, j)  # noqa: E731
  dx, pdt, pds = pl.pallas_call(
    functools.partial(_dgrad_kernel, bn=bn, act=act),
    grid=(m // bm, k // bk),
    in_specs=[
      pl.BlockSpec((bm, n), lambda i, j: (i, 0)),  # dy
      pl.BlockSpec((bm, n), lambda i, j: (i, 0)),  # y
      pl.BlockSpec((1, n), group_rows),  # d_sum of the tile's group
      pl.BlockSpec((1, n), group_rows),  # d_sumsq
      pl.BlockSpec((bk, n), lambda i, j: (j, 0)),  # w
      pl.BlockSpec((bm, bk), lambda i, j: (i, j)),  # x
      pl.BlockSpec((1, bk), group_cols),  # s
      pl.BlockSpec((1, bk), group_cols),  # t
    ],
    out_specs=[
      pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
      pl.BlockSpec((1, bk), lambda i, j: (i, j)),
      pl.BlockSpec((1, bk), lambda i, j: (i, j)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((m, k), x.dtype),
      jax.ShapeDtypeStruct((m // bm, k), F32),
      jax.ShapeDtypeStruct((m // bm, k), F32),
    ],
    compiler_params=_params(tiles),
    interpret=_interpret(),
    name="conv1x1_bn_stats_dgrad",
  )(dy, y, dsum, dsq, w, x, s, t)
  splits = _row_splits(m // bm, (k // bk) * (n // bn))
  split_rows = m // splits
  dw = pl.pallas_call(
    functools.partial(_wgrad_kernel, bm=bm, tiles_per_group=tiles_per_group, act=act),
    grid=(k // bk, n // bn, splits),
    in_specs=[
      pl.BlockSpec((split_rows, bk), lambda i, j, r: (r, i)),  # x
      pl.BlockSpec((groups, bk), lambda i, j, r: (0, i)),  # s, every group
      pl.BlockSpec((groups, bk), lambda i, j, r: (0, i)),  # t
      pl.BlockSpec((split_rows, bn), lambda i, j, r: (r, j)),  # dy
      pl.BlockSpec((split_rows, bn), lambda i, j, r: (r, j)),  # y
      pl.BlockSpec((groups, bn), lambda i, j, r: (0, j)),  # d_sum
      pl.BlockSpec((groups, bn), lambda i, j, r: (0, j)),  # d_sumsq
    ],
    out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, r: (r, i, j)),
    out_shape=jax.ShapeDtypeStruct((splits, k, n), F32),
    compiler_params=_params(tiles),
    interpret=_interpret(),
    name="conv1x1_bn_stats_wgrad",
  )(x, s, t, dy, y, dsum, dsq)
  ds = pds.reshape(groups, tiles_per_group, k).sum(1)
  dt = pdt.reshape(groups, tiles_per_group, k).sum(1)
  return dx, dw.sum(0).astype(w.dtype), ds.astype(s.dtype), dt.astype(t.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _conv1x1_bn_stats(x, w, s, t, rows_per_group: int, act: bool, tiles: Tiles):
  return _forward(x, w, s, t, rows_per_group, act, tiles)


def _fwd(x, w, s, t, rows_per_group, act, tiles):
  y, gsum, gsq = _forward(x, w, s, t, rows_per_group, act, tiles)
  return (y, gsum, gsq), (x, w, s, t, y)


_conv1x1_bn_stats.defvjp(_fwd, _backward)


def conv1x1_bn_stats(x, w, rows_per_group: int, prologue=None, tiles: Tiles | None = None):
  """(y [M, N] in x's dtype, per-group sum of y [G, N], per-group sum of y^2 [G, N]) for y = act(x) @ w.

  x [M, K]: the rows (examples x positions) of a 1x1 convolution's input, `rows_per_group` consecutive rows per
  BatchNorm group; w [K, N] in x's dtype; prologue None (act(x) = x) or (s, t), each [G, K] f32: act(x) =
  relu(x * s[group] + t[group]), the previous BatchNorm's apply and ReLU. Differentiable in x, w, s and t, and
  through both sums (their cotangents reach y's).

  Under a step's mesh (`jax.set_mesh`, as the loop traces its step) with more than one device, the rows are taken
  to be sharded over all of its axes (vlrep shards batches so) and each device runs the kernels on its own rows
  (`jax.shard_map`): a Triton kernel is opaque to XLA's partitioner, which would otherwise gather every row onto
  every device. Groups then lie inside a device's rows, or one group spans the whole batch (its sums are added
  over the devices)."""
  m, k = x.shape
  if not rows_per_group or m % rows_per_group:
    raise ValueError(f"{m} rows are not a whole number of BatchNorm groups of {rows_per_group} rows.")
  groups = m // rows_per_group
  act = prologue is not None
  if act:
    s, t = (p.astype(F32) for p in prologue)
    if s.shape != (groups, k) or t.shape != (groups, k):
      raise ValueError(f"The prologue's scale and shift must be [{groups}, {k}]; got {s.shape} and {t.shape}.")
  else:
    s, t = jnp.ones((groups, k), F32), jnp.zeros((groups, k), F32)
  w = w.astype(x.dtype)
  mesh = jax.sharding.get_abstract_mesh()
  devices = 1 if mesh.empty else mesh.size
  if devices == 1:
    return _local(x, w, s, t, rows_per_group, act, tiles)
  if m % devices:
    raise ValueError(f"{m} rows do not split evenly over the step's {devices} devices.")
  local_rows = m // devices
  rows_spec = P(mesh.axis_names)
  if local_rows % rows_per_group == 0:  # whole groups on each device
    group_spec, local_group, sum_over_devices = rows_spec, rows_per_group, False
  elif groups == 1:  # one group over the whole batch (synchronised BatchNorm)
    group_spec, local_group, sum_over_devices = P(), local_rows, True
  else:
    raise ValueError(
      f"BatchNorm groups of {rows_per_group} rows neither lie within one device's {local_rows} rows nor span the "
      "whole batch; backbone.pallas_conv1x1 needs one or the other."
    )

  def per_device(x, w, s, t):
    y, group_sum, group_sumsq = _local(x, w, s, t, local_group, act, tiles)
    if sum_over_devices:
      group_sum, group_sumsq = jax.lax.psum((group_sum, group_sumsq), mesh.axis_names)
    return y, group_sum, group_sumsq

  # check_vma off: pallas_call's outputs carry no varying-axes annotation.
  sharded = jax.shard_map(
    per_device,
    in_specs=(rows_spec, P(), group_spec, group_spec),
    out_specs=(rows_spec, group_spec, group_spec),
    check_vma=False,
  )
  return sharded(x, w, s, t)


def _local(x, w, s, t, rows_per_group, act, tiles):
  m, k = x.shape
  tiles = tiles or choose_tiles(m, k, w.shape[1], rows_per_group, min_block=1 if _interpret() else 16)
  return _conv1x1_bn_stats(x, w, s, t, rows_per_group, act, tiles)
