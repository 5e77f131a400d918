"""Your own image-text data (manual_dir), in either of two layouts:

  (a) webdataset / img2dataset shards:  MANUAL_DIR/*.tar, each holding KEY.jpg (or .jpeg, .png, .webp) beside
      KEY.txt (the caption) and/or KEY.json ({"caption": "...", "tags": ["...", ...]}, as img2dataset writes);
  (b) a folder of images with MANUAL_DIR/captions.jsonl, one {"image": "relative/path.jpg", "caption": "...",
      "tags": [...]} per line, or MANUAL_DIR/captions.csv with the header image,caption[,tags] (tags separated
      by '|').

Prepared with `python -m vlrep.data.prepare --dataset=image_text --manual_dir=MANUAL_DIR`; one split, 'train'
(take a validation set with 'train[:N%]' elsewhere or keep one in another folder). Rows naming the same image are
grouped into one example holding all its captions and tags. Skipped and counted in the prepare report: lines that
are not UTF-8 or not JSON, rows without an image or caption field, empty captions, missing and undecodable
images, captions that are not strings, unreadable shards (a torn shard keeps the examples before the break),
images without a caption and captions without an image (mismatched keys in a shard).
"""

from __future__ import annotations

import collections
import csv
import glob
import io
import json
import os
import tarfile

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from vlrep.data.builders import common

NAME = "image_text"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class ImageText(tfds.core.GeneratorBasedBuilder):
  """Images with their captions (and optional tags) from webdataset shards or a folder with a JSONL/CSV index."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "key": tfds.features.Text(),  # the shard member's key or the image's path under manual_dir
          "captions": tfds.features.Sequence(tfds.features.Text()),
          "tags": tfds.features.Sequence(tfds.features.Text()),
        }
      ),
      homepage="https://github.com/vlrep/vlrep",
    )

  def _split_generators(self, dl_manager):
    root = os.fspath(dl_manager.manual_dir)
    return {"train": self._generate_examples(root)}

  def _generate_examples(self, root: str):
    for image_id, (key, image, captions, tags) in enumerate(read_manual_dir(root)):
      yield key, {"image": io.BytesIO(image), "image_id": image_id, "key": key, "captions": captions, "tags": tags}


def read_manual_dir(root: str):
  """(key, encoded JPEG, captions, tags) per usable image of `root`, in key order; skips counted in common."""
  shards = sorted(glob.glob(os.path.join(root, "*.tar")))
  if shards:
    return _from_shards(shards)
  for name, read in (("captions.jsonl", _jsonl_rows), ("captions.csv", _csv_rows)):
    if os.path.exists(os.path.join(root, name)):
      return _from_index(root, read(os.path.join(root, name)))
  raise FileNotFoundError(
    f"{root} holds neither webdataset shards (*.tar) nor captions.jsonl / captions.csv. Expected layout:\n{__doc__}"
  )


def _jpeg(data: bytes, what: str) -> bytes | None:
  """The image as JPEG bytes (JPEGs kept as they are), or None (counted) if it does not decode."""
  try:
    with Image.open(io.BytesIO(data)) as im:
      im.load()
      if im.format == "JPEG" and im.mode in ("RGB", "L"):
        return data
      out = io.BytesIO()
      im.convert("RGB").save(out, "JPEG", quality=95)
      return out.getvalue()
  except Exception as e:  # PIL raises many types for corrupt files
    common.skip(NAME, f"undecodable image ({type(e).__name__})", what)
    return None


def _text_fields(meta: dict, what: str) -> tuple[list[str], list[str]]:
  captions = meta.get("caption", meta.get("captions", []))
  captions = list(captions) if isinstance(captions, list | tuple) else [captions]
  tags = meta.get("tags") or []
  tags = tags.split("|") if isinstance(tags, str) else list(tags) if isinstance(tags, list | tuple) else []
  strings = [c for c in captions if isinstance(c, str)]
  if len(strings) < len(captions):  # e.g. {"caption": 3} or {"captions": [null]}
    common.skip(NAME, "caption not a string", what)
  kept = [c.strip() for c in strings if c.strip()]
  if len(kept) < len(strings):
    common.skip(NAME, "empty caption", what)
  return kept, [t.strip() for t in tags if isinstance(t, str) and t.strip()]


def _from_shards(shards: list[str]):
  for shard in shards:
    members: dict[str, dict[str, bytes]] = collections.defaultdict(dict)
    key = None  # the key whose member is being read
    try:
      with tarfile.open(shard) as tar:
        for member in tar:
          if member.isfile():
            key, ext = os.path.splitext(member.name)
            members[key][ext.lower()] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError) as e:
      # A torn download or a damaged file: the examples read before the break are kept; the one being read is
      # dropped with everything after it. A file that is no tar at all keeps nothing.
      common.skip(NAME, f"unreadable shard or shard tail ({type(e).__name__})", shard)
      members.pop(key, None)
    for key in sorted(members):
      files, what = members[key], f"{os.path.basename(shard)}:{key}"
      image = next((files[s] for s in IMAGE_SUFFIXES if s in files), None)
      meta: dict = {}
      if ".json" in files:
        try:
          meta = json.loads(files[".json"].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
          common.skip(NAME, "metadata not UTF-8 JSON", what)
          meta = {}
      if ".txt" in files:
        try:
          meta["caption"] = files[".txt"].decode("utf-8")
        except UnicodeDecodeError:
          common.skip(NAME, "caption not UTF-8", what)
      has_text = ".txt" in files or ".json" in files
      if image is None:
        if has_text:
          common.skip(NAME, "caption without an image (mismatched keys)", what)
        continue
      if not has_text:
        common.skip(NAME, "image without a caption (mismatched keys)", what)
        continue
      captions, tags = _text_fields(meta, what)
      if not captions:
        common.skip(NAME, "image without captions", what)
        continue
      jpeg = _jpeg(image, what)
      if jpeg is not None:
        yield f"{os.path.basename(shard)}/{key}", jpeg, captions, tags


def _jsonl_rows(path: str):
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      what = f"{os.path.basename(path)} line {number}"
      try:
        line = raw.decode("utf-8").strip()
      except UnicodeDecodeError:
        common.skip(NAME, "line not UTF-8", what)
        continue
      if not line:
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        common.skip(NAME, "line not JSON", what)
        continue
      yield row if isinstance(row, dict) else {}, what


def _csv_rows(path: str):
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  decoded = []
  for number, raw in enumerate(lines, 1):
    try:
      decoded.append((number, raw.decode("utf-8")))
    except UnicodeDecodeError:
      common.skip(NAME, "line not UTF-8", f"{os.path.basename(path)} line {number}")
  reader = csv.DictReader(text for _, text in decoded if text.strip())
  numbers = [n for n, text in decoded if text.strip()][1:]
  for number, row in zip(numbers, reader, strict=False):
    yield dict(row), f"{os.path.basename(path)} line {number}"


def _from_index(root: str, rows):
  grouped: dict[str, tuple[list[str], list[str]]] = {}
  for row, what in rows:
    image = row.get("image")
    if not isinstance(image, str) or not image or "caption" not in row and "captions" not in row:
      common.skip(NAME, "row without an image or caption field", what)
      continue
    captions, tags = _text_fields(row, what)
    entry = grouped.setdefault(image, ([], []))
    entry[0].extend(captions)
    entry[1].extend(t for t in tags if t not in entry[1])
  for image in sorted(grouped):
    captions, tags = grouped[image]
    if not captions:
      common.skip(NAME, "image without captions", image)
      continue
    path = os.path.join(root, image)
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError:
      common.skip(NAME, "missing image file", image)
      continue
    jpeg = _jpeg(data, image)
    if jpeg is not None:
      yield image, jpeg, captions, tags
