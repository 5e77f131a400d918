"""A dataset's records and texts, without preprocessing: split names and slices, this host's shard of serialized
examples, every text of a feature (tokenizer corpora, captioning references), and host synchronisation. A leaf
of the data layer: tokenizers, concept sets and the pipeline read through it.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from jax.experimental import multihost_utils


def jax_process_index() -> int:
  return jax.process_index()


def sync_hosts(tag: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(tag)


def split_name(split: str) -> tuple[str, float]:
  """'train' or 'train[:10%]' -> (name, fraction). Fractions take the first part of the split, deterministically."""
  if "[" not in split:
    return split, 1.0
  name, sl = split.rstrip("]").split("[", 1)
  if not (sl.startswith(":") and sl.endswith("%")):
    raise ValueError(f"Only 'split[:N%]' slices are supported, got {split!r}.")
  return name, float(sl[1:-1]) / 100.0


def first_examples(builder, split: str, limit: int = 0) -> str:
  """`split`, or the slice of it holding its first `limit` examples (evaluators' `limit`); 0 keeps all."""
  if not limit:
    return split
  if split not in builder.info.splits:
    raise ValueError(f"Split {split!r} not in {builder.name}; splits: {sorted(builder.info.splits)}")
  total = builder.info.splits[split].num_examples
  return f"{split}[:{100.0 * min(limit, total) / total}%]"


def load_records(
  builder: tfds.core.DatasetBuilder, split: str, host_index: int = 0, host_count: int = 1
) -> list[bytes]:
  """The serialized examples of this host's shard of `split` (records host_index::host_count)."""
  name, fraction = split_name(split)
  if name not in builder.info.splits:
    raise ValueError(f"Split {name!r} not in {builder.name}; splits: {sorted(builder.info.splits)}")
  files = [os.fspath(p) for p in builder.info.splits[name].filepaths]
  records = list(tf.data.TFRecordDataset(files).as_numpy_iterator())
  records = records[: max(1, int(round(len(records) * fraction)))]
  shard = records[host_index::host_count]
  if not shard:
    raise ValueError(f"{builder.name}/{split} has {len(records)} examples, too few for {host_count} hosts.")
  return shard


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
  name, _ = split_name(split)
  ds = builder.as_dataset(split=name, decoders=skip_image_decoding(builder.info.features))
  texts = []
  for ex in ds.map(lambda e: e[key]).as_numpy_iterator():
    if isinstance(ex, np.ndarray):
      texts.extend(t.decode("utf-8") for t in ex.reshape(-1))
    else:
      texts.append(ex.decode("utf-8"))
  return texts


def read_example_texts(builder, split: str, key: str = "captions") -> list[list[str]]:
  """Per example of `split` (in record order, all hosts' shards), its texts: the references for captioning."""
  decoders = skip_image_decoding(builder.info.features)
  out = []
  for ser in load_records(builder, split):
    value = builder.info.features.deserialize_example(ser, decoders=decoders)[key].numpy()
    texts = value.reshape(-1) if isinstance(value, np.ndarray) else [value]
    out.append([t.decode("utf-8") for t in texts])
  return out
