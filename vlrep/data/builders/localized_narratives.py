"""Localized Narratives (Pont-Tuset et al. 2020) on COCO 2017 (and Open Images) from a local copy (manual_dir):

  MANUAL_DIR/localized_narratives/coco_train_localized_narratives*.jsonl      (the official files, as
  MANUAL_DIR/localized_narratives/coco_val_localized_narratives*.jsonl         downloaded; shards allowed)
  MANUAL_DIR/localized_narratives/open_images_train_v6_localized_narratives*.jsonl   (coco_openimages only)
  MANUAL_DIR/train2017/000000000009.jpg ...   MANUAL_DIR/val2017/...             (COCO images)
  MANUAL_DIR/open_images/train/0a0b1c2d3e4f5a6b.jpg ...                          (coco_openimages only)

Prepared with `python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=MANUAL_DIR`
(`--config_name=coco_openimages` adds Open Images to train). Each JSONL line is one narration:
{"dataset_id", "image_id", "annotator_id", "caption", "timed_caption": [{"utterance", "start_time",
"end_time"}], "traces": [[{"x", "y", "t"}, ...], ...]}. Every narration becomes one example; its trace
segments are concatenated into points [N, 3] (x, y, t) kept as recorded (points outside the image are dropped
and counted at training time by `clean_traces`). Open Images pictures are downsampled by 0.6 (LocTex: to
match COCO's resolution). Images are stored as a viewer shows them (vlrep.data.images): a COCO JPEG that is upright
RGB or grayscale byte for byte, others converted and counted in the report's `converted`.

Skipped and counted (printed by the prepare command and saved in its report): lines that are not valid JSON or
lack caption/image_id, empty captions, missing or undecodable images. Malformed timed words or trace points
(missing or non-numeric fields) are dropped and counted; the narration is kept.
"""

from __future__ import annotations

import glob
import io
import json
import os

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from vlrep import errors
from vlrep.data import images, manual_files

OPEN_IMAGES_SCALE = 0.6
_NAME = "localized_narratives"


class LnConfig(tfds.core.BuilderConfig):
  def __init__(self, *, open_images: bool, **kwargs):
    super().__init__(**kwargs)
    self.open_images = open_images


def _float(value) -> float | None:
  try:
    f = float(value)
  except (TypeError, ValueError, OverflowError):  # OverflowError: an integer of hundreds of digits
    return None
  return f


def trace_point(point) -> list[float] | None:
  """One point of an LN trace segment, {"x", "y", "t"} -> [x, y, t]; None if it is not a dict or a field is
  missing or not a number. Shared with the image_text builder, which adds its own checks on the values."""
  xyt = [_float(point.get(k)) for k in ("x", "y", "t")] if isinstance(point, dict) else [None]
  return None if any(v is None for v in xyt) else xyt


def timed_word(entry) -> dict | None:
  """One entry of an LN timed_caption -> {"utterance": str, "start_time", "end_time"} (each time a float, or None
  if missing or not a number); None if the entry is not a dict with an utterance. Shared with image_text."""
  if not isinstance(entry, dict) or "utterance" not in entry:
    return None
  start, end = _float(entry.get("start_time")), _float(entry.get("end_time"))
  return {"utterance": str(entry["utterance"]), "start_time": start, "end_time": end}


def _list(value) -> list:
  return value if isinstance(value, list) else []


def _int(value) -> int:
  """An annotator id: an integer (or a string of one) in int64's range; 0 otherwise."""
  try:
    n = int(value or 0)
  except (TypeError, ValueError, OverflowError):
    return 0
  return n if -(2**63) <= n < 2**63 else 0


def parse_narration(line: str) -> dict | None:
  """One JSONL line -> {source, image_id, annotator_id, narration, timed_caption, traces}; None (counted) if
  the line cannot be used."""
  try:
    record = json.loads(line)
  except (ValueError, RecursionError):  # not JSON, an integer too long to read, nested too deep
    manual_files.skip(_NAME, "line is not valid JSON", line[:60])
    return None
  if not isinstance(record, dict) or "image_id" not in record or "caption" not in record:
    manual_files.skip(_NAME, "line without image_id or caption", line[:60])
    return None
  caption = str(record.get("caption") or "").strip()
  if not caption:
    manual_files.skip(_NAME, "empty caption", f"image {record['image_id']}")
    return None
  timed = []
  for entry in _list(record.get("timed_caption")):
    word = timed_word(entry)
    if word is None or word["start_time"] is None or word["end_time"] is None:
      manual_files.SKIPPED[(_NAME, "malformed timed word (dropped)")] += 1
      continue
    timed.append(word)
  points = []
  for segment in _list(record.get("traces")):
    for p in segment if isinstance(segment, list) else []:
      xyt = trace_point(p)
      if xyt is None:
        manual_files.SKIPPED[(_NAME, "malformed trace point (dropped)")] += 1
        continue
      points.append(xyt)
  traces = np.asarray(points, np.float32).reshape(-1, 3)
  if not len(traces):
    manual_files.SKIPPED[(_NAME, "narration without trace points (kept)")] += 1
  return {
    "source": str(record.get("dataset_id", "")),
    "image_id": str(record["image_id"]),
    "annotator_id": _int(record.get("annotator_id")),
    "narration": caption,
    "timed_caption": timed,
    "traces": traces,
  }


def _downsampled_jpeg(data: bytes, scale: float, what: str) -> bytes | None:
  """An Open Images picture as a viewer shows it (vlrep.data.images; each conversion counted in manual_files.CONVERTED)
  scaled by `scale`, as JPEG; None (a counted skip) when it is over manual_files.LIMITS or does not decode."""
  try:
    with manual_files.decode_image(data) as im:
      rgb, notes = images.viewer_rgb(im)
  except Exception as e:  # PIL raises many types for corrupt files
    manual_files.skip(_NAME, manual_files.image_skip_reason(e), what)
    return None
  for note in notes:
    manual_files.CONVERTED[(_NAME, note)] += 1
  size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
  out = io.BytesIO()
  rgb.resize(size, Image.BICUBIC).save(out, format="JPEG", quality=images.JPEG_QUALITY, subsampling=0)
  return out.getvalue()


class LocalizedNarratives(tfds.core.GeneratorBasedBuilder):
  """Localized Narratives: captions spoken while pointing, with per-word times and mouse traces."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__
  BUILDER_CONFIGS = [
    LnConfig(name="coco", description="COCO train2017 / val2017 narrations.", open_images=False),
    LnConfig(name="coco_openimages", description="Train adds Open Images v6 (images x0.6).", open_images=True),
  ]

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": tfds.features.Text(),
          "source": tfds.features.Text(),
          "annotator_id": np.int64,
          "narration": tfds.features.Text(),
          "timed_caption": tfds.features.Sequence(
            {"utterance": tfds.features.Text(), "start_time": np.float32, "end_time": np.float32}
          ),
          "traces": tfds.features.Tensor(shape=(None, 3), dtype=np.float32),
        }
      ),
      homepage="https://google.github.io/localized-narratives/",
      # `converted`: the images stored after a conversion (vlrep.data.images), in the prepare report.
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (manual_files.CONVERTED)
    root = os.fspath(dl_manager.manual_dir)
    ann = os.path.join(root, "localized_narratives")
    sources = {
      "train": [("coco_train_localized_narratives*.jsonl", os.path.join(root, "train2017"), "coco")],
      "val": [("coco_val_localized_narratives*.jsonl", os.path.join(root, "val2017"), "coco")],
    }
    if self.builder_config.open_images:
      sources["train"].append(
        ("open_images_train_v6_localized_narratives*.jsonl", os.path.join(root, "open_images", "train"), "oi")
      )
    out = {}
    for split, parts in sources.items():
      files = [(sorted(glob.glob(os.path.join(ann, pattern))), images, kind) for pattern, images, kind in parts]
      if not any(f for f, _, _ in files):
        continue
      for (f, _, _), (pattern, _, _) in zip(files, parts, strict=True):
        if not f:
          raise FileNotFoundError(f"No {pattern} in {ann}. Expected layout:\n{__doc__}")
      out[split] = self._generate_examples(files)
    if "train" not in out:
      raise FileNotFoundError(f"No coco_train_localized_narratives*.jsonl in {ann}. Expected layout:\n{__doc__}")
    return out

  def _generate_examples(self, files):
    limit = manual_files.LIMITS.max_text_bytes
    for paths, image_dir, kind in files:
      root = os.path.dirname(os.path.dirname(paths[0])) if paths else None  # MANUAL_DIR/localized_narratives/..
      for path in paths:
        with errors.reading(path, "Localized Narratives JSONL file"), manual_files.open_regular(path) as f:
          for line_no, raw in manual_files.lines(f, limit):
            line_no -= 1  # keys count from 0, as before
            try:
              line = raw.decode("utf-8") if raw is not None else None
            except UnicodeDecodeError:
              manual_files.skip(_NAME, "line not UTF-8", f"{os.path.basename(path)}:{line_no}")
              continue
            if line is None:
              manual_files.skip(
                _NAME, f"line over {limit:,} bytes (--max_text_bytes)", f"{os.path.basename(path)}:{line_no}"
              )
              continue
            if not line.strip():
              continue
            n = parse_narration(line)
            if n is None:
              continue
            if kind == "coco":
              if not n["image_id"].isdigit():
                manual_files.skip(_NAME, "COCO image_id is not a number", n["image_id"])
                continue
              image_path = os.path.join(image_dir, f"{int(n['image_id']):012d}.jpg")
            else:
              image_path = os.path.join(image_dir, f"{n['image_id']}.jpg")
            # Stored as a viewer shows it: a COCO image that already is (an upright RGB or grayscale JPEG) byte
            # for byte (manual_files.viewer_jpeg); an Open Images picture downsampled from what a viewer shows.
            raw = manual_files.read_image_file(image_path, _NAME, root)
            if raw is None:
              continue
            if kind == "coco":
              stored = manual_files.viewer_jpeg(raw, _NAME, image_path)
              image = None if stored is None else stored[0]
            else:
              image = _downsampled_jpeg(raw, OPEN_IMAGES_SCALE, image_path)
            if image is None:
              continue
            self.info.metadata["converted"] = manual_files.converted(_NAME)
            key = f"{os.path.basename(path)}:{line_no}"
            yield key, {**n, "image": image}
