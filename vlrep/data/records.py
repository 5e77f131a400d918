"""A dataset's records and texts, without preprocessing: split names and slices, this host's shard of serialized
examples, every text of a feature (tokenizer corpora, captioning references), and host synchronisation. A leaf
of the data layer: tokenizers, concept sets and the pipeline read through it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from array_record.python import array_record_data_source
from jax.experimental import multihost_utils


def jax_process_index() -> int:
  return jax.process_index()


def sync_hosts(tag: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(tag)


def as_process_0_sees(flag: bool) -> bool:
  """Process 0's value of `flag` on every process (one broadcast when there are several). For "is this file
  missing?" before process 0 writes it and the others wait at a sync point: each process looking for itself
  races with the write, and a process that finds the file already written would skip the sync its peers wait at."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def split_name(split: str) -> tuple[str, float]:
  """'train', 'train[:10%]' or 'train[10%:]' -> (name, the fraction of the split it holds)."""
  name, skip, fraction = _split_parts(split)
  return name, fraction - skip


def _split_parts(split: str) -> tuple[str, float, float]:
  """(name, skipped fraction, end fraction): 'train[:10%]' is its first 10% (0, 0.1); 'train[10%:]' the rest
  (0.1, 1), which never shares a record with 'train[:10%]' (own data's training part and its held-out part)."""
  if "[" not in split:
    return split, 0.0, 1.0
  name, sl = split.rstrip("]").split("[", 1)
  if sl.startswith(":") and sl.endswith("%"):
    return name, 0.0, float(sl[1:-1]) / 100.0
  if sl.endswith("%:"):
    return name, float(sl[:-2]) / 100.0, 1.0
  if sl.count("%") == 2 and sl.endswith("%") and "%:" in sl:  # 'train[10%:20%]': an evaluator's `limit` of a slice
    a, b = sl[:-1].split("%:")
    return name, float(a) / 100.0, float(b) / 100.0
  raise ValueError(f"Only 'split[:N%]', 'split[N%:]' and 'split[A%:B%]' slices are supported, got {split!r}.")


def split_range(builder, split: str) -> tuple[str, int, int]:
  """(name, first record, record count) of `split`: 'name[:N%]' holds the first max(1, round(N% of the split))
  records, 'name[N%:]' the records after exactly those."""
  name, skip, end = _split_parts(split)
  if name not in builder.info.splits:
    raise ValueError(f"Split {name!r} not in {builder.name}; splits: {sorted(builder.info.splits)}")
  total = builder.info.splits[name].num_examples
  head = lambda f: max(1, int(round(total * f))) if f else 0
  start = head(skip)
  stop = total if end == 1.0 else head(end)
  if stop <= start:
    raise ValueError(f"{builder.name}/{split} holds no example (the split has {total}).")
  return name, start, stop - start


def first_examples(builder, split: str, limit: int = 0) -> str:
  """`split`, or the slice of it holding its first `limit` examples (evaluators' `limit`); 0 keeps all."""
  if not limit:
    return split
  name, start, size = split_range(builder, split)
  if limit >= size:
    return split
  total = builder.info.splits[name].num_examples
  if not start:
    return f"{name}[:{100.0 * limit / total}%]"
  return f"{name}[{100.0 * start / total}%:{100.0 * (start + limit) / total}%]"


# Records fetched per read call from ArrayRecord files: one Python call per chunk, not per example.
READ_CHUNK = 32


def pipeline_options(threads: int | None = None) -> tf.data.Options:
  """tf.data options for every vlrep pipeline: deterministic order, and autotuning off. With autotuning on, an
  iterator runs a model thread that sleeps between optimisations for a period that doubles up to 60 s, and deleting
  the iterator waits for that sleep to end, so closing a long-lived stream can stall its run for tens of seconds.
  Without it, a map with AUTOTUNE parallelism runs min(16, thread pool) calls at once; `threads` > 0 gives the
  pipeline its own pool of that many threads."""
  options = tf.data.Options()
  options.deterministic = True
  options.autotune.enabled = False
  if threads:
    options.threading.private_threadpool_size = threads
  return options


def split_size(builder, split: str) -> int:
  """How many records `split` (a name, 'name[:N%]': its first N%, or 'name[N%:]': the rest) holds."""
  return split_range(builder, split)[2]


def is_array_record(builder) -> bool:
  """Whether the dataset is stored in ArrayRecord files (random access by index: reads from disk)."""
  return builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD


class SplitReader:
  """Random access to serialized examples in ArrayRecord files (one split's, or its first `size`), by index;
  `reads` counts the records this process has read (each host reads only its own indices)."""

  def __init__(self, files: Sequence[str], name: str, size: int | None = None, start: int = 0):
    self._source = array_record_data_source.ArrayRecordDataSource(list(files))
    self.start = start  # the split's first record ('name[N%:]' starts after the held-out first N%)
    available = len(self._source) - start
    self.size = available if size is None else min(size, available)
    self.name = name
    self.reads = 0
    self._reads_lock = threading.Lock()  # tf.data calls `read` from several threads at once

  def __len__(self) -> int:
    return self.size

  def read(self, indices) -> list[bytes]:
    indices = [int(i) for i in np.asarray(indices).reshape(-1)]
    bad = [i for i in indices if not 0 <= i < self.size]
    if bad:
      raise IndexError(f"Record index {bad[0]} is past the end of {self.name} ({self.size} records).")
    with self._reads_lock:
      self.reads += len(indices)
    # One by one: __getitems__ starts a thread pool per call, which costs more than the reads themselves.
    return [self._source[self.start + i] for i in indices]

  def host_lookup(self, host_index: int = 0, host_count: int = 1):
    """(this host's record count, a tf function: positions in this host's share -> their serialized examples, of
    the positions' shape). The host's share is records host_index, host_index + host_count, ... (as
    `load_records`), read on demand."""
    count = len(range(host_index, self.size, host_count))
    if not count:
      raise ValueError(f"{self.name} has {self.size} examples, too few for {host_count} hosts.")

    def read_positions(positions):
      positions = np.asarray(positions)
      found = self.read(host_index + positions.reshape(-1) * host_count)
      return np.array(found + [b""], dtype=object)[:-1].reshape(positions.shape)  # [b""]: never a 2-D byte array

    def lookup(positions):
      positions = tf.convert_to_tensor(positions, tf.int64)
      found = tf.numpy_function(read_positions, [positions], tf.string, stateful=False)
      found.set_shape(positions.shape)
      return found

    return count, lookup


def split_reader(builder, split: str) -> SplitReader:
  """A `SplitReader` over `split` ('name' or 'name[:N%]') of a dataset stored as ArrayRecord."""
  if not is_array_record(builder):
    raise ValueError(
      f"{builder.name} is stored as {builder.info.file_format.value}, which has no random access: prepare it again "
      "with `python -m vlrep.data.prepare` (ArrayRecord), or set data.in_memory=True."
    )
  name, start, size = split_range(builder, split)
  files = [os.fspath(p) for p in builder.info.splits[name].filepaths]
  return SplitReader(files, f"{builder.name}/{split}", size, start)


def load_records(
  builder: tfds.core.DatasetBuilder, split: str, host_index: int = 0, host_count: int = 1
) -> list[bytes]:
  """The serialized examples of this host's shard of `split` (records host_index::host_count), in memory. From
  ArrayRecord files a host reads only its own records; TFRecord files are read whole (no random access)."""
  total = split_size(builder, split)
  if is_array_record(builder):
    shard = split_reader(builder, split).read(range(host_index, total, host_count))
  else:
    name, start, _ = split_range(builder, split)
    files = [os.fspath(p) for p in builder.info.splits[name].filepaths]
    shard = list(tf.data.TFRecordDataset(files).skip(start).take(total).as_numpy_iterator())[host_index::host_count]
  if not shard:
    raise ValueError(f"{builder.name}/{split} has {total} examples, too few for {host_count} hosts.")
  return shard


def serialized_records(builder, split: str, host_index: int = 0, host_count: int = 1) -> tf.data.Dataset:
  """This host's serialized examples of `split` (records host_index::host_count; all of them by default), in
  order, as a tf.data.Dataset: read from disk (ArrayRecord) or streamed from TFRecord files."""
  total = split_size(builder, split)
  if not len(range(host_index, total, host_count)):
    raise ValueError(f"{builder.name}/{split} has {total} examples, too few for {host_count} hosts.")
  if is_array_record(builder):
    count, lookup = split_reader(builder, split).host_lookup(host_index, host_count)
    ds = tf.data.Dataset.range(count).batch(READ_CHUNK).with_options(pipeline_options())
    return ds.map(lookup, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
  name, start, _ = split_range(builder, split)
  files = [os.fspath(p) for p in builder.info.splits[name].filepaths]
  ds = tf.data.TFRecordDataset(files).with_options(pipeline_options())
  return ds.skip(start).take(total).shard(host_count, host_index)


def examples(builder, split: str, decode_images: bool = False) -> tf.data.Dataset:
  """Every example of `split` in order, images left encoded unless `decode_images` (what `as_dataset` gives, for
  either storage format: TFDS reads ArrayRecord only through data sources)."""
  decoders = None if decode_images else skip_image_decoding(builder.info.features)
  return serialized_records(builder, split).map(
    lambda ser: builder.info.features.deserialize_example(ser, decoders=decoders),
    num_parallel_calls=tf.data.AUTOTUNE,
    deterministic=True,
  )


def skip_image_decoding(features) -> dict:
  """Decoders that keep every Image feature encoded (decoded later by the `decode` op only when needed)."""
  out = {}
  for key, feat in features.items():
    if isinstance(feat, tfds.features.Image):
      out[key] = tfds.decode.SkipDecoding()
    elif isinstance(feat, tfds.features.Sequence) and isinstance(feat.feature, tfds.features.FeaturesDict):
      sub = skip_image_decoding(feat.feature)
      if sub:
        out[key] = sub
    elif isinstance(feat, tfds.features.FeaturesDict):
      sub = skip_image_decoding(feat)
      if sub:
        out[key] = sub
  return out


def read_texts(builder, split: str, key: str = "captions") -> list[str]:
  """All strings of a text feature (or sequence of texts) in a split: the tokenizer's training corpus."""
  texts = []
  for ex in examples(builder, split).map(lambda e: e[key]).as_numpy_iterator():
    if isinstance(ex, np.ndarray):
      texts.extend(t.decode("utf-8") for t in ex.reshape(-1))
    else:
      texts.append(ex.decode("utf-8"))
  return texts


def read_example_texts(builder, split: str, key: str = "captions") -> list[list[str]]:
  """Per example of `split` (in record order, all hosts' shards), its texts: the references for captioning."""
  out = []
  for value in examples(builder, split).map(lambda e: e[key]).as_numpy_iterator():
    texts = value.reshape(-1) if isinstance(value, np.ndarray) else [value]
    out.append([t.decode("utf-8") for t in texts])
  return out


def most_texts(builder, split: str, key: str = "captions") -> int:
  """The most texts (`key`, a sequence) any example of `split` has: how wide an evaluator that ranks every caption of
  each image pads them (images have different numbers: COCO 5 to 7, your own data any). Images are not decoded;
  every host reads the whole split, so all agree."""
  sizes = examples(builder, split).map(lambda e: tf.size(e[key]))
  return int(sizes.reduce(tf.constant(0), tf.maximum).numpy())
