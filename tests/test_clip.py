"""CLIP and SigLIP: the losses against numpy, the chunked sigmoid loss over 8 devices against the direct formula,
the temperature clip, the model's towers, and tiny runs end to end (train, resume, export)."""

import json

import numpy as np
import pytest
from conftest import run_main, run_module

from vlrep.methods import _contrastive


def _unit(x):
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _np_sigmoid_loss(img, txt, t, b):
  """SigLIP's loss written out pair by pair: -1/B sum_i sum_j log sigmoid(z_ij (t x_i.y_j + b))."""
  x, y = _unit(img.astype(np.float64)), _unit(txt.astype(np.float64))
  total = 0.0
  for i in range(len(x)):
    for j in range(len(y)):
      z = 1.0 if i == j else -1.0
      total += np.log1p(np.exp(-z * (t * x[i] @ y[j] + b)))  # -log sigmoid(u) = log(1 + e^-u)
  return total / len(x)


def _np_clip_loss(img, txt, scale):
  s = _unit(img.astype(np.float64)) @ _unit(txt.astype(np.float64)).T * scale
  log_softmax = lambda m: m - np.log(np.exp(m).sum(1, keepdims=True))
  return float(-(np.diag(log_softmax(s)).mean() + np.diag(log_softmax(s.T)).mean()) / 2)


def test_losses_match_numpy():
  rng = np.random.default_rng(0)
  img, txt = rng.normal(size=(6, 5)).astype(np.float32), rng.normal(size=(6, 5)).astype(np.float32)
  for t, b in ((10.0, -10.0), (3.0, 0.5)):
    want = _np_sigmoid_loss(img, txt, t, b)
    assert float(_contrastive.sigmoid_loss(img, txt, t, b)) == pytest.approx(want, rel=1e-5)
    # Without a mesh, chunks of the texts in a scan: the same sum.
    for chunks in (2, 3, 6):
      assert float(_contrastive.sigmoid_loss_chunked(img, txt, t, b, chunks)) == pytest.approx(want, rel=1e-5)
  with pytest.raises(ValueError, match="sigmoid-loss chunks"):
    _contrastive.sigmoid_loss_chunked(img, txt, 1.0, 0.0, 4)
  scale = np.log(1 / 0.07)
  want = _np_clip_loss(img, txt, 1 / 0.07)
  assert float(_contrastive.clip_loss(img, txt, scale)) == pytest.approx(want, rel=1e-5)
  # CLIP's loss is the symmetric InfoNCE (LocTex's L_C) at temperature 1 / scale: one implementation.
  assert float(_contrastive.info_nce(img, txt, 0.07, symmetric=True)) == pytest.approx(want, rel=1e-5)


def test_logit_scale_is_clipped_at_100_and_gets_no_gradient_beyond():
  import jax

  rng = np.random.default_rng(1)
  img, txt = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
  assert float(_contrastive.clipped_logit_scale(np.log(1 / 0.07))) == pytest.approx(1 / 0.07, rel=1e-6)
  assert float(_contrastive.clipped_logit_scale(10.0)) == pytest.approx(100.0, rel=1e-6)
  assert float(_contrastive.clip_loss(img, txt, 10.0)) == pytest.approx(_np_clip_loss(img, txt, 100.0), rel=1e-5)
  assert float(jax.grad(_contrastive.clip_loss, argnums=2)(img, txt, 10.0)) == 0.0
  assert float(jax.grad(_contrastive.clip_loss, argnums=2)(img, txt, 2.0)) != 0.0


def test_chunked_sigmoid_loss_on_eight_devices_equals_the_direct_formula(tmp_path):
  """Under a mesh of 8 devices the texts go round the ring (ppermute in shard_map): loss and gradients equal the
  direct formula's on one device, and the compiled step passes blocks between devices instead of gathering."""
  script = tmp_path / "ring.py"
  script.write_text(
    """
import json
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from vlrep import sharding
from vlrep.methods import _contrastive
mesh = sharding.make_mesh()
rng = np.random.default_rng(0)
img, txt = rng.normal(size=(16, 6)).astype(np.float32), rng.normal(size=(16, 6)).astype(np.float32)
sh = NamedSharding(mesh, P("data"))
grads = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2, 3))
direct = grads(_contrastive.sigmoid_loss)(img, txt, np.float32(10.0), np.float32(-10.0))
f = jax.jit(grads(_contrastive.sigmoid_loss_chunked), in_shardings=(sh, sh, None, None))
with jax.set_mesh(mesh):
  args = (jax.device_put(img, sh), jax.device_put(txt, sh), np.float32(10.0), np.float32(-10.0))
  ring = f(*args)
  hlo = f.lower(*args).compile().as_text()
diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(direct[1], ring[1]))
print(json.dumps({"devices": len(jax.devices()), "direct": float(direct[0]), "ring": float(ring[0]),
                  "grad_diff": diff, "permutes": "collective-permute" in hlo, "gathers": "all-gather" in hlo}))
"""
  )
  # A process of its own (8 devices), forked from the worker's server: the script is a module on its path.
  devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(tmp_path)}
  res = run_module("ring", env=devices, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert out["devices"] == 8
  rng = np.random.default_rng(0)
  img, txt = rng.normal(size=(16, 6)), rng.normal(size=(16, 6))
  assert out["ring"] == pytest.approx(_np_sigmoid_loss(img, txt, 10.0, -10.0), rel=1e-5)
  assert out["ring"] == pytest.approx(out["direct"], rel=1e-6) and out["grad_diff"] < 1e-6
  assert out["permutes"] and not out["gathers"]


def test_text_tower_reads_the_eos_state_under_a_causal_mask_and_attention_pooling_embeds():
  """The scratch tower: a state sees only earlier tokens; the caption's embedding is its [EOS] state's, whatever
  the padding; a word before [EOS] changes it. pool=attention gives the embedding from the grid."""
  import jax
  import tiny_clip

  from vlrep import methods
  from vlrep.models import special_tokens as st

  method = methods.build(tiny_clip.get_config("pool=attention").method, 50)
  images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
  caption = [st.SOS_ID, 7, 8, st.EOS_ID]
  tokens = np.array([caption + [st.PAD_ID] * 2, [st.SOS_ID, 7, 9, st.EOS_ID, st.PAD_ID, st.PAD_ID]])
  variables = method.init(jax.random.PRNGKey(0), {"image": images, "tokens": tokens})
  text = np.asarray(method.embed(variables, tokens=tokens)["text"])
  longer = np.array([caption + [st.PAD_ID] * 6])
  np.testing.assert_allclose(np.asarray(method.embed(variables, tokens=longer)["text"])[0], text[0], atol=1e-5)
  assert np.abs(text[0] - text[1]).max() > 1e-3
  states = method.model.apply(variables, tokens, method=lambda m, t: m.textual(t))
  np.testing.assert_allclose(np.asarray(states[0, :2]), np.asarray(states[1, :2]), atol=1e-6)  # causal
  assert "attention_pool" in variables["params"] and "visual_projection" not in variables["params"]
  image = np.asarray(method.embed(variables, images=images)["image"])
  assert image.shape == (2, 16) and np.allclose(np.linalg.norm(image, axis=1), 1.0, atol=1e-5)


def test_recipe_follows_clip_and_runlocal_compares_with_virtex_runlocal():
  from configs import clip as clip_config
  from configs import virtex as virtex_config

  recipe = clip_config.get_config()
  o = recipe.optim
  assert (o.name, o.weight_decay, o.b1, o.b2, o.eps, o.lr_groups) == ("adamw", 0.2, 0.9, 0.999, 1e-8, ((".*", 5e-4),))
  assert recipe.method.loss == "softmax" and clip_config.get_config("loss=sigmoid").method.loss == "sigmoid"
  assert clip_config.get_config("text=bert,bert=/b").tokenizer.to_dict() == {"kind": "wordpiece", "path": "/b"}
  local, virtex = clip_config.get_config("runlocal"), virtex_config.get_config("runlocal")
  assert local.method.backbone == virtex.method.backbone and local.data.pp == virtex.data.pp
  assert (local.batch_size, local.total_steps) == (virtex.batch_size, virtex.total_steps)
  for bad in ("loss=l2", "pool=max", "text=gpt"):
    with pytest.raises(ValueError, match="Unknown"):
      clip_config.get_config(bad)


# ---------------------------------------------------------------------------------------------------------- #
# End to end.
# ---------------------------------------------------------------------------------------------------------- #
def test_clip_trains_resumes_and_exports_its_backbone(tmp_path):
  """loss=softmax: the tiny run logs the learned temperature, evaluates (probe, retrieval with its own towers),
  continues from its checkpoint when started again with more steps, and its backbone exports to torchvision."""
  from vlrep.interop import export

  run = tmp_path / "run"
  res = run_main(run, "--config.total_steps=2", "--config.evals={}", config="tests/tiny_clip.py")
  assert res.returncode == 0, res.stderr[-4000:]
  assert "logit_scale" in res.stderr and "temperature" in res.stderr
  again = run_main(run, config="tests/tiny_clip.py")  # total_steps 4: two more, then the evaluators
  assert again.returncode == 0 and "Resumed from step 2" in again.stderr, again.stderr[-4000:]
  summary = json.loads((run / "summary.json").read_text())
  assert summary["steps"] == 4
  for key in ("probe/map", "retrieval/i2t_r1", "retrieval/rsum"):
    assert key in summary and np.isfinite(summary[key]), key
  info = export.export(str(run), "torchvision", str(tmp_path / "backbone.safetensors"), "latest")
  assert info["step"] == 4 and info["parameters"] > 0


def test_siglip_trains_end_to_end(tmp_path):
  res = run_main(
    tmp_path / "run", "--config.evals={}", "--config.total_steps=2", config="tests/tiny_clip.py:loss=sigmoid"
  )
  assert res.returncode == 0, res.stderr[-4000:]
  assert "sigmoid_loss" in res.stderr and "t_prime" not in res.stderr
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
