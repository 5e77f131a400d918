"""PASCAL VOC 2007 classification from a local copy (manual_dir = the VOCdevkit/VOC2007 folder, or VOCdevkit):

  VOC2007/ImageSets/Main/trainval.txt, test.txt    image ids, one per line
  VOC2007/Annotations/<id>.xml                     objects: <name>, <difficult>, <bndbox>
  VOC2007/JPEGImages/<id>.jpg

Prepared with `python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=PATH`. Objects keep their
'difficult' flag, which the VOC07 protocol ignores; unknown class names and unreadable images are skipped and
counted. Images are stored as a viewer shows them (vlrep.data.images): an upright RGB or grayscale JPEG (all of
VOC2007's) byte for byte, others converted and counted in the report's `converted`; an image whose EXIF orientation
turns it across its annotation's size (the boxes were drawn on the stored pixels) is skipped and counted.
"""

from __future__ import annotations

import io
import os
import xml.etree.ElementTree as ET

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from vlrep import errors
from vlrep.data import manual_files

CLASSES = (
  "aeroplane",
  "bicycle",
  "bird",
  "boat",
  "bottle",
  "bus",
  "car",
  "cat",
  "chair",
  "cow",
  "diningtable",
  "dog",
  "horse",
  "motorbike",
  "person",
  "pottedplant",
  "sheep",
  "sofa",
  "train",
  "tvmonitor",
)

TURNED_ACROSS = "EXIF orientation turns the image across its annotation's size (its boxes would be misplaced)"


class Voc2007(tfds.core.GeneratorBasedBuilder):
  """VOC2007 images with object labels, boxes and 'difficult' flags (trainval and test)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": tfds.features.Text(),
          "objects": tfds.features.Sequence(
            {
              "label": tfds.features.ClassLabel(names=CLASSES),
              "bbox": tfds.features.BBoxFeature(),
              "is_difficult": np.bool_,
            }
          ),
        }
      ),
      homepage="http://host.robots.ox.ac.uk/pascal/VOC/voc2007/",
      # `converted`: the images stored after a conversion (vlrep.data.images), in the prepare report.
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (manual_files.CONVERTED)
    root = str(dl_manager.manual_dir)
    if os.path.isdir(os.path.join(root, "VOC2007")):
      root = os.path.join(root, "VOC2007")
    sets = os.path.join(root, "ImageSets", "Main")
    if not os.path.isdir(sets):
      raise FileNotFoundError(f"No ImageSets/Main under {root}. Expected layout:\n{__doc__}")
    return {
      split: self._generate_examples(root, split)
      for split in ("trainval", "test")
      if os.path.exists(os.path.join(sets, f"{split}.txt"))
    }

  def _generate_examples(self, root: str, split: str):
    ids_file = os.path.join(root, "ImageSets", "Main", f"{split}.txt")
    with errors.reading(ids_file, "VOC image set file", "Expected one image id per line, as in VOCdevkit."):
      with manual_files.open_regular(ids_file) as f:
        ids = [_id_line(raw, number) for number, raw in manual_files.lines(f, 4096)]
        ids = [i for i in ids if i]
    for image_id in ids:
      image_path = os.path.join(root, "JPEGImages", f"{image_id}.jpg")
      try:
        with manual_files.open_regular(os.path.join(root, "Annotations", f"{image_id}.xml")) as f:
          tree = ET.parse(f)
      except (OSError, ET.ParseError) as e:  # missing, not a regular file, not XML
        manual_files.skip("voc2007", f"bad annotation ({type(e).__name__})", image_id)
        continue
      raw = manual_files.read_image_file(image_path, "voc2007", root)
      stored = None if raw is None else manual_files.viewer_jpeg(raw, "voc2007", image_path)
      if stored is None:
        continue
      try:
        objects = _objects(tree, image_id)
        annotated = (float(tree.find("size").findtext("width")), float(tree.find("size").findtext("height")))
      except (TypeError, ValueError, AttributeError, ArithmeticError) as e:  # no numeric size or box coordinates
        manual_files.skip("voc2007", f"bad annotation ({type(e).__name__})", image_id)
        continue
      self.info.metadata["converted"] = manual_files.converted("voc2007")
      width, height = stored[1]
      with Image.open(io.BytesIO(raw)) as im:  # the header only: the stored size, before any EXIF orientation
        turned = im.size != stored[1]
      if turned and annotated == (height, width):
        # The boxes (normalised by the annotation's size) were drawn on the stored pixels: turned upright, they
        # would lie across the wrong part of the image.
        manual_files.skip("voc2007", TURNED_ACROSS, image_id)
        continue
      yield image_id, {"image": stored[0], "image_id": image_id, "objects": objects}


def _id_line(raw: bytes | None, number: int) -> str:
  if raw is None:
    raise ValueError(f"line {number} is longer than an image id (4096 bytes)")
  return raw.decode("utf-8").strip()


def _objects(tree, image_id: str) -> list[dict]:
  """The known objects of one VOC annotation; unknown class names and boxes that are not inside the image with
  min <= max counted and dropped."""
  size = tree.find("size")
  w, h = float(size.findtext("width")), float(size.findtext("height"))
  objects = []
  for obj in tree.findall("object"):
    name = obj.findtext("name", "").strip()
    if name not in CLASSES:
      manual_files.skip("voc2007", "unknown class name", f"{image_id}/{name!r}")
      continue
    box = obj.find("bndbox")
    xmin, ymin, xmax, ymax = (float(box.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
    bbox = tfds.features.BBox(max(ymin - 1, 0) / h, max(xmin - 1, 0) / w, min(ymax / h, 1), min(xmax / w, 1))
    if not (0 <= bbox.ymin <= bbox.ymax <= 1 and 0 <= bbox.xmin <= bbox.xmax <= 1):  # NaN fails too
      manual_files.skip("voc2007", "box not inside the image with min <= max (dropped)", f"{image_id}/{name}")
      continue
    objects.append({"label": name, "bbox": bbox, "is_difficult": obj.findtext("difficult", "0").strip() == "1"})
  return objects
