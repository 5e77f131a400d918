"""Faults: the fault-injection harness (vlrep.bench.faults), a non-finite loss, damaged checkpoints, failed saves
(SIGTERM alone: test_preemption)."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import ROOT, final_params, load_tiny_config


def test_the_fault_harness_survives_every_kind_of_fault(tmp_path):
  """4 faults, one of each kind (SIGTERM, SIGKILL, a truncated checkpoint, a full disk), in a tiny run's phases,
  each followed by a restart: the final parameters equal an uninterrupted run's bit for bit, every restart resumes
  from the newest intact checkpoint, SIGTERM exits cleanly within the deadline (docs/reliability.md has the
  30-fault table)."""
  from vlrep.bench import faults

  # Without evaluations (CI time): the 30-fault run of docs/reliability.md has them, and test_preemption checks that
  # an evaluation stops between batches.
  overrides = ["total_steps=24", "checkpoint.every_steps=4", "evals={}"]
  phases = ("startup", "data", "init", "train", "checkpoint")
  config = os.path.join(ROOT, "tests", "tiny_virtex.py")
  # One fault of each kind (CI time: every restart is a new process, paying JAX's startup again); the 30-fault run
  # of docs/reliability.md repeats each kind in every phase.
  result = faults.harness(config, str(tmp_path), kills=4, overrides=overrides, phases=phases)
  injected = [f for f in result["faults"] if f["injected"]]
  assert {f["kind"] for f in injected} == set(faults.KINDS), faults.table(result)
  assert len(injected) == 4 and result["equal"] and result["ok"], faults.table(result)
  assert result["damaged_set_aside"], "the truncated checkpoint was not set aside"
  assert all(f["exit_code"] == 0 for f in injected if f["kind"] == "sigterm"), faults.table(result)
  assert any("CheckpointSaveError" in f["note"] or "clear error" in f["note"] for f in injected)
  # The harness sees a failure where there is one: a restart that resumed from the wrong step.
  bad = {**result, "faults": [{**injected[0], "ok": False, "note": " resumed from step 0, expected 4;"}]}
  assert "FAILED" in faults.table(bad)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  from vlrep import train

  config = load_tiny_config()
  config.total_steps = 12
  config.evals = {}
  config.optim.lr_groups = (("^backbone/", 1e12), (".*", 1e12))
  config.optim.grad_clip_norm = 0.0
  config.optim.warmup_steps = 0
  with pytest.raises(train.NonFiniteLossError, match="last good checkpoint"):
    train.train_and_evaluate(config, str(tmp_path))
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
  train.train_and_evaluate(config, str(tmp_path))
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
    train.train_and_evaluate(config, str(tmp_path))
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
    train.train_and_evaluate(config, str(tmp_path))


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
    train.train_and_evaluate(config, str(tmp_path))
  monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
  assert sorted(int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()) == [4]
  assert final_params(tmp_path)[0] == 4  # and it restores


def test_the_fault_harness_refuses_bad_arguments_before_training(tmp_path):
  from vlrep.bench import faults

  config = os.path.join(ROOT, "tests", "tiny_virtex.py")
  with pytest.raises(ValueError, match="--kills must be at least 1"):
    faults.harness(config, str(tmp_path), kills=0)
  with pytest.raises(ValueError, match="--phases must be among"):
    faults.harness(config, str(tmp_path), kills=2, phases=("compile",))
  with pytest.raises(FileNotFoundError, match="No config file"):
    faults.harness(str(tmp_path / "missing.py"), str(tmp_path), kills=2)
  with pytest.raises(ValueError, match="--processes and --devices_per_process must be at least 1"):
    faults.harness(config, str(tmp_path), kills=2, processes=0)
  assert not os.path.exists(tmp_path / "reference")  # nothing was started
