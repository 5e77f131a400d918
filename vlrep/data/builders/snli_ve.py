"""SNLI-VE (Xie et al. 2019), one of the vision-and-language study's datasets (see _vl_datasets)."""

from __future__ import annotations

import collections
import json
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from vlrep import errors
from vlrep.data import manual_files
from vlrep.data.builders import _vl_datasets

ENTAILMENT_LABELS = ("entailment", "contradiction", "neutral")  # synthetic_scenes' order (scenes.ENTAILMENT_LABELS)


class SnliVe(tfds.core.GeneratorBasedBuilder):
  """SNLI-VE (Xie et al. 2019) from a local copy (manual_dir), with the Flickr30k images:

    MANUAL_DIR/snli_ve_{train,dev,test}.jsonl   one pair per line: {"Flikr30kID": "2248275918.jpg", "sentence1"
                                                (the premise caption), "sentence2" (the hypothesis), "gold_label":
                                                entailment|neutral|contradiction, "pairID", ...}
    MANUAL_DIR/flickr30k_images/2248275918.jpg

  Splits train, val (the dev file) and test. Pairs whose gold_label is '-' (no annotator consensus, as in SNLI)
  are skipped and counted, as are empty hypotheses and malformed lines."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "captions": tfds.features.Sequence(tfds.features.Text()),
          "entailment": tfds.features.Sequence(
            {"statement": tfds.features.Text(), "label": tfds.features.ClassLabel(names=ENTAILMENT_LABELS)}
          ),
        }
      ),
      homepage="https://github.com/necla-ml/SNLI-VE",
      metadata=tfds.core.MetadataDict(),  # `converted` (_vl_datasets.stored_image)
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_vl_datasets.stored_image)
    root, out = dl_manager.manual_dir, {}
    for split, name in (("train", "train"), ("val", "dev"), ("test", "test")):
      path = os.path.join(root, f"snli_ve_{name}.jsonl")
      if os.path.exists(path):
        out[split] = self._generate_examples(path, os.path.join(root, "flickr30k_images"), root)
    if not out:
      raise FileNotFoundError(f"No snli_ve_*.jsonl under {root}. Expected layout:\n{self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    return out

  def _generate_examples(self, path, image_dir, root=None):
    pairs, premises = collections.defaultdict(list), collections.defaultdict(list)
    with errors.reading(path, "SNLI-VE JSONL file"), manual_files.open_regular(path) as f:
      for n, raw in manual_files.lines(f, manual_files.LIMITS.max_text_bytes):
        try:
          line = raw.decode("utf-8")
          if not line.strip():
            continue
          item = json.loads(line)
          name = item["Flikr30kID"] if "Flikr30kID" in item else item["Flickr30kID"]
          if not isinstance(name, str):
            raise TypeError(name)
        except (AttributeError, ValueError, RecursionError, KeyError, TypeError):  # too long, not UTF-8, not JSON
          manual_files.skip("snli_ve", "malformed line", f"{path}:{n}")
          continue
        label, statement = item.get("gold_label", "-"), str(item.get("sentence2") or "").strip()
        if not isinstance(label, str) or label not in ENTAILMENT_LABELS:
          manual_files.skip("snli_ve", "no gold label ('-')", f"pair {item.get('pairID', n)}")
          continue
        if not statement:
          manual_files.skip("snli_ve", "empty hypothesis", f"pair {item.get('pairID', n)}")
          continue
        pairs[name].append({"statement": statement, "label": label})
        premise = str(item.get("sentence1") or "").strip()
        if premise and premise not in premises[name]:
          premises[name].append(premise)
    for name, items in sorted(pairs.items()):
      path = os.path.join(image_dir, name)
      image = _vl_datasets.stored_image(self, path, "snli_ve", root)
      if image is not None:
        image_id = int(re.sub(r"\D", "", name) or 0)
        yield name, {"image": image, "image_id": image_id, "captions": premises[name], "entailment": items}
