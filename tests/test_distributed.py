"""One process over several devices: parameters sharded by the config's rules, and 8 devices with FSDP-sharded
parameters training exactly as one device."""

import json

import jax
import numpy as np
from conftest import final_params, run_main


def test_sharding_rules_from_the_config_place_matching_leaves():
  import jax

  from vlrep import sharding

  mesh = sharding.make_mesh()
  state = {
    "params": {"w": jax.ShapeDtypeStruct((8, 4), np.float32)},
    "model_state": {
      "queues": {"keys": jax.ShapeDtypeStruct((16, 4), np.float32), "ptr": jax.ShapeDtypeStruct((), np.int32)}
    },
  }
  sh = sharding.state_shardings(mesh, state, "replicate", rules=((r"(^|/)queues/", ("data",)),))
  assert sh["model_state"]["queues"]["keys"].spec == sharding.P("data", None)
  assert sh["model_state"]["queues"]["ptr"].spec == sharding.P() and sh["params"]["w"].spec == sharding.P()
  plain = sharding.state_shardings(mesh, state, "replicate")
  assert plain["model_state"]["queues"]["keys"].spec == sharding.P()  # no rule, no split: the config decides


def test_eight_devices_with_fsdp_match_one_device(tmp_path):
  """Same global batch on 1 device (replicated params) and on 8 devices with FSDP-sharded params: the batch split
  over devices and the parameters sharded over them give the same run. (Replicated parameters over several devices
  are what the two-process test runs, on 2 x 2 devices.)"""
  runs = {"1": ("1", "replicate"), "8fsdp": ("8", "fsdp")}
  losses, params = {}, {}
  for name, (n, strategy) in runs.items():
    proc = run_main(
      tmp_path / name,
      "--config.total_steps=3",
      "--config.evals={}",
      f"--config.sharding.params={strategy}",
      "--config.optim.lookahead_steps=2",
      env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"over {n} devices" in proc.stderr
    losses[name] = json.loads((tmp_path / name / "summary.json").read_text())["train/loss"]
    params[name] = final_params(tmp_path / name)[1]
  for name in ("8fsdp",):
    np.testing.assert_allclose(losses["1"], losses[name], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params["1"], params[name])
