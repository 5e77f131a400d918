"""VQA 2.0 (Goyal et al. 2017), one of the vision-and-language study's datasets (see _vl_datasets)."""

from __future__ import annotations

import collections
import os

import tensorflow_datasets as tfds

from vlrep.data import manual_files
from vlrep.data.builders import _vl_datasets


class Vqa2(tfds.core.GeneratorBasedBuilder):
  """VQA 2.0 (Goyal et al. 2017) from a local copy (manual_dir), with the COCO 2014 images:

    MANUAL_DIR/v2_OpenEnded_mscoco_{train,val}2014_questions.json   {"questions": [{image_id, question, question_id}]}
    MANUAL_DIR/v2_mscoco_{train,val}2014_annotations.json          {"annotations": [{question_id, answers: [{answer,
                                                                    answer_confidence, answer_id}] x 10, ...}]}
    MANUAL_DIR/{train,val}2014/COCO_{train,val}2014_000000000009.jpg

  Splits train and val (test-dev has no answers). Questions without an annotation keep no answers ('' x 10; VQA
  accuracy scores them 0) and are counted."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__
  SPLITS = {"train": "train2014", "val": "val2014"}

  def _info(self):
    return self.dataset_info_from_configs(
      features=_vl_datasets.qa_features(), homepage="https://visualqa.org", metadata=tfds.core.MetadataDict()
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_vl_datasets.stored_image)
    root, out = dl_manager.manual_dir, {}
    for split, folder in self.SPLITS.items():
      questions = os.path.join(root, f"v2_OpenEnded_mscoco_{folder}_questions.json")
      if os.path.exists(questions):
        annotations = os.path.join(root, f"v2_mscoco_{folder}_annotations.json")
        out[split] = self._generate_examples(questions, annotations, os.path.join(root, folder), folder, root)
    if not out:
      raise FileNotFoundError(
        f"No v2_OpenEnded_mscoco_*_questions.json under {root}. Expected layout:\n{self.MANUAL_DOWNLOAD_INSTRUCTIONS}"
      )
    return out

  def _generate_examples(self, questions_file, annotations_file, image_dir, folder, root=None):
    with _vl_datasets.structure(questions_file, "vqa2"):
      questions = _vl_datasets.load_json(questions_file, "vqa2")["questions"]
    annotations = {}
    if os.path.exists(annotations_file):
      with _vl_datasets.structure(annotations_file, "vqa2"):
        annotations = {a["question_id"]: a for a in _vl_datasets.load_json(annotations_file, "vqa2")["annotations"]}
    with _vl_datasets.structure(questions_file, "vqa2"):
      by_image = self._by_image(questions, annotations)
    for image_id, qs in sorted(by_image.items()):
      path = os.path.join(image_dir, f"COCO_{folder}_{image_id:012d}.jpg")
      image = _vl_datasets.stored_image(self, path, "vqa2", root)
      if image is not None:
        yield image_id, {"image": image, "image_id": image_id, "questions": qs}

  @staticmethod
  def _by_image(questions, annotations) -> dict:
    by_image = collections.defaultdict(list)
    for q in questions:
      text = (q.get("question") or "").strip()
      if not text:
        manual_files.skip("vqa2", "empty question", f"question {q.get('question_id')}")
        continue
      ann = annotations.get(q["question_id"])
      if ann is None:
        manual_files.skip("vqa2", "question without an annotation (no answers)", f"question {q['question_id']}")
      answers = _vl_datasets.answers(ann["answers"] if ann else [], "vqa2", q["question_id"])
      by_image[int(q["image_id"])].append({"question": text, "answers": answers, "question_id": q["question_id"]})
    return by_image
