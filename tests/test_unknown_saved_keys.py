"""A run folder saved by another version of vlrep may hold config keys this version does not know (an option
that has since left the code). Reading the run says once which keys and that they are ignored; resuming it names
the keys the resumed config lacks and trains on; a checkpoint whose layout no longer fits is refused."""

from __future__ import annotations

import json
import logging
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_main
from test_run_folder_attacks import metadata_files

from vlrep import runs
from vlrep.models import resnet

# A config as another version saved it: one backbone key and one optimizer key this version has no code for.
SAVED = {
  "seed": 0,
  "method": {"name": "virtex", "backbone": {"depth": 10, "width": 8, "stem": "small", "fused_bn_act": True}},
  "optim": {"name": "sgd", "flat_update": True},
}


def _saved_run(workdir, config):
  """A run directory whose one checkpoint holds `config` in its metadata, as the loop writes it."""
  mngr = ocp.CheckpointManager(str(workdir / "checkpoints"))
  mngr.save(5, args=ocp.args.Composite(meta=ocp.args.JsonSave({"config": config, "step": 5})))
  mngr.wait_until_finished()
  mngr.close()
  return str(workdir)


def _said(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]


def test_a_saved_config_with_unknown_keys_reads_without_the_backbone_ones_and_says_so_once(tmp_path, caplog):
  workdir = _saved_run(tmp_path / "run", SAVED)
  with caplog.at_level(logging.WARNING):
    config = runs.read_config(workdir)
    again = runs.read_config(workdir)
  assert config.to_dict() == again.to_dict()
  # The network is built from the keys it knows; the optimizer key stays, read by nothing.
  assert config.method.backbone.to_dict() == {"depth": 10, "width": 8, "stem": "small"}
  assert config.optim.to_dict() == {"name": "sgd", "flat_update": True}
  said = _said(caplog)
  assert len(said) == 1, said
  assert "method.backbone.fused_bn_act" in said[0] and "they are ignored" in said[0] and workdir in said[0]
  # The backbone builds and computes as one saved without the key.
  x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
  net = resnet.from_config(config.method.backbone)
  variables = net.init(jax.random.PRNGKey(0), x)
  plain = resnet.from_config({"depth": 10, "width": 8, "stem": "small"})
  np.testing.assert_array_equal(net.apply(variables, x)[0], plain.apply(variables, x)[0])
  # In the user's own config an unknown key is no saved run's: a typo stays ResNet's own error.
  with pytest.raises(TypeError, match="fused_bn_actt"):
    resnet.from_config({"depth": 10, "fused_bn_actt": True})
  # The resumed run compares with the user's config: every key the saved one has beyond it is named.
  assert runs.read_config(workdir, resuming=True).to_dict() == SAVED
  user = {"seed": 0, "method": {"name": "virtex", "backbone": {"depth": 10, "width": 8}}, "optim": {"name": "sgd"}}
  # (`stem`, which the user's config does not set, is an architecture key init_from may have adopted: known.)
  assert runs.unknown_keys(SAVED, user) == ["method.backbone.fused_bn_act", "optim.flat_update"]
  assert runs.unknown_keys({**SAVED, "evals": {"probe": {}}}, user) == runs.unknown_keys(SAVED, user)


def test_a_run_resumed_with_unknown_saved_keys_names_them_and_trains_on(tiny_virtex_run, tmp_path):
  assert tiny_virtex_run.returncode == 0, tiny_virtex_run.stderr[-2000:]
  run = tmp_path / "run"
  shutil.copytree(tiny_virtex_run.workdir, run, ignore=shutil.ignore_patterns("events.out.*"))
  for path in metadata_files(run):
    with open(path) as f:
      meta = json.load(f)
    meta["config"]["method"]["backbone"]["fused_bn_act"] = True
    meta["config"]["optim"]["flat_update"] = True
    with open(path, "w") as f:
      json.dump(meta, f)
  proc = run_main(run, "--config.total_steps=7", "--config.evals={}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  said = [line for line in proc.stderr.splitlines() if "config keys this config does not have" in line]
  assert len(said) == 1, said
  assert "saved with config keys this config does not have: method.backbone.fused_bn_act, optim.flat_update" in (
    proc.stderr
  )
  assert "Finished 7 steps" in proc.stdout
  # A checkpoint whose layout no longer fits (another version's parameter tree) is refused, naming why.
  for path in metadata_files(run):
    with open(path) as f:
      meta = json.load(f)
    meta["signature"] = {"backbone/old_layout/kernel": [7, 7, 3, 8]}
    with open(path, "w") as f:
      json.dump(meta, f)
  proc = run_main(run, "--config.total_steps=9", "--config.evals={}")
  assert proc.returncode != 0 and "written by a different model" in proc.stderr, proc.stderr[-3000:]
