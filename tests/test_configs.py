"""How config files load: by path, from any working directory, their imports at the top; the `backbone=` argument
of the VirTex, CLIP and LocTex recipes (ResNets and ViTs) and the models it builds."""

import ast
import glob
import importlib.util
import os
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, TESTS

from vlrep import methods
from vlrep.bench import benchmark
from vlrep.config_utils import config_module

CONFIGS = os.path.join(ROOT, "configs")
RECIPES = ("virtex", "clip", "loctex")


def _config(name: str, arg: str):
  return config_module(os.path.join(CONFIGS, "any"), f"{name}.py").get_config(arg)


def _params(config, image_size: int, abstract: bool = True):
  """The parameters the config's method builds on a batch of 2 random examples of `image_size` px, and its loss on
  that batch (with `abstract`, their shapes only: traced, not computed)."""
  method = methods.build(methods.method_config(config), config.tokenizer.vocab_size)
  max_len = config.method.get("max_len") or config.method.text.max_len
  shapes = benchmark.batch_shapes(method, 2, image_size, config.tokenizer.vocab_size, max_len)
  batch = benchmark.random_batch(shapes, config.tokenizer.vocab_size, np.random.default_rng(0))
  key = jax.random.PRNGKey(0)
  if abstract:
    variables = jax.eval_shape(method.init, key, batch)
    loss = jax.eval_shape(lambda v: method.loss(v, batch, key, True), variables)
    return variables["params"], loss
  variables = method.init(key, batch)
  loss = method.loss(variables, batch, key, False)
  return variables["params"], loss


def test_a_config_loads_by_path_from_any_working_directory(tmp_path, monkeypatch):
  """config_flags (and vlrep.tools.sweep) load a config file by path; run from another directory, with vlrep
  installed (its package alone), neither the repository nor configs/ is on sys.path: each config file finds
  configs/common.py from its own location."""
  monkeypatch.chdir(tmp_path)
  away = {os.path.realpath(p) for p in (ROOT, CONFIGS, TESTS)}
  monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.realpath(p or ".") not in away])
  for name in ("virtex", "eval/voc07_svm"):
    spec = importlib.util.spec_from_file_location(f"test_configs_{name}", os.path.join(CONFIGS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_config("runlocal").evals, name
    assert os.path.realpath(module.common.__file__) == os.path.realpath(os.path.join(CONFIGS, "common.py")), name
  assert "common" not in sys.modules  # found by path, not through sys.path


def test_config_files_import_at_the_top():
  paths = glob.glob(os.path.join(CONFIGS, "**", "*.py"), recursive=True) + glob.glob(os.path.join(TESTS, "tiny_*.py"))
  local = []
  for path in sorted(paths):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
      local += [
        f"{os.path.relpath(path, ROOT)}:{n.lineno}" for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)
      ]
  assert len(paths) > 15 and local == []


def test_backbone_names_build_the_papers_vit_b16_recipes():
  """backbone=vit_b16: CLIP's ViT-B/16 (class token, ln_pre, QuickGELU, no patch bias; AdamW beta2 0.98, eps 1e-6,
  LR 5e-4, weight decay 0.2; 512-d embedding; the 12-layer 512-wide text tower) and CapPa's (its 6-layer 768-wide
  decoder and AdamW at 1e-3); the ResNet recipes keep their ResNet-50."""
  clip = _config("clip", "backbone=vit_b16")
  assert dict(clip.method.backbone) == dict(
    arch="vit", width=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16, pool_type="tok", pre_norm=True,
    mlp_act="quick_gelu", ln_eps=1e-5, patch_bias=False,
  )  # fmt: skip
  assert (clip.optim.name, clip.optim.b2, clip.optim.eps, clip.optim.weight_decay) == ("adamw", 0.98, 1e-6, 0.2)
  assert clip.optim.lr_groups == ((".*", 5e-4),) and clip.method.embed_dim == 512
  assert (clip.method.text.hidden, clip.method.text.num_layers, clip.method.text.num_heads) == (512, 12, 8)
  assert (_config("clip", "").optim.b2, _config("clip", "").method.backbone.depth) == (0.999, 50)
  cappa = _config("virtex", "task=cappa,backbone=vit_b16")
  assert (cappa.method.backbone.arch, cappa.method.backbone.patch_size, cappa.method.backbone.width) == ("vit", 16, 768)
  assert (cappa.method.hidden, cappa.method.num_layers, cappa.method.max_len) == (768, 6, 64)
  assert "bn_group_size" not in cappa.method.backbone
  assert (cappa.optim.name, cappa.optim.lr_groups, cappa.optim.grad_clip_norm) == (
    "adamw", (("^backbone/", 1e-3), (".*", 1e-3)), 1.0,
  )  # fmt: skip
  assert _config("virtex", "backbone=r101").method.backbone.depth == 101
  loctex = _config("loctex", "backbone=vit_b16")
  assert (loctex.method.scales, loctex.method.grid_sizes) == ((1,), (14,))  # 224 px / 16-pixel patches
  # The training step's forward, traced (LocTex's per-GPU groups of 128 do not divide the test's batch of 2).
  built = {}
  for name, arg in (("virtex", "task=cappa"), ("clip", ""), ("loctex", "contrastive=global")):
    built[name], loss = _params(_config(name, f"backbone=vit_b16,{arg}".rstrip(",")), 224)
    assert built[name]["backbone"]["pos_embedding"].shape == (1, 196, 768), name
    assert "encoderblock_11" in built[name]["backbone"]["Transformer"], name
    assert loss is not None, name
  layers = sorted(k for k in built["virtex"]["textual_head"] if k.startswith("forward_layer"))
  assert layers == [f"forward_layer{i}" for i in range(6)]  # CapPa's 6-layer decoder
  assert built["clip"]["backbone"]["cls"].shape == (1, 1, 768) and "pre_norm" in built["clip"]["backbone"]


@pytest.mark.parametrize("name", RECIPES)
def test_unknown_backbones_are_refused_naming_the_choices(name):
  with pytest.raises(ValueError, match=r"backbone='r18'; known: r50.*vit_local.*vit_<variant><patch>.*vit_b16"):
    _config(name, "backbone=r18")
  with pytest.raises(ValueError, match=r"vit_b17: patch size 17 is not one of \(8, 14, 16, 32\)"):
    _config(name, "backbone=vit_b17")
  with pytest.raises(ValueError, match=r"Unknown ViT 'vit_q16'.*variant one of Ti, S, M, B"):
    _config(name, "backbone=vit_q16")


def test_vit_only_settings_are_refused_with_the_reason():
  with pytest.raises(ValueError, match="CLIP's ViTs pool with their class token"):
    _config("clip", "backbone=vit_b16,pool=attention")
  with pytest.raises(ValueError, match="a ViT has one feature grid.*use scales=1"):
    _config("loctex", "backbone=vit_local,scales=1+2")


@pytest.mark.parametrize("name", RECIPES)
def test_runlocal_vit_builds_and_computes_the_recipes_shapes(name):
  """runlocal,backbone=vit_local: the 128-wide 4-block ViT with 8-pixel patches on 64 px images (an 8x8 grid),
  trained with AdamW at common.LOCAL_VIT_LR; its model computes a finite loss on 2 random examples."""
  config = _config(name, "runlocal,backbone=vit_local")
  common = config_module(os.path.join(CONFIGS, "any"), "common.py")
  assert config.optim.name == "adamw" and config.optim.lr_groups[0] == ("^backbone/", common.LOCAL_VIT_LR)
  params, loss = _params(config, 64, abstract=False)
  vit = params["backbone"]
  assert vit["embedding"]["kernel"].shape == (8, 8, 3, 128)
  assert vit["pos_embedding"].shape == (1, 64, 128)
  assert sorted(vit["Transformer"]) == ["encoder_norm", *(f"encoderblock_{i}" for i in range(4))]
  assert vit["Transformer"]["encoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"].shape == (128, 512)
  assert vit["Transformer"]["encoderblock_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"].shape == (128, 2, 64)
  assert ("cls" in vit, "pre_norm" in vit) == ((True, True) if name == "clip" else (False, False))
  if name == "loctex":
    assert config.method.grid_sizes == (8,) and "visual_localization_1x" in params
  total = loss[0] if isinstance(loss, tuple) else loss
  assert np.isfinite(float(total))


def test_a_benchmark_variant_is_another_config_file_at_the_baselines_batch(monkeypatch):
  """`vlrep.bench.benchmark --variant=NAME:@FILE.py:ARG` (docs/speed.md's ViT-B/16 against ResNet-50 row): that
  file's config at the baseline's batch size; an unknown file is refused naming it."""
  monkeypatch.chdir(ROOT)
  baseline = _config("clip", "")
  baseline.batch_size = 4
  variant = benchmark.variant_config(baseline, "@configs/clip.py:backbone=vit_b16")
  assert (variant.batch_size, variant.method.backbone.arch, variant.method.embed_dim) == (4, "vit", 512)
  assert benchmark.parse_variant("vit_b16:@configs/clip.py:backbone=vit_b16") == (
    "vit_b16", "@configs/clip.py:backbone=vit_b16",
  )  # fmt: skip
  assert benchmark.variant_config(baseline, "method.embed_dim=256").method.embed_dim == 256
  with pytest.raises(ValueError, match="no config file 'configs/nope.py'"):
    benchmark.variant_config(baseline, "@configs/nope.py:backbone=vit_b16")
