"""MM-IMDB (Arevalo et al. 2017), one of the vision-and-language study's datasets (see _vl_datasets)."""

from __future__ import annotations

import os

import numpy as np
import tensorflow_datasets as tfds

from vlrep import errors
from vlrep.data import manual_files
from vlrep.data.builders import _vl_datasets

# The 23 genres of Arevalo et al. (2017), most frequent first; MM-IMDB's other genres are too rare to split.
MMIMDB_GENRES = (
  "Drama", "Comedy", "Romance", "Thriller", "Crime", "Action", "Adventure", "Horror", "Documentary", "Mystery",
  "Sci-Fi", "Fantasy", "Family", "Biography", "War", "History", "Music", "Animation", "Musical", "Western", "Sport",
  "Short", "Film-Noir",
)  # fmt: skip


class MmImdb(tfds.core.GeneratorBasedBuilder):
  """MM-IMDB (Arevalo et al. 2017) from a local copy of the official release (manual_dir):

    MANUAL_DIR/split.json                {"train": ["0000008", ...], "dev": [...], "test": [...]}
    MANUAL_DIR/dataset/0000008.json      {"plot": ["summary", ...], "genres": ["Drama", ...], "title": ..., ...}
    MANUAL_DIR/dataset/0000008.jpeg      the poster

  Splits train, val (dev) and test. The text is the first plot summary; labels are the movie's genres among the 23
  of the paper (MMIMDB_GENRES); other genres are dropped and counted, and movies left without any are skipped."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "plot": tfds.features.Text(),
          "genres": tfds.features.Sequence(tfds.features.ClassLabel(names=MMIMDB_GENRES)),
        }
      ),
      homepage="http://lisi1.unal.edu.co/mmimdb/",
      metadata=tfds.core.MetadataDict(),  # `converted` (_vl_datasets.stored_image)
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_vl_datasets.stored_image)
    root = dl_manager.manual_dir
    splits = _vl_datasets.load_json(
      os.path.join(root, "split.json"), f"mm_imdb (expected layout:\n{self.MANUAL_DOWNLOAD_INSTRUCTIONS})"
    )
    names = {"train": "train", "val": "dev", "test": "test"}
    folder = os.path.join(root, "dataset")
    if not isinstance(splits, dict) or not all(isinstance(v, list) for v in splits.values()):
      raise errors.BadFile(f"{os.path.join(root, 'split.json')}: expected {{'train': [ids], 'dev': [...], ...}}.")
    return {s: self._generate_examples(splits[n], folder, root) for s, n in names.items() if n in splits}

  def _generate_examples(self, ids, folder, root=None):
    known = set(MMIMDB_GENRES)
    for movie in ids:
      if not (isinstance(movie, str) and movie.isdigit()):
        manual_files.skip("mm_imdb", "movie id not a string of digits", repr(movie)[:60])
        continue
      meta_path = os.path.join(folder, f"{movie}.json")
      if not os.path.exists(meta_path):
        manual_files.skip("mm_imdb", "missing metadata file", meta_path)
        continue
      meta = _vl_datasets.load_json(meta_path, "mm_imdb")
      if not isinstance(meta, dict) or not isinstance(meta.get("plot") or [], list):
        manual_files.skip("mm_imdb", "metadata not a JSON object with a plot list", meta_path)
        continue
      plots = [p.strip() for p in meta.get("plot") or [] if isinstance(p, str) and p.strip()]
      if not plots:
        manual_files.skip("mm_imdb", "movie without a plot", movie)
        continue
      genres = []
      for g in meta.get("genres") if isinstance(meta.get("genres"), list) else []:
        if not isinstance(g, str):
          continue
        if g in known and g not in genres:
          genres.append(g)
        elif g not in known:
          manual_files.skip("mm_imdb", "genre outside the 23 (dropped)", f"{movie}: {g}")
      if not genres:
        manual_files.skip("mm_imdb", "movie without any of the 23 genres", movie)
        continue
      path = os.path.join(folder, f"{movie}.jpeg")
      image = _vl_datasets.stored_image(self, path, "mm_imdb", root)
      if image is not None:
        yield movie, {"image": image, "image_id": int(movie), "plot": plots[0], "genres": genres}
