"""VizWiz VQA (Gurari et al. 2018), one of the vision-and-language study's datasets (see _vl_datasets)."""

from __future__ import annotations

import os
import re

import tensorflow_datasets as tfds

from vlrep.data import manual_files
from vlrep.data.builders import _vl_datasets


class Vizwiz(tfds.core.GeneratorBasedBuilder):
  """VizWiz VQA (Gurari et al. 2018) from a local copy (manual_dir):

    MANUAL_DIR/annotations/{train,val}.json   [{"image": "VizWiz_train_00000000.jpg", "question": ...,
                                                "answers": [{"answer", "answer_confidence"}] x 10, "answerable": 0|1,
                                                "answer_type": ...}]
    MANUAL_DIR/{train,val}/VizWiz_train_00000000.jpg

  One question per image; 'unanswerable' is an answer like any other (it enters the answer vocabulary)."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=_vl_datasets.qa_features(), homepage="https://vizwiz.org", metadata=tfds.core.MetadataDict()
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_vl_datasets.stored_image)
    root, out = dl_manager.manual_dir, {}
    for split in ("train", "val"):
      ann = os.path.join(root, "annotations", f"{split}.json")
      if os.path.exists(ann):
        out[split] = self._generate_examples(ann, os.path.join(root, split), root)
    if not out:
      raise FileNotFoundError(
        f"No annotations/{{train,val}}.json under {root}. Expected layout:\n{self.MANUAL_DOWNLOAD_INSTRUCTIONS}"
      )
    return out

  def _generate_examples(self, annotation_file, image_dir, root=None):
    items = _vl_datasets.load_json(annotation_file, "vizwiz")
    for k, item in enumerate(items if isinstance(items, list) else []):
      if not isinstance(item, dict) or not isinstance(item.get("image", ""), str):
        manual_files.skip("vizwiz", "malformed entry", f"{annotation_file} entry {k}")
        continue
      name = item.get("image", "")
      text = (item.get("question") or "").strip()
      if not text:
        manual_files.skip("vizwiz", "empty question", name)
        continue
      digits = re.findall(r"\d+", name)
      image_id = int(digits[-1]) if digits else k
      path = os.path.join(image_dir, name)
      image = _vl_datasets.stored_image(self, path, "vizwiz", root)
      if image is None:
        continue
      q = {
        "question": text,
        "answers": _vl_datasets.answers(item.get("answers"), "vizwiz", name),
        "question_id": image_id,
      }
      yield name, {"image": image, "image_id": image_id, "questions": [q]}
