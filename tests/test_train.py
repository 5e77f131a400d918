"""The training loop end to end: summary, checkpoints, config errors. (Faults and resumes: test_faults.py;
device-count invariance and multi-host: test_distributed.py.)"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, run_main


def test_main_end_to_end_writes_summary_and_refuses_to_resume_another_model(tiny_virtex_run, tmp_path):
  proc = tiny_virtex_run  # `run_main(workdir)`, shared with test_evaluation
  assert proc.returncode == 0, proc.stderr[-3000:]
  shutil.copytree(proc.workdir, tmp_path / "run")  # the resume below must not touch the shared run
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  # runlocal keeps the best checkpoint by probe/map_val (probe_val), and reports probe/map (probe_test).
  keys = ("probe/map", "probe/map_random_init", "train/loss", "steps", "seconds", "probe/map_val", "probe/map_val_best")
  for key in keys:
    assert key in summary, summary
  assert summary["steps"] == 6 and 0 <= summary["probe/map"] <= 100 and np.isfinite(summary["train/loss"])
  assert summary["best_checkpoint_selected_on"] == "probe/map_val: held out from probe's test split"
  assert "probe/map: pretrained" in proc.stdout and "vs random init" in proc.stdout
  # Whole-model evaluators run in the loop too: captioning on 8 val images at the end.
  assert 0 <= summary["captioning/cider"] and 0 <= summary["captioning/bleu4"] <= 100
  assert "captioning/cider:" in proc.stdout
  # Resuming this run with another model is a clear error before any training (no second run needed).
  proc = run_main(tmp_path / "run", "--config.total_steps=8", "--config.evals={}", "--config.method.hidden=64")
  assert proc.returncode != 0 and "written by a different model" in proc.stderr


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


def test_loading_a_run_logs_no_missing_orbax_metadata(tmp_path):
  """runs.load_run reads a checkpoint through its step's manager: pointing a standalone checkpointer at the `state`
  item folder made orbax look there for the step's _CHECKPOINT_METADATA and warn "Metadata file does not exist" on
  every load."""
  import logging as pylogging

  from vlrep import checkpoint, runs

  state = {"params": {"backbone": {"w": np.arange(3, dtype=np.float32)}}, "model_state": {}, "opt_state": {}}
  config = {"method": {"name": "virtex"}, "data": {"name": "synthetic_scenes", "split": "train"}}
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(3, state, {"signature": checkpoint.signature(state["params"]), "config": config})
  ckpt.wait()
  ckpt.close()
  records = []
  handler = pylogging.Handler(pylogging.WARNING)
  handler.emit = records.append
  pylogging.getLogger().addHandler(handler)
  pylogging.getLogger("absl").addHandler(handler)
  try:
    run = runs.load_run(str(tmp_path), "latest")
  finally:
    pylogging.getLogger().removeHandler(handler)
    pylogging.getLogger("absl").removeHandler(handler)
  np.testing.assert_array_equal(run.params["backbone"]["w"], np.arange(3))
  assert run.step == 3
  assert not [r.getMessage() for r in records if "Metadata file does not exist" in r.getMessage()]


def test_unknown_config_key_is_an_error(tmp_path):
  proc = run_main(tmp_path / "w", "--config.optim.learning_rat=0.1")
  assert proc.returncode != 0 and "learning_rat" in proc.stderr


def test_peak_rss_is_the_process_own_not_its_launchers():
  """A run started by a large process (a pytest worker, a notebook) reports its own peak memory: getrusage's
  ru_maxrss would report the launcher's 1.5 GB, since Linux carries it across fork and exec."""
  if not os.path.exists("/proc/self/status"):
    pytest.skip("VmHWM is Linux's")
  child = (
    "import resource; from vlrep.train import peak_rss_bytes; "
    "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
  )
  launcher = (
    "import subprocess, sys\n"
    "ballast = bytearray(1_500_000_000)\n"
    "ballast[::4096] = b'x' * len(ballast[::4096])  # touched: resident\n"
    f"subprocess.run([sys.executable, '-c', {child!r}], check=True)\n"
  )
  out = subprocess.run([sys.executable, "-c", launcher], cwd=ROOT, capture_output=True, text=True, check=True)
  own, inherited = (int(v) for v in out.stdout.split())
  assert inherited > 1.5e9, out.stdout  # ru_maxrss: the launcher's ballast
  assert 1e7 < own < 1.2e9, out.stdout  # vlrep.train and jax imported, nothing of the launcher's ballast


def test_init_from_brings_the_source_runs_backbone_architecture_and_a_resume_keeps_its_own(monkeypatch):
  """`--config.init_from=RUN` on a config whose backbone differs (finetune.py:runlocal's ResNet-26, ImageNet stem,
  from the quick start's ResNet-10, small stem): the backbone takes RUN's architecture and keeps its own BatchNorm
  grouping; a resumed run takes what it saved, without reading RUN."""
  from ml_collections import ConfigDict

  from vlrep import runs, train, train_state

  source = ConfigDict({"method": {"backbone": {"depth": 10, "width": 16, "stem": "small", "stem_stride": 2}}})
  saved = ConfigDict({"method": {"backbone": {"depth": 18, "width": 8}}})
  available = {"/runs/quick": source}

  reads = []

  def read_config(workdir, resuming=False):
    reads.append((workdir, resuming))
    if workdir not in available:
      raise FileNotFoundError(f"No run directory {workdir}.")
    return available[workdir]

  monkeypatch.setattr(runs, "read_config", read_config)
  config = ConfigDict(
    {"init_from": "/runs/quick", "method": {"backbone": {"depth": 26, "width": 16, "bn_group_size": 32}}}
  )
  config.lock()
  before = config.to_dict()
  adopted = train_state.init_from_architecture(config, "/runs/ft")
  assert config.to_dict() == before  # only read: the loop builds the model from a copy (train.config_as_trained)
  assert adopted == {"depth": 10, "stem": "small"}
  trained = train.config_as_trained(config, (), adopted)
  assert runs.backbone_architecture(trained.method.backbone) == runs.backbone_architecture(source.method.backbone)
  assert trained.method.backbone.bn_group_size == 32 and trained.method.backbone.stem == "small"
  available["/runs/ft"] = saved  # this run has checkpoints now: a restart resumes what it built
  del available["/runs/quick"]
  assert train_state.init_from_architecture(config, "/runs/ft") == {"depth": 18, "width": 8}
  assert config.to_dict() == before
  # Its own workdir is read as resuming (a run of the user's own method resumes); RUN as another run's config.
  assert reads[-1] == ("/runs/ft", True) and ("/runs/quick", False) in reads
