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
"""

from __future__ import annotations

import json
import os
import shutil

from absl import app, flags, logging

from vlrep.data import pipeline
from vlrep.data.builders import common, image_folder, image_text
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
FLAGS = flags.FLAGS

# Your own data: checked as a whole before TFDS writes anything, and fingerprinted (image_text.source_changes
# compares two fingerprints): {dataset: check_source(manual_dir) -> fingerprint}.
SOURCE_CHECKS = {image_text.NAME: image_text.check_source, image_folder.NAME: image_folder.check_source}


class NoManualDir(UserError, FileNotFoundError):
  """--manual_dir is missing, not a folder or empty."""


def _is_prepared(builder) -> bool:
  return os.path.exists(os.path.join(builder.data_dir, "dataset_info.json"))


def _set_aside(version_dir: str) -> str:
  """Moves a prepared version out of TFDS's sight (beside its dataset folder); returns where it now is."""
  aside = os.path.join(os.path.dirname(version_dir), f".{os.path.basename(version_dir)}.previous")
  if os.path.exists(aside):  # left by a run that was killed mid-rebuild: the version folder is the newer copy
    shutil.rmtree(aside)
  os.rename(version_dir, aside)
  return aside


def _restore(aside: str, version_dir: str) -> None:
  """Puts a version set aside back after a rebuild that failed (its partial output removed)."""
  if os.path.exists(version_dir):
    shutil.rmtree(version_dir)
  os.rename(aside, version_dir)
  logging.warning("The rebuild failed: the dataset prepared before is kept in %s", version_dir)


def prepare(
  dataset: str,
  manual_dir: str | None,
  data_dir: str,
  config_name: str | None = None,
  file_format: str = pipeline.FILE_FORMAT,
) -> dict:
  import tensorflow_datasets as tfds

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
  common.SKIPPED.clear()
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
    "skipped": {reason: n for (_, reason), n in common.SKIPPED.items()},
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
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, f"{dataset}_prepare_report.json"), "w") as f:
    json.dump(report, f, indent=2)
  return report


@exit_2_on_user_error
def main(argv):
  del argv
  report = prepare(FLAGS.dataset, FLAGS.manual_dir, FLAGS.data_dir, FLAGS.config_name, FLAGS.file_format)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  flags.mark_flag_as_required("dataset")
  app.run(main)
