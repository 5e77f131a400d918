"""The MCT queue check of tests/test_mct.py, run as `python -m mct_queues` (from tests/, in a process of its own:
its device count comes from XLA_FLAGS at start): seven tiny MCT steps fill the 32-key queues, sharded over the
`data` axis, and wrap around once; the queues must hold each batch's tags and validity in ring order. Prints JSON:
the device count, the rows each device holds, the queue's sharding and the image keys."""

import json

import jax
import numpy as np
from test_mct import _tiny_method_and_batch

from vlrep import sharding


def main():
  config, method, batch = _tiny_method_and_batch()
  mesh = sharding.make_mesh()
  k = config.method.queue_size
  variables = method.init(jax.random.PRNGKey(0), batch)
  state_sh = sharding.state_shardings(mesh, variables, "replicate", rules=((r"(^|/)queues/", ("data",)),))
  variables = jax.device_put(variables, state_sh)
  batch_sh = sharding.batch_sharding(mesh)
  step = jax.jit(
    lambda v, b, r: {**v, **method.loss(v, b, r, True)[2]},
    in_shardings=(state_sh, batch_sh, None),
    out_shardings=state_sh,
  )
  rng = np.random.default_rng(1)
  tags_ring, valid_ring = np.zeros((k, 20), np.uint8), np.ones((k,), bool)
  ptr = 0
  for t in range(7):  # 7 batches of 8 into 32 slots: wraps around once
    batch["tags"] = (rng.random((8, 20)) < 0.3).astype(np.uint8)
    batch["stat_empty"] = rng.random(8) < 0.3
    variables = step(variables, sharding.global_batch(batch, batch_sh), jax.random.PRNGKey(t))
    tags_ring[ptr : ptr + 8], valid_ring[ptr : ptr + 8] = batch["tags"], ~batch["stat_empty"]
    ptr = (ptr + 8) % k
  q = variables["queues"]
  np.testing.assert_array_equal(np.asarray(q["tags"]), tags_ring)
  np.testing.assert_array_equal(np.asarray(q["text_valid"]), valid_ring)
  assert int(q["ptr"]) == ptr == 24
  shard_rows = sorted({s.data.shape[0] for s in q["image_intra"].addressable_shards})
  out = {
    "devices": jax.device_count(),
    "rows_per_device": shard_rows,
    "spec": str(q["image_intra"].sharding.spec),
    "image_intra": np.asarray(q["image_intra"]).round(5).tolist(),
  }
  print(json.dumps(out))


if __name__ == "__main__":
  main()
