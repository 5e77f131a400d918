"""Conceptual Captions 3M (Sharma et al. 2018), one of the vision-and-language study's datasets (see
_vl_datasets)."""

from __future__ import annotations

import csv
import os

import numpy as np
import tensorflow_datasets as tfds

from vlrep import errors
from vlrep.data import manual_files
from vlrep.data.builders import _vl_datasets


class ConceptualCaptions(tfds.core.GeneratorBasedBuilder):
  """Conceptual Captions 3M (Sharma et al. 2018) from a local copy (manual_dir): the official TSVs and the images
  a downloader saved under the row's index (about a sixth of the URLs are dead: those rows are skipped and counted):

    MANUAL_DIR/Train_GCC-training.tsv              caption <TAB> url, one image per line
    MANUAL_DIR/Validation_GCC-1.1.0-Validation.tsv
    MANUAL_DIR/training/<row>.jpg                  row = the 0-based line number in the TSV
    MANUAL_DIR/validation/<row>.jpg
  """

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__
  FILES = {
    "train": ("Train_GCC-training.tsv", "training"),
    "val": ("Validation_GCC-1.1.0-Validation.tsv", "validation"),
  }

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "captions": tfds.features.Sequence(tfds.features.Text()),
        }
      ),
      homepage="https://ai.google.com/research/ConceptualCaptions",
      metadata=tfds.core.MetadataDict(),  # `converted` (_vl_datasets.stored_image)
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_vl_datasets.stored_image)
    root, out = dl_manager.manual_dir, {}
    for split, (tsv, folder) in self.FILES.items():
      if os.path.exists(os.path.join(root, tsv)):
        out[split] = self._generate_examples(os.path.join(root, tsv), os.path.join(root, folder), root)
    if not out:
      raise FileNotFoundError(
        f"No Conceptual Captions TSV under {root}. Expected layout:\n{self.MANUAL_DOWNLOAD_INSTRUCTIONS}"
      )
    return out

  def _generate_examples(self, tsv, image_dir, root=None):
    with errors.reading(tsv, "Conceptual Captions TSV", "Expected UTF-8 lines caption<TAB>url, as downloaded."):
      yield from self._rows(tsv, image_dir, root)

  def _rows(self, tsv, image_dir, root):
    with manual_files.open_regular(tsv) as f:
      for row, fields in enumerate(csv.reader(_vl_datasets.texts(f), delimiter="\t", quoting=csv.QUOTE_NONE)):
        caption = fields[0].strip() if fields else ""
        if not caption:
          manual_files.skip("conceptual_captions", "empty caption", f"{tsv}:{row}")
          continue
        path = os.path.join(image_dir, f"{row}.jpg")
        image = _vl_datasets.stored_image(self, path, "conceptual_captions", root)
        if image is not None:
          yield row, {"image": image, "image_id": row, "captions": [caption]}
