"""Faults: SIGKILL and SIGTERM mid-run and resume, a non-finite loss, damaged checkpoints, failed saves."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import ROOT, final_params, load_tiny_config, run_main


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
  step_a, params_a = final_params(tmp_path / "ref")
  step_b, params_b = final_params(workdir)
  assert step_a == step_b == 24
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)


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
    params = final_params(str(tmp_path))[1]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params)), step


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog):
  from vlrep import checkpoint, runs, train

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

  # The best-by-metric copy follows the same rules: a damaged best falls back to the newest intact latest step.
  shutil.copytree(ckpts / "8", tmp_path / "best" / "8")
  damage(8)
  for f in [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "best" / "8" / "state") for f in fs]:
    if os.path.getsize(f) > 1024:
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
  with caplog.at_level("WARNING"):
    assert runs.load_run(str(tmp_path), "best").step == 4
  assert "best/8 does not restore" in caplog.text and "checkpoints/8 does not restore" in caplog.text
  with pytest.raises(ValueError):  # a step asked for by number never falls back (a truncated file: ValueError)
    runs.load_run(str(tmp_path), "8")
  shutil.rmtree(tmp_path / "best")
  caplog.clear()
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
  assert final_params(tmp_path)[0] == 4  # and it restores


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


def _sigterm_when_logged(workdir, line, *overrides):
  """Starts a tiny VirTex run, sends SIGTERM once its log shows `line`; -> (returncode, log, seconds to exit)."""
  cmd = [sys.executable, "-m", "vlrep.main", "--config=tests/tiny_virtex.py", f"--workdir={workdir}", *overrides]
  log_path = str(workdir) + ".log"
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while line not in open(log_path).read() and proc.poll() is None and time.time() < deadline:
      time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    proc.wait(timeout=120)
  return proc.returncode, open(log_path).read(), time.time() - sent


def test_sigterm_before_any_step_exits_without_training_and_the_deadline_bounds_the_exit(tmp_path):
  # At startup (before the random-init probe): the probe finishes, no step is trained, nothing new is saved.
  code, log, _ = _sigterm_when_logged(tmp_path / "startup", "Training stream over")
  assert code == 0, log[-3000:]
  summary = json.loads((tmp_path / "startup" / "summary.json").read_text())
  assert summary["preempted"] is True and summary["steps"] == 0, summary
  assert "probe/map_random_init" in summary  # the phase in progress finished
  assert not [p for p in os.listdir(tmp_path / "startup" / "checkpoints") if p.isdigit()]
  # A deadline shorter than the phase in progress ends the process at the deadline, with SIGTERM's exit code.
  code, log, seconds = _sigterm_when_logged(
    tmp_path / "deadline", "Training stream over", "--config.checkpoint.exit_deadline_secs=1"
  )
  assert code == 143 and "SIGTERM deadline (1 s) passed" in log, log[-3000:]
  assert seconds < 10, seconds
