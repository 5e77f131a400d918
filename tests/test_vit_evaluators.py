"""Every evaluator on a ViT backbone: tiny VirTex, CLIP and LocTex runs on a two-block ViT (tests/tiny_vit.py, trained
once for this file) through `vlrep.main`, their in-loop evaluators (VOC07 SVM probe, captioning, retrieval,
localization), `vlrep.evaluate` standalone (linear probe, SVM on the patch grid, zero-shot both ways, captioning,
retrieval), `vlrep.load` (encode_images, encode_text, zero_shot, caption), the timm export of a trained run, and the
refusals: LocTex's scales 2 and 4, detection transfer (the evaluator and the Detectron2 driver) and the
torchvision / Detectron2 / PyTorch hand-off exports."""

import functools
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import timm
import torch
from conftest import ROOT, load_tiny_config, run_main
from ml_collections import ConfigDict
from PIL import Image
from safetensors.torch import load_file
from skimage import data as skdata

import vlrep
from vlrep import defaults, evaluate, inference, runs
from vlrep.config_utils import config_module
from vlrep.errors import UserError
from vlrep.interop import export, import_run
from vlrep.interop.keymaps import NotExportable
from vlrep.models import vit
from vlrep.pytorch import detectron2_transfer

D = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
DATA = dict(dataset="synthetic_scenes", config_name="tiny", data_dir=D)
WIDTH, GRID = 32, 4  # tests/tiny_vit.py's ViT: width 32, 8-pixel patches at 32 px


@pytest.fixture(scope="module")
def vit_runs(tmp_path_factory):
  """{method: workdir} of the three tiny ViT runs (trained once; the tests read them, none writes into them but
  `vlrep.evaluate`'s summary entries)."""
  root = tmp_path_factory.mktemp("vit_runs")
  out = {}
  for method in ("virtex", "clip", "loctex"):
    proc = run_main(root / method, config=f"tests/tiny_vit.py:{method}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[method] = types.SimpleNamespace(workdir=str(root / method), stdout=proc.stdout)
  return out


def _summary(workdir) -> dict:
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
  root = tmp_path_factory.mktemp("photos")
  paths = []
  for name in ("astronaut", "chelsea", "coffee"):
    path = str(root / f"{name}.jpg")
    Image.fromarray(getattr(skdata, name)()).save(path, quality=90)
    paths.append(path)
  return paths


def test_the_training_loops_evaluators_run_on_a_vit(vit_runs):
  virtex, clip, loctex = (_summary(vit_runs[m].workdir) for m in ("virtex", "clip", "loctex"))
  assert virtex["steps"] == 6 and np.isfinite(virtex["train/loss"])
  for summary in (virtex, clip, loctex):  # the VOC07 SVM probe on the pooled token, and its random-init baseline
    assert 0 < summary["probe/map"] <= 100 and 0 < summary["probe/map_random_init"] <= 100
  assert 0 <= virtex["captioning/cider"] and "captioning/bleu4" in virtex
  assert clip["retrieval/chance_r1"] == 6.25 and 0 <= clip["retrieval/i2t_r1"] <= 100
  assert 0 <= loctex["localization/pointing_1x"] <= 100 and 0 <= loctex["localization/iou_1x"] <= 100
  assert "localization/pointing_contrastive" in loctex


def _eval_config(**evals) -> ConfigDict:
  return ConfigDict({"evals": evals})


def _zero_shot(**settings) -> dict:
  module = config_module(os.path.join(ROOT, "configs", "eval", "x"), "zero_shot.py")
  cfg = module.get_config("runlocal,labels=single,limit=16").evals.zero_shot
  cfg.update(data_dir=D, config_name="tiny", batch_size=16, **settings)
  return cfg.to_dict()


def test_vlrep_evaluate_runs_every_backbone_evaluator_on_a_vit_virtex(vit_runs):
  workdir = vit_runs["virtex"].workdir
  probe = {**load_tiny_config().evals.probe.to_dict(), "solver": "jax", "random_init": False}
  results = evaluate.evaluate(
    _eval_config(
      svm_grid={**probe, "feature": "grid", "pooling": "2x2"},  # the 4x4 patch grid pooled to 2x2
      linear=dict(
        type="linear_probe",
        **DATA,
        train_split="train",
        test_split="val",
        num_classes=10,
        pp_train="decode|normalize|largest_object_label",
        pp_eval="decode|normalize|largest_object_label",
        mode="features",
        epochs=1,
        batch_size=16,
        lr=0.3,
      ),
      zero_shot=_zero_shot(),  # the captioner's likelihood of each class's prompts
      captions=dict(
        type="captioning",
        **DATA,
        split="val",
        pp="decode|normalize",
        decoding="greedy",
        max_len=6,
        batch_size=16,
        limit=8,
      ),
    ),
    workdir,
  )
  assert 0 < results["svm_grid/map"] <= 100
  assert 0 <= results["linear/top1"] <= 100
  assert results["zero_shot/chance"] == 10.0 and 0 <= results["zero_shot/top1"] <= 100
  assert 0 <= results["captions/cider"]
  assert all(results[f"{name}/checkpoint_step"] == 6 for name in ("svm_grid", "linear", "zero_shot", "captions"))


def test_vlrep_evaluate_runs_zero_shot_and_both_retrievals_on_a_vit_clip(vit_runs):
  workdir = vit_runs["clip"].workdir
  retrieval = config_module(os.path.join(ROOT, "configs", "eval", "x"), "retrieval.py")
  entry = retrieval.get_config("runlocal,protocol=towers").evals.retrieval.to_dict()
  entry.update(config_name="tiny", data_dir=D, batch_size=8, limit=16)
  # VSE++ (MCT's retrieval protocol): a joint embedding trained on the frozen ViT's pooled features, one epoch.
  vsepp = dict(defaults.VSEPP_COCO, **defaults.VSEPP_RUNLOCAL)
  vsepp.update(config_name="tiny", data_dir=D, train_limit=32, test_limit=16, batch_size=16, train_batch_size=8)
  vsepp.update(epochs=1, lr_update_epochs=1, sum_loss_epochs=1, embed_dim=16, word_dim=16)
  results = evaluate.evaluate(_eval_config(zero_shot=_zero_shot(), retrieval=entry, vsepp=vsepp), workdir)
  assert results["zero_shot/chance"] == 10.0 and 0 <= results["zero_shot/top1"] <= 100
  assert results["retrieval/chance_r1"] == 6.25 and 0 <= results["retrieval/t2i_r1"] <= 100
  assert results["vsepp/chance_r1"] == 6.25 and np.isfinite(results["vsepp/train_loss"])


@pytest.mark.parametrize("method", ["virtex", "clip", "loctex"])
def test_vlrep_load_encodes_with_the_vit(method, vit_runs, photos):
  """vlrep.load: the pooled token and the patch grid are the ViT's (its own apply on the same pixels), and the text
  side (a tower's embeddings, a captioner's scores and captions) runs on them."""
  model = vlrep.load(vit_runs[method].workdir)
  features = model.encode_images(photos, features=("pooled", "grid"))
  assert features["pooled"].shape == (3, WIDTH) and features["grid"].shape == (3, GRID, GRID, WIDTH)
  run = runs.load_run(vit_runs[method].workdir)
  module, variables = runs.backbone_of(run)
  grid, aux = module.apply(variables, jnp.asarray(model.pixels(photos)), False)
  np.testing.assert_allclose(features["pooled"], aux["pre_logits"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(features["grid"], grid, rtol=1e-5, atol=1e-5)
  zs = model.zero_shot(photos, ["astronaut", "cat", "cup of coffee"], top_k=1)
  assert np.asarray(zs["scores"]).shape == (3, 3) and np.all(np.isfinite(zs["scores"]))
  if method == "virtex":
    captions = model.caption(photos, max_len=6)
    assert len(captions) == 3 and all(isinstance(c, str) for c in captions)
  else:
    assert model.encode_text(["a red circle.", "a cat."]).shape[0] == 2
    assert model.encode_images(photos, features=("embedding",))["embedding"].shape[0] == 3


def test_a_trained_vit_exports_to_timm_and_imports_back(vit_runs, photos, tmp_path):
  """`vlrep.interop.export --format=timm` of the VirTex run: timm's model built by the printed call strict-loads it
  and gives vlrep.load's features; `vlrep.interop.import_run --format=auto` reads it back to the same backbone."""
  workdir = vit_runs["virtex"].workdir
  out = str(tmp_path / "vit.safetensors")
  info = export.export(workdir, "timm", out)
  model = eval(info["timm_code"], {"timm": timm, "functools": functools}).eval()
  model.load_state_dict(load_file(out), strict=True)
  pixels = vlrep.load(workdir).pixels(photos)
  with torch.no_grad():
    tokens = model.forward_features(torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))))
    pooled = model.forward_head(tokens, pre_logits=True).numpy()
  want = vlrep.load(workdir).encode_images(photos, features=("pooled",))["pooled"]
  assert np.linalg.norm(pooled - want) / np.linalg.norm(want) < 2e-6
  imported = import_run.import_run("auto", out, str(tmp_path / "imported"))
  assert imported.note["format"] == "timm" and imported.note["settings_not_in_the_state_dict"]["num_heads"] == "given"
  original = runs.backbone_of(runs.load_run(workdir))[1]["params"]
  back = runs.backbone_of(runs.load_run(str(tmp_path / "imported")))[1]["params"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), back, original)


def test_loctex_refuses_trace_scales_a_vit_has_not(tmp_path):
  proc = run_main(
    tmp_path / "loctex_scales",
    "--config.method.scales=(1, 2)",
    "--config.method.grid_sizes=(4, 8)",
    config="tests/tiny_vit.py:loctex",
  )
  assert proc.returncode != 0
  assert "scales [2]" in proc.stderr and "a ViT supports scales [1] only" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("fmt, out", [("torchvision", "b.safetensors"), ("detectron2", "b.pkl"), ("backbone", "hand")])
def test_resnet_layout_exports_refuse_a_vit(fmt, out, vit_runs, tmp_path):
  with pytest.raises(NotExportable, match=r"supports ResNet backbones only, and this run's is a ViT.*--format=timm"):
    export.export(vit_runs["virtex"].workdir, fmt, str(tmp_path / out))
  assert not os.listdir(tmp_path)  # nothing written


def test_detection_transfer_refuses_a_vit_before_any_work(vit_runs, tmp_path, capsys):
  workdir = vit_runs["virtex"].workdir
  detection = config_module(os.path.join(ROOT, "configs", "eval", "x"), "detection.py")
  entry = detection.get_config("runlocal").evals
  name = next(iter(entry))
  cfg = entry[name]
  cfg.update(data_dir=D, config_name="tiny")
  with pytest.raises(UserError, match=r"(?s)this run's is a ViT.*C2\.\.C5.*ViTDet's simple feature pyramid"):
    evaluate.evaluate(ConfigDict({"evals": {name: cfg}}), workdir)
  # The Detectron2 driver: refused from the run's saved config, before Detectron2 is imported or anything written.
  yaml = tmp_path / "faster_rcnn.yaml"
  yaml.write_text("MODEL:\n  META_ARCHITECTURE: GeneralizedRCNN\n")
  assert detectron2_transfer.main([f"--workdir={workdir}", f"--config-file={yaml}"]) == 2
  err = capsys.readouterr().err
  assert "this run's is a ViT" in err and "ViTDet" in err, err
  assert not os.path.exists(os.path.join(workdir, "detectron2"))


def test_a_vit_with_14_pixel_patches_passes_the_backbone_check():
  """vlrep.evaluate and vlrep.load trace the saved backbone before reading images: at a side the patches divide (a
  ViT-L/14's 14 does not divide a ResNet's 64)."""
  section = vit.config_for("vit_ti14", width=32, depth=1, num_heads=2, mlp_dim=64)
  params = vit.from_config(section).init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)))["params"]
  config = ConfigDict({"method": {"name": "classifier", "num_classes": 3, "backbone": section}})
  run = runs.Run(config=config, params={"backbone": params}, model_state={}, step=0, path="/nowhere/0", meta={})
  inference.check_backbone(run)
  wrong = runs.Run(
    config=config, params={"backbone": {**params, "embedding": {}}}, model_state={}, step=0, path="/nowhere/0", meta={}
  )
  with pytest.raises(UserError, match="saved config does not build"):
    inference.check_backbone(wrong)
