"""Speed switches that do not pay on an accelerator have no code in vlrep (docs/speed.md): no config carries them,
and runs saved with them still read, evaluate and export, except the two whose checkpoints hold something the plain
path cannot read (then a clear error)."""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_evaluation import _recipe_configs

from vlrep import runs
from vlrep.models import resnet
from vlrep.removed_switches import REMOVED_SWITCHES, drop_removed_switches


def _flat_keys(tree, prefix=""):
  for key, value in tree.items():
    full = f"{prefix}.{key}" if prefix else key
    yield full
    if hasattr(value, "items"):
      yield from _flat_keys(value, full)


def test_no_recipe_carries_a_removed_switch():
  removed_names = {key.rsplit(".", 1)[-1] for key in REMOVED_SWITCHES}
  for name, config in _recipe_configs():
    leftover = [k for k in _flat_keys(config.to_dict()) if k.rsplit(".", 1)[-1] in removed_names]
    assert not leftover, (name, leftover)


# A config as a run saved it with the switches: the speed-only ones on, the state-changing ones off.
SAVED = {
  "seed": 0,
  "rng_impl": "unsafe_rbg",
  "method": {
    "name": "virtex",
    "fused_qkv": True,
    "fused_memory_kv": False,
    "vocab_multiple": 1,
    "backbone": {"depth": 10, "width": 8, "fused_bn_act": True, "conv1x1_as_dot": True, "pallas_conv1x1": False},
  },
  "optim": {"name": "sgd", "grad_norm_once": True, "lookahead_sync_only": True, "flat_update": False},
}


def _saved_run(workdir, config):
  """A run directory whose one checkpoint holds `config` in its metadata, as the loop writes it."""
  mngr = ocp.CheckpointManager(str(workdir / "checkpoints"))
  mngr.save(5, args=ocp.args.Composite(meta=ocp.args.JsonSave({"config": config, "step": 5})))
  mngr.wait_until_finished()
  mngr.close()
  return str(workdir)


def test_a_run_saved_with_removed_switches_reads_without_them(tmp_path):
  config = runs.read_config(_saved_run(tmp_path, SAVED))
  assert config.to_dict() == {
    "seed": 0,
    "method": {"name": "virtex", "backbone": {"depth": 10, "width": 8}},
    "optim": {"name": "sgd"},
  }
  assert runs.read_config(str(tmp_path), resuming=True).to_dict() == config.to_dict()


def test_switches_that_changed_the_checkpoint_are_clear_errors(tmp_path):
  flat = dict(SAVED, optim=dict(SAVED["optim"], flat_update=True))
  workdir = _saved_run(tmp_path / "flat", flat)
  # A flat momentum vector: the weights still evaluate and export; resuming the optimizer state cannot.
  assert "optim" in runs.read_config(workdir)
  with pytest.raises(ValueError, match=r"optim.flat_update=True, which changed what its checkpoint holds"):
    runs.read_config(workdir, resuming=True)
  # Padded vocabulary tables: the plain head has other shapes, so even reading the run for evaluation refuses.
  padded = dict(SAVED, method=dict(SAVED["method"], vocab_multiple=128))
  with pytest.raises(ValueError, match=r"method.vocab_multiple=128"):
    runs.read_config(_saved_run(tmp_path / "padded", padded))


def test_a_backbone_section_with_removed_switches_builds_the_same_network():
  section = dict(depth=10, width=8, stem="small", bn_group_size=2)
  old = dict(section, fused_bn_act=True, fast_max_pool=True, conv1x1_as_dot=False, pallas_conv1x1=True)
  assert drop_removed_switches(old, "method.backbone") == section
  x = np.random.default_rng(0).normal(size=(4, 16, 16, 3)).astype(np.float32)
  plain, saved = resnet.from_config(section), resnet.from_config(old)
  variables = plain.init(jax.random.PRNGKey(0), x)
  np.testing.assert_array_equal(saved.apply(variables, x)[0], plain.apply(variables, x)[0])
  # Not a dropped key: an unknown one is still ResNet's own error.
  with pytest.raises(TypeError, match="fused_bn_actt"):
    resnet.from_config(dict(section, fused_bn_actt=True))
