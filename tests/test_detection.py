"""Detection transfer: the backbone's conversion to PyTorch, synthetic_scenes' COCO instances, and a short
fine-tune of torchvision's Mask R-CNN around a vlrep backbone, scored by pycocotools (vlrep.evaluators.detection,
vlrep.pytorch.detection_worker, vlrep.data.instances)."""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
import pytest
import torch
from ml_collections import ConfigDict
from PIL import Image
from pycocotools.coco import COCO

from vlrep.data import instances, pipeline, records
from vlrep.errors import UserError
from vlrep.evaluators import EvalInputs, Model, detection
from vlrep.interop.formats import torchvision as tv_format
from vlrep.models import resnet, vgg
from vlrep.pytorch import detection_spec, detection_worker, handoff

torch.set_num_threads(1)  # the test machine's cores are shared

DATA_DIR = os.environ["VLREP_TEST_DATA_DIR"]


def _trained_looking(variables, seed=1):
  """The variables with every BatchNorm's scale, bias and statistics drawn at random: a conversion that mixed
  them up, or left one out, would show."""
  rng = np.random.default_rng(seed)

  def draw(path, x):
    name = jax.tree_util.keystr(path)
    if "scale" in name or "var" in name:
      return rng.uniform(0.5, 1.5, x.shape).astype(np.float32)
    if "bias" in name or "mean" in name:
      return rng.normal(0, 0.3, x.shape).astype(np.float32)
    return np.asarray(x)

  return jax.tree_util.tree_map_with_path(draw, jax.device_get(variables))


@pytest.mark.parametrize(
  "arch",
  [
    dict(depth=10, width=8, stem="small", stem_stride=2),  # the runlocal backbones' (basic blocks)
    dict(depth=26, width=8, stem="imagenet"),  # every paper recipe's stem, bottleneck blocks
  ],
)
def test_converted_backbone_features_equal_jax(arch, tmp_path):
  """Every stage the FPN reads, with BatchNorm trained (nn.BatchNorm2d, in eval mode) or frozen."""
  module = resnet.ResNet(**arch)
  images = np.random.default_rng(0).normal(size=(2, 48, 40, 3)).astype(np.float32)
  variables = _trained_looking(module.init(jax.random.PRNGKey(0), images[:1]))
  _, stages = module.apply(variables, images, False)
  folder = str(tmp_path / "backbone")
  tv_format.write_backbone(variables, detection.method_section(module), folder)
  # torch's own shapes, to the counter: a 0-d num_batches_tracked (not the 1-d that np.ascontiguousarray makes).
  weights = handoff.read_weights(folder)
  counters = [k for k in weights if k.endswith("num_batches_tracked")]
  assert counters and all(np.shape(weights[k]) == () for k in counters)
  assert handoff.read_info(folder)["architecture"] == {k: arch.get(k, 2 if k == "stem_stride" else 1) for k in
    ("depth", "width", "inner_multiplier", "stem", "stem_stride")} | arch  # fmt: skip
  for norm in detection_spec.NORMS:
    spec = detection_spec.full_spec({"backbone": folder, "norm": norm})
    net = detection_worker.torch_backbone(spec).eval()
    x = torch.from_numpy(images).permute(0, 3, 1, 2)
    with torch.no_grad():
      x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
      for stage in range(1, 5):
        x = getattr(net, f"layer{stage}")(x)
        want = np.asarray(stages[f"stage{stage}"]).transpose(0, 3, 1, 2)
        assert x.shape == want.shape
        error = np.abs(x.numpy() - want).max() / np.abs(want).max()
        assert error < 1e-5, f"{norm} BatchNorm, stage{stage}: relative error {error:.2e}"


def test_unconvertible_backbone_is_refused(tmp_path):
  with pytest.raises(UserError, match="converts ResNet backbones to PyTorch; this run's backbone is VGG16"):
    detection.method_section(vgg.VGG16(width=8))
  module = resnet.ResNet(depth=10, width=8, stem="small")
  params = {"params": module.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3), np.float32))["params"]}
  with pytest.raises(UserError, match="no BatchNorm statistics"):
    tv_format.write_backbone(params, detection.method_section(module), str(tmp_path / "w"))
  with pytest.raises(ValueError, match="anchor_sizes .* has 3 sizes; the FPN has 5 levels"):
    detection_spec.full_spec({"anchor_sizes": (8, 16, 32)})
  # A config's detector entry is checked when the evaluator is made, before anything is read or trained.
  config = _tiny_evaluation(seeds=(0,), detector={**_tiny_detector(), "weights": "w.safetensors"})
  with pytest.raises(UserError, match=r"Unknown detector settings \['weights'\]"):
    detection.Evaluator(config, EvalInputs())
  config = _tiny_evaluation(seeds=(0,), detector={**_tiny_detector(), "seed": 3})
  with pytest.raises(UserError, match="the evaluator sets these for each worker"):
    detection.Evaluator(config, EvalInputs())


def test_dataset_without_instances_is_refused(tmp_path):
  config = ConfigDict({"dataset": "voc2007", "data_dir": str(tmp_path), "seeds": (0,)})
  with pytest.raises(UserError, match="'voc2007' has no instance annotations: its examples have no 'object_map'"):
    detection.Evaluator(config, EvalInputs())
  with pytest.raises(UserError, match="not one of vlrep's datasets with instance maps"):
    instances.write_instances("imagenet2012", "train", str(tmp_path / "x.json"), data_dir=str(tmp_path))
  missing = {k: str(tmp_path / k) for k in detection.DATA_FILES}
  with pytest.raises(UserError, match="train_annotations=.* does not exist"):
    detection.Evaluator(ConfigDict({**missing, "seeds": (0,)}), EvalInputs())


def test_instances_match_the_instance_maps(tmp_path):
  out, images_dir = str(tmp_path / "val.json"), str(tmp_path / "images")
  counts = instances.write_instances("synthetic_scenes", "val", out, images_dir, DATA_DIR, "tiny")
  coco = COCO(out)
  builder = pipeline.get_builder("synthetic_scenes", DATA_DIR, "tiny")
  examples = list(records.examples(builder, "val", decode_images=True).as_numpy_iterator())
  assert sorted(coco.getImgIds()) == sorted(int(e["image_id"]) for e in examples)
  assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(builder.info.features["objects"]["label"].names)
  assert len(coco.getCatIds()) == 10 and min(coco.getAnnIds()) == 1
  objects = 0
  for ex in examples:
    anns = coco.loadAnns(coco.getAnnIds(imgIds=int(ex["image_id"])))
    file_name = coco.loadImgs(int(ex["image_id"]))[0]["file_name"]
    np.testing.assert_array_equal(np.asarray(Image.open(os.path.join(images_dir, file_name))), ex["image"])
    instance_map = ex["object_map"][..., 0]
    visible = [k for k in range(len(ex["objects"]["label"])) if (instance_map == k + 1).any()]
    assert len(anns) == len(visible)
    objects += len(visible)
    for ann, k in zip(anns, visible, strict=True):
      mask = coco.annToMask(ann).astype(bool)
      np.testing.assert_array_equal(mask, instance_map == k + 1)
      assert ann["category_id"] == ex["objects"]["label"][k] + 1 and ann["iscrowd"] == 0
      assert ann["area"] == mask.sum()
      x, y, w, h = ann["bbox"]
      ys, xs = np.nonzero(mask)
      assert (x, y, x + w, y + h) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)  # tight, so it encloses it
  assert objects == counts["annotations"] > 0


def test_short_fine_tune_end_to_end(tmp_path):
  """The evaluator on a backbone (random, as the evaluator's own random_init makes) through the worker process:
  a Mask R-CNN fine-tuned for a few iterations on the tiny dataset, with a finite, falling loss and every AP."""
  module = resnet.ResNet(depth=10, width=8, stem="small")
  variables = _trained_looking(module.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3), np.float32)))
  config = _tiny_evaluation(test_limit=8, seeds=(0,), detector={**_tiny_detector(), "iterations": 16, "log_every": 4})
  metrics = detection.Evaluator(config, EvalInputs()).evaluate(Model(variables, None, lambda: (module, variables)))
  assert np.isfinite(metrics["loss_first"]) and np.isfinite(metrics["loss_last"])
  assert metrics["loss_last"] < 0.8 * metrics["loss_first"], metrics
  for key in detection.AP_METRICS:
    assert 0.0 <= metrics[key] <= 100.0, (key, metrics)
  assert metrics["iterations"] == 16


def _tiny_evaluation(**keys) -> ConfigDict:
  """The detection evaluator's config on the tiny synthetic_scenes (train -> val), the pretrained backbone's."""
  base = {
    "type": "detection",
    "dataset": "synthetic_scenes",
    "config_name": "tiny",
    "data_dir": DATA_DIR,
    "train_split": "train",
    "test_split": "val",
    "random_init": False,
  }
  return ConfigDict({**base, **keys})


def _tiny_detector() -> dict:
  """configs/eval/detection.py's runlocal detector at 32 px, batch 4."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("detection_config", "configs/eval/detection.py")
  config = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(config)
  return {**config.runlocal_detector(), "min_size": 32, "max_size": 32, "batch_size": 4, "threads": 1}


def test_parallel_workers_overlap_and_keep_the_seeds_order(monkeypatch, tmp_path):
  """parallel=2 runs two workers at once, each with half the cores unless threads is set, and summarises the
  seeds in the config's order whatever order they finish in."""
  module = resnet.ResNet(depth=10, width=8, stem="small")
  variables = _trained_looking(module.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3), np.float32)))
  spans, threads = {}, {}

  def fake_worker(spec, folder, seed):
    start = time.time()
    time.sleep(0.6 if seed == 5 else 0.2)  # the first seed finishes last
    spans[seed] = (start, time.time())
    threads[seed] = spec["threads"]
    assert os.path.exists(os.path.join(spec["backbone"], handoff.HANDOFF_WEIGHTS))
    assert os.path.exists(spec["train_annotations"]) and spec == detection_spec.full_spec(spec)
    return {"box_ap": float(seed), "mask_ap": 1.0, "loss_first": 2.0, "loss_last": 1.0, "iterations": 3.0}

  monkeypatch.setattr(detection, "run_worker", fake_worker)
  monkeypatch.setattr(os, "cpu_count", lambda: 4)
  config = _tiny_evaluation(
    train_limit=4, test_limit=4, seeds=(5, 6, 7), parallel=2, detector={**_tiny_detector(), "threads": 0}
  )
  metrics = detection.Evaluator(config, EvalInputs()).evaluate(Model(variables, None, lambda: (module, variables)))
  assert spans[6][0] < spans[5][1] and spans[5][0] < spans[6][1]  # 5 and 6 ran at the same time
  assert max(start for start, _ in spans.values()) >= min(end for _, end in spans.values())  # never 3 at once
  assert threads == {5: 2, 6: 2, 7: 2}
  assert [metrics[f"box_ap_seed{s}"] for s in (5, 6, 7)] == [5.0, 6.0, 7.0] and metrics["box_ap"] == 6.0
  config.parallel = 0
  with pytest.raises(UserError, match="parallel=0"):
    detection.Evaluator(config, EvalInputs())


def test_several_seeds_are_summarised():
  per_seed = [
    {"box_ap": 10.0, "mask_ap": 4.0, "loss_first": 3.0, "loss_last": 1.0, "seconds": 5.0, "iterations": 9.0},
    {"box_ap": 20.0, "mask_ap": 8.0, "loss_first": 5.0, "loss_last": 2.0, "seconds": 5.0, "iterations": 9.0},
  ]
  out = detection.summarize(per_seed, [3, 7])
  # sample std (n - 1), the tie rule's: 7.07, not the population's 5
  assert out["box_ap"] == 15.0 and out["box_ap_std"] == pytest.approx(50**0.5) and out["box_ap_seed7"] == 20.0
  assert out["mask_ap_std"] == pytest.approx(8**0.5) and out["loss_last"] == 1.5 and "loss_last_std" not in out
  assert json.dumps(out)
