"""`synthetic_scenes`: the embedded dataset, generated locally from a seed (no download).

Splits (sizes per builder config):
  train, val            main-style scenes with captions, narrations, objects, QA and entailment.
  probe_trainval        multi-label probe in VOC07 form (objects with shape labels and `is_difficult`): SVM training.
  probe_val             the same: hyperparameters and runlocal defaults are chosen on it.
  probe_test            the same: only reported, never tuned on.
  ood_train, ood_val    the same annotations in the out-of-domain "sketch" style.

Configs: `default` (64x64, the sizes below), `tiny` (32x32, a few dozen per split: tests) and `scale2k`,
`scale20k`, `scale200k` (64x64 training scenes in those numbers, tiny other splits: the data-at-scale test,
`vlrep.bench.scale_test`).

Every split is generated from its own seed stream, so a config always yields the same examples.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import zlib

import numpy as np
import tensorflow_datasets as tfds

from vlrep.data import scenes


@dataclasses.dataclass
class ScenesConfig(tfds.core.BuilderConfig):
  image_size: int = 64
  splits: dict = dataclasses.field(default_factory=dict)
  seed: int = 0


_DEFAULT_SPLITS = {
  "train": 8000,
  "val": 500,
  "probe_trainval": 1000,
  "probe_val": 1000,
  "probe_test": 1000,
  "ood_train": 500,
  "ood_val": 500,
}
_TINY_SPLITS = {
  "train": 64,
  "val": 16,
  "probe_trainval": 40,
  "probe_val": 40,
  "probe_test": 40,
  "ood_train": 16,
  "ood_val": 16,
}


# Splits up to this size are drawn in this process; larger ones by a pool of spawned workers.
_IN_PROCESS_MAX = 1000


def _scale_config(train: int) -> ScenesConfig:
  return ScenesConfig(
    name=f"scale{train // 1000}k",
    description=f"{train:,} 64x64 training scenes and tiny other splits: the data-at-scale test's datasets "
    "(vlrep.bench.scale_test).",
    image_size=64,
    splits={**_TINY_SPLITS, "train": train},
  )


class SyntheticScenes(tfds.core.GeneratorBasedBuilder):
  """Procedurally generated scenes of coloured shapes with captions, narrations, masks, QA and entailment."""

  # Nothing to download or copy: `pipeline.get_builder` generates it where it is missing (every other dataset of
  # vlrep's is prepared from a local copy with `vlrep.data.prepare`).
  generated_on_first_use = True

  VERSION = tfds.core.Version("2.1.0")
  RELEASE_NOTES = {
    "1.0.0": "First release.",
    "1.1.0": "Fix: split seeds from the CRC32 of the split name. 1.0.0 took the first 4 bytes of the name, so "
    "probe_trainval and probe_test (and ood_train and ood_val) were the same images.",
    "2.0.0": "Learnable at the runlocal budget: shapes 1.6-2.6x larger (radius 12-26% of the side), at most 3 per "
    "image, diamond/hexagon/pentagon (near-duplicates at low resolution) replaced by arrow/crescent/bar, plain "
    "gradient backgrounds (no stripes or blotches); train 8000 images; a probe_val split for choosing "
    "hyperparameters (probe_test is only reported).",
    "2.1.0": "Captions and narrations name an object's colour in a quarter of its mentions (2.0.0: always), so "
    "colour no longer dominates what a captioning model learns first; 'an image' instead of 'a image'. Images, "
    "objects, masks and labels are 2.0.0's (each scene draws them before its text); captions, narrations, questions "
    "and entailment statements differ.",
  }
  BUILDER_CONFIGS = [
    ScenesConfig(
      name="default",
      description="64x64 images; builds in well under a minute on 2 cores.",
      image_size=64,
      splits=_DEFAULT_SPLITS,
    ),
    ScenesConfig(name="tiny", description="Tiny splits for tests.", image_size=32, splits=_TINY_SPLITS),
    *(_scale_config(n) for n in (2_000, 20_000, 200_000)),
  ]

  def _info(self) -> tfds.core.DatasetInfo:
    size = self.builder_config.image_size
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(shape=(size, size, 3), encoding_format="png"),
          "image_id": tfds.features.Scalar(np.int64),
          "style": tfds.features.ClassLabel(names=scenes.STYLES),
          "captions": tfds.features.Sequence(tfds.features.Text()),
          "narration": tfds.features.Text(),
          "timed_caption": tfds.features.Sequence(
            {
              "utterance": tfds.features.Text(),
              "start_time": np.float32,
              "end_time": np.float32,
            }
          ),
          # Mouse trace points (x, y normalised to [0, 1]; t in seconds), as Localized Narratives' traces.
          "traces": tfds.features.Tensor(shape=(None, 3), dtype=np.float32),
          "objects": tfds.features.Sequence(
            {
              "label": tfds.features.ClassLabel(names=scenes.SHAPES),
              "color": tfds.features.ClassLabel(names=scenes.COLOR_NAMES),
              "size": tfds.features.ClassLabel(names=scenes.SIZES),
              "bbox": tfds.features.BBoxFeature(),
              "is_difficult": np.bool_,
            }
          ),
          # Visible-instance map: pixel value k+1 where object k is visible (masks are disjoint after occlusion).
          "object_map": tfds.features.Image(shape=(size, size, 1), encoding_format="png"),
          "questions": tfds.features.Sequence({"question": tfds.features.Text(), "answer": tfds.features.Text()}),
          "entailment": tfds.features.Sequence(
            {
              "statement": tfds.features.Text(),
              "label": tfds.features.ClassLabel(names=scenes.ENTAILMENT_LABELS),
            }
          ),
        }
      ),
      supervised_keys=None,
      homepage="https://github.com/vlrep/vlrep",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {name: self._generate_examples(name, n) for name, n in self.builder_config.splits.items()}

  def _generate_examples(self, split: str, num_examples: int):
    cfg = self.builder_config
    # Split-specific seed: crc of the split name, so adding a split does not change the others.
    seed = np.random.SeedSequence([cfg.seed, zlib.crc32(split.encode())])
    style = "sketch" if split.startswith("ood") else "main"
    # One child seed per example: examples do not depend on how generation is parallelised. Workers are
    # spawned (not forked: the parent runs TF/JAX threads) and import only the numpy/PIL scene module.
    jobs = [(child, cfg.image_size, style, i) for i, child in enumerate(seed.spawn(num_examples))]
    for i, record in enumerate(_encoded_records(jobs)):
      for o in record["objects"]:
        o["bbox"] = tfds.features.BBox(*o["bbox"])
      yield i, record


def _encoded_records(jobs):
  if len(jobs) <= _IN_PROCESS_MAX:  # starting a pool (seconds) costs more than drawing a small split
    yield from map(scenes.make_encoded_record, jobs)
    return
  with multiprocessing.get_context("spawn").Pool(min(4, os.cpu_count() or 1)) as pool:
    yield from pool.imap(scenes.make_encoded_record, jobs, chunksize=64)
