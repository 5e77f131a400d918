"""COCO Captions 2017 from a local copy (manual_dir):

  MANUAL_DIR/annotations/captions_train2017.json   MANUAL_DIR/train2017/000000000009.jpg ...
  MANUAL_DIR/annotations/captions_val2017.json     MANUAL_DIR/val2017/...
  MANUAL_DIR/annotations/instances_{train,val}2017.json   optional: the 80 object categories per image
                                                         ('objects/label', MCT's tags; empty without it)

Prepared with `python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=MANUAL_DIR`.
Images that are missing or do not decode, empty captions, and images left without captions are skipped and
counted (printed by the prepare command and saved in its report). An annotation file that is not COCO's JSON is
one message naming it (exit status 2); an image file_name that resolves outside MANUAL_DIR stops prepare unless
--allow_outside_manual_dir is given. Images are stored as a viewer shows them (vlrep.data.images): an upright RGB or
grayscale JPEG byte for byte, an EXIF-rotated, CMYK, 16-bit, transparent or non-JPEG file converted and counted in
the report's `converted`.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np
import tensorflow_datasets as tfds

from vlrep import errors
from vlrep.data import manual_files

_HINT = "Expected COCO's annotations JSON ({'images': [...], 'annotations': [...]}), as downloaded."

_SPLITS = {"train": "train2017", "val": "val2017"}
_NAME = "coco_captions2017"


class CocoCaptions2017(tfds.core.GeneratorBasedBuilder):
  """COCO Captions (Chen et al. 2015), 2017 splits: images with their (usually five) captions."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.0.0": "First release.", "1.1.0": "Object categories from the instance annotations."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "captions": tfds.features.Sequence(tfds.features.Text()),
          # Category index 0..79 (COCO's category ids in increasing order), one entry per instance.
          "objects": tfds.features.Sequence({"label": tfds.features.ClassLabel(num_classes=80)}),
        }
      ),
      homepage="https://cocodataset.org",
      # `converted`: the images stored after a conversion (vlrep.data.images), in the prepare report.
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    root = dl_manager.manual_dir
    self.info.metadata["converted"] = {}  # filled as images are stored (manual_files.CONVERTED)
    out = {}
    for split, folder in _SPLITS.items():
      ann = os.path.join(root, "annotations", f"captions_{folder}.json")
      if os.path.exists(ann):
        instances = os.path.join(root, "annotations", f"instances_{folder}.json")
        out[split] = self._generate_examples(ann, os.path.join(root, folder), instances, os.fspath(root))
    if not out:
      raise FileNotFoundError(f"No annotations/captions_*2017.json under {root}. Expected layout:\n{__doc__}")
    return out

  def _generate_examples(self, annotation_file: str, image_dir: str, instances_file: str = "", root: str = ""):
    labels = collections.defaultdict(list)
    if instances_file and os.path.exists(instances_file):
      with errors.reading(instances_file, "COCO instances annotation file", _HINT):
        with manual_files.open_regular(instances_file) as f:
          instances = json.load(f)
        index = {cat["id"]: i for i, cat in enumerate(sorted(instances["categories"], key=lambda c: c["id"]))}
        for ann in instances["annotations"]:
          if ann.get("category_id") in index:
            labels[ann["image_id"]].append(index[ann["category_id"]])
          else:
            manual_files.skip("coco_captions2017", "instance with unknown category", f"annotation {ann.get('id')}")
    # A file whose structure is not COCO's (a key missing, a list where an object belongs) is a BadFile naming
    # it: the images are read inside the block, but their own errors are counted skips (manual_files.viewer_jpeg).
    with errors.reading(annotation_file, "COCO captions annotation file", _HINT):
      with manual_files.open_regular(annotation_file) as f:
        data = json.load(f)
      captions = collections.defaultdict(list)
      for ann in data["annotations"]:
        text = (ann.get("caption") or "").strip()
        if text:
          captions[ann["image_id"]].append(text)
        else:
          manual_files.skip("coco_captions2017", "empty caption", f"annotation {ann.get('id')}")
      for image in data["images"]:
        image_id = image["id"]
        if not captions.get(image_id):
          manual_files.skip("coco_captions2017", "image without captions", image["file_name"])
          continue
        path = os.path.join(image_dir, image["file_name"])
        # Stored as a viewer shows it (manual_files.viewer_jpeg): an upright RGB or grayscale JPEG, as nearly all of
        # COCO's are, byte for byte; an EXIF-rotated, CMYK or non-JPEG file converted and counted.
        raw = manual_files.read_image_file(path, _NAME, root or None)
        stored = None if raw is None else manual_files.viewer_jpeg(raw, _NAME, path)
        if stored is None:
          continue
        self.info.metadata["converted"] = manual_files.converted(_NAME)
        objects = {"label": labels.get(image_id, [])}
        yield image_id, {"image": stored[0], "image_id": image_id, "captions": captions[image_id], "objects": objects}
