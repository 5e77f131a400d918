"""Prepares a real dataset from a local copy into TFDS format (nothing is downloaded).

  python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=/data/coco --data_dir=~/tensorflow_datasets
  python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=/data/VOCdevkit --data_dir=~/tensorflow_datasets
  python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=/data/coco [--config_name=coco_openimages]
  python -m vlrep.data.prepare --dataset=vqa2 --manual_dir=/data/vqa2          (also vizwiz, snli_ve, mm_imdb,
                                                                              conceptual_captions)
  python -m vlrep.data.prepare --dataset=image_text --manual_dir=/data/mine     (your own: webdataset shards, or
                                                                              images + captions.jsonl / .csv)
  python -m vlrep.data.prepare --dataset=image_folder --manual_dir=/data/labelled   (your own labelled images: a
                                                                              folder per class, or labels.csv)

Skipped inputs (undecodable or missing images, empty captions, ...) are counted, printed, and saved to
DATA_DIR/<dataset>_prepare_report.json. For image_text the report's `fields` also says how many prepared examples
carry each field ({"captions": n, "tags": n, "narration": n, "timed_caption": n, "traces": n, "boxes": n,
"box_labels": n}): a method that needs one checks it before training; `trace_mismatch` counts the narrations
whose timed words do not spell their caption (LocTex trains on their caption without traces).

image_text is checked as a whole before anything is written (a missing or empty manual_dir, an index without a
usable header or row, fewer than 2 classes: exit status 2, naming what was found and what was expected), and
fingerprinted: a dataset already in DATA_DIR is reused only if its source is unchanged (the index file's SHA-256,
the names, sizes and modification times of its images or shards); otherwise it is rebuilt, and the report's
`source` says which and why.

A manual_dir may come from someone else, so what prepare reads from it is bounded (vlrep/data/builders/manual_files.py):
an image file or shard member over --max_file_bytes (256 MiB), an index line or a shard's KEY.txt / KEY.json over
--max_text_bytes (8 MiB), an image whose header declares more than --max_image_pixels (~179 megapixels: a
decompression bomb) are skipped and counted in the report, the limit named in the reason, before they are read
or decoded (a gzip shard that decompresses to more than its tar headers declare is refused as it is read).
Files that the index, the class folders or the shard listing name and that resolve outside --manual_dir (an
absolute path, a '../' path, a symlink) stop prepare before anything is written (exit status 2, the count and a
few named) unless --allow_outside_manual_dir is given; then they are read and the report's
`outside_manual_dir` counts and names them. A file that cannot be read as a whole (an index that is a folder or
not a file, an annotation file that is not JSON) is one message and exit status 2. The report is written
atomically inside --data_dir (a symlink at its name is replaced, never followed).

Your own photos (image_text, image_folder) are stored as a viewer shows them (vlrep/data/images.py): the report's
`converted` counts each conversion (EXIF orientation, 16-bit range, transparency over white, CMYK, the first frame
of an animation); image_text's report also has `merged` (rows naming one file, identical captions kept once) and
`row_fields` (the rows giving each field read, and each field ignored, by name).

SIGTERM stops prepare as Ctrl-C does (exit status 143): TFDS removes its unfinished incomplete.* folder and a
version set aside for a rebuild is put back. What a kill that nothing sees leaves (TFDS's incomplete.XXXXXX_<version>
folders of the dataset, a stale .<version>.previous) is removed by the next prepare of that dataset, logged and
named in the report's `removed_leftovers`. The dataset's folder is locked while it is prepared (flock on the
folder: nothing written): a second prepare into it stops with exit status 2.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import threading

from absl import app, flags, logging
from PIL import Image

from vlrep import safe_files
from vlrep.data import manual_files, pipeline
from vlrep.data.builders import image_folder, image_text
from vlrep.errors import UserError, exit_2_on_user_error

flags.DEFINE_string("dataset", None, " | ".join(sorted(pipeline.builder_classes())))
flags.DEFINE_string("manual_dir", None, "Folder with the local copy (see the builder's docstring for its layout).")
flags.DEFINE_string("data_dir", "~/tensorflow_datasets", "TFDS data_dir to write to.")
flags.DEFINE_string(
  "config_name",
  None,
  "Builder config (synthetic_scenes: default | tiny; localized_narratives: coco | coco_openimages).",
)
flags.DEFINE_enum(
  "file_format",
  pipeline.FILE_FORMAT,
  ["array_record", "tfrecord"],
  "Storage: array_record (random access: training reads each host's records from disk) or tfrecord (sequential: "
  "training holds each host's share in memory).",
)
flags.DEFINE_bool(
  "allow_outside_manual_dir",
  False,
  "Read files that the index, the class folders or the shard listing name but that resolve outside --manual_dir "
  "(an absolute path, a '../' path, a symlink: e.g. images symlinked in on purpose). Without it prepare stops "
  "before writing anything, naming them; with it the report's `outside_manual_dir` counts and names them.",
)
flags.DEFINE_integer(
  "max_file_bytes",
  manual_files.Limits.max_file_bytes,
  "Largest image file or shard member read (bytes); larger ones are skipped and counted, unread.",
  lower_bound=1,
)
flags.DEFINE_integer(
  "max_text_bytes",
  manual_files.Limits.max_text_bytes,
  "Longest index line (captions.jsonl, captions.csv, labels.csv, LN JSONL) or shard KEY.txt / KEY.json read "
  "(bytes); longer ones are skipped and counted.",
  lower_bound=1,
)
flags.DEFINE_integer(
  "max_image_pixels",
  manual_files.Limits.max_image_pixels,
  "Most pixels an image's header may declare (width x height) for it to be decoded; larger ones (decompression "
  "bombs) are skipped and counted. Decoding holds up to ~8 bytes per pixel.",
  lower_bound=1,
)
FLAGS = flags.FLAGS

# Your own data: checked as a whole before TFDS writes anything, and fingerprinted (image_text.source_changes
# compares two fingerprints): {dataset: check_source(manual_dir) -> fingerprint}.
SOURCE_CHECKS = {image_text.NAME: image_text.check_source, image_folder.NAME: image_folder.check_source}


class NoManualDir(UserError, FileNotFoundError):
  """--manual_dir is missing, not a folder or empty."""


class Busy(UserError):
  """Another prepare is writing the same dataset folder."""


class Terminated(SystemExit):
  """SIGTERM arrived while preparing: raised in the main thread so that TFDS's and prepare's clean-ups run as
  they do for Ctrl-C (SIGINT's KeyboardInterrupt); the process then exits with status 143 (128 + SIGTERM)."""

  def __init__(self):
    super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def _sigterm_cleans_up():
  """While preparing, SIGTERM raises Terminated (once; a second SIGTERM during the clean-up is ignored) instead
  of killing the process where it stands, which would leave TFDS's incomplete.* folder behind."""
  if threading.current_thread() is not threading.main_thread():
    yield  # signal handlers can only be set in the main thread
    return

  def terminate(signum, frame):
    del signum, frame
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.warning("SIGTERM: stopping prepare, removing its unfinished output")
    raise Terminated()

  previous = signal.signal(signal.SIGTERM, terminate)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _locked(folder: str):
  """An exclusive lock on the dataset's folder (flock on the folder itself: no file is written) while it is
  prepared: a second prepare into it stops (Busy) rather than removing the first one's work in progress."""
  fd = os.open(folder, os.O_RDONLY)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise Busy(
        f"{folder} is being prepared by another process (it holds the folder's lock); wait for it to finish, or "
        "prepare into another --data_dir"
      ) from None
    yield
  finally:
    os.close(fd)  # releases the lock


def _remove_leftovers(version_dir: str) -> list[str]:
  """Removes what an interrupted prepare of this dataset left beside `version_dir` and returns their names:
  TFDS's unfinished output (incomplete.XXXXXX_<version>, left by a kill TFDS could not clean up after) and a
  version set aside for a rebuild (.<version>.previous: put back if the version itself is missing, so the
  fingerprint decides reuse or rebuild as before the kill; removed if the version is there)."""
  parent, version = os.path.split(version_dir)
  pattern = re.compile(rf"incomplete\.[A-Z0-9]{{6}}_{re.escape(version)}")
  removed = []
  for name in sorted(os.listdir(parent)):
    if pattern.fullmatch(name):
      _remove(os.path.join(parent, name))
      removed.append(name)
  aside = os.path.join(parent, f".{version}.previous")
  if os.path.lexists(aside):
    if os.path.lexists(version_dir):
      _remove(aside)
      removed.append(os.path.basename(aside))
    else:
      os.rename(aside, version_dir)
      logging.warning("%s: restored the version a killed rebuild had set aside", version_dir)
  for name in removed:
    logging.warning("Removed %s in %s: left by an interrupted prepare", name, parent)
  return removed


def _is_prepared(builder) -> bool:
  return os.path.exists(os.path.join(builder.data_dir, "dataset_info.json"))


def _remove(path: str) -> None:
  """Removes a file, a link (not what it points to) or a folder."""
  if os.path.islink(path) or os.path.isfile(path):
    os.unlink(path)
  elif os.path.isdir(path):
    shutil.rmtree(path)


def _set_aside(version_dir: str) -> str:
  """Moves a prepared version out of TFDS's sight (beside its dataset folder); returns where it now is."""
  aside = os.path.join(os.path.dirname(version_dir), f".{os.path.basename(version_dir)}.previous")
  if os.path.lexists(aside):  # left by a run that was killed mid-rebuild: the version folder is the newer copy
    _remove(aside)
  os.rename(version_dir, aside)
  return aside


def _restore(aside: str, version_dir: str) -> None:
  """Puts a version set aside back after a rebuild that failed (its partial output removed)."""
  if os.path.lexists(version_dir):
    _remove(version_dir)
  os.rename(aside, version_dir)
  logging.warning("The rebuild failed: the dataset prepared before is kept in %s", version_dir)


def prepare(
  dataset: str,
  manual_dir: str | None,
  data_dir: str,
  config_name: str | None = None,
  file_format: str = pipeline.FILE_FORMAT,
  limits: manual_files.Limits | None = None,
) -> dict:
  """Prepares `dataset` from `manual_dir` into `data_dir` and writes its report; `limits`: what one input may make
  it read (manual_files.Limits(); its fields are the command's flags of the same names)."""
  manual_files.LIMITS = limits or manual_files.Limits()
  if manual_files.LIMITS.max_image_pixels > 2 * (Image.MAX_IMAGE_PIXELS or 0) and Image.MAX_IMAGE_PIXELS is not None:
    # PIL refuses images above twice its own limit before vlrep sees their size: a larger --max_image_pixels is the
    # user's explicit choice, so PIL's limit is raised to match (in this process).
    Image.MAX_IMAGE_PIXELS = manual_files.LIMITS.max_image_pixels
  manual_files.SKIPPED.clear()
  manual_files.OUTSIDE.clear()
  manual_files.CONVERTED.clear()

  registry = pipeline.builder_classes()
  if dataset not in registry:
    raise UserError(f"Unknown dataset {dataset!r}; known: {', '.join(sorted(registry))}")
  cls = registry[dataset]
  generated = getattr(cls, "generated_on_first_use", False)
  if not generated and not manual_dir:
    raise NoManualDir(
      f"--manual_dir is not given: the folder with your copy of {dataset}. Expected layout:\n{cls.__doc__}"
    )
  if not generated and not os.path.isdir(manual_dir):
    raise NoManualDir(
      f"--manual_dir={manual_dir!r} is not a folder or is empty (no such folder). Expected layout:\n{cls.__doc__}"
    )
  if not generated and not os.listdir(manual_dir):
    raise NoManualDir(
      f"--manual_dir={manual_dir!r} is not a folder or is empty (the folder is empty). Expected layout:\n{cls.__doc__}"
    )
  source = SOURCE_CHECKS[dataset](manual_dir) if dataset in SOURCE_CHECKS else None
  data_dir = os.path.expanduser(data_dir)
  kwargs = {"config": config_name} if config_name else {}
  builder = cls(data_dir=data_dir, file_format=file_format, **kwargs)
  folder = os.path.dirname(builder.data_dir)  # the dataset's folder: its versions and TFDS's incomplete.* ones
  safe_files.make_dirs(folder)
  with _locked(folder), _sigterm_cleans_up():
    leftovers = _remove_leftovers(builder.data_dir)
    builder = cls(data_dir=data_dir, file_format=file_format, **kwargs)  # a version put back is seen
    report = _prepare_locked(dataset, manual_dir, data_dir, builder, source, cls, file_format, kwargs)
  if leftovers:
    report["removed_leftovers"] = leftovers
  safe_files.make_dirs(data_dir)
  # Written atomically inside data_dir: a symlink planted at the report's name is replaced, never followed.
  safe_files.write_json(os.path.join(data_dir, f"{dataset}_prepare_report.json"), report, root=data_dir)
  return report


def _prepare_locked(dataset, manual_dir, data_dir, builder, source, cls, file_format, kwargs) -> dict:
  """prepare's work once it holds the dataset folder's lock: reuse, rebuild or build, and the report."""
  import tensorflow_datasets as tfds

  source_action = "prepared"
  previous = None  # the prepared version set aside while it is rebuilt
  if source is not None and _is_prepared(builder):
    changes = image_text.source_changes(builder.info.metadata.get("source"), source)
    if changes:
      # The prepared copy is derived data, made again from the source the user just changed: rebuilding is what
      # re-running prepare asks for (docs/bad_inputs.md). The old version is kept aside until the new one is
      # complete, so a rebuild that fails leaves it in place.
      source_action = "rebuilt: " + "; ".join(changes)
      logging.warning("%s in %s: %s", dataset, builder.data_dir, source_action)
      previous = _set_aside(builder.data_dir)
      builder = cls(data_dir=data_dir, file_format=file_format, **kwargs)
    else:
      source_action = f"reused: the source in {manual_dir} is unchanged since {builder.data_dir} was prepared"
  if source is not None and not _is_prepared(builder):
    builder.info.metadata["source"] = source
  manual_files.SKIPPED.clear()  # check_source's look counts nothing; the generation counts each skip once
  try:
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
  except BaseException:
    if previous:
      _restore(previous, builder.data_dir)
    raise
  if previous:
    shutil.rmtree(previous)
  report = {
    "dataset": dataset,
    "data_dir": builder.data_dir,
    "file_format": builder.info.file_format.value,
    "splits": {k: v.num_examples for k, v in builder.info.splits.items()},
    "skipped": {reason: n for (_, reason), n in manual_files.SKIPPED.items()},
  }
  # Builders that count their optional fields (image_text) keep the counts in the dataset's metadata, so they are
  # exact whether this call generated the dataset or found it prepared.
  fields = (builder.info.metadata or {}).get("fields")
  if fields is not None:
    report["fields"] = {name: int(n) for name, n in fields.items()}
  classes = (builder.info.metadata or {}).get("classes")
  if classes is not None:
    report["classes"] = {name: {split: int(n) for split, n in splits.items()} for name, splits in classes.items()}
  if "trace_mismatch" in (builder.info.metadata or {}):
    report["trace_mismatch"] = int(builder.info.metadata["trace_mismatch"])
  if source is not None:
    report["source"] = source_action
  if manual_files.OUTSIDE:
    outside = sorted(set(manual_files.OUTSIDE))
    report["outside_manual_dir"] = {"files": len(outside), "first": outside[:10]}
  # Own photos: the images stored after a conversion (vlrep.data.images: EXIF orientation, 16-bit range,
  # transparency over white, CMYK, the first frame of an animation), the rows and captions merged, the row fields
  # read and ignored; kept in the dataset's metadata, so a dataset found prepared reports them too.
  metadata = builder.info.metadata or {}
  for key in ("converted", "merged", "row_fields"):
    if key in metadata:
      report[key] = json.loads(json.dumps(metadata[key]))
  limits = manual_files.LIMITS
  report["limits"] = {
    "max_file_bytes": limits.max_file_bytes,
    "max_text_bytes": limits.max_text_bytes,
    "max_image_pixels": limits.max_image_pixels,
    "allow_outside_manual_dir": limits.allow_outside_manual_dir,
  }
  return report


@exit_2_on_user_error
def main(argv):
  del argv
  limits = manual_files.Limits(
    max_file_bytes=FLAGS.max_file_bytes,
    max_text_bytes=FLAGS.max_text_bytes,
    max_image_pixels=FLAGS.max_image_pixels,
    allow_outside_manual_dir=FLAGS.allow_outside_manual_dir,
  )
  report = prepare(FLAGS.dataset, FLAGS.manual_dir, FLAGS.data_dir, FLAGS.config_name, FLAGS.file_format, limits)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  flags.mark_flag_as_required("dataset")
  app.run(main)
