r"""COCO-format instance annotations of a dataset with visible-instance maps (synthetic_scenes), for detection.

  python -m vlrep.data.instances --dataset=synthetic_scenes --split=val --out=/tmp/scenes_val/instances.json
  python -m vlrep.data.instances --dataset=synthetic_scenes --config_name=tiny --split=val \
    --out=/tmp/scenes_tiny/instances.json --images=/tmp/scenes_tiny/images

Each example's `object_map` (pixel value k+1 where object k is visible; occlusion already applied, so the masks are
disjoint) gives one annotation per visible object: its mask as compressed RLE (pycocotools' `mask.encode`), the
tight box of that mask (`bbox` [x, y, width, height] in pixels, so it encloses the mask), `area` (the mask's
pixels), `category_id` (the shape's index + 1: 1 circle .. 10 heart; 0 is the detectors' background) and
`iscrowd` 0. Image ids are the examples' `image_id` (their index in the split); annotation ids count from 1
(pycocotools' evaluation takes id 0 for "unmatched"). An object hidden entirely by later ones has no visible pixel
and no annotation; `info.objects_fully_occluded` counts them. `--images=DIR` also writes each image as
DIR/<image_id, 6 digits>.png, the `file_name` the JSON gives, so the pair is a COCO-style dataset any detection
tool reads. `--limit=N` keeps the split's first N examples.

Written atomically (a temporary file renamed into place). A dataset whose examples have no `object_map` is refused.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow_datasets as tfds
from absl import app, flags, logging
from PIL import Image
from pycocotools import mask as mask_utils

from vlrep import defaults, safe_files
from vlrep.data import pipeline, records
from vlrep.errors import UserError, exit_2_on_user_error

INSTANCE_MAP = "object_map"  # the feature holding the visible-instance map


def check_has_instances(builder) -> None:
  """A clear error for a dataset without visible-instance maps (only synthetic_scenes has them)."""
  features = builder.info.features
  if INSTANCE_MAP not in features or "objects" not in features:
    raise UserError(
      f"Dataset {builder.name!r} has no instance annotations: its examples have no {INSTANCE_MAP!r} (visible-"
      f"instance map) and 'objects' features (they have {sorted(features)}). Detection needs a dataset with "
      "instance masks: synthetic_scenes, or a COCO-format instances JSON with its image folder "
      "(the detection evaluator's train_annotations/train_images, test_annotations/test_images)."
    )


def instances_builder(dataset: str, data_dir: str | None, config_name: str | None = None):
  """The builder of `dataset`, checked for instance maps before anything is prepared or generated: a dataset
  without them is refused at once, not after it has been read."""
  registry = pipeline.builder_classes()
  if dataset not in registry:
    raise UserError(
      f"Dataset {dataset!r} is not one of vlrep's datasets with instance maps (synthetic_scenes); give a COCO-format "
      "instances JSON with its image folder instead."
    )
  cls = registry[dataset]
  data_dir = os.path.expanduser(data_dir or tfds.core.constants.DATA_DIR)
  unprepared = cls(config=config_name, data_dir=data_dir) if config_name else cls(data_dir=data_dir)
  check_has_instances(unprepared)  # the features come from the builder's code: nothing is read
  return pipeline.get_builder(dataset, data_dir, config_name)


def categories(builder) -> list[dict]:
  """COCO categories of the dataset's object labels: id = label index + 1."""
  names = builder.info.features["objects"]["label"].names
  return [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(names)]


def image_file_name(image_id: int) -> str:
  return f"{image_id:06d}.png"


def example_annotations(object_map: np.ndarray, labels: np.ndarray, image_id: int, first_id: int) -> list[dict]:
  """COCO annotations of one example: object k (label labels[k]) is where object_map == k + 1."""
  out = []
  instance_map = object_map[..., 0] if object_map.ndim == 3 else object_map
  for k, label in enumerate(labels):
    mask = instance_map == k + 1
    if not mask.any():
      continue
    ys, xs = np.nonzero(mask)
    x0, y0 = int(xs.min()), int(ys.min())
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    rle["counts"] = rle["counts"].decode("ascii")
    out.append(
      {
        "id": first_id + len(out),
        "image_id": int(image_id),
        "category_id": int(label) + 1,
        "bbox": [x0, y0, int(xs.max()) + 1 - x0, int(ys.max()) + 1 - y0],
        "area": int(mask.sum()),
        "segmentation": rle,
        "iscrowd": 0,
      }
    )
  return out


def coco_instances(builder, split: str, limit: int = 0, images_dir: str | None = None) -> dict:
  """The COCO instances dict of `split` (its first `limit` examples; 0: all); each image also written to
  `images_dir` as PNG when given."""
  check_has_instances(builder)
  split = records.first_examples(builder, split, limit)
  if images_dir:
    safe_files.make_dirs(images_dir)
  images, annotations, occluded = [], [], 0
  for ex in records.examples(builder, split, decode_images=True).as_numpy_iterator():
    image_id = int(ex["image_id"])
    height, width = ex["image"].shape[:2]
    images.append({"id": image_id, "file_name": image_file_name(image_id), "width": width, "height": height})
    labels = ex["objects"]["label"]
    anns = example_annotations(ex[INSTANCE_MAP], labels, image_id, len(annotations) + 1)
    occluded += len(labels) - len(anns)
    annotations += anns
    if images_dir:
      with safe_files.open_atomic(os.path.join(images_dir, image_file_name(image_id)), "wb", root=images_dir) as f:
        Image.fromarray(ex["image"]).save(f, format="PNG")
  if not images:
    raise UserError(f"{builder.name}/{split} holds no example.")
  return {
    "info": {
      "description": f"{builder.name}/{builder.builder_config.name if builder.builder_config else ''} {split}",
      "version": str(builder.version),
      "objects_fully_occluded": occluded,
    },
    "images": images,
    "annotations": annotations,
    "categories": categories(builder),
  }


def write_json(data: dict, out: str) -> None:
  """Writes `data` to `out` atomically (safe_files: a fresh temporary file renamed into place, no link followed)."""
  safe_files.make_dirs(os.path.dirname(os.path.abspath(out)))
  safe_files.write_json(out, data, indent=None)


def write_instances(
  dataset: str,
  split: str,
  out: str,
  images_dir: str | None = None,
  data_dir: str | None = None,
  config_name: str | None = None,
  limit: int = 0,
) -> dict:
  """Writes `split`'s COCO instances JSON to `out` (and its images to `images_dir`); returns the counts."""
  builder = instances_builder(dataset, data_dir, config_name)
  data = coco_instances(builder, split, limit, images_dir)
  write_json(data, out)
  counts = {"images": len(data["images"]), "annotations": len(data["annotations"])}
  counts["objects_fully_occluded"] = data["info"]["objects_fully_occluded"]
  logging.info("Wrote %s to %s.", counts, out)
  return counts


def define_flags():
  """Command-line flags (defined only when run as a command, so importing the module defines none)."""
  flags.DEFINE_string("dataset", "synthetic_scenes", "A dataset with visible-instance maps (synthetic_scenes).")
  flags.DEFINE_string("config_name", None, "The dataset's builder config (synthetic_scenes: default, tiny, ...).")
  flags.DEFINE_string(
    "data_dir",
    defaults.DATA_DIR,
    "Where the dataset is (the configs' default; generated there on first use).",
  )
  flags.DEFINE_string("split", "val", "The split, e.g. train, val, probe_test.")
  flags.DEFINE_string("out", None, "The COCO instances JSON to write.")
  flags.DEFINE_string("images", None, "Also write the images as PNG files into this folder (the JSON's file_name).")
  flags.DEFINE_integer("limit", 0, "Only the split's first N examples (0: all).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  counts = write_instances(f.dataset, f.split, f.out, f.images, f.data_dir, f.config_name, f.limit)
  print(
    f"Wrote {counts['images']} images and {counts['annotations']} instances to {f.out} "
    f"({counts['objects_fully_occluded']} objects fully occluded, not annotated)",
    flush=True,
  )


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["out"])
  app.run(exit_2_on_user_error(main))
