"""COCO Captions 2017 and VOC2007 prepared from fixture files in their real formats."""

import json
import os

import numpy as np
from PIL import Image

from vlrep.data import pipeline, prepare, records
from vlrep.data.builders import voc2007


def _jpeg(path, seed):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(np.random.default_rng(seed).integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(path, "JPEG")


def test_coco_captions_from_local_files(tmp_path):
  root = tmp_path / "coco"
  images = [{"id": i, "file_name": f"{i:012d}.jpg", "height": 24, "width": 32} for i in range(1, 6)]
  anns = [{"id": 100 + k, "image_id": i, "caption": f"A photo {i}, caption {k}."} for i in (1, 2, 3) for k in range(5)]
  anns.append({"id": 999, "image_id": 4, "caption": "   "})  # empty caption: image 4 has no usable caption
  os.makedirs(root / "annotations")
  with open(root / "annotations" / "captions_train2017.json", "w") as f:
    json.dump({"images": images, "annotations": anns + [{"id": 998, "image_id": 5, "caption": "a cat"}]}, f)
  # Instances: COCO's sparse category ids (1, 3, 90) map to contiguous labels in id order; 7 is unknown.
  categories = [{"id": 90, "name": "toothbrush"}, {"id": 1, "name": "person"}, {"id": 3, "name": "car"}]
  inst = [{"id": 1, "image_id": 1, "category_id": 3}, {"id": 2, "image_id": 1, "category_id": 90}]
  inst += [{"id": 3, "image_id": 2, "category_id": 7}]
  with open(root / "annotations" / "instances_train2017.json", "w") as f:
    json.dump({"images": images, "categories": categories, "annotations": inst}, f)
  for i in (1, 2, 3, 4):
    _jpeg(str(root / "train2017" / f"{i:012d}.jpg"), i)
  (root / "train2017" / f"{5:012d}.jpg").write_bytes(b"not a jpeg")  # undecodable
  report = prepare.prepare("coco_captions2017", str(root), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 3}
  assert report["skipped"] == {
    "empty caption": 1,
    "image without captions": 1,
    "undecodable image (UnidentifiedImageError)": 1,
    "instance with unknown category": 1,
  }
  builder = pipeline.get_builder("coco_captions2017", str(tmp_path / "tfds"))
  examples = {int(e["image_id"]): e for e in records.examples(builder, "train", decode_images=True)}
  assert examples[1]["image"].shape == (24, 32, 3) and len(examples[1]["captions"]) == 5
  assert (
    sorted(examples[1]["objects"]["label"].numpy().tolist()) == [1, 2] and len(examples[2]["objects"]["label"]) == 0
  )


def test_voc2007_from_local_files(tmp_path):
  root = tmp_path / "VOCdevkit" / "VOC2007"
  os.makedirs(root / "ImageSets" / "Main")
  os.makedirs(root / "Annotations")
  (root / "ImageSets" / "Main" / "trainval.txt").write_text("000001\n000002\n")
  (root / "ImageSets" / "Main" / "test.txt").write_text("000003\n")
  objects = {"000001": [("dog", 0), ("person", 1)], "000002": [("car", 0)], "000003": [("cat", 1)]}
  for image_id, objs in objects.items():
    xml = "".join(
      f"<object><name>{n}</name><difficult>{d}</difficult><bndbox><xmin>2</xmin><ymin>3</ymin>"
      f"<xmax>20</xmax><ymax>22</ymax></bndbox></object>"
      for n, d in objs
    )
    (root / "Annotations" / f"{image_id}.xml").write_text(
      f"<annotation><size><width>32</width><height>24</height><depth>3</depth></size>{xml}</annotation>"
    )
    _jpeg(str(root / "JPEGImages" / f"{image_id}.jpg"), int(image_id))
  report = prepare.prepare("voc2007", str(tmp_path / "VOCdevkit"), str(tmp_path / "tfds"))
  assert report["splits"] == {"trainval": 2, "test": 1}
  builder = pipeline.get_builder("voc2007", str(tmp_path / "tfds"))
  batches = list(
    pipeline.eval_batches(
      builder, "trainval", "decode|resize_small(32)|central_crop(24)|normalize|voc_labels(20)", ("image", "labels"), 4
    )
  )
  labels = batches[0]["labels"][:2]
  dog, person, car = (voc2007.CLASSES.index(c) for c in ("dog", "person", "car"))
  assert labels[0, dog] == 1 and labels[0, person] == 0 and labels[0, car] == -1  # person is difficult
  assert labels[1, car] == 1 and batches[0]["_mask"].tolist() == [True, True, False, False]
