"""The training loop end to end: summary, resume after SIGKILL, device-count invariance, checkpoints, errors."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import ROOT, load_tiny_config, run_main


def _final_params(workdir):
  """Raw restore (no target) of the newest checkpoint's params as numpy."""
  steps = [int(p) for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit()]
  step = max(steps)
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  # Onto this process's first device, whatever device count wrote the checkpoint.
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  checkpointer = ocp.StandardCheckpointer()
  meta = checkpointer.metadata(path).item_metadata
  state = checkpointer.restore(
    path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
  )
  return step, jax.tree.map(np.asarray, state["params"])


def test_main_end_to_end_writes_summary_and_refuses_to_resume_another_model(tmp_path):
  proc = run_main(tmp_path / "run")
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  # runlocal keeps the best checkpoint by probe/map_val (probe_val), and reports probe/map (probe_test).
  keys = ("probe/map", "probe/map_random_init", "train/loss", "steps", "seconds", "probe/map_val", "probe/map_val_best")
  for key in keys:
    assert key in summary, summary
  assert summary["steps"] == 6 and 0 <= summary["probe/map"] <= 100 and np.isfinite(summary["train/loss"])
  assert "probe/map: pretrained" in proc.stdout and "vs random init" in proc.stdout
  # Whole-model evaluators run in the loop too: captioning on 8 val images at the end.
  assert 0 <= summary["captioning/cider"] and 0 <= summary["captioning/bleu4"] <= 100
  assert "captioning/cider:" in proc.stdout
  # Resuming this run with another model is a clear error before any training (no second run needed).
  proc = run_main(tmp_path / "run", "--config.total_steps=8", "--config.evals={}", "--config.method.hidden=64")
  assert proc.returncode != 0 and "written by a different model" in proc.stderr


def test_sigkill_and_restart_matches_uninterrupted_run(tmp_path):
  overrides = [
    "--config.total_steps=24",
    "--config.checkpoint.every_steps=5",
    "--config.evals={}",
    "--config.log_every_steps=24",
  ]
  ref = run_main(tmp_path / "ref", *overrides)
  assert ref.returncode == 0, ref.stderr[-3000:]

  workdir = tmp_path / "killed"
  cmd = [sys.executable, "-m", "vlrep.main", "--config=tests/tiny_virtex.py", f"--workdir={workdir}", *overrides]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while not (workdir / "checkpoints" / "10").exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  steps = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  assert steps and steps[-1] < 24, f"the run finished before it could be killed: {steps}"

  again = run_main(workdir, *overrides)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Resumed from step" in again.stderr
  step_a, params_a = _final_params(tmp_path / "ref")
  step_b, params_b = _final_params(workdir)
  assert step_a == step_b == 24
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)


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
    params[name] = _final_params(tmp_path / name)[1]
  for name in ("8fsdp",):
    np.testing.assert_allclose(losses["1"], losses[name], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params["1"], params[name])


def test_checkpoint_restores_bit_exactly_and_rejects_other_models(tmp_path):
  from vlrep import checkpoint

  rng = np.random.default_rng(0)
  state = {
    "step": np.int32(7),
    "params": {
      "backbone": {"conv1": {"kernel": rng.normal(size=(3, 3, 3, 8)).astype(np.float32)}},
      "head": {"bias": rng.normal(size=(5,)).astype(np.float32)},
    },
    "opt_state": {"mu": rng.normal(size=(5,)).astype(np.float32)},
  }
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(7, state, {"signature": checkpoint.signature(state["params"])})
  ckpt.wait()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state)
  restored, _ = ckpt.restore(7, abstract)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), restored, state)
  assert (
    restored["params"]["backbone"]["conv1"]["kernel"].tobytes()
    == state["params"]["backbone"]["conv1"]["kernel"].tobytes()
  )

  other = jax.tree.map(lambda x: x, abstract)
  other["params"]["backbone"]["conv1"]["kernel"] = jax.ShapeDtypeStruct((7, 7, 3, 8), np.float32)
  with pytest.raises(
    ValueError, match=r"(?s)different model.*backbone/conv1/kernel: checkpoint \(3, 3, 3, 8\) vs model \(7, 7, 3, 8\)"
  ):
    ckpt.restore(7, other)


def test_unknown_config_key_is_an_error(tmp_path):
  proc = run_main(tmp_path / "w", "--config.optim.learning_rat=0.1")
  assert proc.returncode != 0 and "learning_rat" in proc.stderr


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  from vlrep import train

  config = load_tiny_config()
  config.total_steps = 12
  config.evals = {}
  config.optim.lr_groups = (("^backbone/", 1e12), (".*", 1e12))
  config.optim.grad_clip_norm = 0.0
  config.optim.warmup_steps = 0
  with pytest.raises(train.NonFiniteLossError, match="last good checkpoint"):
    train.run(config, str(tmp_path))
  ckpts = [int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()]
  for step in ckpts:  # whatever was saved holds finite parameters
    params = _final_params(str(tmp_path))[1]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params)), step


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog):
  from vlrep import checkpoint, train

  config = load_tiny_config()
  config.evals = {}
  config.total_steps = 8
  config.checkpoint.update(every_steps=4, keep=3, async_save=False)
  train.run(config, str(tmp_path))
  ckpts = tmp_path / "checkpoints"
  assert sorted(int(p) for p in os.listdir(ckpts) if p.isdigit()) == [4, 8]

  def damage(step):  # truncate every array file of the step's state to half its size
    files = [os.path.join(d, f) for d, _, fs in os.walk(ckpts / str(step) / "state") for f in fs]
    data = [f for f in files if os.path.getsize(f) > 1024]
    assert data, files
    for f in data:
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)

  damage(8)
  config.total_steps = 10
  with caplog.at_level("WARNING"):
    train.run(config, str(tmp_path))
  text = caplog.text
  assert "Checkpoint at step 8 does not restore" in text and "newest intact checkpoint, instead of 8" in text
  # It trained steps 5..10 from step 4's state; the damaged step 8 was moved aside, not deleted, and saved anew.
  assert sorted(int(p) for p in os.listdir(ckpts) if p.isdigit()) == [4, 8, 10] and (ckpts / "damaged_8").is_dir()
  assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 10
  # With every checkpoint damaged the run refuses to start over from step 0 and names them.
  for step in [int(p) for p in os.listdir(ckpts) if p.isdigit()]:
    damage(step)
  config.total_steps = 12
  with pytest.raises(checkpoint.NoIntactCheckpointError, match="(?s)would start again from step 0.*step 10"):
    train.run(config, str(tmp_path))


def test_a_failed_save_is_a_clear_error_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
  from vlrep import checkpoint, train

  config = load_tiny_config()
  config.evals = {}
  config.total_steps = 8
  config.checkpoint.update(every_steps=4, keep=3, async_save=False)
  real_save = ocp.CheckpointManager.save

  def disk_full_after_step_4(self, step, *args, **kwargs):
    if step > 4:
      raise OSError(28, "No space left on device")
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full_after_step_4)
  with pytest.raises(checkpoint.CheckpointSaveError, match=r"(?s)step 8.*No space left.*steps \[4\]\) are untouched"):
    train.run(config, str(tmp_path))
  monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
  assert sorted(int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()) == [4]
  assert _final_params(tmp_path)[0] == 4  # and it restores


def test_sigterm_checkpoints_exits_cleanly_and_resumes(tmp_path):
  workdir = tmp_path / "preempted"
  overrides = ["--config.total_steps=400", "--config.checkpoint.every_steps=5", "--config.evals={}"]
  cmd = [sys.executable, "-m", "vlrep.main", "--config=tests/tiny_virtex.py", f"--workdir={workdir}", *overrides]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not (workdir / "checkpoints" / "5").exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 0, stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["preempted"] is True and 5 <= summary["steps"] < 400 and summary["seconds"] > 0
  assert f"Preempted (SIGTERM) after {summary['steps']} steps" in stdout  # the console says what happened
  saved = max(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  assert saved == summary["steps"]  # the checkpoint is at the step where the signal was handled
  again = run_main(workdir, "--config.total_steps=" + str(saved + 2), "--config.evals={}")
  assert again.returncode == 0 and f"Resumed from step {saved}" in again.stderr
