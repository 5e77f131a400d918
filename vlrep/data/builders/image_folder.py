"""Your own labelled images (manual_dir), for the linear probe, the VOC07-style SVM probe and zero-shot
classification, in one of three layouts:

  (a) a folder per class:  MANUAL_DIR/<class>/*.jpg (or any suffix of vlrep.data.images.IMAGE_SUFFIXES: .jpeg,
      .png, .webp, .gif, .bmp, .tif, .tiff, ...; subfolders of a class folder are read too); the class names are
      the folder names;
  (b) split folders:       MANUAL_DIR/train/<class>/*.jpg, MANUAL_DIR/val/<class>/..., MANUAL_DIR/test/<class>/...
      (`validation/` is read as val); only train/ is required;
  (c) an index:            MANUAL_DIR/labels.csv with the header image,label[,split]: image paths relative to
      MANUAL_DIR, any label text, the split (train, val or test; empty: assigned as below); the delimiter ',', ';'
      or tab, a UTF-8 byte-order mark before the header dropped. When labels.csv is there, it is the index: folders
      beside it are read only through it.

Prepared with `python -m vlrep.data.prepare --dataset=image_folder --manual_dir=MANUAL_DIR --data_dir=DATA_DIR`
into three splits: train (what the probes train on), val (what hyperparameters are chosen on) and test (only
reported). Images without a given split (layouts (a) and (c), or a split folder missing in (b)) are assigned per
class, deterministically from their file names: a class's images are ordered by the SHA-256 of their path under
MANUAL_DIR; the first 15% (rounded, at least 1) go to test, the next 15% (at least 1) to val, the rest to train. A
class with fewer than 3 such images stays in train only. The split is decided from the file names before any image
is decoded, so an image keeps its split when others are added or fixed.

Stored: `image` (JPEG, as a viewer shows it: vlrep.data.images applies EXIF orientation, scales 16-bit by the
type's range and 32-bit/float by their min..max, composites transparency over white, converts CMYK and palette,
keeps an animation's first frame; each conversion counted in the report's `converted`), `label` (a ClassLabel
whose names are the classes, sorted; zero-shot prompts read them, underscores as spaces) and `key` (the path under
MANUAL_DIR).
The prepare report's `classes` gives each class's image count per split.

Skipped and counted in the prepare report: undecodable or missing images, files without an image suffix inside a
class folder, images at the top of MANUAL_DIR (outside any class folder), class folders without an image (the
class is left out), labels.csv rows without an image or a label, with an unknown split, or naming an image a
second time, images over the prepare command's --max_file_bytes or --max_image_pixels (a decompression bomb),
labels.csv lines over --max_text_bytes or that the csv module refuses. Images, class folders and labels.csv rows
that resolve outside MANUAL_DIR (an absolute path, a '../' path, a symlink; a class folder that is a link outside
is not walked) stop prepare before anything is written (exit status 2, naming them) unless
--allow_outside_manual_dir is given. Whole-file problems stop before anything is written (a SourceError, exit status
2, naming what was found and what was expected): no class folder and no labels.csv, split folders mixed with other
folders, split folders without train/ or naming a split twice (val/ and validation/), fewer than 2 classes with
images, no image for val or test (every class under 3 images), a labels.csv without image and label fields, with an
unknown field, or without a row.
"""

from __future__ import annotations

import collections
import hashlib
import io
import os

import tensorflow_datasets as tfds
from absl import logging

from vlrep import errors, safe_files
from vlrep.data import images, manual_files
from vlrep.data.builders.image_text import SourceError, csv_rows, index_lines

NAME = "image_folder"
IMAGE_SUFFIXES = images.IMAGE_SUFFIXES  # the same in every input format
SPLITS = ("train", "val", "test")
# Split folders of layout (b), and split values of labels.csv, by the split they name.
SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "test": "test"}
# The shares of a class's images held out when no split is given; a class needs MIN_HELD_OUT images to give one
# to each held-out split and keep one to train on.
TEST_SHARE = VAL_SHARE = 0.15
MIN_HELD_OUT = 3
INDEX_FILE = "labels.csv"
CSV_REQUIRED, CSV_OPTIONAL = ("image", "label"), ("split",)


class ImageFolder(tfds.core.GeneratorBasedBuilder):
  """Your own images with one class label each (a folder per class or labels.csv): splits train, val, test."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          # The names are the user's classes: set when the source is read (_split_generators), restored with the
          # prepared dataset (label.labels.txt).
          "label": tfds.features.ClassLabel(),
          "key": tfds.features.Text(),
        }
      ),
      # `classes`: {class: {split: images}}, written with the dataset (the prepare report copies it).
      metadata=tfds.core.MetadataDict(),
      homepage="https://github.com/vlrep/vlrep",
    )

  def _split_generators(self, dl_manager):
    root = os.fspath(dl_manager.manual_dir)
    listing = read_listing(root, quiet=False)
    names = sorted({label for _, label, _ in listing})
    self.info.features["label"].names = names
    by_split = {split: [(path, label) for path, label, s in listing if s == split] for split in SPLITS}
    counts = {name: dict.fromkeys(SPLITS, 0) for name in names}  # filled as images decode
    self.info.metadata["classes"] = counts
    self.info.metadata["converted"] = {}  # filled as images are stored (manual_files.CONVERTED)
    return {split: self._generate_examples(root, items, split, counts) for split, items in by_split.items() if items}

  def _generate_examples(self, root: str, items: list[tuple[str, str]], split: str, counts: dict):
    n = 0
    for path, label in items:
      jpeg = _jpeg(os.path.join(root, path), path, root)
      if jpeg is None:
        continue
      n += 1
      counts[label][split] += 1
      self.info.metadata["converted"].update(manual_files.converted(NAME))
      yield path, {"image": io.BytesIO(jpeg), "label": label, "key": path}
    if not n:
      # Raised before TFDS finalizes the split (which would assert "No examples were yielded").
      skipped = {reason: k for (name, reason), k in manual_files.SKIPPED.items() if name == NAME}
      raise SourceError(f"{root}: no usable image in split {split!r} ({len(items)} listed); skipped: {skipped}")


def _jpeg(path: str, what: str, root: str) -> bytes | None:
  """The image as JPEG bytes as a viewer shows it (vlrep.data.images: EXIF orientation applied, 16-bit scaled by
  its range, transparency over white, the first frame; upright RGB and grayscale JPEGs kept as they are), or None
  (counted) if it is missing, outside `root` (check_source refused those unless they are allowed), over
  manual_files.LIMITS (file size, pixels) or does not decode."""
  if manual_files.outside(root, path) is not None and not manual_files.LIMITS.allow_outside_manual_dir:
    manual_files.skip(NAME, "image outside --manual_dir (not read)", what)
    return None
  try:
    data = manual_files.read_file(path)
  except (OSError, manual_files.TooLarge) as e:
    manual_files.skip(NAME, manual_files.image_skip_reason(e), what)
    return None
  stored = manual_files.viewer_jpeg(data, NAME, what)
  return stored and stored[0]


def _skip(reason: str, what: str, quiet: bool) -> None:
  if not quiet:  # check_source lists the source once before preparing: its skips are counted when preparing
    manual_files.skip(NAME, reason, what)


def _is_image(name: str) -> bool:
  return os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES


def _visible(names) -> list[str]:
  return sorted(n for n in names if not n.startswith("."))


def _class_images(root: str, folder: str, quiet: bool) -> list[str]:
  """The image files under root/folder (subfolders too), as paths under root; other files counted."""
  found = []
  for parent, dirs, files in os.walk(os.path.join(root, folder)):
    dirs[:] = _visible(dirs)
    for name in _visible(files):
      path = os.path.relpath(os.path.join(parent, name), root)
      if _is_image(name):
        found.append(path)
      else:
        _skip("not an image file (by its suffix)", path, quiet)
  return found


def _class_folders(root: str, top: str, quiet: bool) -> list[tuple[str, str]]:
  """[(image path under root, class)] of the class folders in root/top; empty class folders counted."""
  where = os.path.join(root, top)
  entries = _visible(os.listdir(where))
  items = []
  for name in entries:
    if os.path.isdir(os.path.join(where, name)):
      real = manual_files.outside(root, os.path.join(where, name))
      if real is not None and not manual_files.LIMITS.allow_outside_manual_dir:  # not walked: it may be a link to /
        manual_files.refuse_outside(root, [(os.path.join(top, name), real)], "the class folders")
      images = _class_images(root, os.path.join(top, name) if top else name, quiet)
      if not images:
        _skip("class folder without an image (class left out)", os.path.join(top, name), quiet)
      items.extend((path, name) for path in images)
    elif _is_image(name):
      _skip("image outside a class folder", os.path.join(top, name), quiet)
  return items


def _held_out_order(path: str) -> str:
  return hashlib.sha256(path.encode("utf-8")).hexdigest()


def assign_splits(items: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
  """[(path, class, split)] of images without a split: per class, ordered by the SHA-256 of the path, the first
  round(TEST_SHARE * n) (at least 1) to test, the next round(VAL_SHARE * n) (at least 1) to val, the rest to train;
  a class with fewer than MIN_HELD_OUT images all to train."""
  by_class = collections.defaultdict(list)
  for path, label in items:
    by_class[label].append(path)
  out = []
  for label in sorted(by_class):
    paths = sorted(by_class[label], key=_held_out_order)
    n = len(paths)
    n_test = max(1, round(TEST_SHARE * n)) if n >= MIN_HELD_OUT else 0
    n_val = max(1, round(VAL_SHARE * n)) if n >= MIN_HELD_OUT else 0
    for i, path in enumerate(paths):
      split = "test" if i < n_test else "val" if i < n_test + n_val else "train"
      out.append((path, label, split))
  return out


def _with_held_out(given: list[tuple[str, str, str]], unassigned: list[tuple[str, str]]) -> list:
  """The images with a split given, and those without one assigned (assign_splits)."""
  return sorted(given + assign_splits(unassigned))


def _from_split_folders(root: str, folders: list[str], quiet: bool) -> list[tuple[str, str, str]]:
  splits = {SPLIT_NAMES[f.lower()]: f for f in folders}
  if len(splits) < len(folders):  # e.g. val/ beside validation/
    raise SourceError(f"{root}: split folders {', '.join(folders)} name a split twice; expected one folder per split")
  if "train" not in splits:
    raise SourceError(
      f"{root}: split folders {', '.join(folders)} but no train/; expected train/<class>/*.jpg (with optional "
      f"val/<class>/... and test/<class>/...), or a folder per class with no split folders. Expected layout:\n{__doc__}"
    )
  given = [(path, label, split) for split, f in splits.items() for path, label in _class_folders(root, f, quiet)]
  # A held-out split without its folder is taken out of train/ as if no split were given; the images
  # assign_splits would give the other held-out split (which has its folder) stay in train.
  missing = [split for split in ("val", "test") if split not in splits]
  assigned = {path: split for path, _, split in assign_splits([(p, c) for p, c, s in given if s == "train"])}
  return sorted(
    (path, label, assigned[path] if assigned.get(path) in missing else split) for path, label, split in given
  )


def _from_index(root: str, quiet: bool) -> list[tuple[str, str, str]]:
  path = os.path.join(root, INDEX_FILE)

  def skip(reason, what):
    _skip(reason, what, quiet)

  rows = csv_rows(path, index_lines(path, quiet, skip), CSV_REQUIRED, CSV_OPTIONAL, skip)
  given, unassigned, seen = [], [], set()
  n_rows = 0
  for row, number in rows:
    n_rows += 1
    what = f"{INDEX_FILE} line {number}"
    image, label = (row.get("image") or "").strip(), (row.get("label") or "").strip()
    image = os.path.normpath(image) if image else image  # `./a.jpg` is `a.jpg`: listed twice, not two images
    split = (row.get("split") or "").strip().lower()
    if not image or not label:
      _skip("row without an image or a label", what, quiet)
    elif split and split not in SPLIT_NAMES:
      _skip("unknown split (expected train, val or test)", what, quiet)
    elif image in seen:
      _skip("image listed a second time (its first row kept)", what, quiet)
    else:
      seen.add(image)
      if split:
        given.append((image, label, SPLIT_NAMES[split]))
      else:
        unassigned.append((image, label))
  if not given and not unassigned:
    raise SourceError(
      f"{path}: no row with an image and a label: {n_rows} rows below the header; expected rows image,label[,split]"
    )
  return _with_held_out(given, unassigned)


def read_listing(root: str, quiet: bool = True) -> list[tuple[str, str, str]]:
  """[(image path under root, class, split)] of `root` in any of the three layouts, sorted; SourceError for a
  whole-file problem (see the module docstring). `quiet`: its skips are not counted (check_source's look)."""
  if os.path.isfile(os.path.join(root, INDEX_FILE)):
    listing = _from_index(root, quiet)
  else:
    folders = [n for n in _visible(os.listdir(root)) if os.path.isdir(os.path.join(root, n))]
    split_folders = [f for f in folders if f.lower() in SPLIT_NAMES]
    if not folders:
      images = sum(_is_image(n) for n in os.listdir(root))
      raise SourceError(
        f"{root} holds no class folder and no {INDEX_FILE} (found {images} image files and no folder at its "
        f"top); expected a folder per class, MANUAL_DIR/<class>/*.jpg, or {INDEX_FILE}. Expected layout:\n{__doc__}"
      )
    if split_folders and len(split_folders) < len(folders):
      others = [f for f in folders if f not in split_folders]
      raise SourceError(
        f"{root} mixes split folders ({', '.join(split_folders)}) with other folders ({', '.join(others[:5])}); "
        "expected either only split folders (train/<class>/..., val/..., test/...) or only class folders (a "
        "class named like a split: rename its folder)"
      )
    if split_folders:
      listing = _from_split_folders(root, split_folders, quiet)
    else:
      listing = _with_held_out([], _class_folders(root, "", quiet))
  counts = collections.Counter(label for _, label, _ in listing)
  empty = [split for split in SPLITS if not any(s == split for _, _, s in listing)]
  if len(counts) >= 2 and empty:
    sizes = ", ".join(f"{label!r} ({n})" for label, n in sorted(counts.items()))
    raise SourceError(
      f"{root}: no image for the {' and '.join(empty)} split{'s' if len(empty) > 1 else ''} (images per class: "
      f"{sizes}); expected at least {MIN_HELD_OUT} images in a class for it to give one to val and one to test, "
      "or val/ and test/ folders (labels.csv: a split column)"
    )
  if len(counts) < 2:
    found = ", ".join(f"{label!r} ({n} images)" for label, n in counts.items()) or "no class with an image"
    raise SourceError(
      f"{root}: {len(counts)} class{'es' if len(counts) != 1 else ''} with images ({found}); a classifier needs at "
      "least 2: expected a folder per class (MANUAL_DIR/<class>/*.jpg) or labels.csv rows with 2 or more labels"
    )
  return listing


def _stat_line(root: str, path: str, label: str, split: str) -> str:
  try:
    st = os.stat(os.path.join(root, path))
  except OSError:
    return f"{path}\t{label}\t{split}\tmissing"
  return f"{path}\t{label}\t{split}\t{st.st_size}\t{st.st_mtime_ns}"


def check_source(root: str) -> dict:
  """Checks `root` as a whole before anything is prepared (SourceError: see the module docstring) and returns its
  fingerprint, in image_text.check_source's form (image_text.source_changes compares two): {"index": {labels.csv:
  its SHA-256} or {}, "files": images listed, "files_sha256": SHA-256 of their paths, classes, splits, sizes and
  modification times}."""
  listing = read_listing(root, quiet=True)
  index = os.path.join(root, INDEX_FILE)
  named = ([INDEX_FILE] if os.path.lexists(index) else []) + [p for p, _, _ in listing]
  outside = [(p, real) for p in named if (real := manual_files.outside(root, os.path.join(root, p)))]
  manual_files.refuse_outside(root, outside, INDEX_FILE if os.path.lexists(index) else "the class folders")
  lines = [_stat_line(root, *entry) for entry in listing]
  logging.info("%s: %d images in %d classes in %s", NAME, len(listing), len({c for _, c, _ in listing}), root)
  with errors.reading(index, "text index"):
    sha256 = safe_files.sha256_of(index) if os.path.isfile(index) else None
  return {
    "index": {INDEX_FILE: sha256} if sha256 else {},
    "files": len(lines),
    "files_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
  }


def eval_pp(size: int = 224) -> str:
  """An evaluation's preprocessing of these images: the shorter side to size * 256 / 224 (256 for 224, as the
  probes' ImageNet protocol), the centre size x size crop, ImageNet mean/std."""
  return f"decode|resize_small({round(size * 256 / 224)})|central_crop({size})|normalize"


def eval_settings(data_dir: str, size: int = 224) -> dict:
  """An evaluator's dataset block for an image_folder dataset prepared in `data_dir`, at `size` pixels."""
  return {"dataset": NAME, "data_dir": data_dir, "config_name": "", "pp": eval_pp(size)}
