"""Reading torch.save files without running them: a restricted unpickler for torch's zip format (torch >= 1.6) and
its legacy format (older torch, or `_use_new_zipfile_serialization=False`).

Nothing in a file is imported or called: tensors (and nn.Parameters) are rebuilt as numpy arrays from the raw
storages (float64/32/16, bfloat16 as ml_dtypes.bfloat16, ints, bool; any strides and storage offset), ordered dicts
and plain containers as themselves, and every other object (an optimizer's or trainer's state, a config object, a
payload that would run a command) becomes an inert placeholder that only records its name and arguments.

  load_checkpoint(path) -> Any                        the whole object
  load_state_dict(path) -> dict[str, np.ndarray]      its state dict, flat
  as_state_dict(obj, path) -> dict[str, np.ndarray]   the state dict of an object already read

A leaf module: it imports nothing from vlrep, so any layer (models, importers, tools) may read torch files.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import struct
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

_STORAGES = {
  "FloatStorage": np.float32,
  "DoubleStorage": np.float64,
  "HalfStorage": np.float16,
  "BFloat16Storage": ml_dtypes.bfloat16,
  "LongStorage": np.int64,
  "IntStorage": np.int32,
  "ShortStorage": np.int16,
  "CharStorage": np.int8,
  "ByteStorage": np.uint8,
  "BoolStorage": np.bool_,
}


class _Opaque:
  """Stands for any other object of a checkpoint (an optimizer's or scheduler's state, a config object): it records
  the name and arguments it was unpickled with and runs nothing. A state dict that holds one is an error."""

  name = "?"

  def __init__(self, *args, **kwargs):
    self.args = args

  def __setstate__(self, state):
    self.state = state

  def __repr__(self):
    return f"<{self.name}>"


class _Storage:
  def __init__(self, name: str):
    self.dtype = np.dtype(_STORAGES[name])


@dataclasses.dataclass
class _LazyTensor:
  """A tensor of a legacy-format file, whose storages follow the pickle: materialised once they are read."""

  storage: Any
  offset: int
  size: tuple
  stride: tuple


def _as_array(storage: np.ndarray, offset: int, size, stride) -> np.ndarray:
  if not size:
    return storage[offset : offset + 1].reshape(()).copy()
  itemsize = storage.itemsize
  return np.lib.stride_tricks.as_strided(
    storage[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
  ).copy()


def _unpickler(file, path: str, load_storage, lazy: bool):
  class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
      if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
        return rebuild_tensor
      if module == "torch._utils" and name == "_rebuild_parameter":
        return lambda data, *unused: data
      if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
      if module == "torch" and name in _STORAGES:
        return _Storage(name)
      # Anything else is recorded, never imported or called.
      return type(f"Opaque_{name}", (_Opaque,), {"name": f"{module}.{name}"})

    def persistent_load(self, pid):
      if not (isinstance(pid, tuple) and pid and pid[0] in ("storage", b"storage")):
        raise pickle.UnpicklingError(f"{path}: unexpected persistent id {pid!r}.")
      return load_storage(*pid[1:])

  def rebuild_tensor(storage, offset, size, stride, *unused):
    if lazy:
      return _LazyTensor(storage, offset, tuple(size), tuple(stride))
    return _as_array(storage, offset, size, stride)

  return RestrictedUnpickler(file)


def _read_zip(path: str):
  with zipfile.ZipFile(path) as archive:
    pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl is None:
      raise ValueError(f"{path} is a zip file without data.pkl: not a torch checkpoint.")
    prefix = pkl[: -len("data.pkl")]

    def load_storage(storage_type, key, location, numel, *unused):
      return np.frombuffer(archive.read(f"{prefix}data/{key}"), storage_type.dtype)

    with archive.open(pkl) as f:
      return _unpickler(f, path, load_storage, lazy=False).load()


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def _read_legacy(path: str):
  """torch.save's format before torch 1.6 (or with _use_new_zipfile_serialization=False): three small pickles,
  the object's pickle, the list of storage keys, then each storage as an int64 element count and its bytes."""
  with open(path, "rb") as f:
    if pickle.load(f) != _LEGACY_MAGIC:
      raise ValueError(f"{path} is neither a zip nor a legacy torch checkpoint (wrong magic number).")
    pickle.load(f)  # protocol version
    pickle.load(f)  # system info
    dtypes: dict[str, np.dtype] = {}

    def load_storage(storage_type, key, location, numel, view_metadata=None):
      dtypes.setdefault(key, storage_type.dtype)
      if view_metadata is not None:
        view_key, view_offset, _ = view_metadata
        return ("view", key, view_offset)
      return ("root", key, 0)

    obj = _unpickler(f, path, load_storage, lazy=True).load()
    keys = pickle.load(f)
    data = {}
    for key in keys:
      dtype = dtypes[key]
      (count,) = struct.unpack("<q", f.read(8))
      data[key] = np.frombuffer(f.read(count * dtype.itemsize), dtype)

  def materialise(x):
    if isinstance(x, _LazyTensor):
      _, key, view_offset = x.storage
      return _as_array(data[key], view_offset + x.offset, x.size, x.stride)
    if isinstance(x, dict):
      return type(x)((k, materialise(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
      return type(x)(materialise(v) for v in x)
    return x

  return materialise(obj)


def load_checkpoint(path: str) -> Any:
  """A torch.save file (.pth/.pt/.bin, zip or legacy format) as plain Python containers and numpy arrays, through
  a restricted unpickler: tensors, storages and ordered dicts are rebuilt; any other object becomes an inert
  placeholder (nothing is imported or run)."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"No checkpoint file {path}.")
  if zipfile.is_zipfile(path):
    return _read_zip(path)
  try:
    return _read_legacy(path)
  except (pickle.UnpicklingError, EOFError, struct.error) as e:
    raise ValueError(f"{path} is not a torch checkpoint (zip or legacy format): {e}") from e


_WRAPPERS = ("model", "state_dict", "model_state_dict", "module")


def as_state_dict(obj: Any, path: str) -> dict[str, np.ndarray]:
  """The state dict ({name: numpy array}) of what `load_checkpoint` read from `path` (named in errors): the object
  itself, or what it holds under 'model' / 'state_dict' / ... (VirTex's {"model": ..., "optimizer": ...,
  "iteration": ...}) when its top level has no tensors; a 'module.' prefix on every key (a DistributedDataParallel
  model's) is removed. An entry that is not a tensor (e.g. a placeholder for a foreign object) is an error naming
  its key."""
  if not isinstance(obj, dict):
    raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict.")
  if not any(isinstance(v, np.ndarray) for v in obj.values()):
    inner = next((obj[k] for k in _WRAPPERS if isinstance(obj.get(k), dict)), None)
    if inner is None:
      raise ValueError(
        f"{path} holds no tensors at its top level nor under {_WRAPPERS}; its entries: {sorted(map(str, obj))[:10]}."
      )
    obj = inner
  bad = [k for k, v in obj.items() if not isinstance(v, np.ndarray)]
  if bad:
    raise ValueError(f"{path}: the state dict holds entries that are not tensors: {bad[:5]} ({obj[bad[0]]!r}).")
  if obj and all(k.startswith("module.") for k in obj):
    obj = {k[len("module.") :]: v for k, v in obj.items()}
  return dict(obj)


def load_state_dict(path: str) -> dict[str, np.ndarray]:
  """The state dict of a torch.save file, flat ({name: numpy array}): `as_state_dict(load_checkpoint(path), path)`."""
  return as_state_dict(load_checkpoint(path), path)
