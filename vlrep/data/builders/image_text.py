"""Your own image-text data (manual_dir), in either of two layouts:

  (a) webdataset / img2dataset shards:  MANUAL_DIR/*.tar, each holding KEY.jpg (or any suffix of
      vlrep.data.images.IMAGE_SUFFIXES: .jpeg, .png, .webp, .gif, .bmp, .tif, .tiff, ...) beside
      KEY.txt (the caption) and/or KEY.json ({"caption": "...", "tags": ["...", ...]}, as img2dataset writes,
      with the optional fields below);
  (b) a folder of images with MANUAL_DIR/captions.jsonl, one {"image": "relative/path.jpg", "caption": "...",
      "tags": [...]} per line (with the optional fields below), or MANUAL_DIR/captions.csv with the header
      image,caption[,tags] (tags separated by '|'; CSV carries no optional field; the delimiter ',', ';' or tab;
      a UTF-8 byte-order mark before either index is dropped).

An index that cannot give a single row (a CSV header without image and caption or with an unknown field, no row,
no JSON object with an image and a caption) is a SourceError naming what was found and what was expected,
raised by check_source before anything is prepared; so is a source of which no example survives.

Prepared with `python -m vlrep.data.prepare --dataset=image_text --manual_dir=MANUAL_DIR`; one split, 'train'
(take a validation set with 'train[:N%]' elsewhere or keep one in another folder). Rows naming the same image are
grouped into one example holding all its captions and tags: the same file under another spelling (`./a.jpg`,
`x/../a.jpg`) or another name (a link) too, counted in the report's `merged` (SAME_FILE); an image's identical
captions are kept once, counted (DUPLICATE_CAPTION). A row's `caption` and `captions` are both read (`caption`
first); in a shard KEY.txt, KEY.json's `caption` and its `captions` all are (KEY.txt equal to KEY.json's caption,
as img2dataset writes them, is one caption). The report's `row_fields` counts the rows giving each field read and
names each field ignored (`url`, `width`, ...; shard members of other suffixes as "shard member *.EXT").

Images are stored as a viewer shows them (vlrep.data.images: EXIF orientation applied, 16-bit scaled by the type's
range, 32-bit and float by their min..max, transparency over white, CMYK converted, the first frame of an
animation), each conversion counted in the report's `converted`. Skipped and counted in the prepare report: lines that
are not UTF-8 or not JSON, rows without an image or caption field, empty captions, missing and undecodable
images, captions that are not strings, unreadable shards (a torn shard keeps the examples before the break),
images without a caption and captions without an image (mismatched keys in a shard), shard metadata that is not
a UTF-8 JSON object.

A manual_dir may come from someone else; what is read from it is bounded (vlrep/data/builders/manual_files.py, the
limits are `vlrep.data.prepare` flags), each refusal counted under a reason naming its flag: an image file or shard
member over --max_file_bytes (256 MiB; a member's declared size is checked before it is read, and its read capped,
so a small gzip shard that inflates to gigabytes is never held), an index line or a shard's KEY.txt / KEY.json
over --max_text_bytes (8 MiB), an image whose header declares more than --max_image_pixels (~179 megapixels: a
decompression bomb, never decoded), a CSV line the csv module refuses, a tar header record over 1 MiB (the rest
of the shard skipped). A shard is read as webdataset reads it, a sample's files (consecutive members with one key)
together, one sample held at a time; files of a key already prepared that come apart from it are skipped. A shard
that ends in damaged data (a torn or corrupt gzip stream, a header that is not tar's) keeps the samples before the
break. Shards, the index and the images it names that resolve outside MANUAL_DIR (an absolute path, a '../'
path, a symlink) stop prepare before anything is written, counted and a few named (exit status 2), unless
--allow_outside_manual_dir is given: then they are read and the report's `outside_manual_dir` names them. An
index that is not a regular file (a folder, a FIFO) or cannot be read is one message naming it (exit status 2).

Optional fields of a captions.jsonl row or a shard's KEY.json (LocTex and the VL pretraining read them):

  Localized Narratives, exactly as in LN's JSONL: "caption" (the narration), "timed_caption": [{"utterance",
  "start_time", "end_time"}, ...] (seconds) and "traces": [[{"x", "y", "t"}, ...], ...] (segments of points; x, y
  in [0, 1] of the image, t in seconds on the timed_caption's clock). Stored as `narration` (text; '' when the
  image has none), `timed_caption` (utterance, start_time, end_time: float32) and `traces` (float32 [N, 3]: x, y,
  t, the segments concatenated), as the localized_narratives builder stores them. An image's narration comes from
  its first row (file order) with usable `traces`; the narration's caption also goes into `captions`. In a shard
  the narration is KEY.json's "caption" (it is in `captions` too, after KEY.txt's caption if present).
  Checks, each counted under the reason quoted:
    - a row with "traces" once its image has a narration: "second narration of an image (its caption kept, its
      trace not)";
    - "traces" not a list of segment lists: "traces not a list of segments (narration dropped, caption kept)";
      "timed_caption" not a list: "timed_caption not a list (narration dropped, caption kept)"; "caption" not a
      non-empty string: "narration without a caption (narration dropped)"; "timed_caption" on a row without
      "traces": "timed_caption without traces (timed words ignored)";
    - a point that is not a dict or whose x, y or t is missing, not a number or not finite: "malformed trace
      point (point dropped)" (counted per point);
    - a point with x or y outside [0, 1] by at most 0.02 is clipped to the image (LN's own data has such points);
      further out: "trace point outside the image by more than 0.02 (point dropped)" (per point);
    - no point left: "narration without usable trace points (narration dropped, caption kept)";
    - point times that decrease along the trace (segments in order): "trace times decrease (narration dropped,
      caption kept)": its words could not be matched to the right points;
    - a timed word that is not a dict with a string utterance: "malformed timed word (word dropped)" (per word);
    - a word whose start_time or end_time is missing, not a number or not finite: "timed word without numeric
      times (word kept without times: it gets no trace)"; start_time > end_time: "timed word with start_time >
      end_time (word kept without times: it gets no trace)". Such a word keeps its utterance (so the words still
      spell the caption) with both times stored as NaN, which LocTex's trace_words gives no points;
    - a word spoken entirely before the first or after the last point: "timed word outside the trace's time span
      (word kept; it gets no trace)" (per word); if no timed word overlaps the trace's time span at all, the clocks
      do not match: "no timed word within the trace's time span (narration dropped, caption kept)".

  Boxes: "boxes": [[x_min, y_min, x_max, y_max], ...] in pixels of the image, with optional "labels": ["...",
  ...] (one string or null per box). Stored as `boxes` (float32 [B, 4], pixels) and `box_labels` (text per box,
  '' without a label). An image's boxes come from its first row with at least one well-formed box; checks:
    - a row with "boxes" once its image has boxes: "second set of boxes of an image (its caption kept, its boxes
      not)";
    - "boxes" not a list: "boxes not a list (boxes ignored)"; "labels" on a row without boxes: "labels without
      boxes (labels ignored)";
    - "labels" not a list of strings (or nulls) as long as "boxes": "labels not one string per box (labels
      dropped, boxes kept)";
    - a box that is not 4 finite numbers: "box not 4 finite numbers (box dropped)"; x_min >= x_max or y_min >=
      y_max: "box with x_min >= x_max or y_min >= y_max (box dropped)";
    - a box reaching outside the image by at most 1 pixel is clipped to it; further out (or empty once clipped):
      "box outside the image by more than 1 pixel (box dropped)".

The prepare report's `fields` says how many prepared examples carry each field: `captions`, `tags`, `narration`
(with >= 1 trace point), `timed_caption`, `traces`, `boxes` and `box_labels` (>= 1 non-empty label).
"""

from __future__ import annotations

import bz2
import collections
import csv
import glob
import gzip
import hashlib
import io
import json
import lzma
import math
import os
import tarfile
import zlib

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from vlrep import errors, safe_files
from vlrep.data import images, manual_files
from vlrep.data.builders import localized_narratives as ln
from vlrep.errors import UserError

NAME = "image_text"
# The same image suffixes in every input format (vlrep.data.images): a shard's KEY.gif or KEY.tif is its image.
IMAGE_SUFFIXES = images.IMAGE_SUFFIXES
# The row fields (captions.jsonl, captions.csv, a shard's KEY.json) that are read; the report's `row_fields`
# counts the rows giving each, and each other field (ignored) by name.
ROW_FIELDS = ("image", "caption", "captions", "tags", "timed_caption", "traces", "boxes", "labels")
DUPLICATE_CAPTION = "identical caption of one image (kept once)"
SAME_FILE = "rows naming an image by another spelling of its path (merged into one example)"
# How far (in [0, 1] image units) a trace point may lie outside the image and still be kept, clipped onto it.
TRACE_TOLERANCE = 0.02
# How far (pixels) a box may reach outside the image and still be kept, clipped to it.
BOX_TOLERANCE = 1.0
# The fields whose examples the prepare report counts (`fields`): an example carries one when it is non-empty.
COUNTED_FIELDS = ("captions", "tags", "narration", "timed_caption", "traces", "boxes", "box_labels")
INDEX_FILES = ("captions.jsonl", "captions.csv")  # in order of preference
# captions.csv: its header's fields (matched without surrounding spaces, case-insensitively), the delimiters tried
# (spreadsheet programs write ';' in many locales, and tab-separated files are common) and the byte-order mark that
# spreadsheet programs put before the header.
CSV_REQUIRED, CSV_OPTIONAL = ("image", "caption"), ("tags",)
CSV_DELIMITERS = (",", ";", "\t")
BOM = "\ufeff"


class SourceError(UserError):
  """A whole-file problem of manual_dir (an index without a usable header or row, nothing usable at all): no row
  could be read, so nothing is prepared; the message names what was found and what was expected."""


class NoSource(SourceError, FileNotFoundError):
  """manual_dir holds neither shards nor an index."""


class ImageText(tfds.core.GeneratorBasedBuilder):
  """Images with their captions (optional tags, Localized Narratives fields and boxes) from webdataset shards or a
  folder with a JSONL/CSV index."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {
    "1.0.0": "First release.",
    "1.1.0": "Localized Narratives fields (narration, timed_caption, traces) and boxes (boxes, box_labels); "
    "metadata `fields`: how many examples carry each optional field.",
  }
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
          # As the localized_narratives builder stores them (LocTex's ops read both alike).
          "narration": tfds.features.Text(),
          "timed_caption": tfds.features.Sequence(
            {"utterance": tfds.features.Text(), "start_time": np.float32, "end_time": np.float32}
          ),
          "traces": tfds.features.Tensor(shape=(None, 3), dtype=np.float32),
          "boxes": tfds.features.Tensor(shape=(None, 4), dtype=np.float32),  # x_min, y_min, x_max, y_max, pixels
          "box_labels": tfds.features.Sequence(tfds.features.Text()),
        }
      ),
      # `fields`: {field: examples carrying it}, written with the dataset and read back with it (the prepare
      # report copies it), so it is exact even when the report is written again for a dataset already prepared.
      metadata=tfds.core.MetadataDict(),
      homepage="https://github.com/vlrep/vlrep",
    )

  def _split_generators(self, dl_manager):
    root = os.fspath(dl_manager.manual_dir)
    return {"train": self._generate_examples(root)}

  def _generate_examples(self, root: str):
    counts = dict.fromkeys(COUNTED_FIELDS, 0)
    mismatched = 0  # narrations whose timed words do not spell their caption
    n = 0
    stats = new_stats()
    for n, example in enumerate(read_manual_dir(root, stats), 1):
      for field in COUNTED_FIELDS:
        value = example[field]
        counts[field] += bool(any(value) if field == "box_labels" else len(value))
      if example["narration"] and not words_spell_caption(example["timed_caption"], example["narration"]):
        mismatched += 1
        logging.warning("%s: %s: %s", NAME, example["key"], TRACE_MISMATCH)
      yield example["key"], {**example, "image": io.BytesIO(example["image"]), "image_id": n - 1}
    if not n:
      # Raised before TFDS finalizes the split (which would assert "No examples were yielded").
      skipped = {reason: k for (name, reason), k in manual_files.SKIPPED.items() if name == NAME}
      raise SourceError(f"{root}: no usable example: every row, image or shard member was skipped: {skipped}")
    self.info.metadata["fields"] = counts
    self.info.metadata["trace_mismatch"] = mismatched
    # What was read of the rows, merged and converted: kept with the dataset, so the report of a dataset found
    # prepared says it too.
    self.info.metadata["row_fields"] = {k: dict(sorted(v.items())) for k, v in stats["row_fields"].items()}
    self.info.metadata["merged"] = dict(sorted(stats["merged"].items()))
    self.info.metadata["converted"] = manual_files.converted(NAME)


def new_stats() -> dict:
  """What one reading of a source counts besides its skips: {"row_fields": {"read": {field: rows}, "ignored":
  {field: rows}}, "merged": {what: n}} (SAME_FILE rows, DUPLICATE_CAPTION captions)."""
  counter = collections.Counter
  return {"row_fields": {"read": counter(), "ignored": counter()}, "merged": counter()}


TRACE_MISMATCH = (
  "narration whose timed words do not spell its caption (kept: LocTex gives its words no trace, "
  "data/trace_mismatch_count)"
)


def _squash(text: str) -> str:
  """Letters and digits only, ASCII lower-cased: the form in which LocTex's trace_words compares utterances and
  caption (tf.strings.lower lower-cases ASCII only)."""
  return "".join(c.lower() if c.isascii() else c for c in text if c.isalnum())


def words_spell_caption(timed_caption: list[dict], caption: str) -> bool:
  """Whether the timed words spell the caption as LocTex's trace_words requires (else it uses the caption's words
  with empty masks and counts `data/trace_mismatch_count`)."""
  utterances = [w["utterance"] for w in timed_caption]
  return bool(utterances) and _squash("".join(utterances)) == _squash(caption)


def _source_files(root: str) -> tuple[list[str], str | None]:
  """(the shards, []) or ([], the index file's name) that read_manual_dir reads; NoSource if neither."""
  shards = sorted(glob.glob(os.path.join(glob.escape(root), "*.tar")))
  if shards:
    return shards, None
  for name in INDEX_FILES:
    if os.path.exists(os.path.join(root, name)):
      return [], name
  raise NoSource(
    f"{root} holds neither webdataset shards (*.tar) nor captions.jsonl / captions.csv. Expected layout:\n{__doc__}"
  )


def read_manual_dir(root: str, stats: dict | None = None):
  """One dict per usable image of `root`, in key order: key, image (JPEG bytes), captions, tags, narration,
  timed_caption, traces, boxes, box_labels; skips counted in manual_files, the fields read or ignored and the merges in
  `stats` (new_stats())."""
  stats = stats or new_stats()
  shards, index = _source_files(root)
  if shards:
    return _from_shards(shards, stats)
  read = _jsonl_rows if index == "captions.jsonl" else _csv_rows
  return _from_index(root, read(os.path.join(root, index)), stats)


def _stat_line(root: str, relative: str) -> str:
  try:
    st = os.stat(os.path.join(root, relative))
  except OSError:
    return f"{relative}\tmissing"
  return f"{relative}\t{st.st_size}\t{st.st_mtime_ns}"


def check_source(root: str) -> dict:
  """Checks `root` as a whole before anything is prepared and returns its fingerprint, which decides whether a
  dataset prepared from it is still current: {"index": {name: SHA-256 of the file} (the index read, or each
  shard's size and mtime), "files": the images the index names, "files_sha256": SHA-256 of their names, sizes and
  modification times}. Raises SourceError (no traceback from the CLI) when the index cannot give a single row: an
  empty file, a CSV header without image and caption (or with unknown fields), no JSON object with both; and
  manual_files.OutsideManualDir when shards, the index or the images it names resolve outside `root` (an absolute path,
  a '../' path, a symlink), all counted and a few named, unless manual_files.LIMITS allows them."""
  shards, index = _source_files(root)
  if shards:
    outside = [(os.path.basename(s), real) for s in shards if (real := manual_files.outside(root, s))]
    manual_files.refuse_outside(root, outside, "the shard listing (*.tar)")
    lines = [_stat_line(root, os.path.relpath(s, root)) for s in shards]
    return {"index": {}, "files": len(lines), "files_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}
  path = os.path.join(root, index)
  rows = _csv_rows(path, quiet=True) if index == "captions.csv" else _jsonl_rows(path, quiet=True)
  images, keys, n_rows = set(), collections.Counter(), 0
  for row, _ in rows:
    n_rows += 1
    keys.update(list(row))  # the keys, not their values
    if isinstance(row.get("image"), str) and row["image"] and ("caption" in row or "captions" in row):
      images.add(os.path.normpath(row["image"]))  # as read_manual_dir reads it (`./a.jpg` is `a.jpg`)
  if not images:
    if index == "captions.csv":
      raise SourceError(
        f"{path}: no row with an image path: {n_rows} rows below the header; expected rows image,caption[,tags]"
      )
    found = ", ".join(f"{k!r} ({n} rows)" for k, n in keys.most_common(12)) or "none"
    raise SourceError(
      f"{path}: no row with both an image and a caption field ({n_rows} JSON objects read; keys found: {found}); "
      'expected one JSON object per line, {"image": "relative/path.jpg", "caption": "..."} (or "captions": '
      '[...]), with optional "tags", "timed_caption", "traces", "boxes", "labels"'
    )
  named = [index] + sorted(images)
  outside = [(n, real) for n in named if (real := manual_files.outside(root, os.path.join(root, n)))]
  manual_files.refuse_outside(root, outside, index)
  lines = [_stat_line(root, image) for image in sorted(images)]
  with errors.reading(path, "text index"):
    sha256 = safe_files.sha256_of(path)
  return {
    "index": {index: sha256},
    "files": len(lines),
    "files_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
  }


def source_changes(old: dict | None, new: dict) -> list[str]:
  """What differs between two fingerprints of check_source, in words ([] when the source is unchanged)."""
  if not old:
    return ["the prepared dataset carries no fingerprint of its source (prepared by an older vlrep)"]
  changes = [
    f"{name} changed"
    for name in sorted(set(old["index"]) | set(new["index"]))
    if old["index"].get(name) != new["index"].get(name)
  ]
  if old["files_sha256"] != new["files_sha256"]:
    changes.append(
      f"image files or shards changed (names, sizes or modification times; {old['files']} -> {new['files']})"
    )
  return changes


def _count(reason: str, n: int, what: str) -> None:
  """Counts n skips (points, words, boxes) of one row under `reason`, logged once."""
  if n:
    manual_files.SKIPPED[(NAME, reason)] += n
    logging.warning("%s: %s: %d x %s", NAME, what, n, reason)


def _jpeg(data: bytes, what: str) -> tuple[bytes, tuple[int, int]] | None:
  """(the image as JPEG bytes as a viewer shows it (vlrep.data.images; a JPEG already upright kept as it is),
  its (width, height)), or None (counted) if it does not decode or its header declares more than
  manual_files.LIMITS.max_image_pixels."""
  return manual_files.viewer_jpeg(data, NAME, what)


def _count_fields(row: dict, stats: dict, read=ROW_FIELDS) -> None:
  """Counts the row's fields, read (`read`) or ignored, for the report's `row_fields`."""
  for field in row:
    stats["row_fields"]["read" if field in read else "ignored"][str(field)] += 1


def _unique(captions: list[str], what: str, stats: dict) -> list[str]:
  """The captions with repeats of one text dropped (first kept), counted (DUPLICATE_CAPTION)."""
  kept = list(dict.fromkeys(captions))
  if len(kept) < len(captions):
    stats["merged"][DUPLICATE_CAPTION] += len(captions) - len(kept)
    logging.info("%s: %s: %d x %s", NAME, what, len(captions) - len(kept), DUPLICATE_CAPTION)
  return kept


def _text_fields(meta: dict, what: str, first: tuple = ()) -> tuple[list[str], list[str]]:
  """(captions, tags) of a row: `first` (a shard's KEY.txt), then "caption", then "captions" (each one string or
  a list of them: both fields together keep all), stripped; non-strings and empty ones dropped (counted)."""
  captions = list(first)
  for field in ("caption", "captions"):
    if field in meta:
      value = meta[field]
      captions.extend(value if isinstance(value, list | tuple) else [value])
  tags = meta.get("tags") or []
  tags = tags.split("|") if isinstance(tags, str) else list(tags) if isinstance(tags, list | tuple) else []
  strings = [c for c in captions if isinstance(c, str)]
  if len(strings) < len(captions):  # e.g. {"caption": 3} or {"captions": [null]}
    manual_files.skip(NAME, "caption not a string", what)
  kept = [c.strip() for c in strings if c.strip()]
  if len(kept) < len(strings):
    manual_files.skip(NAME, "empty caption", what)
  return kept, [t.strip() for t in tags if isinstance(t, str) and t.strip()]


def _finite(value) -> bool:
  if not isinstance(value, int | float) or isinstance(value, bool):
    return False
  try:
    return math.isfinite(value)
  except OverflowError:  # an integer of hundreds of digits
    return False


def _narration(row: dict, what: str) -> dict | None:
  """The row's Localized Narratives fields, checked (see the module docstring): {narration, timed_caption,
  traces}, or None when the row has no `traces` or its narration is dropped (counted; its caption is kept)."""
  if "traces" not in row:
    if row.get("timed_caption"):
      manual_files.skip(NAME, "timed_caption without traces (timed words ignored)", what)
    return None
  traces, timed, caption = row["traces"], row.get("timed_caption") or [], row.get("caption")
  if not isinstance(traces, list) or not all(isinstance(segment, list) for segment in traces):
    manual_files.skip(NAME, "traces not a list of segments (narration dropped, caption kept)", what)
    return None
  if not isinstance(timed, list):
    manual_files.skip(NAME, "timed_caption not a list (narration dropped, caption kept)", what)
    return None
  if not isinstance(caption, str) or not caption.strip():
    manual_files.skip(NAME, "narration without a caption (narration dropped)", what)
    return None
  points, malformed, outside = [], 0, 0
  for point in (p for segment in traces for p in segment):
    xyt = ln.trace_point(point)
    if xyt is None or not all(math.isfinite(v) for v in xyt):
      malformed += 1
    elif not all(-TRACE_TOLERANCE <= v <= 1 + TRACE_TOLERANCE for v in xyt[:2]):
      outside += 1
    else:
      points.append([min(max(xyt[0], 0.0), 1.0), min(max(xyt[1], 0.0), 1.0), xyt[2]])
  _count("malformed trace point (point dropped)", malformed, what)
  _count(f"trace point outside the image by more than {TRACE_TOLERANCE} (point dropped)", outside, what)
  if not points:
    manual_files.skip(NAME, "narration without usable trace points (narration dropped, caption kept)", what)
    return None
  times = [t for _, _, t in points]
  if any(b < a for a, b in zip(times, times[1:], strict=False)):
    manual_files.skip(NAME, "trace times decrease (narration dropped, caption kept)", what)
    return None
  words, malformed, counts = [], 0, collections.Counter()
  for entry in timed:
    word = ln.timed_word(entry)
    if word is None or not isinstance(entry["utterance"], str):
      malformed += 1
      continue
    start, end = word["start_time"], word["end_time"]
    if start is None or end is None or not (math.isfinite(start) and math.isfinite(end)):
      counts["timed word without numeric times (word kept without times: it gets no trace)"] += 1
      start = end = math.nan
    elif start > end:
      counts["timed word with start_time > end_time (word kept without times: it gets no trace)"] += 1
      start = end = math.nan
    words.append({"utterance": entry["utterance"], "start_time": start, "end_time": end})
  _count("malformed timed word (word dropped)", malformed, what)
  timed_words = [w for w in words if not math.isnan(w["start_time"])]
  outside = [w for w in timed_words if w["end_time"] < times[0] or w["start_time"] > times[-1]]
  if timed_words and len(outside) == len(timed_words):
    manual_files.skip(NAME, "no timed word within the trace's time span (narration dropped, caption kept)", what)
    return None
  counts["timed word outside the trace's time span (word kept; it gets no trace)"] += len(outside)
  for reason, n in counts.items():
    _count(reason, n, what)
  return {"narration": caption.strip(), "timed_caption": words, "traces": np.asarray(points, np.float32)}


def _boxes(row: dict, what: str) -> list[tuple[list[float], str]] | None:
  """The row's well-formed boxes [x_min, y_min, x_max, y_max] with their labels ('' without one), or None when
  the row has none; the image's bounds are checked once it is decoded (`_fit_boxes`)."""
  boxes, labels = row.get("boxes"), row.get("labels")
  if boxes is None or boxes == []:
    if labels:
      manual_files.skip(NAME, "labels without boxes (labels ignored)", what)
    return None
  if not isinstance(boxes, list):
    manual_files.skip(NAME, "boxes not a list (boxes ignored)", what)
    return None
  if labels is not None and not (
    isinstance(labels, list) and len(labels) == len(boxes) and all(x is None or isinstance(x, str) for x in labels)
  ):
    manual_files.skip(NAME, "labels not one string per box (labels dropped, boxes kept)", what)
    labels = None
  labels = [(x or "").strip() for x in labels] if labels is not None else [""] * len(boxes)
  kept, malformed, empty = [], 0, 0
  for box, label in zip(boxes, labels, strict=True):
    if not (isinstance(box, list | tuple) and len(box) == 4 and all(_finite(v) for v in box)):
      malformed += 1
    elif not (box[0] < box[2] and box[1] < box[3]):
      empty += 1
    else:
      kept.append(([float(v) for v in box], label))
  _count("box not 4 finite numbers (box dropped)", malformed, what)
  _count("box with x_min >= x_max or y_min >= y_max (box dropped)", empty, what)
  return kept or None


def _fit_boxes(boxes, size: tuple[int, int], what: str) -> tuple[np.ndarray, list[str]]:
  """Boxes clipped to the image of `size` (width, height), those outside it by more than BOX_TOLERANCE (or empty
  once clipped) dropped and counted: (float32 [B, 4], labels)."""
  width, height = size
  kept, labels, outside = [], [], 0
  for (x0, y0, x1, y1), label in boxes or []:
    inside = min(x0, y0) >= -BOX_TOLERANCE and x1 <= width + BOX_TOLERANCE and y1 <= height + BOX_TOLERANCE
    x0, x1 = min(max(x0, 0.0), width), min(max(x1, 0.0), width)
    y0, y1 = min(max(y0, 0.0), height), min(max(y1, 0.0), height)
    if inside and x0 < x1 and y0 < y1:
      kept.append([x0, y0, x1, y1])
      labels.append(label)
    else:
      outside += 1
  _count(f"box outside the image by more than {BOX_TOLERANCE:g} pixel (box dropped)", outside, what)
  return np.asarray(kept, np.float32).reshape(-1, 4), labels


_NO_NARRATION = {"narration": "", "timed_caption": [], "traces": np.zeros((0, 3), np.float32)}


def _example(key, image, captions, tags, narration, boxes, what) -> dict | None:
  """The example's fields (image_id aside), or None (counted) if the image does not decode."""
  decoded = _jpeg(image, what)
  if decoded is None:
    return None
  jpeg, size = decoded
  box_array, box_labels = _fit_boxes(boxes, size, what)
  return {
    "key": key,
    "image": jpeg,
    "captions": captions,
    "tags": tags,
    **(narration or _NO_NARRATION),
    "boxes": box_array,
    "box_labels": box_labels,
  }


# The shard members read (a sample's image and texts); members with other suffixes are passed over unread.
TEXT_SUFFIXES = (".txt", ".json")
# A tar header record (a pax header, a GNU long name) is read whole by tarfile before any member: at most this.
MAX_HEADER_BYTES = manual_files.MIB
# What a shard stops at: a torn or corrupt tar, gzip, bzip2 or xz stream, a header record over MAX_HEADER_BYTES.
SHARD_ERRORS = (tarfile.TarError, OSError, EOFError, ValueError, zlib.error, lzma.LZMAError)


class _CappedReads:
  """A shard's (decompressed) stream as tarfile reads it, each read at most `cap` bytes: tarfile reads a pax header
  or a GNU long name whole, with the size its header declares, before vlrep sees the member."""

  def __init__(self, stream, name: str):
    self.stream, self.name, self.cap = stream, name, MAX_HEADER_BYTES

  def read(self, n: int = -1) -> bytes:
    if n is None or n < 0 or n > self.cap:
      raise manual_files.TooLarge(
        f"shard header record over {manual_files._size(MAX_HEADER_BYTES)} (rest of the shard skipped)"
      )
    return self.stream.read(n)

  def seek(self, offset: int, whence: int = 0) -> int:
    return self.stream.seek(offset, whence)

  def tell(self) -> int:
    return self.stream.tell()


def _decompressed(f):
  """The tar stream in `f`: gzip, bzip2 and xz shards decompressed (as tarfile.open's 'r:*' would), read as they
  are needed (a forward seek decompresses and drops, in bounded pieces)."""
  head = f.read(6)
  f.seek(0)
  if head.startswith(b"\x1f\x8b"):
    return gzip.GzipFile(fileobj=f, mode="rb")
  if head.startswith(b"BZh"):
    return bz2.BZ2File(f)
  if head.startswith(b"\xfd7zXZ\x00"):
    return lzma.LZMAFile(f)
  return f


def _member_bytes(tar, stream: _CappedReads, member, limit: int, flag: str) -> bytes:
  """A member's data, refused (TooLarge) when its header declares more than `limit` bytes or its data runs longer:
  nothing over the limit is held."""
  reason = f"shard member over {manual_files._size(limit)} (--{flag}; its sample skipped)"
  if member.size > limit:
    raise manual_files.TooLarge(reason)
  stream.cap = limit + 1
  try:
    return manual_files.read_capped(tar.extractfile(member), limit, reason)
  finally:
    stream.cap = MAX_HEADER_BYTES


def _shard_samples(shard: str):
  """(key, {suffix: bytes} or None when a member of the sample was refused) of a shard's samples in file order: as
  webdataset groups them, consecutive members with one key (KEY.jpg, KEY.txt, ...) form a sample. One member is
  held at a time besides the sample's own, each within manual_files.LIMITS, so a shard of any size or compression ratio
  is read in bounded memory. A torn or corrupt shard keeps the samples before the break (counted)."""
  limits = manual_files.LIMITS
  try:
    f = manual_files.open_regular(shard)
  except OSError as e:
    manual_files.skip(NAME, f"unreadable shard or shard tail ({type(e).__name__})", shard)
    return
  key, files = None, {}
  with f:
    try:
      stream = _CappedReads(_decompressed(f), shard)
      tar = tarfile.open(fileobj=stream, mode="r:")
      while (member := tar.next()) is not None:
        tar.members.clear()  # one TarInfo at a time: a shard of millions of members is listed in bounded memory
        if not member.isfile():
          continue
        name, ext = os.path.splitext(member.name)
        if name != key:
          if key is not None:
            yield key, files
          key, files = name, {}
        ext = ext.lower()
        if files is None:
          continue
        if ext not in IMAGE_SUFFIXES + TEXT_SUFFIXES:
          files.setdefault("other", []).append(ext or member.name)  # named in the report, not read
          continue
        text = ext in TEXT_SUFFIXES
        limit, flag = (limits.max_text_bytes, "max_text_bytes") if text else (limits.max_file_bytes, "max_file_bytes")
        try:
          files[ext] = _member_bytes(tar, stream, member, limit, flag)
        except manual_files.TooLarge as e:
          manual_files.skip(NAME, e.reason, f"{os.path.basename(shard)}:{member.name}")
          files = None  # the sample is dropped; its other members are not read
      # tarfile ends an archive at a header it cannot read as silently as at the end-of-archive blocks: what
      # follows must be zeros (read in bounded pieces; a gzip stream's checksum is checked at its end).
      while chunk := stream.stream.read(manual_files.MIB):
        if chunk.strip(b"\0"):
          raise tarfile.ReadError("data after a header that is not a tar header")
    except manual_files.TooLarge as e:
      manual_files.skip(NAME, e.reason, shard)
      return
    except SHARD_ERRORS as e:
      # A torn download or a damaged file: the samples read before the break are kept; the one being read is
      # dropped with everything after it. A file that is no tar at all keeps nothing.
      manual_files.skip(NAME, f"unreadable shard or shard tail ({type(e).__name__})", shard)
      return
  if key is not None:
    yield key, files


def _from_shards(shards: list[str], stats: dict):
  for shard in shards:
    yielded = set()  # a sample's key, once it gave an example (TFDS keys must be unique)
    for key, files in _shard_samples(shard):
      what = f"{os.path.basename(shard)}:{key}"
      if files is None:  # a member over a limit: counted when it was refused
        continue
      if key in yielded:
        manual_files.skip(
          NAME, "sample files apart from the rest of their sample (webdataset keeps them together)", what
        )
        continue
      example = _shard_example(shard, key, files, what, stats)
      if example is not None:
        yielded.add(key)
        yield example


def _shard_example(shard: str, key: str, files: dict, what: str, stats: dict) -> dict | None:
  image = next((files[s] for s in IMAGE_SUFFIXES if s in files), None)
  for ext in files.get("other", []):
    stats["row_fields"]["ignored"][f"shard member *{ext}"] += 1
  meta: dict = {}
  if ".json" in files:
    try:
      meta = json.loads(files[".json"].decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, an integer too long, nested too deep
      manual_files.skip(NAME, "metadata not UTF-8 JSON", what)
      meta = {}
    if not isinstance(meta, dict):
      manual_files.skip(NAME, "metadata not a JSON object", what)
      meta = {}
  extra = dict(meta)  # the narration is KEY.json's caption, even beside a KEY.txt
  first = ()
  if ".txt" in files:
    try:
      first = (files[".txt"].decode("utf-8"),)
    except UnicodeDecodeError:
      manual_files.skip(NAME, "caption not UTF-8", what)
    stats["row_fields"]["read"]["shard member *.txt"] += 1
    caption = meta.get("caption")
    if first and isinstance(caption, str) and caption.strip() == first[0].strip():
      meta.pop("caption")  # KEY.txt and KEY.json's caption as img2dataset writes them: one caption, twice
  _count_fields(extra, stats)
  has_text = ".txt" in files or ".json" in files
  if image is None:
    if has_text:
      other = files.get("other")
      reason = (
        f"image in a format vlrep does not read ({', '.join(sorted(set(other)))}; read: {' '.join(IMAGE_SUFFIXES)})"
        if other
        else "caption without an image (mismatched keys)"
      )
      manual_files.skip(NAME, reason, what)
    return None
  if not has_text:
    manual_files.skip(NAME, "image without a caption (mismatched keys)", what)
    return None
  captions, tags = _text_fields(meta, what, first)
  captions = _unique(captions, what, stats)
  if not captions:
    manual_files.skip(NAME, "image without captions", what)
    return None
  key = f"{os.path.basename(shard)}/{key}"
  return _example(key, image, captions, tags, _narration(extra, what), _boxes(extra, what), what)


def _skip(reason: str, what: str, quiet: bool) -> None:
  if not quiet:  # check_source reads the index once before preparing: its skips are counted when preparing
    manual_files.skip(NAME, reason, what)


def index_lines(path: str, quiet: bool, skip=None):
  """(line number, text) of an index file's lines, decoded; lines that are not UTF-8 or longer than
  manual_files.LIMITS.max_text_bytes skipped (counted unless `quiet`; `skip(reason, what)`: image_folder counts its
  own). A file that cannot be opened or read as a whole (a folder, a FIFO, an I/O error) is a BadFile."""
  skip = skip or (lambda reason, what: _skip(reason, what, quiet))
  limit = manual_files.LIMITS.max_text_bytes
  with errors.reading(path, "text index", "It should be a UTF-8 text file, one row per line."):
    with manual_files.open_regular(path) as f:
      for number, raw in manual_files.lines(f, limit):
        what = f"{os.path.basename(path)} line {number}"
        if raw is None:
          skip(f"line over {manual_files._size(limit)} (--max_text_bytes)", what)
          continue
        try:
          text = raw.decode("utf-8")
        except UnicodeDecodeError:
          skip("line not UTF-8", what)
          continue
        yield number, text.removeprefix(BOM) if number == 1 else text


def _jsonl_rows(path: str, quiet: bool = False):
  for number, text in index_lines(path, quiet):
    what = f"{os.path.basename(path)} line {number}"
    line = text.strip()
    if not line:
      continue
    try:
      row = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, an integer too long to read, nested too deep
      _skip("line not JSON", what, quiet)
      continue
    yield row if isinstance(row, dict) else {}, what


def csv_header(path: str, line: str, required: tuple, optional: tuple, note: str = "") -> tuple[str, list[str]]:
  """(delimiter, field names) of a CSV index's header line (BOM stripped): the first of CSV_DELIMITERS that splits
  it into known fields (`required` + `optional`) including every required one; SourceError naming the header found
  otherwise (`note` added where a field is unknown). Shared by image_text's captions.csv and image_folder's
  labels.csv."""
  expected = f"a header {','.join(required)}[,{','.join(optional)}] (delimiter ',', ';' or tab)"
  if not line.strip():
    raise SourceError(f"{path}: no header (the file is empty or starts with an empty line); expected {expected}")
  for delimiter in CSV_DELIMITERS:
    fields = [f.strip().lower() for f in next(csv.reader([line], delimiter=delimiter))]
    if set(required) <= set(fields):
      unknown = [f for f in fields if f not in required + optional]
      if unknown or len(set(fields)) < len(fields):
        raise SourceError(
          f"{path}: header {line.strip()!r} has unknown or repeated fields {unknown or fields}; expected {expected}"
          + note
        )
      return delimiter, fields
  raise SourceError(f"{path}: header {line.strip()!r} has no {' and '.join(required)} fields; expected {expected}")


def csv_rows(path: str, decoded, required: tuple, optional: tuple, skip, note: str = ""):
  """(row dict, line number) of a CSV index whose decoded lines are `decoded` ((number, text), as index_lines
  gives them; blank lines dropped): the header must be line 1 (csv_header); a line the csv module refuses (a field
  over its 131072 characters) is skipped (`skip(reason, what)`). Shared with image_folder's labels.csv."""
  decoded = ((n, text) for n, text in decoded if text.strip())
  first = next(decoded, None)
  if first is None or first[0] != 1:  # the header line missing, empty, not UTF-8 or too long
    raise SourceError(f"{path}: no header on line 1; expected a header {','.join(required)}[,{','.join(optional)}]")
  delimiter, fields = csv_header(path, first[1], required, optional, note)
  current = [1]  # the number of the line the csv reader took last

  def texts():
    for number, text in decoded:
      current[0] = number
      yield text

  reader = csv.DictReader(texts(), fieldnames=fields, delimiter=delimiter)
  while True:
    try:
      row = next(reader)
    except StopIteration:
      return
    except csv.Error as e:
      skip(f"line not CSV ({e})", f"{os.path.basename(path)} line {current[0]}")
      continue
    yield {k: v for k, v in row.items() if k is not None}, current[0]


def _csv_rows(path: str, quiet: bool = False):
  note = " (a CSV carries no other field: use captions.jsonl for narrations and boxes)"
  rows = csv_rows(
    path, index_lines(path, quiet), CSV_REQUIRED, CSV_OPTIONAL, lambda reason, what: _skip(reason, what, quiet), note
  )
  for row, number in rows:
    yield row, f"{os.path.basename(path)} line {number}"


def _image_file(root: str, image: str) -> bytes | None:
  """The bytes of the image a row names, or None (counted): missing, not a regular file, over
  manual_files.LIMITS.max_file_bytes, outside manual_dir (check_source refused those unless they are allowed)."""
  path = os.path.join(root, image)
  if manual_files.outside(root, path) is not None and not manual_files.LIMITS.allow_outside_manual_dir:
    manual_files.skip(NAME, "image outside --manual_dir (not read)", image)
    return None
  try:
    return manual_files.read_file(path)
  except (OSError, manual_files.TooLarge) as e:
    manual_files.skip(NAME, manual_files.image_skip_reason(e), image)
    return None


def _file_identity(root: str, path: str) -> tuple[int, int] | None:
  """(device, inode) of the file `path` (under root) is, links followed; None if it cannot be seen."""
  try:
    st = os.stat(os.path.join(root, path))
  except (OSError, ValueError):  # missing, a name the OS refuses (counted when it is read)
    return None
  return (st.st_dev, st.st_ino)


def _from_index(root: str, rows, stats: dict):
  """Rows grouped by the file they name: spellings of one path (`a.jpg`, `./a.jpg`, `x/../a.jpg`) and names of
  one file (a link, a hard link) are one example with all their captions (SAME_FILE counts the rows spelled
  otherwise than the first); an image's identical captions are kept once (DUPLICATE_CAPTION)."""
  grouped: dict[str, dict] = {}
  by_spelling: dict[str, str] = {}  # the path as a row gives it -> its example's key
  by_identity: dict[tuple[int, int], str] = {}
  for row, what in rows:
    _count_fields(row, stats)
    image = row.get("image")
    if not isinstance(image, str) or not image or "caption" not in row and "captions" not in row:
      manual_files.skip(NAME, "row without an image or caption field", what)
      continue
    captions, tags = _text_fields(row, what)
    if image not in by_spelling:
      normal = os.path.normpath(image)
      identity = _file_identity(root, normal)
      by_spelling[image] = by_identity.setdefault(identity, normal) if identity else normal
    key = by_spelling[image]
    entry = grouped.setdefault(key, {"captions": [], "tags": [], "narration": None, "boxes": None, "spelling": image})
    if image != entry["spelling"]:
      stats["merged"][SAME_FILE] += 1
      logging.info("%s: %s: %r is %r (merged into one example)", NAME, what, image, entry["spelling"])
    entry["captions"].extend(captions)
    entry["tags"].extend(t for t in tags if t not in entry["tags"])
    if entry["narration"] is None:
      entry["narration"] = _narration(row, what)
    elif "traces" in row:
      manual_files.skip(NAME, "second narration of an image (its caption kept, its trace not)", what)
    elif row.get("timed_caption"):
      manual_files.skip(NAME, "timed_caption without traces (timed words ignored)", what)
    if entry["boxes"] is None:
      entry["boxes"] = _boxes(row, what)
    elif row.get("boxes"):
      manual_files.skip(NAME, "second set of boxes of an image (its caption kept, its boxes not)", what)
    elif row.get("labels"):
      manual_files.skip(NAME, "labels without boxes (labels ignored)", what)
  for image in sorted(grouped):
    entry = grouped[image]
    entry["captions"] = _unique(entry["captions"], image, stats)
    if not entry["captions"]:
      manual_files.skip(NAME, "image without captions", image)
      continue
    data = _image_file(root, image)
    if data is None:
      continue
    example = _example(image, data, entry["captions"], entry["tags"], entry["narration"], entry["boxes"], image)
    if example is not None:
      yield example
