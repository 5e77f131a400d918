"""The pallas_conv1x1 kernels under a step's mesh of 4 devices, as its own process (`python tests/pallas_sharded.py`
with 4 host-platform devices prints JSON): each device runs the kernels on its own rows (`jax.shard_map`), and the
values and gradients equal one device's, for BatchNorm groups inside a device and for one group over the batch."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vlrep import sharding
from vlrep.models import pallas_conv


def main():
  assert jax.device_count() == 4, jax.device_count()
  rng = np.random.default_rng(0)
  m, k, n = 256, 32, 48
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(k, n)) * 0.2, jnp.float32)
  cy = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
  mesh = sharding.make_mesh()
  rows_sharded = NamedSharding(mesh, P(sharding.DATA))
  tiles = pallas_conv.Tiles(bm=16, bk=16, bn=16)
  out = {}
  for rows, case in ((32, "two_groups_per_device"), (m, "one_group_over_the_batch")):
    s = jnp.asarray(rng.normal(size=(m // rows, k)), jnp.float32)
    t = jnp.asarray(rng.normal(size=(m // rows, k)), jnp.float32)

    def loss(x, w, s, t, rows=rows):
      y, group_sum, group_sumsq = pallas_conv.conv1x1_bn_stats(x, w, rows, (s, t), tiles)
      return jnp.sum(y * cy) + jnp.sum(group_sum) + 0.01 * jnp.sum(group_sumsq), (y, group_sum, group_sumsq)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    one = jax.jit(grad)(x, w, s, t)
    step = jax.jit(grad, in_shardings=(rows_sharded, None, None, None))
    hlo = sharding.under_mesh(mesh, step.lower)(x, w, s, t).as_text()
    four = sharding.under_mesh(mesh, step)(x, w, s, t)
    diffs = jax.tree.map(
      lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max() / (np.abs(b).max() + 1e-12)), four, one
    )
    out[case] = {
      "max_relative_difference": max(jax.tree.leaves(diffs)),
      "manual_region": "manual" in hlo.lower(),  # shard_map's per-device region, not XLA's partitioner
      "y_sharding": str(four[0][1][0].sharding.spec),
    }
  try:
    sharding.under_mesh(mesh, jax.jit(lambda x, w: pallas_conv.conv1x1_bn_stats(x, w, 128, None, tiles)))(x, w)
    out["straddling_groups_error"] = None
  except ValueError as e:
    out["straddling_groups_error"] = str(e)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
