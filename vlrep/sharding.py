"""Device mesh, parameter shardings and global batch assembly.

The mesh has one `data` axis over all devices (of all hosts). Batches are sharded along it. Parameters are
replicated by default; `sharding.params = 'fsdp'` shards each parameter's largest dimension divisible by the
data axis (ZeRO-3 / FSDP style; XLA inserts the all-gathers), which large backbones and heads need.
"""

from __future__ import annotations

import queue
import re
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"


def make_mesh(num_devices: int | None = None) -> Mesh:
  devices = jax.devices()[: num_devices or None]
  # Auto axes: shardings come from jit's in/out_shardings and XLA's propagation (make_mesh defaults to Explicit).
  return jax.make_mesh((len(devices),), (DATA,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(DATA))


def _fsdp_spec(shape, axis_size: int, min_size: int) -> P:
  if not shape or np.prod(shape) < min_size:
    return P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % axis_size == 0:
      spec = [None] * len(shape)
      spec[dim] = DATA
      return P(*spec)
  return P()


def state_shardings(mesh: Mesh, abstract_state: Any, strategy: str = "replicate", fsdp_min_size: int = 2**14, rules=()):
  """Shardings for every leaf of the (abstract) train state: params, optimizer and model state alike.

  `rules` (the config's `sharding.rules`) are (regex, spec) pairs tried in order on each leaf's '/'-joined path
  (e.g. 'model_state/queues/image_intra'); the first whose regex matches (re.search) gives the PartitionSpec of
  a leaf with at least as many dimensions as the spec, whose entries are mesh axis names or None. MCT declares
  `((r"(^|/)queues/", ("data",)),)`, so each device holds 1/N of every key queue. A spec that does not divide the
  leaf's shape is an error. Other leaves follow `strategy`: 'replicate', or 'fsdp' (the largest dimension
  divisible by the data axis)."""
  if strategy not in ("replicate", "fsdp"):
    raise ValueError(f"Unknown parameter sharding {strategy!r}; expected 'replicate' or 'fsdp'.")
  size = mesh.shape[DATA]
  compiled = [(re.compile(pattern), tuple(spec)) for pattern, spec in rules]

  def key_name(k) -> str:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)

  def rule(path, x):
    shape = getattr(x, "shape", ())
    name = "/".join(key_name(k) for k in path)
    for pattern, spec in compiled:
      if pattern.search(name) and len(spec) <= len(shape):  # (scalars such as a queue's pointer: replicated)
        if any(a and shape[d] % mesh.shape[a] for d, a in enumerate(spec)):
          raise ValueError(f"sharding rule {pattern.pattern!r} -> {spec} does not divide {name} of shape {shape}.")
        return NamedSharding(mesh, P(*spec, *([None] * (len(shape) - len(spec)))))
    if strategy == "fsdp":
      return NamedSharding(mesh, _fsdp_spec(shape, size, fsdp_min_size))
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(rule, abstract_state)


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  """Assembles each host's local batch into global arrays sharded along the data axis."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def _produce(batches, sharding, buffer, stop, done):
  def put(item) -> bool:  # False once the consumer stopped (it may never take another item)
    while not stop.is_set():
      try:
        buffer.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  try:
    for local in batches:
      if not put(global_batch(local, sharding)):
        return
    put(done)
  except BaseException as e:  # surfaced in the consumer, with its traceback
    put(e)


def device_prefetch(batches, sharding: NamedSharding, size: int = 2) -> DevicePrefetch:
  """Global device batches of `batches` (local ones), assembled and transferred `size` ahead by a thread."""
  return DevicePrefetch(batches, sharding, size)


class DevicePrefetch:
  """An iterator of global device batches while a thread assembles and transfers up to `size` more ahead, so the
  host-to-device copy overlaps the running step. `close()` stops the thread and closes `batches`;
  `close(wait=False)` (a preempted process about to exit) only tells the thread to stop: waiting would last until
  the input pipeline finished the batch it is building, seconds under load. Dropping the iterator (e.g. on an
  error) also tells it to stop: the thread holds no reference to it."""

  _DONE = object()

  def __init__(self, batches, sharding: NamedSharding, size: int = 2):
    self._batches = batches
    self._buffer: queue.Queue = queue.Queue(maxsize=max(1, size))
    self._stop = threading.Event()
    self._finished = False
    self._thread = threading.Thread(
      target=_produce,
      args=(batches, sharding, self._buffer, self._stop, self._DONE),
      name="device_prefetch",
      daemon=True,
    )
    self._thread.start()

  def __del__(self):
    self._stop.set()

  def __iter__(self):
    return self

  def __next__(self):
    if self._finished:
      raise StopIteration
    item = self._buffer.get()
    if item is self._DONE:
      self._finished = True
      raise StopIteration
    if isinstance(item, BaseException):
      self._finished = True
      raise item
    return item

  def close(self, wait: bool = True) -> None:
    self._finished = True
    self._stop.set()
    if not wait:
      return
    self._thread.join(timeout=60)
    if hasattr(self._batches, "close") and not self._thread.is_alive():
      self._batches.close()
