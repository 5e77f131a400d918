"""`config.microbatches`: one step of every method (each VirTex task, CLIP, SigLIP whole and chunked, LocTex over
the batch and in groups, MCT, ICMLM, VL-BERT, the classifier) taken in 4 microbatches gives the loss, metrics,
updated parameters and BatchNorm statistics of the whole batch at once, on one device and on 8 simulated ones (the
batch split over them, and FSDP); the loop trains with it; bad settings are refused before anything is built.
How each variant is made exact (dropout off, BatchNorm groups of 8, SGD at learning rate 1) is
tests/microbatch_equivalence.py's docstring."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import microbatch_equivalence as equivalence
import ml_collections
import numpy as np
import optax
import pytest
from conftest import ROOT, TESTS, final_params, run_main, with_devices

from vlrep import methods, train_step

# float32 rounding: the sums over examples run in another order (observed: 1e-7 .. 1e-6 on this machine).
TOLERANCE = 1e-5
ONE_DEVICE = [v for v in equivalence.VARIANTS if not v.endswith("_fsdp")]


def _assert_equal(name: str, d: dict) -> None:
  assert "error" not in d, f"{name}: {d.get('error')}"
  assert d["loss_relative"] <= TOLERANCE, (name, d)
  assert d["params_over_update"] <= TOLERANCE, (name, d)
  assert d["update"] > 0, (name, d)  # the step moved the parameters: equal parameters say something
  assert d["model_state"] <= TOLERANCE, (name, d)
  off = {k: v for k, v in d["metrics"].items() if v > 1e-4}
  assert not off, (name, off)


@pytest.mark.parametrize("name", ONE_DEVICE)
def test_four_microbatches_give_the_whole_batch_step_on_one_device(name):
  _assert_equal(name, equivalence.differences(name))


@pytest.mark.parametrize("name", ONE_DEVICE)
def test_four_rematerialised_microbatches_give_the_whole_batch_step(name):
  """remat='full' wraps every residual block and transformer layer of the method in a checkpoint: BatchNorm's
  statistics, dropout's rngs and the sown values pass through it, so the step is the same."""
  _assert_equal(name, equivalence.differences(name, "full"))


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory) -> dict:
  """Every variant on 8 simulated CPU devices, in one process (compiles are the cost)."""
  out = tmp_path_factory.mktemp("mb8") / "out.json"
  env = with_devices(8)
  proc = subprocess.run(
    [sys.executable, os.path.join(TESTS, "microbatch_equivalence.py"), str(out)],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1500,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(equivalence.VARIANTS))
def test_four_microbatches_give_the_whole_batch_step_on_eight_devices(name, eight_devices):
  d = eight_devices[name]
  assert d.get("devices") == 8, d
  _assert_equal(name, d)


def _config(**kw):
  base = {"batch_size": 64, "microbatches": 4, "remat": "none", "method": {"backbone": {"bn_group_size": 8}}}
  return ml_collections.ConfigDict({**base, **kw})


def test_step_settings_that_cannot_hold_are_refused_with_the_reason():
  assert train_step.step_errors(_config(), 2) == []
  assert train_step.step_errors(_config(microbatches=1, batch_size=7), 3) == []
  (e,) = train_step.step_errors(_config(batch_size=60), 2)
  assert "batch_size=60 does not split into microbatches=4 equal parts on each of 2 devices" in e
  # 64 / (4 devices x 4 microbatches) = 4 examples per device and microbatch: half a BatchNorm group of 8.
  (e,) = train_step.step_errors(_config(), 4)
  assert "method.backbone.bn_group_size=8" in e and "holds 4 examples per device" in e
  for bad in (0, -2, 2.5, True, "4"):
    (e,) = train_step.step_errors(_config(microbatches=bad), 1)
    assert e.startswith(f"microbatches={bad!r}"), e
  (e,) = train_step.step_errors(_config(remat="everything"), 1)
  assert "remat='everything': one of 'none', 'dots', 'full'" in e


def test_whole_batch_norms_are_named_for_the_warning():
  """BatchNorms whose statistics become per microbatch: a whole-batch backbone, MCT's head BatchNorm; VL-BERT's
  frozen region extractor (running statistics) and grouped backbones are not."""
  whole = _config(method={"backbone": {"bn_group_size": 0}, "head_batchnorm": ("inter",)})
  assert train_step.whole_batch_norms(whole) == ["method.backbone.bn_group_size=0", "method.head_batchnorm=('inter',)"]
  assert train_step.whole_batch_norms(_config()) == []
  assert train_step.whole_batch_norms(_config(method={"visual": {"backbone": {"bn_group_size": 0}}})) == []


class _WholeBatchOnly:
  """A method of one's own with only `loss`: it cannot be split, and says so."""

  fields = ("x",)

  def init(self, rng, batch):
    return {"params": {"w": jnp.ones((3,))}}

  def loss(self, variables, batch, rng, train=True):
    return jnp.sum(batch["x"] @ variables["params"]["w"]), {}, {}

  def features(self, variables, images):
    return {}


def test_a_method_that_does_not_split_its_loss_is_refused_by_name():
  m = _WholeBatchOnly()
  assert not isinstance(m, methods.SplitsItsLoss)
  tx = optax.sgd(0.1)
  state = train_step.init_train_state(m, tx, jax.random.PRNGKey(0), {"x": np.ones((4, 3), np.float32)})
  step = train_step.make_train_step(m, tx, {}, jax.random.PRNGKey(0), microbatches=2)
  with pytest.raises(ValueError, match="'_WholeBatchOnly' does not split its loss into per_example and combine"):
    step(state, {"x": np.ones((4, 3), np.float32)})


class _IntegerOutputs(_WholeBatchOnly):
  def per_example(self, variables, batch, rng, train):
    return {"n": jnp.sum(batch["x"] > 0, -1)}, {}

  def combine(self, variables, outputs, batch):
    return jnp.sum(outputs["n"]), {}, {}


def test_a_per_example_output_that_is_not_floating_is_refused_by_name():
  m = _IntegerOutputs()
  tx = optax.sgd(0.1)
  state = train_step.init_train_state(m, tx, jax.random.PRNGKey(0), {"x": np.ones((4, 3), np.float32)})
  step = train_step.make_train_step(m, tx, {}, jax.random.PRNGKey(0), microbatches=2)
  with pytest.raises(TypeError, match=r"per_example's output \['n'\] is int32: outputs are differentiated"):
    step(state, {"x": np.ones((4, 3), np.float32)})


def test_the_loop_trains_in_microbatches_as_it_trains_whole_batches(tmp_path):
  """vlrep.main with microbatches=2 and remat='dots' (tiny VirTex, dropout off, BatchNorm groups of 4: each
  microbatch of 4 holds one) logs the same losses and ends at the same parameters as microbatches=1; a batch that
  does not split is refused before anything is built."""
  same = ["--config.method.dropout=0.0", "--config.evals={}"]
  one = run_main(tmp_path / "one", *same)
  two = run_main(tmp_path / "two", *same, "--config.microbatches=2", "--config.remat=dots")
  assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
  losses = [[float(x) for x in _logged(p.stderr, "train/loss")] for p in (one, two)]
  assert len(losses[0]) >= 4 and np.allclose(losses[0], losses[1], rtol=1e-5), losses
  (_, p1), (_, p2) = final_params(tmp_path / "one"), final_params(tmp_path / "two")
  flat1, flat2 = jax.tree.leaves(p1), jax.tree.leaves(p2)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(flat1, flat2, strict=True)) < 1e-4

  bad = run_main(tmp_path / "bad", *same, "--config.microbatches=3")
  assert bad.returncode != 0
  assert "batch_size=8 does not split into microbatches=3 equal parts" in bad.stderr, bad.stderr[-2000:]
  assert not (tmp_path / "bad" / "checkpoints").exists()


def _logged(log: str, key: str) -> list[str]:
  out = []
  for line in log.splitlines():
    if f"{key}=" in line:
      out.append(line.split(f"{key}=", 1)[1].split()[0].rstrip(","))
  return out
