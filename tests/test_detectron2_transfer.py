"""`python -m vlrep.pytorch.detectron2_transfer`: the papers' detection transfer through Detectron2.

Detectron2 is not on the package index, so CI has none: there the tests check the refusal (exit 2 with the install
instruction), the mapping of a run's backbone to Detectron2's ResNet keys, the input-convention check, the command
line's dataset specs, the hand-off the driver builds Detectron2's weights from, and AP 0 for a detector that made no
predictions. Where Detectron2 is installed (built from its source), the last tests build every
YAML of configs/detectron2/ through the driver and fine-tune a tiny ResNet-50 run end to end on a COCO-format set;
elsewhere they skip (docs/detectron2.md has the figures of a real run).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from PIL import Image, ImageDraw
from safetensors.numpy import save_file

from vlrep import safe_files
from vlrep.errors import BadFile, UserError
from vlrep.pytorch import detectron2_keys, handoff
from vlrep.pytorch import detectron2_transfer as d2t

HAVE_DETECTRON2 = d2t.detectron2_missing() is None
CONFIG_DIR = os.path.join(ROOT, "configs", "detectron2")
YAMLS = sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml") and not f.startswith("Base-"))


def _arch(**changes):
  """backbone.json's architecture (vlrep.pytorch.resnet.ResNet's arguments) of a ResNet-50, with `changes`."""
  return {"depth": 50, "width": 64, "inner_multiplier": 1, "stem": "imagenet", "stem_stride": 2, **changes}


def test_without_detectron2_the_command_exits_2_with_the_install_instruction(tmp_path):
  # Detectron2 hidden from the import system, whether or not this machine has it: what CI and a new user see.
  (tmp_path / "run").mkdir()
  code = (
    "import sys; sys.modules['detectron2'] = None\n"
    "from vlrep.pytorch import detectron2_transfer as d\n"
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
  assert d2t.backbone_settings(_arch()) == {
    "MODEL.RESNETS.DEPTH": 50,
    "MODEL.RESNETS.STEM_OUT_CHANNELS": 64,
    "MODEL.RESNETS.RES2_OUT_CHANNELS": 256,
    "MODEL.RESNETS.WIDTH_PER_GROUP": 64,
  }
  # Wide ResNet-50-2: bottleneck inner width doubled, outputs unchanged (torchvision's wide_resnet50_2).
  wide = d2t.backbone_settings(_arch(inner_multiplier=2))
  assert wide["MODEL.RESNETS.WIDTH_PER_GROUP"] == 128 and wide["MODEL.RESNETS.RES2_OUT_CHANNELS"] == 256
  assert d2t.backbone_settings(_arch(depth=101, width=16))["MODEL.RESNETS.RES2_OUT_CHANNELS"] == 64
  assert d2t.backbone_settings(_arch(depth=18))["MODEL.RESNETS.RES2_OUT_CHANNELS"] == 64
  with pytest.raises(UserError, match="stem='small'"):
    d2t.backbone_settings(_arch(depth=10, width=16, stem="small"))
  with pytest.raises(UserError, match="depth 10"):
    d2t.backbone_settings(_arch(depth=10))
  with pytest.raises(UserError, match="64 channels in res2"):
    d2t.backbone_settings(_arch(depth=18, width=16))


def test_the_driver_builds_detectron2_weights_from_the_runs_exported_hand_off(tiny_virtex_run, tmp_path):
  # The driver's own path without Detectron2: the export command into OUTPUT_DIR, the record, backbone.json's
  # architecture and the weights Detectron2 would get (its ResNet names, the values of the hand-off's tensors).
  out = tmp_path / "run_out"
  d2t.export_backbone(str(tiny_virtex_run.workdir), "latest", str(out))
  for name in d2t.HANDOFF_FILES:
    d2t.record_written(str(out), name, str(tmp_path))
  arch = d2t.read_handoff(str(out))["architecture"]
  assert set(arch) == set(handoff.ARCHITECTURE_KEYS) and arch["stem"] == "small"  # the tiny recipe's backbone
  with pytest.raises(UserError, match="stem='small'"):  # which Detectron2's ResNet cannot build: refused
    d2t.backbone_settings(arch)
  torchvision_weights = handoff.read_weights(str(out))
  weights = d2t.load_for_detectron2(str(out / handoff.HANDOFF_WEIGHTS), str(out))
  assert weights["matching_heuristics"] and str(tiny_virtex_run.workdir) in weights["__author__"]
  np.testing.assert_array_equal(weights["model"]["stem.conv1.weight"], torchvision_weights["conv1.weight"])
  np.testing.assert_array_equal(
    weights["model"]["res2.0.conv1.norm.running_mean"], torchvision_weights["layer1.0.bn1.running_mean"]
  )
  counters = [k for k in torchvision_weights if k.endswith("num_batches_tracked")]
  assert counters and len(weights["model"]) == len(torchvision_weights) - len(counters)


def test_a_failed_export_of_the_hand_off_is_one_user_error(tmp_path):
  # What the export refuses (no run, no checkpoint, a VGG16 backbone) reaches the user as its own message.
  with pytest.raises(UserError, match=r"Exporting .*nope's backbone failed \(exit 2\)"):
    d2t.export_backbone(str(tmp_path / "nope"), "best", str(tmp_path / "out"))
  assert not (tmp_path / "out" / handoff.HANDOFF_WEIGHTS).exists()


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
  cfg = d2t.build_config(args, world_size=1, cuda=False)
  d2t.set_backbone(cfg, _arch(width=16))
  assert cfg.MODEL.RESNETS.NORM == "BN" and cfg.TEST.PRECISE_BN.NUM_ITER <= cfg.SOLVER.MAX_ITER
  model = build_model(cfg)
  names = dict(model.named_modules())
  assert names["backbone.bottom_up.stem.conv1" if "FPN" in yaml else "backbone.stem.conv1"].out_channels == 16
  if "extra_bn" in yaml or "subset" in yaml:  # LocTex: the res5 stage of the ROI head ends with its extra norm
    assert "roi_heads.res5.norm" in names


@needs_detectron2
def test_a_config_with_python_tags_is_refused_not_run(tmp_path):
  # Detectron2's merge_from_file retries such a YAML with yaml.unsafe_load unless told not to.
  marker = tmp_path / "ran"
  yaml_file = tmp_path / "evil.yaml"
  yaml_file.write_text(
    f"_BASE_: {CONFIG_DIR}/{YAML}.yaml\nSOLVER:\n  MAX_ITER: !!python/object/apply:os.system ['touch {marker}']\n"
  )
  args = d2t.parse_args([f"--workdir={tmp_path}", f"--config-file={yaml_file}"])
  with pytest.raises(UserError, match="not a plain YAML config"):
    d2t.build_config(args, world_size=1, cuda=False)
  assert not marker.exists()


def _driver(args):
  """The driver in a fresh interpreter, as a user runs it (not forked from the test's command server: torch
  imported after that server's TensorFlow crashes the process)."""
  env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  cmd = [sys.executable, "-m", "vlrep.pytorch.detectron2_transfer", *args]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def _tiny_resnet50_transfer(tmp_path, *overrides: str):
  """A 2-step ResNet-50 (width 8) run and the driver's arguments that fine-tune its COCO FPN Mask R-CNN for 4
  iterations on 8 shapes images and test it on 4 (`overrides`: Detectron2 config keys and values added)."""
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
    *overrides,
  ]
  return run, args


@needs_detectron2
def test_a_detector_without_predictions_is_ap_0_through_real_detectron2(tmp_path, caplog):
  """The issue's case with Detectron2 itself: a detector whose every score is below the test threshold ("No
  predictions from the model!", NaN APs from Detectron2) is AP 0 in transfer_results.json and summary.json, and
  the driver says so."""
  run, args = _tiny_resnet50_transfer(tmp_path, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "1.01")
  proc = _driver(args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "made no predictions on shapes_val (bbox)" in proc.stdout + proc.stderr
  summary = json.loads((run / "summary.json").read_text())
  for task in ("bbox", "segm"):
    assert summary[f"detectron2/coco_mask_rcnn_R_50_FPN_2x/{task}/AP"] == 0.0, sorted(summary)
    assert summary[f"detectron2/coco_mask_rcnn_R_50_FPN_2x/{task}/AP50"] == 0.0


@needs_detectron2
def test_a_tiny_resnet50_run_fine_tunes_and_its_metrics_reach_the_summary(tmp_path):
  run, args = _tiny_resnet50_transfer(tmp_path)
  proc = _driver(args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((run / "summary.json").read_text())
  key = "detectron2/coco_mask_rcnn_R_50_FPN_2x/bbox/AP"
  assert key in summary and np.isfinite(summary[key]), sorted(summary)
  assert not [k for k in summary if "/AP-" in k]  # per-class APs only in transfer_results.json
  results = json.loads((run / "detectron2" / "coco_mask_rcnn_R_50_FPN_2x" / "transfer_results.json").read_text())
  assert "detectron2/coco_mask_rcnn_R_50_FPN_2x/bbox/AP-red" in results
  out = run / "detectron2" / "coco_mask_rcnn_R_50_FPN_2x"
  assert (out / "backbone.safetensors").exists() and (out / "model_final.pth").exists()
  assert handoff.read_info(str(out))["architecture"] == _arch(width=8)
  assert (out / "log.txt").read_text().count("Total inference time") == 1  # the final model evaluated once
  # What the driver wrote is recorded with its sha256; the weights Detectron2 loaded were read by the driver.
  files = json.loads((out / d2t.MANIFEST).read_text())["files"]
  assert (
    set(files) == {"backbone.safetensors", "backbone.json", "model_final.pth"}
    and (out / "last_checkpoint").read_text() == "model_final.pth"
  )
  assert files["model_final.pth"] == safe_files.sha256_of(str(out / "model_final.pth"))
  # Rerunning resumes at the end (no export, no training) and evaluates again.
  again = _driver(args)
  assert again.returncode == 0 and "Resuming at iteration" in again.stdout + again.stderr
  # The checkpoint swapped for a payload, its record forged to match: refused, nothing run.
  import hashlib

  marker = tmp_path / "ran"
  _, pth = _payload_files(tmp_path / "payload", marker)
  os.replace(pth, out / "model_final.pth")
  files["model_final.pth"] = hashlib.sha256((out / "model_final.pth").read_bytes()).hexdigest()
  (out / d2t.MANIFEST).write_text(json.dumps({"files": files}))
  planted = _driver(args)
  assert planted.returncode == 2 and "asks for builtins.exec" in planted.stderr and not marker.exists()


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


# ---------------------------------------------------------------------------------------------------- #
# A run folder from someone else: the driver resumes and loads only what it wrote (no Detectron2 needed).
# ---------------------------------------------------------------------------------------------------- #

YAML = "voc_faster_rcnn_R_50_C4_24k"


class _Payload:
  """Pickled as `exec(code)`: what a plain pickle.load (Detectron2's for .pkl) or torch.load(weights_only=False)
  would run."""

  def __init__(self, marker):
    self.code = f"open({str(marker)!r}, 'w').close()"

  def __reduce__(self):
    return (exec, (self.code,))


def _payload_files(folder, marker):
  """A pickle (.pkl) and a torch.save file (.pth), each of which creates `marker` when loaded without restriction."""
  import pickle

  import torch

  folder.mkdir(parents=True, exist_ok=True)
  pkl, pth = folder / "evil.pkl", folder / "evil.pth"
  pkl.write_bytes(pickle.dumps({"model": {}, "__author__": "x", "p": _Payload(marker)}))
  torch.save({"model": {}, "p": _Payload(marker)}, pth)
  return pkl, pth


def test_the_payloads_run_code_when_loaded_without_restriction(tmp_path):
  # The attack is real: loaded as Detectron2 loads them (plain pickle; torch.load without weights_only), they run.
  import pickle

  import torch

  pkl, pth = _payload_files(tmp_path / "p", tmp_path / "ran")
  with open(pkl, "rb") as f:
    pickle.load(f)
  assert (tmp_path / "ran").exists()
  (tmp_path / "ran").unlink()
  torch.load(pth, weights_only=False)
  assert (tmp_path / "ran").exists()


def _refused(run, capsys, monkeypatch, *extra):
  """The driver's main on `run` (Detectron2 hidden, as in CI): its exit status and stderr."""
  monkeypatch.setitem(sys.modules, "detectron2", None)
  code = d2t.main([f"--workdir={run}", f"--config-file={CONFIG_DIR}/{YAML}.yaml", *extra])
  return code, capsys.readouterr().err


def _record(out, files):
  (out / d2t.MANIFEST).write_text(json.dumps({"files": files}))


def test_a_last_checkpoint_the_driver_did_not_write_is_refused_before_detectron2(tmp_path, capsys, monkeypatch):
  import hashlib

  marker = tmp_path / "ran"
  run = tmp_path / "run"
  out = run / "detectron2" / YAML
  pkl, pth = _payload_files(out, marker)
  outside_pkl, _ = _payload_files(tmp_path / "elsewhere", marker)
  sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
  final = out / "model_final.pth"
  cases = {
    "a .pkl beside it": ("evil.pkl", None, "resumes only the checkpoints it writes"),
    "a path outside": (str(outside_pkl), None, "resumes only the checkpoints it writes"),
    "a path up": ("../../../elsewhere/evil.pkl", None, "resumes only the checkpoints it writes"),
    "a checkpoint name, no record": ("model_final.pth", None, "was not written by the Detectron2 driver"),
    "a checkpoint name, recorded with another hash": ("model_final.pth", "0" * 64, "sha256 is"),
    # The record is in the run folder too: a forged one with the payload's own hash still loads nothing.
    "a checkpoint name, a forged record": ("model_final.pth", "forged", "asks for builtins.exec"),
  }
  for case, (name, recorded, message) in cases.items():
    final.write_bytes(pth.read_bytes())
    (out / d2t.MANIFEST).unlink(missing_ok=True)
    if recorded:
      _record(out, {"model_final.pth": sha(final) if recorded == "forged" else recorded})
    (out / "last_checkpoint").write_text(name)
    code, err = _refused(run, capsys, monkeypatch)
    assert code == 2, case
    assert message in err, (case, err)
    named = str(final) if name == "model_final.pth" else str(out / "last_checkpoint")
    assert named in err and "Detectron2 is not installed" not in err, (case, err)
    assert not marker.exists(), case
  # A last_checkpoint that is itself a link (to a file naming the payload) is refused as well.
  (out / "last_checkpoint").unlink()
  (tmp_path / "names").write_text(str(pkl))
  os.symlink(tmp_path / "names", out / "last_checkpoint")
  code, err = _refused(run, capsys, monkeypatch)
  assert code == 2 and f"{out / 'last_checkpoint'} is a symlink" in err and not marker.exists()


def test_links_in_or_above_the_output_folder_are_refused_before_detectron2(tmp_path, capsys, monkeypatch):
  victim = tmp_path / "bashrc"
  victim.write_text("keep me")
  run = tmp_path / "run"
  out = run / "detectron2" / YAML
  out.mkdir(parents=True)
  os.symlink(victim, out / "log.txt")  # Detectron2 appends its log there by name
  code, err = _refused(run, capsys, monkeypatch)
  assert code == 2 and str(out / "log.txt") in err and "symlink" in err
  (out / "log.txt").unlink()
  os.symlink(victim, out / "inference")
  code, err = _refused(run, capsys, monkeypatch)
  assert code == 2 and str(out / "inference") in err
  # The folder between the run and OUTPUT_DIR a link elsewhere: nothing may be written through it.
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (out / "inference").unlink()
  os.rename(run / "detectron2", elsewhere / "detectron2")
  os.symlink(elsewhere / "detectron2", run / "detectron2")
  code, err = _refused(run, capsys, monkeypatch)
  assert code == 2 and str(run / "detectron2") in err and "symlink" in err
  assert victim.read_text() == "keep me"
  (run / "detectron2").unlink()
  (run / "detectron2").write_text("")
  code, err = _refused(run, capsys, monkeypatch)
  assert code == 2 and f"{run / 'detectron2'} is a file" in err
  # A fresh output folder passes these checks and reaches the install instruction (CI has no Detectron2).
  code, err = _refused(run, capsys, monkeypatch, f"--output-dir={tmp_path / 'fresh'}")
  assert code == 2 and "Detectron2 is not installed" in err


def test_the_command_refuses_a_planted_checkpoint_with_one_message(tmp_path):
  marker = tmp_path / "ran"
  run = tmp_path / "run"
  out = run / "detectron2" / YAML
  _, pth = _payload_files(out, marker)
  os.rename(pth, out / "model_0000999.pth")
  (out / "last_checkpoint").write_text("model_0000999.pth")
  code = (
    "import sys; sys.modules['detectron2'] = None\n"
    "from vlrep.pytorch import detectron2_transfer as d\n"
    f"sys.exit(d.main(['--workdir={run}', '--config-file={CONFIG_DIR}/{YAML}.yaml']))"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.startswith("ERROR: ") and str(out / "model_0000999.pth") in proc.stderr
  assert "Traceback" not in proc.stderr and not marker.exists()


def _checkpoint_as_detectron2_saves_it():
  """What Detectron2's trainer saves: the model's state dict (an OrderedDict with _metadata), the trainer's state
  (iteration, the optimizer's, the LR scheduler hook's) and the iteration."""
  import torch

  model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  model(torch.randn(2, 3, 8, 8)).sum().backward()
  optimizer.step()
  trainer = {
    "iteration": 3,
    "hooks": {"LRScheduler": {"base_lrs": [0.1, 0.1], "last_epoch": 4}},
    "optimizer": optimizer.state_dict(),
  }
  return {"model": model.state_dict(), "trainer": trainer, "iteration": 3}


def test_what_the_driver_wrote_resumes_through_the_restricted_unpickler(tmp_path):

  import torch

  run = tmp_path / "run"
  out = run / "detectron2" / YAML
  out.mkdir(parents=True)
  args = d2t.parse_args([f"--workdir={run}", f"--config-file={CONFIG_DIR}/{YAML}.yaml"])
  assert d2t.check_output(args, keep=False) is None  # nothing to resume: a fresh start
  saved = _checkpoint_as_detectron2_saves_it()
  torch.save(saved, out / "model_0000003.pth")
  d2t.record_written(str(out), "model_0000003.pth", str(run))
  _handoff(out)
  for name in d2t.HANDOFF_FILES:
    d2t.record_written(str(out), name, str(run))
  (out / "last_checkpoint").write_text("model_0000003.pth")
  assert set(json.loads((out / d2t.MANIFEST).read_text())["files"]) == {
    "backbone.safetensors",
    "backbone.json",
    "model_0000003.pth",
  }

  path = d2t.check_output(args, keep=True)
  assert path == str(out / "model_0000003.pth") and path in d2t._READ
  loaded = d2t.load_for_detectron2(path, str(out))
  assert path not in d2t._READ  # handed over once
  for key, value in saved["model"].items():
    assert torch.equal(loaded["model"][key], value), key
  assert loaded["model"]._metadata == saved["model"]._metadata  # module versions, for load_state_dict
  state = loaded["trainer"]["optimizer"]["state"][0]["momentum_buffer"]
  assert isinstance(state, torch.Tensor) and torch.equal(
    state, saved["trainer"]["optimizer"]["state"][0]["momentum_buffer"]
  )
  assert loaded["trainer"]["hooks"] == saved["trainer"]["hooks"] and loaded["iteration"] == 3
  # The optimizer takes the state back, as Detectron2's trainer gives it.
  model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
  torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(loaded["trainer"]["optimizer"])
  # The hand-off's weights as Detectron2 loads a model zoo .pkl: its ResNet names, numpy, matching heuristics on.
  backbone = d2t.load_for_detectron2(str(out / "backbone.safetensors"), str(out))
  assert backbone["matching_heuristics"] is True and backbone["__author__"] == "vlrep (a test)"
  np.testing.assert_array_equal(backbone["model"]["stem.conv1.weight"], np.full((2, 3, 1, 1), 2, np.float32))
  np.testing.assert_array_equal(backbone["model"]["res2.0.conv1.norm.running_var"], np.arange(2, dtype=np.float32))
  assert set(backbone["model"]) == {"stem.conv1.weight", "stem.conv1.norm.weight", "res2.0.conv1.norm.running_var"}

  # Anything else Detectron2 might be asked to load is refused: another folder, another name, a changed file.
  for name in ("evil.pkl", "backbone.pkl", "model_final.pth"):
    (out / name).write_bytes(b"x")
  for name in ("evil.pkl", "backbone.pkl", "backbone.json"):  # a .pkl (plain pickle.load in Detectron2) never
    with pytest.raises(UserError, match="hands it only the files it wrote"):
      d2t.load_for_detectron2(str(out / name), str(out))
  with pytest.raises(UserError, match="hands it only the files it wrote"):
    d2t.load_for_detectron2(str(tmp_path / "backbone.safetensors"), str(out))
  with pytest.raises(UserError, match="was not written by the Detectron2 driver"):
    d2t.load_for_detectron2(str(out / "model_final.pth"), str(out))
  for name in d2t.HANDOFF_FILES:  # either file of the hand-off changed since it was recorded
    original = (out / name).read_bytes()
    with open(out / name, "ab") as f:
      f.write(b" ")
    with pytest.raises(UserError, match=f"{name}.*sha256 is"):
      d2t.load_for_detectron2(str(out / "backbone.safetensors"), str(out))
    (out / name).write_bytes(original)
  assert d2t.read_handoff(str(out))["architecture"] == _arch(width=2)


def _handoff(out, weights=None, architecture=None):
  """A hand-off as `vlrep.interop.export --format=backbone` writes it: backbone.safetensors (torchvision names) and
  backbone.json."""
  out.mkdir(parents=True, exist_ok=True)
  weights = weights or {
    "conv1.weight": np.full((2, 3, 1, 1), 2, np.float32),
    "bn1.weight": np.ones(2, np.float32),
    "layer1.0.bn1.running_var": np.arange(2, dtype=np.float32),
    "layer1.0.bn1.num_batches_tracked": np.array(5, np.int64),
  }
  save_file(weights, str(out / handoff.HANDOFF_WEIGHTS), metadata={"format": "pt"})
  info = {"architecture": architecture or _arch(width=2), "source": "a test"}
  (out / handoff.HANDOFF_INFO).write_text(json.dumps(info))


def test_a_planted_backbone_with_a_forged_record_loads_nothing(tmp_path):
  import hashlib

  marker = tmp_path / "ran"
  out = tmp_path / "out"
  pkl, _ = _payload_files(out, marker)
  # The payload pickle under the weights' name, its record forged to match: read as safetensors, no pickle run.
  os.rename(pkl, out / "backbone.safetensors")
  _handoff(tmp_path / "elsewhere")
  os.rename(tmp_path / "elsewhere" / "backbone.json", out / "backbone.json")
  sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
  _record(out, {n: sha(out / n) for n in d2t.HANDOFF_FILES})
  with pytest.raises(BadFile, match=r"backbone.safetensors"):
    d2t.load_for_detectron2(str(out / "backbone.safetensors"), str(out))
  assert not marker.exists()
  # A backbone.pkl of the old driver's record is not a file this driver hands over.
  _record(out, {"backbone.pkl": "0" * 64})
  with pytest.raises(UserError, match=d2t.MANIFEST):
    d2t.load_for_detectron2(str(out / "backbone.safetensors"), str(out))
  # A malformed record is one message naming it.
  (out / d2t.MANIFEST).write_text('{"files": {"../x": "0"}}')
  with pytest.raises(UserError, match=d2t.MANIFEST):
    d2t.load_for_detectron2(str(out / "backbone.safetensors"), str(out))


def test_the_hand_off_description_is_checked(tmp_path):
  out = tmp_path / "out"
  _handoff(out)
  assert handoff.read_info(str(out)) == {"architecture": _arch(width=2), "source": "a test"}
  bad = {
    "not JSON": "{",
    "a list": "[]",
    "no architecture": '{"source": "x"}',
    "a key missing": json.dumps({"architecture": {k: v for k, v in _arch().items() if k != "stem"}}),
    "an extra key": json.dumps({"architecture": {**_arch(), "arch": "vgg16"}}),
    "a wrong type": json.dumps({"architecture": _arch(depth="50")}),
    "a bool for an int": json.dumps({"architecture": _arch(width=True)}),
  }
  for case, text in bad.items():
    (out / handoff.HANDOFF_INFO).write_text(text)
    with pytest.raises(BadFile, match="backbone.json"):
      handoff.read_info(str(out))
      pytest.fail(case)


def test_detectron2_names_of_the_hand_off_weights():
  torchvision_names = {
    "conv1.weight": "stem.conv1.weight",
    "bn1.running_mean": "stem.conv1.norm.running_mean",
    "layer1.0.conv2.weight": "res2.0.conv2.weight",
    "layer1.0.bn3.bias": "res2.0.conv3.norm.bias",
    "layer4.2.downsample.0.weight": "res5.2.shortcut.weight",
    "layer4.2.downsample.1.running_var": "res5.2.shortcut.norm.running_var",
  }
  renamed = detectron2_keys.detectron2_state_dict(
    {**{k: k for k in torchvision_names}, "layer1.0.bn1.num_batches_tracked": 0, "fc.weight": 0}
  )
  assert renamed == {d2: tv for tv, d2 in torchvision_names.items()}  # counters and a classifier left out


# ---------------------------------------------------------------------------------------------------- #
# A detector that makes no predictions (Detectron2: "No predictions from the model!", every metric NaN).
# ---------------------------------------------------------------------------------------------------- #

NAN = float("nan")


def test_no_predictions_is_ap_0_and_says_so_while_a_size_without_ground_truth_stays_absent(caplog):
  # Detectron2's COCOEvaluator with no detection: every metric NaN and no per-class AP, for bbox and segm.
  nothing = {m: NAN for m in d2t.COCO_METRICS}
  results = {"bbox": dict(nothing), "segm": dict(nothing)}
  with caplog.at_level("WARNING"):
    scored = d2t.with_no_predictions_scored(results, ["shapes_val"], ("bbox", "segm"), lambda name: {"APs", "APm"})
  for task in ("bbox", "segm"):
    assert scored[task] == {"AP": 0.0, "AP50": 0.0, "AP75": 0.0, "APs": 0.0, "APm": 0.0}  # no large object: no APl
  assert caplog.text.count("made no predictions on shapes_val") == 2 and "(segm)" in caplog.text
  values = d2t.summary_values("coco_mask_rcnn_R_50_FPN_2x", scored)
  assert values["detectron2/coco_mask_rcnn_R_50_FPN_2x/bbox/AP"] == 0.0 and len(values) == 10

  # A detector that predicts: NaN stays only where Detectron2 means "undefined" (a size, a class without objects).
  made = {"bbox": {"AP": 12.5, "AP50": 30.0, "AP75": 10.0, "APs": NAN, "APm": 5.0, "APl": 20.0, "AP-red": NAN}}
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert d2t.with_no_predictions_scored(made, ["v"], ("bbox",), lambda name: {"APm", "APl"}) == made
  assert "no predictions" not in caplog.text
  # Several test sets ({dataset: {task: metrics}}): only the one without predictions is scored 0; an evaluator
  # that returned nothing at all for it ({}) gets the tasks it scores.
  several = {"a": made, "b": {}}
  scored = d2t.with_no_predictions_scored(several, ["a", "b"], ("bbox",), lambda name: {"APs", "APm", "APl"})
  assert scored["a"] == made and scored["b"] == {"bbox": {m: 0.0 for m in d2t.COCO_METRICS}}
  # A test set without ground truth has no AP to give: left as Detectron2 reports it (absent from the summary).
  assert d2t.with_no_predictions_scored(results, ["v"], ("bbox", "segm"), lambda name: set()) == results
  assert d2t.summary_values("x", results) == {}


def test_the_size_ranges_with_ground_truth_are_cocoevals():
  def box(area, **extra):
    return {"area": area, "bbox": [0, 0, 1, 1], **extra}

  assert d2t.sizes_with_ground_truth([box(100)]) == {"APs"}
  assert d2t.sizes_with_ground_truth([box(32**2)]) == {"APs", "APm"}  # COCOeval's bounds are inclusive
  assert d2t.sizes_with_ground_truth([box(5000), box(10**5)]) == {"APm", "APl"}
  assert d2t.sizes_with_ground_truth([box(100, iscrowd=1)]) == set()  # crowds are not ground truth to COCOeval
  assert d2t.sizes_with_ground_truth([{"bbox": [0, 0, 100, 100]}]) == {"APl"}  # no area: the box's
  assert d2t.sizes_with_ground_truth([]) == set()


class _Cfg(dict):
  """A stand-in for Detectron2's CfgNode: attribute access to nested dicts, YAML merge, KEY VALUE pairs."""

  def __getattr__(self, key):
    try:
      return self[key]
    except KeyError as e:
      raise AttributeError(key) from e

  def __setattr__(self, key, value):
    self[key] = value

  def merge_from_file(self, path, allow_unsafe=False):
    import yaml

    assert allow_unsafe is False
    with open(path) as f:
      self._merge(self, yaml.safe_load(f))

  @classmethod
  def _merge(cls, node, values):
    for key, value in values.items():
      if isinstance(value, dict):
        cls._merge(node[key], value)
      else:
        node[key] = value

  def merge_from_list(self, pairs):
    for key, value in zip(pairs[0::2], pairs[1::2], strict=True):
      d2t._set(self, key, type(d2t._get(self, key))(value))

  def freeze(self):
    pass

  @classmethod
  def of(cls, tree):
    return cls({k: cls.of(v) if isinstance(v, dict) else v for k, v in tree.items()})


def _stub_detectron2(monkeypatch, results, seen):
  """Detectron2's names train_and_evaluate uses, as stand-ins whose trainer 'trains' and evaluates to `results`."""
  import types

  defaults = {
    "INPUT": {"FORMAT": "BGR", "MASK_FORMAT": "polygon"},
    "DATASETS": {"TRAIN": (), "TEST": ()},
    "DATALOADER": {"NUM_WORKERS": 4},
    "SOLVER": {"MAX_ITER": 10},
    "TEST": {"PRECISE_BN": {"NUM_ITER": 200}},
    "OUTPUT_DIR": "",
    "MODEL": {
      "DEVICE": "cuda",
      "WEIGHTS": "",
      "MASK_ON": True,
      "PIXEL_MEAN": [103.53, 116.28, 123.675],
      "PIXEL_STD": [1.0, 1.0, 1.0],
      "RESNETS": {"NORM": "FrozenBN", "STRIDE_IN_1X1": True, "DEPTH": 50, "STEM_OUT_CHANNELS": 64,
                  "RES2_OUT_CHANNELS": 256, "WIDTH_PER_GROUP": 64},
      "FPN": {"NORM": ""},
      "ROI_BOX_HEAD": {"NORM": ""},
      "ROI_MASK_HEAD": {"NORM": ""},
    },
  }  # fmt: skip

  class Trainer:
    def __init__(self, cfg):
      seen["cfg"] = cfg

    def resume_or_load(self, resume):
      seen["weights"] = d2t.load_for_detectron2(seen["cfg"].MODEL.WEIGHTS, seen["cfg"].OUTPUT_DIR)

    def train(self):
      self._last_eval_results = results

  class Metadata(dict):
    get = dict.get

  names = (
    *("detectron2", "detectron2.engine", "detectron2.utils", "detectron2.utils.comm", "detectron2.config"),
    *("detectron2.data", "detectron2.data.datasets", "detectron2.data.datasets.pascal_voc", "detectron2.layers"),
    *("detectron2.modeling", "detectron2.modeling.roi_heads", "detectron2.evaluation", "detectron2.checkpoint"),
  )
  modules = {n: types.ModuleType(n) for n in names}
  registry = {}
  m = modules
  m["detectron2.engine"].DefaultTrainer, m["detectron2.engine"].default_setup = Trainer, lambda cfg, args: None
  comm = m["detectron2.utils.comm"]
  comm.get_world_size, comm.is_main_process, comm.synchronize = (lambda: 1), (lambda: True), (lambda: None)
  m["detectron2.utils"].comm = comm
  m["detectron2.config"].get_cfg = lambda: _Cfg.of(defaults)
  m["detectron2.data"].DatasetCatalog = types.SimpleNamespace(list=lambda: list(registry))
  m["detectron2.data"].MetadataCatalog = types.SimpleNamespace(get=lambda name: registry[name])

  def register_coco_instances(name, meta, json_file, images):
    registry[name] = types.SimpleNamespace(
      evaluator_type="coco", get=Metadata(evaluator_type="coco", json_file=json_file).get
    )

  m["detectron2.data.datasets"].register_coco_instances = register_coco_instances
  m["detectron2.data.datasets"].register_lvis_instances = register_coco_instances
  m["detectron2.data.datasets.pascal_voc"].register_pascal_voc = lambda *a: None
  m["detectron2.layers"].get_norm = lambda norm, channels: None
  m["detectron2.modeling.roi_heads"].ROI_HEADS_REGISTRY = types.SimpleNamespace(register=lambda: lambda cls: cls)
  m["detectron2.modeling.roi_heads"].Res5ROIHeads = object
  for name, module in modules.items():
    monkeypatch.setitem(sys.modules, name, module)


def test_a_detector_without_predictions_reaches_the_summary_as_ap_0(tmp_path, monkeypatch, caplog):
  """train_and_evaluate with Detectron2's names stood in for (CI has no Detectron2): the hand-off exported into
  OUTPUT_DIR and recorded, the config given the run's architecture and the hand-off as its weights, and an evaluation
  without a single prediction (every metric NaN) written as AP 0, a warning saying why; the test set has no large
  object, so no APl."""
  from vlrep import run_summary

  run = tmp_path / "run"
  run.mkdir()
  images = tmp_path / "images"
  images.mkdir()
  instances = tmp_path / "val.json"
  boxes = [[0, 0, 10, 10], [0, 0, 40, 40]]  # areas 100 (small) and 1,600 (medium)
  annotations = [
    {"id": i, "image_id": 1, "category_id": 1, "bbox": b, "area": b[2] * b[3]} for i, b in enumerate(boxes)
  ]
  instances.write_text(json.dumps({"images": [], "annotations": annotations, "categories": []}))
  yaml_file = tmp_path / "stub.yaml"
  yaml_file.write_text(
    "INPUT: {FORMAT: RGB}\nMODEL:\n  PIXEL_MEAN: [123.675, 116.28, 103.53]\n  PIXEL_STD: [58.395, 57.12, 57.375]\n"
    "  RESNETS: {STRIDE_IN_1X1: false, NORM: SyncBN}\n"
  )
  nothing = {m: NAN for m in d2t.COCO_METRICS}
  seen = {}
  _stub_detectron2(monkeypatch, {"bbox": dict(nothing), "segm": dict(nothing)}, seen)
  exported = []

  def export_backbone(workdir, checkpoint, out_dir):  # what `vlrep.interop.export --format=backbone` writes
    exported.append((workdir, checkpoint, out_dir))
    _handoff(pathlib.Path(out_dir), architecture=_arch(width=2))

  monkeypatch.setattr(d2t, "export_backbone", export_backbone)
  args = d2t.parse_args(
    [f"--workdir={run}", f"--config-file={yaml_file}", f"--dataset=val=coco:{instances}:{images}", "--test=val"]
  )
  with caplog.at_level("WARNING"):
    d2t.train_and_evaluate(args)

  out = run / "detectron2" / "stub"
  assert exported == [(str(run), "best", str(out))]
  assert set(json.loads((out / d2t.MANIFEST).read_text())["files"]) == set(d2t.HANDOFF_FILES)
  cfg = seen["cfg"]
  assert cfg.MODEL.WEIGHTS == str(out / "backbone.safetensors") and cfg.MODEL.RESNETS.STEM_OUT_CHANNELS == 2
  assert cfg.MODEL.RESNETS.NORM == "BN" and "stem.conv1.weight" in seen["weights"]["model"]
  want = {f"detectron2/stub/{t}/{m}": 0.0 for t in ("bbox", "segm") for m in ("AP", "AP50", "AP75", "APs", "APm")}
  assert json.loads((out / "transfer_results.json").read_text()) == want
  assert run_summary.read_summary(str(run)) == want
  assert "made no predictions on val (bbox)" in caplog.text and "made no predictions on val (segm)" in caplog.text
