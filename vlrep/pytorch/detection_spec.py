"""The detection worker's spec: every setting the worker (vlrep.pytorch.detection_worker) reads from its --spec file,
its default and its checks, in one place. Torch-free (no torch, JAX or TensorFlow), so the evaluator
(vlrep.evaluators.detection) builds and checks a spec in its own process, and configs/eval/detection.py builds its
`detector` entry from these defaults.

A spec is SETTINGS (a config's `detector` entry: the detector's sizes and schedule) plus what the evaluator sets
for each worker (PER_WORKER: the backbone hand-off folder, the data and the seed).
"""

from __future__ import annotations

from vlrep.errors import UserError

DETECTORS = ("faster_rcnn", "mask_rcnn")


def refuse_backbone(arch: str, where: str) -> None:
  """A UserError for a run whose backbone (its config's `arch`) detection transfer cannot take: the detectors here
  (torchvision's Faster/Mask R-CNN in the detection evaluator, Detectron2's in vlrep.pytorch.detectron2_transfer)
  are built on a ResNet's four stages. `where`: the run, for the message."""
  if arch == "resnet":
    return
  if arch == "vit":
    raise UserError(
      f"{where}: detection transfer takes ResNet backbones only, and this run's is a ViT. The detectors here "
      "(torchvision's Faster/Mask R-CNN with FPN in the detection evaluator, Detectron2's R-CNN in "
      "vlrep.pytorch.detectron2_transfer) read a ResNet's C2..C5 feature maps (strides 4 to 32) through an FPN; a "
      "ViT has one map, at its patch stride. A ViT detects through ViTDet's simple feature pyramid (Li et al., "
      "2022), which vlrep does not build. Evaluate the ViT with the probes (configs/eval/voc07_svm.py, "
      "linear_probe.py), zero-shot, retrieval, captioning or localization instead."
    )
  raise UserError(
    f"{where}: detection transfer converts ResNet backbones to PyTorch; this run's backbone is {arch}. Evaluate "
    "it with the probes (configs/eval/voc07_svm.py, linear_probe.py) instead."
  )


NORMS = ("trained", "frozen")

# What the evaluator sets for each worker, never a config: the hand-off folder (vlrep.pytorch.handoff: the
# backbone's weights and architecture), the COCO instances files and image folders, the seed.
PER_WORKER = {
  "backbone": "",
  "train_annotations": "",
  "train_images": "",
  "test_annotations": "",
  "test_images": "",
  "seed": 0,
}
# The detector and its schedule, with the value an omitted one takes (torchvision's defaults where they fit any
# image size; Detectron2's Mask R-CNN R50-FPN 1x sizes): what a config's `detector` entry holds.
SETTINGS = {
  "detector": "mask_rcnn",
  "norm": "trained",  # the backbone's BatchNorm: trained (statistics and affine) or frozen (FrozenBatchNorm2d)
  "fpn_layers": (1, 2, 3, 4),  # the ResNet stages the FPN reads
  "fpn_channels": 256,
  "anchor_sizes": (32, 64, 128, 256, 512),  # one per FPN level (the stages read, then the extra max-pool level)
  "aspect_ratios": (0.5, 1.0, 2.0),
  "min_size": 800,
  "max_size": 1333,
  "image_mean": (0.485, 0.456, 0.406),  # vlrep's `normalize` op: ImageNet mean/std of [0, 1] RGB
  "image_std": (0.229, 0.224, 0.225),
  "rpn_pre_nms_top_n_train": 2000,
  "rpn_post_nms_top_n_train": 2000,
  "rpn_pre_nms_top_n_test": 1000,
  "rpn_post_nms_top_n_test": 1000,
  "rpn_batch_size_per_image": 256,
  "box_batch_size_per_image": 512,
  "box_detections_per_img": 100,
  "box_head_width": 1024,
  "mask_head_width": 256,
  "roi_canonical_scale": 224,  # RoIAlign's level mapping: a box this size goes to level roi_canonical_level
  "roi_canonical_level": 4,
  "roi_sampling_ratio": 2,  # RoIAlign's samples per bin side (its backward pass dominates a CPU step)
  "iterations": 1000,
  "batch_size": 16,
  "lr": 0.02,
  "momentum": 0.9,
  "weight_decay": 1e-4,
  "warmup_iterations": 100,
  "lr_drops": (0.75, 0.9),  # fractions of the iterations where the learning rate is divided by 10
  "flip": True,  # random horizontal flips in training
  "threads": 0,  # torch CPU threads (0: torch's default)
  "device": "auto",  # auto: CUDA when there is one
  "eval_batch_size": 32,
  "test_limit": 0,  # score only the test set's first N images (0: all)
  "log_every": 20,
}
DEFAULTS = {**PER_WORKER, **SETTINGS}  # every key of a spec


def _checked(out: dict) -> dict:
  if out["detector"] not in DETECTORS:
    raise UserError(f"detector={out['detector']!r}; expected one of {DETECTORS}.")
  if out["norm"] not in NORMS:
    raise UserError(f"norm={out['norm']!r}; expected one of {NORMS}.")
  levels = len(out["fpn_layers"]) + 1  # the FPN adds a max-pooled level above the last stage
  if len(out["anchor_sizes"]) != levels:
    raise UserError(
      f"anchor_sizes {tuple(out['anchor_sizes'])} has {len(out['anchor_sizes'])} sizes; the FPN has {levels} levels "
      f"(stages {tuple(out['fpn_layers'])} and a max-pooled one): give one size per level."
    )
  return out


def settings(**changes) -> dict:
  """SETTINGS with `changes`, checked: a config's `detector` entry (every setting written out)."""
  unknown = sorted(set(changes) - set(SETTINGS))
  if unknown:
    where = " (the evaluator sets these for each worker)" if set(unknown) & set(PER_WORKER) else ""
    raise UserError(f"Unknown detector settings {unknown}{where}; known: {sorted(SETTINGS)}.")
  return _checked({**SETTINGS, **changes})


def full_spec(spec: dict) -> dict:
  """A worker's spec with every omitted key at its default, checked (a UserError naming what is wrong)."""
  unknown = sorted(set(spec) - set(DEFAULTS))
  if unknown:
    raise UserError(f"Unknown detection settings {unknown}; known: {sorted(DEFAULTS)}.")
  return _checked({**DEFAULTS, **spec})
