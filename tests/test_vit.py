"""vlrep.models.vit (big_vision's ViT) against the real timm (`timm.models.vision_transformer.VisionTransformer`,
random weights): the same features both ways through vlrep.interop.formats.timm (import and strict-loading export),
the position embedding resized as timm resizes it, the sin-cos embedding, bf16, remat, and FSDP over 8 devices."""

import functools
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import timm
import timm.models.vision_transformer as tvit
import torch
from conftest import ROOT, with_devices
from ml_collections import ConfigDict
from PIL import Image
from safetensors.torch import save_file
from skimage import data as skdata

from vlrep import runs
from vlrep.interop import keymaps
from vlrep.interop.formats import timm as timm_format
from vlrep.models import vit

SMALL = dict(width=64, depth=2, num_heads=4, mlp_dim=128, patch_size=8)  # 32 px: a 4 x 4 grid of patches


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def photos():
  """Two real photographs (scikit-image's astronaut and cat) at 32 px, ImageNet-normalised, NHWC float32."""
  out = []
  for rgb in (skdata.astronaut(), skdata.chelsea()):
    img = np.asarray(Image.fromarray(rgb).resize((32, 32), Image.BICUBIC), np.float32) / 255.0
    out.append((img - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225]))
  return np.stack(out).astype(np.float32)


def _timm_model(**kwargs):
  """timm's VisionTransformer of these kwargs with every weight random (LayerNorms away from 1 and 0, biases and
  tokens non-zero: what a trained model has), in eval mode."""
  eps = kwargs.pop("ln_eps", 1e-6)
  model = timm.create_model(
    "vit_tiny_patch16_224",
    pretrained=False,
    norm_layer=functools.partial(timm.layers.LayerNorm, eps=eps),
    **kwargs,
  ).eval()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith(".weight") else 0.1 * noise)
  return model


def _timm_features(model, images: np.ndarray):
  """(tokens after the final norm [B, T, C], pooled [B, C]) of timm's model on NHWC images."""
  with torch.no_grad():
    x = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))
    tokens = model.forward_features(x)
    pooled = model.forward_head(tokens, pre_logits=True)
  return tokens.numpy(), pooled.numpy()


def _vlrep_features(section: dict, params: dict, images: np.ndarray):
  module = vit.from_config(runs.backbone_architecture(section))
  _, aux = module.apply({"params": params}, jnp.asarray(images), False)
  return np.asarray(aux["tokens"]), np.asarray(aux["pre_logits"]), aux


# (vlrep's ViT section, timm's kwargs): big_vision's SigLIP-style MAP head, a class token with CLIP's pre-norm,
# QuickGELU and epsilon 1e-5, and global average pooling.
CASES = {
  "map": (
    dict(pool_type="map", mlp_act="gelu_tanh"),
    dict(class_token=False, global_pool="map", act_layer="gelu_tanh"),
  ),
  "tok_clip": (
    dict(pool_type="tok", pre_norm=True, patch_bias=False, mlp_act="quick_gelu", ln_eps=1e-5),
    dict(class_token=True, global_pool="token", pre_norm=True, act_layer="quick_gelu", ln_eps=1e-5),
  ),
  "gap": (dict(pool_type="gap", mlp_act="gelu"), dict(class_token=False, global_pool="avg", fc_norm=False)),
}


def _timm_kwargs(case: str) -> dict:
  return dict(
    img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=0, **CASES[case][1]
  )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_timm_model_imports_and_computes_the_same_features(case, photos, tmp_path):
  model = _timm_model(**_timm_kwargs(case))
  path = str(tmp_path / "timm.safetensors")
  save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
  section = {"arch": "vit", **SMALL, **CASES[case][0]}
  config = ConfigDict({"method": {"name": "classifier", "num_classes": 1000, "backbone": section}})
  imported = timm_format.read(path, config=config)
  assert dict(imported.config.method.backbone) == {**runs.backbone_architecture(section), "arch": "vit"}
  assert imported.note["settings_not_in_the_state_dict"] == dict.fromkeys(("num_heads", "act_layer", "ln_eps"), "given")
  tokens, pooled, _ = _vlrep_features(section, imported.params["backbone"], photos)
  want_tokens, want_pooled = _timm_features(model, photos)
  # Float32 rounding: the two compute the same sums in other orders.
  print(f"{case}: relative error tokens {_rel(tokens, want_tokens):.1e}, pooled {_rel(pooled, want_pooled):.1e}")
  assert _rel(tokens, want_tokens) < 2e-6 and _rel(pooled, want_pooled) < 2e-6
  # The importer without a recipe: timm's defaults for what a state dict lacks (64-wide heads: 1 head here).
  plain = timm_format.read(path)
  assert plain.config.method.backbone["num_heads"] == 1 and plain.note["settings_not_in_the_state_dict"]["num_heads"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_exported_vit_strict_loads_into_timm_and_computes_the_same_features(case, photos):
  section = {"arch": "vit", **SMALL, **CASES[case][0]}
  module = vit.from_config(runs.backbone_architecture(section))
  params = module.init(jax.random.PRNGKey(1), jnp.zeros((1, 32, 32, 3)))["params"]
  # Away from the initialiser's zeros (class token, biases): a trained model's values.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  noisy = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
  params = jax.tree.unflatten(tree, noisy)
  kwargs = timm_format.timm_kwargs(section, grid=4)
  code = timm_format.timm_code(kwargs)
  model = eval(code, {"timm": timm, "functools": functools}).eval()  # the printed call, as a user runs it
  sd = timm_format.state_dict(params, section["pool_type"])
  missing = model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
  assert not missing.missing_keys and not missing.unexpected_keys
  want_tokens, want_pooled = _timm_features(model, photos)
  tokens, pooled, _ = _vlrep_features(section, params, photos)
  print(f"{case}: relative error tokens {_rel(tokens, want_tokens):.1e}, pooled {_rel(pooled, want_pooled):.1e}")
  assert _rel(tokens, want_tokens) < 2e-6 and _rel(pooled, want_pooled) < 2e-6


def test_a_class_token_without_a_position_is_big_visions_layout(photos, tmp_path):
  """timm's no_embed_class=True (DeiT III, big_vision ports): the class token has no position row; imported as is."""
  model = _timm_model(**_timm_kwargs("tok_clip"), no_embed_class=True)
  path = str(tmp_path / "deit3.safetensors")
  save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
  section = {"arch": "vit", **SMALL, **CASES["tok_clip"][0]}
  imported = timm_format.read(path, config=ConfigDict({"method": {"name": "classifier", "backbone": section}}))
  assert imported.note["timm_kwargs"]["no_embed_class"] is True
  tokens, pooled, _ = _vlrep_features(section, imported.params["backbone"], photos)
  want_tokens, want_pooled = _timm_features(model, photos)
  assert _rel(tokens, want_tokens) < 2e-6 and _rel(pooled, want_pooled) < 2e-6


def test_export_refuses_what_timm_cannot_express():
  base = {"arch": "vit", **SMALL}
  with pytest.raises(ValueError, match="fixed sin-cos"):
    timm_format.timm_kwargs({**base, "posemb": "sincos2d"}, 4)
  with pytest.raises(ValueError, match="bias exactly when there is no norm_pre"):
    timm_format.timm_kwargs({**base, "pre_norm": True}, 4)  # a patch bias and pre_norm
  with pytest.raises(ValueError, match="exports ViT backbones"):
    timm_format.timm_kwargs({"depth": 10}, 4)


def test_the_parameter_tree_has_big_visions_names():
  section = {"arch": "vit", **SMALL, "pool_type": "tok", "pre_norm": True}
  params = jax.eval_shape(lambda: vit.from_config(section).init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))[
    "params"
  ]
  names = set(keymaps.flatten(params))
  block = "Transformer/encoderblock_1"
  for name in (
    "embedding/kernel",
    "embedding/bias",
    "cls",
    "pos_embedding",
    "pre_norm/scale",
    f"{block}/LayerNorm_0/scale",
    f"{block}/MultiHeadDotProductAttention_0/query/kernel",
    f"{block}/MultiHeadDotProductAttention_0/out/kernel",
    f"{block}/LayerNorm_1/bias",
    f"{block}/MlpBlock_0/Dense_0/kernel",
    f"{block}/MlpBlock_0/Dense_1/bias",
    "Transformer/encoder_norm/scale",
  ):
    assert name in names, sorted(names)
  assert params["Transformer"]["encoderblock_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"].shape == (
    64,
    4,
    16,
  )
  mapped = jax.eval_shape(
    lambda: vit.from_config({**SMALL, "pool_type": "map"}).init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))
  )["params"]
  assert {"probe", "MultiHeadDotProductAttention_0", "LayerNorm_0", "MlpBlock_0"} == set(mapped["MAPHead_0"])
  assert "cls" not in mapped


@pytest.mark.parametrize("grid", [6, 3])
def test_a_resized_position_embedding_is_timms_bilinear_without_antialias(grid):
  """big_vision resizes bilinearly without antialiasing: timm's resample_abs_pos_embed(interpolation='bilinear',
  antialias=False) to float32 rounding, up (4 -> 6) and down (4 -> 3). timm's default (bicubic, antialiased) differs:
  a model moved to another resolution computes other features in each."""
  pe = np.random.default_rng(0).normal(size=(1, 16, 8)).astype(np.float32)
  ours = np.asarray(vit.resize_posemb(jnp.asarray(pe), (grid, grid)))
  theirs = timm.layers.resample_abs_pos_embed(
    torch.from_numpy(pe), [grid, grid], num_prefix_tokens=0, interpolation="bilinear", antialias=False
  ).numpy()
  assert ours.shape == theirs.shape == (1, grid * grid, 8)
  assert _rel(ours, theirs) < 1e-6, _rel(ours, theirs)
  default = timm.layers.resample_abs_pos_embed(torch.from_numpy(pe), [grid, grid], num_prefix_tokens=0).numpy()
  assert _rel(ours, default) > 1e-2


def test_a_checkpoint_applies_at_another_resolution_as_timm_with_bilinear_resizing(photos):
  """A 32 px model at 48 px: vlrep resizes the learned embedding when applied; timm with dynamic_img_size and the
  same resampling computes the same features."""
  model = _timm_model(**_timm_kwargs("gap"), dynamic_img_size=True)
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  kwargs, _ = timm_format.architecture(sd, {"num_heads": 4, "act_layer": "gelu"})
  params = runs.unflatten(
    {
      **timm_format.KEY_MAP.to_vlrep(
        {k: v for k, v in sd.items() if k not in timm_format.SPECIAL},
        {
          k: v
          for k, v in timm_format.expected_shapes(timm_format.section_of(kwargs), 32).items()
          if not k.endswith("pos_embedding")
        },
      ).variables,
      **timm_format._cls_and_posemb(sd, kwargs),
    }
  )["params"]["backbone"]
  big = np.asarray(jax.image.resize(photos, (2, 48, 48, 3), "bilinear"))
  original = tvit.resample_abs_pos_embed
  tvit.resample_abs_pos_embed = functools.partial(original, interpolation="bilinear", antialias=False)
  try:
    want_tokens, _ = _timm_features(model, big)
  finally:
    tvit.resample_abs_pos_embed = original
  tokens, _, _ = _vlrep_features(timm_format.section_of(kwargs), params, big)
  assert tokens.shape == (2, 36, 64)
  assert _rel(tokens, want_tokens) < 2e-6, _rel(tokens, want_tokens)


def test_sincos2d_is_big_visions_embedding():
  """big_vision's posemb_sincos_2d: [sin x, cos x, sin y, cos y] over width/4 frequencies 1 ... 1/temperature
  (exponents i / (width/4 - 1); timm's build_sincos2d_pos_embed divides by width/4 and stacks y before x)."""
  h, w, width = 3, 5, 16
  pe = np.asarray(vit.posemb_sincos_2d(h, w, width))[0]
  assert pe.shape == (h * w, width)
  freqs = 1.0 / 10_000.0 ** (np.arange(4) / 3)
  for row in range(h):
    for col in range(w):
      want = np.concatenate([np.sin(col * freqs), np.cos(col * freqs), np.sin(row * freqs), np.cos(row * freqs)])
      np.testing.assert_allclose(pe[row * w + col], want, rtol=1e-6, atol=1e-6)
  module = vit.ViT(**SMALL, posemb="sincos2d")
  variables = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))
  assert "pos_embedding" not in variables["params"]
  with pytest.raises(ValueError, match="divisible by 4"):
    vit.posemb_sincos_2d(2, 2, 6)


def test_bf16_runs_and_stays_near_float32(photos):
  f32 = vit.ViT(**SMALL, pool_type="map")
  params = f32.init(jax.random.PRNGKey(0), photos[:1])["params"]
  grid32, aux32 = f32.apply({"params": params}, photos)
  grid16, aux16 = vit.ViT(**SMALL, pool_type="map", dtype=jnp.bfloat16).apply({"params": params}, photos)
  assert grid16.dtype == jnp.bfloat16 and aux16["pre_logits"].dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(aux16["pre_logits"])))
  assert _rel(grid16.astype(jnp.float32), grid32) < 3e-2 and _rel(aux16["pre_logits"], aux32["pre_logits"]) < 3e-2


def test_remat_gives_the_same_gradients(photos):
  def grads(remat):
    module = vit.ViT(**SMALL, pool_type="tok", remat=remat)
    params = module.init(jax.random.PRNGKey(0), photos[:1])["params"]

    def loss(p):
      grid, aux = module.apply({"params": p}, photos, True)
      return jnp.sum(aux["pre_logits"] ** 2) + jnp.mean(grid**2)

    return jax.grad(loss)(params)

  plain = grads("none")
  for policy in ("full", "dots"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads(policy), plain)


FSDP_SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np
from vlrep import sharding
from vlrep.models import vit

module = vit.ViT(width=64, depth=2, num_heads=4, mlp_dim=128, patch_size=8, pool_type="map")
images = jax.random.normal(jax.random.PRNGKey(1), (16, 32, 32, 3))
target = jax.random.normal(jax.random.PRNGKey(2), (16, 64))
params = module.init(jax.random.PRNGKey(0), images[:1])["params"]

def step(p, x, y):
  def loss(p):
    grid, aux = module.apply({"params": p}, x, True)
    return jnp.mean((aux["pre_logits"] - y) ** 2) + jnp.mean(grid ** 2)
  value, g = jax.value_and_grad(loss)(p)
  return value, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

one_loss, one = jax.jit(step)(params, images, target)
mesh = sharding.make_mesh()
shardings = sharding.state_shardings(mesh, params, "fsdp", fsdp_min_size=256)
sharded = jax.device_put(params, shardings)
batch = sharding.batch_sharding(mesh)
many_loss, many = jax.jit(step, out_shardings=(sharding.replicated(mesh), shardings))(
  sharded, jax.device_put(images, batch), jax.device_put(target, batch))
split = [s.spec for s in jax.tree.leaves(shardings) if any(a is not None for a in s.spec)]
qkernel = many["Transformer"]["encoderblock_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
pairs = zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True)
diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)
print(json.dumps({"devices": len(jax.devices()), "split": len(split), "leaves": len(jax.tree.leaves(params)),
  "shards": len(qkernel.addressable_shards), "shard_shape": list(qkernel.addressable_shards[0].data.shape),
  "loss": [float(one_loss), float(many_loss)], "max_diff": diff}))
"""


def test_fsdp_over_eight_devices_trains_a_step_as_one_device():
  env = with_devices(8)
  out = subprocess.run(
    [sys.executable, "-c", FSDP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["devices"] == 8 and got["split"] >= 8, got  # the kernels split over the 8 devices
  assert got["shards"] == 8 and math.prod(got["shard_shape"]) * 8 == 64 * 4 * 16, got
  np.testing.assert_allclose(got["loss"][1], got["loss"][0], rtol=1e-6)
  assert got["max_diff"] < 1e-5, got
