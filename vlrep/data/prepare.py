"""Prepares a real dataset from a local copy into TFDS format (nothing is downloaded).

  python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=/data/coco --data_dir=~/tensorflow_datasets
  python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=/data/VOCdevkit --data_dir=~/tensorflow_datasets
  python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=/data/coco [--config_name=coco_openimages]
  python -m vlrep.data.prepare --dataset=vqa2 --manual_dir=/data/vqa2          (also vizwiz, snli_ve, mm_imdb,
                                                                              conceptual_captions)
  python -m vlrep.data.prepare --dataset=image_text --manual_dir=/data/mine     (your own: webdataset shards, or
                                                                              images + captions.jsonl / .csv)

Skipped inputs (undecodable or missing images, empty captions, ...) are counted, printed, and saved to
DATA_DIR/<dataset>_prepare_report.json. For image_text the report's `fields` also says how many prepared examples
carry each field ({"captions": n, "tags": n, "narration": n, "timed_caption": n, "traces": n, "boxes": n,
"box_labels": n}): a method that needs one checks it before training.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from vlrep.data import pipeline
from vlrep.data.builders import common

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
    raise ValueError(f"Unknown dataset {dataset!r}; known: {', '.join(sorted(registry))}")
  cls = registry[dataset]
  generated = getattr(cls, "generated_on_first_use", False)
  if not generated and not (manual_dir and os.path.isdir(manual_dir) and os.listdir(manual_dir)):
    raise FileNotFoundError(f"--manual_dir={manual_dir!r} is not a folder or is empty. Expected layout:\n{cls.__doc__}")
  data_dir = os.path.expanduser(data_dir)
  kwargs = {"config": config_name} if config_name else {}
  builder = cls(data_dir=data_dir, file_format=file_format, **kwargs)
  common.SKIPPED.clear()
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
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
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, f"{dataset}_prepare_report.json"), "w") as f:
    json.dump(report, f, indent=2)
  return report


def main(argv):
  del argv
  report = prepare(FLAGS.dataset, FLAGS.manual_dir, FLAGS.data_dir, FLAGS.config_name, FLAGS.file_format)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  flags.mark_flag_as_required("dataset")
  app.run(main)
