r"""The PyTorch side of the detection evaluator: fine-tunes torchvision's Faster R-CNN or Mask R-CNN with FPN around
a converted vlrep backbone and scores it with pycocotools.

  python -m vlrep.pytorch.detection_worker --spec=SPEC.json --out=METRICS.json

Run as a process of its own by `vlrep.evaluators.detection` (torch and JAX never share a process, so they never
contend for one accelerator's memory); it imports torch, torchvision and pycocotools, never JAX or TensorFlow.
SPEC.json is the one input: the backbone hand-off folder (vlrep.pytorch.handoff: backbone.safetensors and
backbone.json, which `vlrep.interop.formats.torchvision.write_backbone` writes), the datasets (COCO instances JSON +
image folder), the detector's sizes and the schedule; its keys, defaults and checks are
`vlrep.pytorch.detection_spec`'s (the evaluator builds it from its config there). METRICS.json gets
box_ap, box_ap50, box_ap75 (and mask_* for Mask R-CNN) in percent, the first and last logged training losses,
and the seconds taken. Progress (loss every `log_every` iterations) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import FrozenBatchNorm2d, MultiScaleRoIAlign

from vlrep import safe_files
from vlrep.data import images as image_files  # numpy and PIL only: no TensorFlow or JAX in this process
from vlrep.pytorch import detection_spec, handoff, resnet

# ----------------------------------------------------------------------------------------------------------------
# Data: a COCO instances JSON and its image folder.


class CocoInstances(torch.utils.data.Dataset):
  """(image [3, H, W] float in [0, 1], target {boxes xyxy, labels 1..K, masks [N, H, W] uint8, image_id})."""

  def __init__(self, annotations: str, images: str, limit: int = 0, with_masks: bool = True):
    for path in (annotations, images):
      if not os.path.exists(path):
        raise FileNotFoundError(f"Detection data: {path} does not exist.")
    with contextlib.redirect_stdout(sys.stderr):  # pycocotools prints its progress
      self.coco = COCO(annotations)
    self.images = images
    self.ids = sorted(self.coco.getImgIds())[: limit or None]
    if not self.ids:
      raise ValueError(f"{annotations} lists no images.")
    # Contiguous labels 1..K for the detector (COCO's ids have gaps), 0 being background.
    self.category_ids = sorted(self.coco.getCatIds())
    self.label_of = {c: i + 1 for i, c in enumerate(self.category_ids)}
    self.with_masks = with_masks

  def __len__(self):
    return len(self.ids)

  def __getitem__(self, index):
    image_id = self.ids[index]
    info = self.coco.loadImgs(image_id)[0]
    path = os.path.join(self.images, info["file_name"])
    # As a viewer shows it, the one decoding vlrep uses for files (EXIF orientation, CMYK, 16-bit range, ...).
    image, _ = image_files.decode_file(path)
    annotated = (info.get("height"), info.get("width"))
    if None not in annotated and annotated != image.shape[:2]:
      # Boxes and masks are in the annotation's pixel frame: an image shown at another size (an EXIF orientation
      # the annotator did not see) would train and score on misplaced objects.
      raise ValueError(
        f"{path}: the annotations give {annotated[1]} x {annotated[0]} pixels (width x height), the image as a viewer "
        f"shows it is {image.shape[1]} x {image.shape[0]} (EXIF orientation applied): fix the image or its entry."
      )
    anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=image_id)) if not a.get("iscrowd", 0)]
    anns = [a for a in anns if a["bbox"][2] > 0 and a["bbox"][3] > 0]
    boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)], dtype=torch.float32)
    target = {
      "boxes": boxes.reshape(-1, 4),
      "labels": torch.tensor([self.label_of[a["category_id"]] for a in anns], dtype=torch.int64),
      "image_id": image_id,
    }
    if self.with_masks:
      h, w = image.shape[:2]
      masks = [self.coco.annToMask(a) for a in anns]
      target["masks"] = torch.from_numpy(np.stack(masks) if masks else np.zeros((0, h, w), np.uint8))
    return torch.from_numpy(image.copy()).permute(2, 0, 1).float() / 255.0, target


def flipped(image: torch.Tensor, target: dict) -> tuple[torch.Tensor, dict]:
  """The horizontal mirror of an image and its boxes and masks."""
  width = image.shape[-1]
  target = dict(target)
  boxes = target["boxes"].clone()
  boxes[:, [0, 2]] = width - target["boxes"][:, [2, 0]]
  target["boxes"] = boxes
  if "masks" in target:
    target["masks"] = target["masks"].flip(-1)
  return image.flip(-1), target


def training_batches(dataset, spec: dict, generator: torch.Generator):
  """`spec['iterations']` batches of `batch_size` examples: the dataset reshuffled every pass, flipped at random."""
  order: list[int] = []
  for _ in range(spec["iterations"]):
    batch = []
    for _ in range(spec["batch_size"]):
      if not order:
        order = torch.randperm(len(dataset), generator=generator).tolist()
      image, target = dataset[order.pop()]
      if spec["flip"] and torch.rand((), generator=generator) < 0.5:
        image, target = flipped(image, target)
      batch.append((image, target))
    yield batch


# ----------------------------------------------------------------------------------------------------------------
# The model.


def torch_backbone(spec: dict) -> nn.Module:
  """vlrep's ResNet in PyTorch (`vlrep.pytorch.resnet`) built from the hand-off folder `spec['backbone']` (its
  backbone.json's architecture) with its backbone.safetensors loaded strictly."""
  if not spec["backbone"]:
    raise ValueError("The spec names no backbone hand-off folder (the JAX side writes random weights for random_init).")
  arch = handoff.read_info(spec["backbone"])["architecture"]
  norm = FrozenBatchNorm2d if spec["norm"] == "frozen" else nn.BatchNorm2d
  model = resnet.ResNet(**arch, norm=norm)
  state = {k: torch.tensor(v) for k, v in handoff.read_weights(spec["backbone"]).items()}
  if spec["norm"] == "frozen":  # FrozenBatchNorm2d keeps no counter
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
  model.load_state_dict(state, strict=True)
  return model


def detector(spec: dict, num_classes: int) -> nn.Module:
  """torchvision's Faster R-CNN or Mask R-CNN with an FPN over the converted backbone, sized by the spec."""
  backbone = torch_backbone(spec)
  channels = backbone.stage_channels
  layers = tuple(spec["fpn_layers"])
  fpn = BackboneWithFPN(
    backbone,
    return_layers={f"layer{s}": str(i) for i, s in enumerate(layers)},
    in_channels_list=[channels[s - 1] for s in layers],
    out_channels=spec["fpn_channels"],
  )
  names = [str(i) for i in range(len(layers))]
  anchors = AnchorGenerator(
    sizes=tuple((int(s),) for s in spec["anchor_sizes"]),
    aspect_ratios=(tuple(spec["aspect_ratios"]),) * len(spec["anchor_sizes"]),
  )

  def roi_align(output_size):
    # canonical_scale/level: torchvision's 224/4 suit 800-px images; at 64 px every box would map to the finest level.
    return MultiScaleRoIAlign(
      names,
      output_size,
      sampling_ratio=spec["roi_sampling_ratio"],
      canonical_scale=spec["roi_canonical_scale"],
      canonical_level=spec["roi_canonical_level"],
    )

  c = spec["fpn_channels"]
  width = spec["box_head_width"]
  kwargs = dict(
    min_size=spec["min_size"],
    max_size=spec["max_size"],
    image_mean=list(spec["image_mean"]),
    image_std=list(spec["image_std"]),
    rpn_anchor_generator=anchors,
    rpn_pre_nms_top_n_train=spec["rpn_pre_nms_top_n_train"],
    rpn_post_nms_top_n_train=spec["rpn_post_nms_top_n_train"],
    rpn_pre_nms_top_n_test=spec["rpn_pre_nms_top_n_test"],
    rpn_post_nms_top_n_test=spec["rpn_post_nms_top_n_test"],
    rpn_batch_size_per_image=spec["rpn_batch_size_per_image"],
    box_batch_size_per_image=spec["box_batch_size_per_image"],
    box_detections_per_img=spec["box_detections_per_img"],
    box_roi_pool=roi_align(7),
    box_head=TwoMLPHead(c * 7 * 7, width),
    box_predictor=FastRCNNPredictor(width, num_classes),
  )
  if spec["detector"] == "faster_rcnn":
    return FasterRCNN(fpn, **kwargs)
  mask_width = spec["mask_head_width"]
  return MaskRCNN(
    fpn,
    mask_roi_pool=roi_align(14),
    mask_head=MaskRCNNHeads(c, (mask_width,) * 4, 1),
    mask_predictor=MaskRCNNPredictor(mask_width, mask_width, num_classes),
    **kwargs,
  )


def learning_rate(spec: dict, iteration: int) -> float:
  """Linear warm-up from lr/1000 then steps down by 10 at each of `lr_drops` (fractions of the iterations)."""
  lr = spec["lr"] * 0.1 ** sum(iteration >= f * spec["iterations"] for f in spec["lr_drops"])
  if iteration < spec["warmup_iterations"]:
    alpha = iteration / spec["warmup_iterations"]
    lr *= 0.001 * (1 - alpha) + alpha
  return lr


# ----------------------------------------------------------------------------------------------------------------
# Training and evaluation.


def train(model: nn.Module, dataset, spec: dict, device: torch.device) -> list[tuple[int, float]]:
  """Fine-tunes end to end for `iterations` steps of SGD; returns (iteration, loss) every `log_every`."""
  params = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.SGD(params, lr=spec["lr"], momentum=spec["momentum"], weight_decay=spec["weight_decay"])
  generator = torch.Generator().manual_seed(spec["seed"])
  model.train()
  log, window, start = [], [], time.time()
  for it, batch in enumerate(training_batches(dataset, spec, generator)):
    for group in optimizer.param_groups:
      group["lr"] = learning_rate(spec, it)
    images = [image.to(device) for image, _ in batch]
    targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for _, t in batch]
    losses = model(images, targets)
    loss = sum(losses.values())
    if not math.isfinite(loss.item()):
      raise FloatingPointError(
        f"The detection loss is {loss.item()} at iteration {it} ({ {k: v.item() for k, v in losses.items()} }): "
        "lower lr or raise warmup_iterations."
      )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    window.append(loss.item())
    if (it + 1) % spec["log_every"] == 0 or it + 1 == spec["iterations"]:
      log.append((it + 1, float(np.mean(window))))
      print(
        f"detection (seed {spec['seed']}): iteration {it + 1}/{spec['iterations']}, loss {log[-1][1]:.3f}, "
        f"lr {learning_rate(spec, it):.4f}, {time.time() - start:.0f}s",
        file=sys.stderr,
        flush=True,
      )
      window = []
  return log


def coco_results(outputs: list[dict], image_ids: list[int], dataset, with_masks: bool) -> tuple[list, list]:
  """Detections as pycocotools' result lists: boxes [x, y, w, h] and masks (RLE of the 0.5-thresholded mask)."""
  boxes, segms = [], []
  for image_id, out in zip(image_ids, outputs, strict=True):
    xyxy = out["boxes"].cpu().numpy()
    scores, labels = out["scores"].cpu().numpy(), out["labels"].cpu().numpy()
    masks = (out["masks"][:, 0] > 0.5).cpu().numpy() if with_masks else None
    for k in range(len(scores)):
      x0, y0, x1, y1 = (float(v) for v in xyxy[k])
      common = {
        "image_id": int(image_id),
        "category_id": dataset.category_ids[int(labels[k]) - 1],
        "score": float(scores[k]),
      }
      boxes.append({**common, "bbox": [x0, y0, x1 - x0, y1 - y0]})
      if with_masks:
        rle = mask_utils.encode(np.asfortranarray(masks[k].astype(np.uint8)))
        rle["counts"] = rle["counts"].decode("ascii")
        segms.append({**common, "segmentation": rle})
  return boxes, segms


def coco_ap(coco_gt: COCO, results: list, iou_type: str, image_ids: list[int]) -> dict[str, float]:
  """AP, AP50, AP75 (percent) by pycocotools; 0 when there is no detection at all."""
  if not results:
    return {"ap": 0.0, "ap50": 0.0, "ap75": 0.0}
  with contextlib.redirect_stdout(sys.stderr):
    evaluation = COCOeval(coco_gt, coco_gt.loadRes(results), iou_type)
    evaluation.params.imgIds = image_ids
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
  ap, ap50, ap75 = (100.0 * max(float(v), 0.0) for v in evaluation.stats[:3])  # -1: no ground truth
  return {"ap": ap, "ap50": ap50, "ap75": ap75}


@torch.no_grad()
def evaluate(model: nn.Module, dataset, spec: dict, device: torch.device) -> dict[str, float]:
  model.eval()
  with_masks = spec["detector"] == "mask_rcnn"
  outputs = []
  for i in range(0, len(dataset), spec["eval_batch_size"]):
    images = [dataset[j][0].to(device) for j in range(i, min(i + spec["eval_batch_size"], len(dataset)))]
    outputs += model(images)
  boxes, segms = coco_results(outputs, dataset.ids, dataset, with_masks)
  metrics = {f"box_{k}": v for k, v in coco_ap(dataset.coco, boxes, "bbox", dataset.ids).items()}
  if with_masks:
    metrics.update({f"mask_{k}": v for k, v in coco_ap(dataset.coco, segms, "segm", dataset.ids).items()})
  return metrics


def train_and_evaluate(spec: dict) -> dict[str, float]:
  """Builds, fine-tunes and scores the detector the spec describes; returns its metrics."""
  spec = detection_spec.full_spec(spec)
  if spec["threads"]:
    torch.set_num_threads(spec["threads"])
  torch.manual_seed(spec["seed"])
  device = torch.device(
    ("cuda" if torch.cuda.is_available() else "cpu") if spec["device"] == "auto" else spec["device"]
  )
  with_masks = spec["detector"] == "mask_rcnn"
  train_set = CocoInstances(spec["train_annotations"], spec["train_images"], with_masks=with_masks)
  test_set = CocoInstances(spec["test_annotations"], spec["test_images"], spec["test_limit"], with_masks=False)
  if test_set.category_ids != train_set.category_ids:
    raise ValueError(
      f"The training set's categories {train_set.category_ids} differ from the test set's {test_set.category_ids}."
    )
  model = detector(spec, len(train_set.category_ids) + 1).to(device)
  print(
    f"detection (seed {spec['seed']}): {spec['detector']} on {device}, {len(train_set)} training images, "
    f"{len(test_set)} test images, "
    f"{sum(p.numel() for p in model.parameters()):,} parameters",
    file=sys.stderr,
    flush=True,
  )
  start = time.time()
  log = train(model, train_set, spec, device)
  metrics = evaluate(model, test_set, spec, device)
  metrics.update(loss_first=log[0][1], loss_last=log[-1][1], seconds=time.time() - start)
  metrics["iterations"] = float(spec["iterations"])
  return metrics


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--spec", required=True, help="The JSON spec (vlrep.evaluators.detection writes it).")
  parser.add_argument("--out", required=True, help="Where to write the metrics JSON.")
  args = parser.parse_args(argv)
  with open(args.spec) as f:
    spec = json.load(f)
  metrics = train_and_evaluate(spec)
  safe_files.write_json(args.out, metrics)  # a fresh temporary file, renamed: no link at --out followed


if __name__ == "__main__":
  main()
