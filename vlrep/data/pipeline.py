"""tf.data input pipelines: a resumable, per-host training stream and finite evaluation passes.

Training order is a pure function of (seed, host, example index): epoch e visits the host's records (its 1/N:
records host, host + N, ...) in the permutation `index_shuffle(., seed=(seed, host, e))`, and every example's
augmentation seed is its position in the stream. Records stored as ArrayRecord are read from disk by index as the
stream needs them; otherwise (or with `in_memory`) the host's share is held in memory, serialized, images still
encoded. Resuming at step s therefore just starts the stream at s * local_batch: the run sees exactly the batches
an uninterrupted run would, whatever tf.data's parallelism.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging

# ops, region_files, traces and vl_ops are imported for their side effect: they register their ops in `registry`.
from vlrep import preemption
from vlrep.data import caption_views, concepts, ops, records, region_files, registry, traces, vl_ops  # noqa: F401
from vlrep.data.builders import coco_captions, image_text, localized_narratives, synthetic_scenes, vl_datasets, voc2007
from vlrep.errors import DatasetNotPrepared, MissingField, UserError

_STREAM_END = 2**62


def _builders() -> dict[str, Any]:
  return {
    "synthetic_scenes": (synthetic_scenes.SyntheticScenes, True),
    "coco_captions2017": (coco_captions.CocoCaptions2017, False),
    "voc2007": (voc2007.Voc2007, False),
    "localized_narratives": (localized_narratives.LocalizedNarratives, False),
    "vqa2": (vl_datasets.Vqa2, False),
    "vizwiz": (vl_datasets.Vizwiz, False),
    "snli_ve": (vl_datasets.SnliVe, False),
    "mm_imdb": (vl_datasets.MmImdb, False),
    "conceptual_captions": (vl_datasets.ConceptualCaptions, False),
    "image_text": (image_text.ImageText, False),
  }


# How vlrep prepares datasets: ArrayRecord files, read by index (training reads each host's records from disk as
# it needs them). Datasets prepared as TFRecord (older vlrep, or TFDS's own builders) still read, into memory.
FILE_FORMAT = "array_record"


def prepare_command(name: str) -> str:
  return f"python -m vlrep.data.prepare --dataset={name} --manual_dir=PATH --data_dir=DATA_DIR"


# Where each annotation a method may need lives in a user's own files (`image_text`, README "Train on your own
# data"), for the error a method gives when the prepared data lacks it.
FIELD_FORMATS = {
  "captions": 'a caption per image: KEY.txt or KEY.json {"caption": ...} in a shard, or the caption column of '
  "captions.jsonl / captions.csv",
  "tags": '"tags": [...] on a captions.jsonl row or in a shard\'s KEY.json (captions.csv: a tags column, '
  "'|'-separated)",
  "narration": 'Localized Narratives\' "caption", "timed_caption" and "traces" (points in [0, 1] of the image) '
  "on a captions.jsonl row or in a shard's KEY.json, exactly as in LN's JSONL files",
  "boxes": '"boxes": [[x_min, y_min, x_max, y_max], ...] in pixels (optional "labels") on a captions.jsonl row or in '
  "a shard's KEY.json",
}


def prepared_field_counts(builder) -> dict[str, int] | None:
  """{field: prepared examples carrying it} from the prepare report beside the dataset
  (DATA_DIR/<name>_prepare_report.json, `fields`), or None when the report does not say."""
  root = builder.data_dir
  for _ in range(3):  # DATA_DIR/name/version (or DATA_DIR/name/config/version)
    root = os.path.dirname(root)
    path = os.path.join(root, f"{builder.name}_prepare_report.json")
    if os.path.exists(path):
      with open(path) as f:
        counts = json.load(f).get("fields")
      return {k: int(v) for k, v in counts.items()} if isinstance(counts, dict) else None
  return None


def check_required_fields(builder, split: str, requires: dict, method: str) -> None:
  """Before anything trains: every field in `requires` ({field: what needs it, and the alternative}) is in the
  dataset and carried by some prepared example, else a MissingField error naming the field, what needs it and the
  format that carries it. Counts come from the prepare report, else from the split's first 1,000 examples."""
  if not requires:
    return
  counts = prepared_field_counts(builder)
  features = builder.info.features
  for field, why in dict(requires).items():
    if field in features and counts is not None and field in counts:
      present = counts[field] > 0
    elif field in features:
      present = any(
        np.asarray(ex[field]).size and np.asarray(ex[field]).reshape(-1)[0] not in (b"", "")
        for ex in records.examples(builder, split).take(1000).as_numpy_iterator()
      )
    else:
      present = False
    if not present:
      raise MissingField(
        f"{method} needs '{field}' ({why}), and {builder.name}/{split} in {builder.data_dir} has none. Your data "
        f"carries it as {FIELD_FORMATS.get(field, field)}; add it and prepare again ({prepare_command(builder.name)})."
      )


def get_builder(name: str, data_dir: str | None, config_name: str | None = None) -> tfds.core.DatasetBuilder:
  """Returns the dataset's builder, generating `synthetic_scenes` on first use.

  Real datasets are never prepared implicitly: a missing one is an error naming the command that prepares it.
  """
  registry = _builders()
  data_dir = os.path.expanduser(data_dir or tfds.core.constants.DATA_DIR)
  if name not in registry:
    return _tfds_builder(name, data_dir, config_name, registry)
  cls, generated = registry[name]
  builder = cls(config=config_name, data_dir=data_dir) if config_name else cls(data_dir=data_dir)
  if not builder.is_prepared():
    if not generated:
      raise DatasetNotPrepared(
        f"Dataset {name!r} is not prepared in {data_dir}. Prepare it from your local copy with:\n  "
        f"{prepare_command(name)}"
      )
    if records.jax_process_index() == 0:
      logging.info("Generating %s/%s in %s (first use).", name, builder.builder_config.name, data_dir)
      kwargs = {"config": config_name} if config_name else {}
      cls(data_dir=data_dir, file_format=FILE_FORMAT, **kwargs).download_and_prepare()
    records.sync_hosts(f"prepare {name}")
    builder = cls(config=config_name, data_dir=data_dir) if config_name else cls(data_dir=data_dir)
  return builder


def _tfds_builder(name: str, data_dir: str, config_name: str | None, registry: dict) -> tfds.core.DatasetBuilder:
  """Any other TFDS dataset (imagenet2012, i_naturalist2017, places365_small, ...), prepared beforehand."""
  full = f"{name}/{config_name}" if config_name else name
  try:
    builder = tfds.builder(full, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise UserError(
      f"Unknown dataset {name!r}: neither one of vlrep's ({', '.join(sorted(registry))}) nor a TFDS dataset."
    ) from e
  if not builder.is_prepared():
    raise DatasetNotPrepared(
      f"TFDS dataset {full!r} is not prepared in {data_dir}. Prepare it with TFDS from your local copy, e.g.\n  "
      f"tfds build {name} --data_dir={data_dir} --manual_dir=/path/to/downloaded/files"
    )
  return builder


def _lookup_fn(records: list[bytes]):
  """Random access into in-memory records. A tf.Variable is captured by handle, so large splits do not
  become graph constants (which are limited to 2 GB)."""
  table = tf.Variable(np.array(records, dtype=object), trainable=False, name="records")
  return lambda i: tf.gather(table, i)


def _tf_fields(preprocess: registry.Preprocess, fields: Sequence[str]) -> list[str]:
  """Fields tf.data must produce: the requested ones not made by host ops, plus the host ops' inputs."""
  return [f for f in fields if f not in preprocess.host_outputs] + list(preprocess.host_inputs)


def _finish(batch: dict, preprocess: registry.Preprocess, fields: Sequence[str]) -> dict:
  batch = preprocess.batch_fn(batch)
  return _select(batch, [*fields, *(["_mask"] if "_mask" in batch else [])])


def _select(example: dict, fields: Sequence[str]) -> dict:
  missing = [f for f in fields if f not in example]
  if missing:
    raise KeyError(f"Preprocessing did not produce fields {missing}; it produced {sorted(example)}.")
  out = {f: example[f] for f in fields}
  out.update({k: v for k, v in example.items() if k.startswith("stat_")})
  return out


def decoded_image_cache(records: list[bytes], parse_fn, size: int, key: str = "image"):
  """Decodes every record's image once, resized so that its shorter side is `size` (aspect kept), into one flat
  uint8 buffer: returns (buffer, offsets, shapes). Training then crops from memory instead of decoding JPEGs
  each epoch. Memory is about 3 * size^2 * aspect bytes per image (COCO train2017 at 256: ~31 GB over all
  hosts, each host holding its own shard)."""
  resize = registry.parse(f"decode(key={key!r})|resize_small({size}, key={key!r})").example_fn
  ds = tf.data.Dataset.from_tensor_slices(np.array(records, dtype=object))
  ds = ds.map(lambda r: resize({key: parse_fn(r)[key]})[key], num_parallel_calls=tf.data.AUTOTUNE)
  images = list(ds.as_numpy_iterator())
  shapes = np.array([im.shape for im in images], np.int64)
  sizes = shapes.prod(1)
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
  return np.concatenate([im.reshape(-1) for im in images]), offsets, shapes


def _cached_lookup_fn(cache):
  """Random access into the decoded-image cache (tf.Variables, captured by handle: no 2 GB graph constants)."""
  buffer, offsets, shapes = (tf.Variable(a, trainable=False) for a in cache)

  def lookup(i):
    shape = tf.gather(shapes, i)
    flat = buffer[tf.gather(offsets, i) : tf.gather(offsets, i) + tf.reduce_prod(shape)]
    image = tf.reshape(flat, shape)
    image.set_shape([None, None, 3])
    return image

  return lookup


def stream_dataset(
  num_records: int,
  read_records,
  make_raw_example,
  example_fn,
  local_batch: int,
  seed: int,
  start_step: int = 0,
  host_index: int = 0,
  host_count: int = 1,
  prefetch: int = 2,
  threads: int | None = None,
  read_chunk: int = records.READ_CHUNK,
) -> tf.data.Dataset:
  """The training tf.data graph over a host's `num_records`: epoch-wise stateless permutation, records fetched
  `read_chunk` at a time (`read_records(indices) -> serialized records`: one call per chunk, so reading from disk
  costs one Python call per chunk, not per example), `make_raw_example(index, record)` -> example, per-example
  seed, parallel deterministic map, batch, prefetch."""
  n = num_records

  def position(i):
    epoch, pos = i // n, i % n
    return tf.random.experimental.index_shuffle(
      pos, tf.stack([tf.constant(seed * 1_000_003 + host_index, tf.int64), epoch]), tf.constant(n - 1, tf.int64)
    )

  def make_example(i, index, record):
    ex = make_raw_example(index, record)
    # Augmentation seed: the example's position in the global stream.
    ex["_rng"] = tf.stack([tf.constant(seed, tf.int64), i * host_count + host_index])
    return example_fn(ex)

  parallel = {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True}
  ds = tf.data.Dataset.range(start_step * local_batch, _STREAM_END)
  ds = ds.map(lambda i: (i, position(i)), **parallel).batch(read_chunk)
  ds = ds.map(lambda i, index: (i, index, read_records(index)), **parallel).unbatch()
  ds = ds.map(make_example, **parallel)
  ds = ds.batch(local_batch, drop_remainder=True).prefetch(prefetch)
  options = tf.data.Options()
  options.deterministic = True
  options.threading.private_threadpool_size = threads or max(2, os.cpu_count() or 2)
  return ds.with_options(options)


class TrainStream:
  """Iterator of a host's local training batches (`train_stream`); `close()` stops its workers.

  `records_read()`: the serialized records this process has read for it so far. From disk, only those its batches
  needed (and the few prefetched); in memory, its whole share at startup; from TFRecord files, which have no
  random access, the whole split."""

  def __init__(self, batches: Iterator[dict[str, np.ndarray]], records_read: Callable[[], int]):
    self._batches = batches
    self.records_read = records_read

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._batches)

  def close(self) -> None:
    self._batches.close()


def train_stream(
  builder,
  data: Mapping[str, Any],
  fields: Sequence[str],
  local_batch: int,
  *,
  seed: int,
  start_step: int = 0,
  host_index: int = 0,
  host_count: int = 1,
  context: dict | None = None,
) -> TrainStream:
  """Infinite iterator of local training batches of `data.split` preprocessed by `data.pp`, starting at batch
  `start_step`. `data` is a config's `data` block (or any mapping with those keys).

  Records stored as ArrayRecord are read from disk by index as the stream needs them (this host's share only);
  `data.in_memory` (or TFRecord storage, which has no random access) holds this host's share of the encoded records
  in memory instead. Either way batch k is the same. `data.prefetch` (default 2) bounds the batches prepared ahead:
  an autotuned buffer grows over a long run, competes with evaluation for host cores and makes teardown slow.
  `data.cache_image_size` > 0 decodes every image once into memory, resized to that shorter side (`decode` then
  passes the cached pixels through). Call `.close()` when done to stop the workers.
  """
  split, pp = data["split"], data["pp"]
  prefetch, in_memory = data.get("prefetch", 2), data.get("in_memory", False)
  cache_image_size = data.get("cache_image_size", 0)
  from_disk = records.is_array_record(builder) and not in_memory and not cache_image_size
  if from_disk:
    reader = records.split_reader(builder, split)
    num_records, lookup = reader.host_lookup(host_index, host_count)

    def records_read() -> int:
      return reader.reads

  else:
    shard = records.load_records(builder, split, host_index, host_count)
    num_records, lookup = len(shard), _lookup_fn(shard)
    # ArrayRecord: this host's share, by index; TFRecord: every record of the split, read to pick the share.
    read_at_start = len(shard) if records.is_array_record(builder) else records.split_size(builder, split)

    def records_read() -> int:
      return read_at_start

  decoders = records.skip_image_decoding(builder.info.features)
  preprocess = registry.parse(pp, context)
  tf_fields = _tf_fields(preprocess, fields)

  def deserialize(ser):
    return builder.info.features.deserialize_example(ser, decoders=decoders)

  cached = None
  if cache_image_size:
    if "object_map" in pp or "oracle" in pp:
      raise ValueError("data.cache_image_size caches the image alone; this pp also crops the instance map.")
    cache = decoded_image_cache(shard, deserialize, cache_image_size)
    logging.info(
      "Cached %d decoded images (shorter side %d) in %.2f GB of host memory.",
      len(shard),
      cache_image_size,
      cache[0].nbytes / 1e9,
    )
    cached = _cached_lookup_fn(cache)

  def make_raw_example(index, record):
    ex = deserialize(record)
    if cached is not None:
      ex["image"] = cached(index)
    return ex

  logging.info(
    "Training stream over %d records of %s/%s (host %d/%d), %s, starting at batch %d.",
    num_records,
    builder.name,
    split,
    host_index,
    host_count,
    "read from disk" if from_disk else "in memory",
    start_step,
  )
  ds = stream_dataset(
    num_records,
    lookup,
    make_raw_example,
    lambda ex: _select(preprocess.example_fn(ex), tf_fields),
    local_batch,
    seed,
    start_step,
    host_index,
    host_count,
    prefetch,
  )
  return TrainStream((_finish(batch, preprocess, fields) for batch in ds.as_numpy_iterator()), records_read)


def eval_batches(
  builder,
  split: str,
  pp: str,
  fields: Sequence[str],
  local_batch: int,
  host_index: int = 0,
  host_count: int = 1,
  context: dict | None = None,
) -> Iterator[dict[str, np.ndarray]]:
  """One pass over this host's shard of `split`, in order. The last batch is padded; `_mask` marks real rows.

  Every host yields the same number of batches (the longest shard's), so collective ops stay in step.
  """
  total = records.split_size(builder, split)
  num_batches = math.ceil(math.ceil(total / host_count) / local_batch)
  decoders = records.skip_image_decoding(builder.info.features)
  preprocess = registry.parse(pp, context)
  tf_fields = _tf_fields(preprocess, fields)

  def make_example(ser):
    ex = builder.info.features.deserialize_example(ser, decoders=decoders)
    ex["_rng"] = tf.zeros([2], tf.int64)
    ex = _select(preprocess.example_fn(ex), tf_fields)
    ex["_mask"] = tf.constant(True)
    return ex

  ds = records.serialized_records(builder, split, host_index, host_count)
  ds = ds.map(make_example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.batch(local_batch, drop_remainder=False)
  count = 0
  example = None
  for batch in ds.as_numpy_iterator():
    preemption.check()  # SIGTERM: the evaluation stops here, and the loop saves and exits
    batch = _finish(batch, preprocess, fields)
    example = batch
    yield _pad_batch(batch, local_batch)
    count += 1
  while count < num_batches:  # this host's shard is shorter: send fully masked batches
    yield {k: np.zeros_like(v[:1]).repeat(local_batch, 0) for k, v in example.items()}
    count += 1


def _pad_batch(batch: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
  n = len(batch["_mask"])
  if n == size:
    return batch
  return {k: np.concatenate([v, np.zeros((size - n,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}
