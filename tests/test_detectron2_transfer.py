"""`python -m vlrep.tools.detectron2_transfer`: the papers' detection transfer through Detectron2.

Detectron2 is not on the package index, so CI has none: there the tests check the refusal (exit 2 with the install
instruction), the mapping of a run's backbone to Detectron2's ResNet keys, the input-convention check and the
command line's dataset specs. Where Detectron2 is installed (built from its source), the last tests build every
YAML of configs/detectron2/ through the driver and fine-tune a tiny ResNet-50 run end to end on a COCO-format set;
elsewhere they skip (docs/detectron2.md has the figures of a real run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from ml_collections import ConfigDict
from PIL import Image, ImageDraw

from vlrep.errors import UserError
from vlrep.tools import detectron2_transfer as d2t

HAVE_DETECTRON2 = d2t.detectron2_missing() is None
CONFIG_DIR = os.path.join(ROOT, "configs", "detectron2")
YAMLS = sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml") and not f.startswith("Base-"))


def _run_config(**backbone):
  return ConfigDict({"method": {"name": "virtex", "backbone": dict(dict(depth=50, width=64), **backbone)}})


def test_without_detectron2_the_command_exits_2_with_the_install_instruction(tmp_path):
  # Detectron2 hidden from the import system, whether or not this machine has it: what CI and a new user see.
  (tmp_path / "run").mkdir()
  code = (
    "import sys; sys.modules['detectron2'] = None\n"
    "from vlrep.tools import detectron2_transfer as d\n"
    f"sys.exit(d.main(['--workdir={tmp_path / 'run'}', '--config-file={CONFIG_DIR}/voc_faster_rcnn_R_50_C4_24k.yaml']))"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 2, proc.stderr
  assert "Detectron2 is not installed" in proc.stderr and "pip install --no-build-isolation -e ." in proc.stderr
  assert "Traceback" not in proc.stderr


def test_missing_run_or_config_file_and_odd_overrides_are_user_errors(tmp_path):
  assert d2t.main([f"--workdir={tmp_path / 'nope'}", f"--config-file={CONFIG_DIR}/{YAMLS[0]}"]) == 2
  assert d2t.main([f"--workdir={tmp_path}", "--config-file=/nonexistent.yaml"]) == 2
  with pytest.raises(UserError, match="KEY VALUE pairs"):
    d2t.parse_args([f"--workdir={tmp_path}", "--config-file=x.yaml", "SOLVER.MAX_ITER"])


def test_backbone_settings_follow_the_run_and_refuse_what_detectron2_cannot_build():
  assert d2t.backbone_settings(_run_config()) == {
    "MODEL.RESNETS.DEPTH": 50,
    "MODEL.RESNETS.STEM_OUT_CHANNELS": 64,
    "MODEL.RESNETS.RES2_OUT_CHANNELS": 256,
    "MODEL.RESNETS.WIDTH_PER_GROUP": 64,
  }
  # Wide ResNet-50-2: bottleneck inner width doubled, outputs unchanged (torchvision's wide_resnet50_2).
  wide = d2t.backbone_settings(_run_config(inner_multiplier=2))
  assert wide["MODEL.RESNETS.WIDTH_PER_GROUP"] == 128 and wide["MODEL.RESNETS.RES2_OUT_CHANNELS"] == 256
  assert d2t.backbone_settings(_run_config(depth=101, width=16))["MODEL.RESNETS.RES2_OUT_CHANNELS"] == 64
  assert d2t.backbone_settings(_run_config(depth=18))["MODEL.RESNETS.RES2_OUT_CHANNELS"] == 64
  with pytest.raises(UserError, match="stem='small'"):
    d2t.backbone_settings(_run_config(depth=10, width=16, stem="small"))
  with pytest.raises(UserError, match="depth 10"):
    d2t.backbone_settings(_run_config(depth=10))
  with pytest.raises(UserError, match="64 channels in res2"):
    d2t.backbone_settings(_run_config(depth=18, width=16))
  with pytest.raises(UserError, match="ResNet backbone"):
    d2t.backbone_settings(_run_config(arch="vgg16"))


def _cfg(fmt="RGB", mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375), stride_in_1x1=False):
  return {
    "INPUT": {"FORMAT": fmt},
    "MODEL": {"PIXEL_MEAN": list(mean), "PIXEL_STD": list(std), "RESNETS": {"STRIDE_IN_1X1": stride_in_1x1}},
  }


def test_input_convention_of_detectron2s_stock_configs_is_refused_naming_each_key():
  d2t.check_input_convention(_cfg())  # vlrep's Base-*-vlrep.yaml values pass
  # Detectron2's stock defaults (Base-RCNN-*.yaml on its MSRA weights): BGR, Caffe means, std 1, stride in 1x1.
  with pytest.raises(UserError) as e:
    d2t.check_input_convention(_cfg("BGR", (103.53, 116.28, 123.675), (1.0, 1.0, 1.0), True))
  for key in ("INPUT.FORMAT", "MODEL.PIXEL_MEAN", "MODEL.PIXEL_STD", "MODEL.RESNETS.STRIDE_IN_1X1"):
    assert key in str(e.value)
  with pytest.raises(UserError, match="MODEL.PIXEL_STD") as e:
    d2t.check_input_convention(_cfg(std=(1.0, 1.0, 1.0)))
  assert "INPUT.FORMAT is" not in str(e.value)  # only what is wrong is named


def test_dataset_specs(tmp_path):
  (tmp_path / "a.json").write_text("{}")
  name, kind, fields = d2t.parse_dataset(f"mine=coco:{tmp_path / 'a.json'}:{tmp_path}")
  assert (name, kind, fields) == ("mine", "coco", [str(tmp_path / "a.json"), str(tmp_path)])
  assert d2t.parse_dataset(f"v=voc:{tmp_path}:trainval:2007") == ("v", "voc", [str(tmp_path), "trainval", "2007"])
  for bad in ("mine", "mine=yolo:a:b", f"mine=coco:{tmp_path / 'a.json'}", f"v=voc:{tmp_path}:trainval"):
    with pytest.raises(UserError, match="expected NAME=coco"):
      d2t.parse_dataset(bad)
  with pytest.raises(UserError, match="does not exist"):
    d2t.parse_dataset(f"mine=coco:{tmp_path / 'missing.json'}:{tmp_path}")


def test_results_become_flat_summary_keys():
  results = {"mine_val": {"bbox": {"AP": 12.5, "AP50": 30.0, "AP-square": float("nan")}, "segm": {"AP": 9.0}}}
  values = d2t.summary_values("coco_mask_rcnn_R_50_FPN_2x", results)
  assert values["detectron2/coco_mask_rcnn_R_50_FPN_2x/mine_val/bbox/AP50"] == 30.0
  assert values["detectron2/coco_mask_rcnn_R_50_FPN_2x/mine_val/segm/AP"] == 9.0
  assert len(values) == 3  # NaN (no instance of that size) left out


# ---------------------------------------------------------------------------------------------------- #
# With Detectron2 installed (built from its source): the real thing. Skipped where it is not (CI).
# ---------------------------------------------------------------------------------------------------- #

needs_detectron2 = pytest.mark.skipif(not HAVE_DETECTRON2, reason="Detectron2 is not installed (built from source)")


def _shapes_coco(folder, n: int, seed: int) -> str:
  """n 96x128 RGB images with 1-3 filled rectangles each (2 categories), as a COCO instances file; returns it."""
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  images, annotations = [], []
  for i in range(n):
    image = Image.new("RGB", (128, 96), tuple(int(v) for v in rng.integers(0, 80, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(1, 4))):
      w, h = int(rng.integers(16, 48)), int(rng.integers(16, 40))
      x, y = int(rng.integers(0, 128 - w)), int(rng.integers(0, 96 - h))
      cat = int(rng.integers(1, 3))
      draw.rectangle([x, y, x + w - 1, y + h - 1], fill=(230, 40, 40) if cat == 1 else (40, 40, 230))
      poly = [x, y, x + w, y, x + w, y + h, x, y + h]
      annotations.append(
        dict(id=len(annotations) + 1, image_id=i + 1, category_id=cat, bbox=[x, y, w, h], area=w * h,
             segmentation=[poly], iscrowd=0)
      )  # fmt: skip
    image.save(os.path.join(folder, f"{i}.png"))
    images.append(dict(id=i + 1, file_name=f"{i}.png", width=128, height=96))
  path = os.path.join(folder, "instances.json")
  with open(path, "w") as f:
    json.dump(
      dict(images=images, annotations=annotations, categories=[dict(id=1, name="red"), dict(id=2, name="blue")]), f
    )
  return path


@needs_detectron2
@pytest.mark.parametrize("yaml", YAMLS)
def test_every_shipped_config_builds_its_model_through_the_driver(yaml, tmp_path):
  from detectron2.modeling import build_model

  args = d2t.parse_args([f"--workdir={tmp_path}", f"--config-file={CONFIG_DIR}/{yaml}"])
  d2t.register([])
  cfg = d2t.build_config(args, _run_config(width=16), world_size=1, cuda=False)
  assert cfg.MODEL.RESNETS.NORM == "BN" and cfg.TEST.PRECISE_BN.NUM_ITER <= cfg.SOLVER.MAX_ITER
  model = build_model(cfg)
  names = dict(model.named_modules())
  assert names["backbone.bottom_up.stem.conv1" if "FPN" in yaml else "backbone.stem.conv1"].out_channels == 16
  if "extra_bn" in yaml or "subset" in yaml:  # LocTex: the res5 stage of the ROI head ends with its extra norm
    assert "roi_heads.res5.norm" in names


def _driver(args):
  """The driver in a fresh interpreter, as a user runs it (not forked from the test's command server: torch
  imported after that server's TensorFlow crashes the process)."""
  env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  cmd = [sys.executable, "-m", "vlrep.tools.detectron2_transfer", *args]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@needs_detectron2
def test_a_tiny_resnet50_run_fine_tunes_and_its_metrics_reach_the_summary(tmp_path):
  from conftest import run_main

  run = tmp_path / "run"
  proc = run_main(
    run,
    "--config.method.backbone.stem=imagenet",
    "--config.method.backbone.depth=50",
    "--config.method.backbone.width=8",
    "--config.total_steps=2",
    "--config.evals={}",
    "--config.best_metric=",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  train = _shapes_coco(str(tmp_path / "train"), 8, 0)
  val = _shapes_coco(str(tmp_path / "val"), 4, 1)
  args = [
    f"--workdir={run}",
    f"--config-file={CONFIG_DIR}/coco_mask_rcnn_R_50_FPN_2x.yaml",
    f"--dataset=shapes_train=coco:{train}:{tmp_path / 'train'}",
    f"--dataset=shapes_val=coco:{val}:{tmp_path / 'val'}",
    "--train=shapes_train",
    "--test=shapes_val",
    "--num-workers=0",
    *("SOLVER.MAX_ITER 4 SOLVER.STEPS (3,) SOLVER.IMS_PER_BATCH 2 SOLVER.BASE_LR 0.002 SOLVER.WARMUP_ITERS 1").split(),
    *("INPUT.MIN_SIZE_TRAIN (96,) INPUT.MIN_SIZE_TEST 96 MODEL.ROI_HEADS.NUM_CLASSES 2 TEST.EVAL_PERIOD 0").split(),
  ]
  proc = _driver(args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((run / "summary.json").read_text())
  key = "detectron2/coco_mask_rcnn_R_50_FPN_2x/bbox/AP"
  assert key in summary and np.isfinite(summary[key]), sorted(summary)
  assert not [k for k in summary if "/AP-" in k]  # per-class APs only in transfer_results.json
  results = json.loads((run / "detectron2" / "coco_mask_rcnn_R_50_FPN_2x" / "transfer_results.json").read_text())
  assert "detectron2/coco_mask_rcnn_R_50_FPN_2x/bbox/AP-red" in results
  out = run / "detectron2" / "coco_mask_rcnn_R_50_FPN_2x"
  assert (out / "backbone.pkl").exists() and (out / "model_final.pth").exists()
  assert (out / "log.txt").read_text().count("Total inference time") == 1  # the final model evaluated once
  # Rerunning resumes at the end (no export, no training) and evaluates again.
  again = _driver(args)
  assert again.returncode == 0 and "Resuming at iteration" in again.stdout + again.stderr


def test_rle_masks_of_a_command_line_set_are_detected(tmp_path):
  images = tmp_path / "images"
  images.mkdir()
  for name, segmentation in (("poly", [[0, 0, 4, 0, 4, 4]]), ("rle", {"size": [8, 8], "counts": "0`0"})):
    (tmp_path / f"{name}.json").write_text(json.dumps({"annotations": [{"segmentation": segmentation}]}))
  specs = [f"p=coco:{tmp_path / 'poly.json'}:{images}", f"r=coco:{tmp_path / 'rle.json'}:{images}"]
  assert not d2t.uses_rle_masks(specs, ("p",))
  assert d2t.uses_rle_masks(specs, ("p", "r"))
  assert not d2t.uses_rle_masks(specs, ("coco_2017_train",))  # Detectron2's own sets: polygons, left as they are


def test_the_random_init_baseline_has_its_own_output_folder_and_keys(tmp_path):
  run = d2t.parse_args([f"--workdir={tmp_path}", "--config-file=configs/detectron2/voc.yaml"])
  random = d2t.parse_args([f"--workdir={tmp_path}", "--config-file=configs/detectron2/voc.yaml", "--weights=random"])
  assert d2t.output_dir(run) == str(tmp_path / "detectron2" / "voc")
  assert d2t.output_dir(random) == str(tmp_path / "detectron2" / "voc_random")  # never resumes the run's training
  assert d2t.result_name(random) == "voc_random"
