"""Reading pickled foreign files without running them: vlrep's one restricted unpickler, for torch.save's zip format
(torch >= 1.6), its legacy format (older torch, or `_use_new_zipfile_serialization=False`) and numpy's pickled
`.npy` files (MMF's `_info.npy`).

A pickle names the functions and classes that rebuild its objects ("globals"), and a plain `pickle.load` imports and
calls whatever it names: `os.system`, `builtins.exec`, `subprocess.Popen`. Here every global is looked up in a fixed
table, and the table holds only what rebuilds data:

  tensors, nn.Parameters   torch._utils._rebuild_tensor(_v2), _rebuild_parameter(_with_state),
                           torch._tensor._rebuild_from_type_v2 (of a plain Tensor or Parameter)
                           -> numpy arrays from the raw storages (float64/32/16, bfloat16 as ml_dtypes.bfloat16,
                           complex, ints, bool; any strides and storage offset, bounds-checked)
  storages                 torch.FloatStorage, ... (one per dtype), torch.UntypedStorage; torch.Size (a tuple)
  numpy arrays             numpy.ndarray, numpy.dtype, numpy.(_)core.multiarray._reconstruct / scalar,
                           numpy.(_)core.numeric._frombuffer
  containers               collections.OrderedDict, set, frozenset, complex, and protocol 2's bytes
                           (_codecs.encode of latin-1 text only); dict, list, tuple, str, numbers need no global

Any other global is an `UnsafeFile` error (a `vlrep.errors.UserError`) naming the file and the global, raised
when the unpickler meets it, before anything of it is imported or called; a file that is not a well-formed pickle of
these is a ValueError naming the file. The callables of the table are fresh closures of each load, so a file cannot
change them for the next one (pickle's BUILD can set attributes), and each one checks its arguments.

  load_checkpoint(path) -> Any                        a torch.save file's whole object
  load_state_dict(path) -> dict[str, np.ndarray]      its state dict, flat
  as_state_dict(obj, path) -> dict[str, np.ndarray]   the state dict of an object already read
  load_pickle(file, path) -> Any                      one plain pickle (no tensors) from an open file

A leaf module: it imports only vlrep.errors (itself a leaf), so any layer (data, models, importers, tools) may read
foreign pickles through it.
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

from vlrep.errors import UserError

_STORAGES = {
  "FloatStorage": np.float32,
  "DoubleStorage": np.float64,
  "HalfStorage": np.float16,
  "BFloat16Storage": ml_dtypes.bfloat16,
  "ComplexFloatStorage": np.complex64,
  "ComplexDoubleStorage": np.complex128,
  "LongStorage": np.int64,
  "IntStorage": np.int32,
  "ShortStorage": np.int16,
  "CharStorage": np.int8,
  "ByteStorage": np.uint8,
  "BoolStorage": np.bool_,
  "UntypedStorage": np.uint8,
}

_STORAGE_DTYPES = {np.dtype(t) for t in _STORAGES.values()}

_ALLOWED = "tensors, storages, ordered dicts, numpy arrays and plain containers (dict, list, tuple, set, str, numbers)"


# numpy's own array and scalar rebuilders, wherever this numpy version keeps them (numpy.core or numpy._core).
_NUMPY_RECONSTRUCT = np.zeros(()).__reduce__()[0]
_NUMPY_SCALAR = np.float64(0).__reduce__()[0]


class UnsafeFile(UserError):
  """A pickle asked for a global outside the restricted unpickler's table; nothing of it was imported or run."""


class _Storage:
  """What a storage global (torch.FloatStorage, ...) stands for: its element type."""

  def __init__(self, name: str):
    self.dtype = np.dtype(_STORAGES[name])


def _dtype_of(storage_type: _Storage, path: str) -> np.dtype:
  # A storage object's attributes are the pickle's to set (BUILD): its dtype is checked again where it is used.
  dtype = getattr(storage_type, "dtype", None)
  if not (isinstance(dtype, np.dtype) and dtype in _STORAGE_DTYPES):
    raise ValueError(f"{path}: a storage of element type {dtype!r}.")
  return dtype


@dataclasses.dataclass
class _LazyTensor:
  """A tensor of a legacy-format file, whose storages follow the pickle: materialised once they are read."""

  storage: Any
  offset: int
  size: tuple
  stride: tuple


def _check_layout(path: str, numel: int, offset, size, stride) -> None:
  """A tensor's view must lie inside its storage: numpy's as_strided does not check, and would read other memory."""
  ints = lambda xs: all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
  if not (ints([offset]) and ints(size) and ints(stride) and len(size) == len(stride)):
    raise ValueError(f"{path}: a tensor with a malformed layout (offset {offset!r}, size {size!r}, stride {stride!r}).")
  if 0 in size:
    return
  last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
  if last >= numel:
    raise ValueError(f"{path}: a tensor reaches element {last} of a storage of {numel} elements.")


def _as_array(storage: np.ndarray, offset: int, size, stride, path: str) -> np.ndarray:
  size, stride = tuple(size), tuple(stride)
  _check_layout(path, len(storage), offset, size, stride)
  if 0 in size:
    return np.zeros(size, storage.dtype)
  if not size:
    return storage[offset : offset + 1].reshape(()).copy()
  itemsize = storage.itemsize
  return np.lib.stride_tricks.as_strided(
    storage[offset:], shape=size, strides=tuple(s * itemsize for s in stride)
  ).copy()


def _safe_globals(path: str, rebuild_tensor) -> dict[tuple[str, str], Any]:
  """The restricted unpickler's whole table, {(module, name): what it stands for}, built fresh for each load.
  `rebuild_tensor(storage, offset, size, stride)` is the format's tensor builder; None: no tensors allowed."""

  def encode_latin1(text, encoding="latin1"):  # how protocol 2 pickles bytes
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
      raise ValueError(f"{path}: _codecs.encode of {type(text).__name__} with {encoding!r}; only latin-1 text.")
    return text.encode("latin1")

  def frombuffer(buffer, dtype, shape, order):  # how protocol 5 pickles numpy arrays
    return np.frombuffer(buffer, np.dtype(dtype)).reshape(shape, order=order).copy()

  table: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): encode_latin1,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("torch", "Size"): tuple,
  }
  for core in ("numpy.core", "numpy._core"):  # numpy 1's and numpy 2's names
    table[(f"{core}.multiarray", "_reconstruct")] = _NUMPY_RECONSTRUCT
    table[(f"{core}.multiarray", "scalar")] = _NUMPY_SCALAR
    table[(f"{core}.numeric", "_frombuffer")] = frombuffer
  if rebuild_tensor is None:
    return table

  def tensor(storage, offset, size, stride, *unused):
    return rebuild_tensor(storage, offset, tuple(size), tuple(stride))

  def parameter(data, *unused):
    return data

  def from_type(func, new_type, args, state):  # a Tensor or Parameter with Python attributes (dropped)
    if func not in (tensor, parameter) or new_type not in ("torch.Tensor", "torch.nn.parameter.Parameter"):
      raise ValueError(f"{path}: _rebuild_from_type_v2 of {new_type!r}: only plain tensors and parameters.")
    return func(*args)

  table.update(
    {
      ("torch._utils", "_rebuild_tensor"): tensor,
      ("torch._utils", "_rebuild_tensor_v2"): tensor,
      ("torch._utils", "_rebuild_parameter"): parameter,
      ("torch._utils", "_rebuild_parameter_with_state"): parameter,
      ("torch._tensor", "_rebuild_from_type_v2"): from_type,
      ("torch", "Tensor"): "torch.Tensor",
      ("torch.nn.parameter", "Parameter"): "torch.nn.parameter.Parameter",
    }
  )
  table.update({("torch", name): _Storage(name) for name in _STORAGES})
  return table


def _load(file, path: str, part: str, rebuild_tensor=None, load_storage=None) -> Any:
  """One pickle from `file` through the restricted table (`part` names which pickle of the file, for errors)."""
  table = _safe_globals(path, rebuild_tensor)

  class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
      module = "builtins" if module == "__builtin__" else module  # protocol 2's name (Python 2)
      if (module, name) not in table:
        raise UnsafeFile(
          f"{path}{part} asks for {module}.{name}, which vlrep's restricted unpickler does not load: such a file "
          f"may hold only {_ALLOWED}. Nothing in it was run. Convert a checkpoint you trust to .safetensors."
        )
      return table[(module, name)]

    def persistent_load(self, pid):
      if load_storage is None or not (isinstance(pid, tuple) and pid and pid[0] in ("storage", b"storage")):
        raise ValueError(f"{path}{part}: unexpected persistent id {pid!r}.")
      if len(pid) < 5 or not isinstance(pid[1], _Storage) or not isinstance(pid[2], str):
        raise ValueError(f"{path}{part}: malformed storage reference {pid!r}.")
      return load_storage(*pid[1:])

  try:
    return RestrictedUnpickler(file).load()
  except (UnsafeFile, OSError):
    raise
  except Exception as e:  # noqa: BLE001 -- anything a crafted pickle makes the unpickler raise: the file is bad
    raise ValueError(f"{path}{part} is not a pickle vlrep can read: {type(e).__name__}: {e}") from e


def load_pickle(file, path: str) -> Any:
  """One pickle of plain containers and numpy arrays (no tensors, no persistent ids) from the open binary `file`
  (`path` names it in errors), through the restricted table: e.g. the pickle of an `np.save(allow_pickle=True)`."""
  return _load(file, path, "")


def _read_zip(path: str):
  """torch.save's format since torch 1.6: a zip of `<name>/data.pkl` (the object, whose tensors refer to storages
  by key), `<name>/data/<key>` (each storage's bytes) and `<name>/byteorder` (torch >= 2.1)."""
  with zipfile.ZipFile(path) as archive:
    names = archive.namelist()
    pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl is None:
      raise ValueError(f"{path} is a zip file without data.pkl: not a torch checkpoint.")
    prefix = pkl[: -len("data.pkl")]
    if f"{prefix}byteorder" in names and archive.read(f"{prefix}byteorder").strip() not in (b"little", b""):
      raise ValueError(f"{path} was written on a big-endian machine; vlrep reads little-endian tensors only.")

    storages: dict[int, np.ndarray] = {}  # by id: the storages read from the archive, kept alive

    def load_storage(storage_type, key, location, numel, *unused):
      member = f"{prefix}data/{key}"
      if member not in names:
        raise ValueError(f"{path}: its pickle refers to storage {key!r}, which the archive lacks.")
      storage = np.frombuffer(archive.read(member), _dtype_of(storage_type, path))
      storages[id(storage)] = storage
      return storage

    def rebuild_tensor(storage, offset, size, stride):
      if id(storage) not in storages:  # e.g. an array the pickle built itself
        raise ValueError(f"{path}: a tensor whose storage is a {type(storage).__name__}, not one of the archive's.")
      return _as_array(storage, offset, size, stride, path)

    with archive.open(pkl) as f:
      return _load(f, path, f" ({pkl})", rebuild_tensor, load_storage)


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def _read_legacy(path: str):
  """torch.save's format before torch 1.6 (or with _use_new_zipfile_serialization=False): three small pickles
  (magic number, protocol version, system info), the object's pickle, the list of storage keys, then each storage
  as an int64 element count and its bytes. Every pickle goes through the restricted table."""
  with open(path, "rb") as f:
    try:
      magic = _load(f, path, " (its first pickle, the magic number)")
    except UnsafeFile:
      raise
    except ValueError as e:
      raise ValueError(f"{path} is neither a zip nor a legacy torch checkpoint: {e}") from e
    if not (isinstance(magic, int) and magic == _LEGACY_MAGIC):
      raise ValueError(f"{path} is neither a zip nor a legacy torch checkpoint (wrong magic number).")
    protocol = _load(f, path, " (the protocol version)")
    if not (isinstance(protocol, int) and protocol == _LEGACY_PROTOCOL):
      raise ValueError(f"{path}: legacy torch protocol {protocol!r}; vlrep reads {_LEGACY_PROTOCOL}.")
    sys_info = _load(f, path, " (the system info)")
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is False:
      raise ValueError(f"{path}: system info {sys_info!r}; vlrep reads little-endian files only.")
    dtypes: dict[str, np.dtype] = {}

    def load_storage(storage_type, key, location, numel, view_metadata=None):
      dtypes.setdefault(key, _dtype_of(storage_type, path))
      if view_metadata is not None:
        view_key, view_offset, _ = view_metadata
        return ("view", key, view_offset)
      return ("root", key, 0)

    def rebuild_tensor(storage, offset, size, stride):
      if not (isinstance(storage, tuple) and len(storage) == 3 and isinstance(storage[2], int)):
        raise ValueError(f"{path}: a tensor whose storage is a {type(storage).__name__}.")
      return _LazyTensor(storage, offset, size, stride)

    obj = _load(f, path, " (the object's pickle)", rebuild_tensor, load_storage)
    keys = _load(f, path, " (the storage keys)")
    if not (isinstance(keys, list) and all(isinstance(k, str) and k in dtypes for k in keys)):
      raise ValueError(f"{path}: the storage keys {str(keys)[:200]} are not the storages its tensors use.")
    data = {}
    for key in keys:
      dtype = dtypes[key]
      header = f.read(8)
      count = struct.unpack("<q", header)[0] if len(header) == 8 else -1
      raw = f.read(count * dtype.itemsize) if count >= 0 else b""
      if count < 0 or len(raw) != count * dtype.itemsize:
        raise ValueError(f"{path} is truncated: storage {key!r} is incomplete.")
      data[key] = np.frombuffer(raw, dtype)

  def materialise(x):
    if isinstance(x, _LazyTensor):
      _, key, view_offset = x.storage
      if key not in data:
        raise ValueError(f"{path}: a tensor refers to storage {key!r}, which the file does not hold.")
      return _as_array(data[key], view_offset + x.offset, x.size, x.stride, path)
    if isinstance(x, dict):
      return type(x)((k, materialise(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
      return type(x)(materialise(v) for v in x)
    return x

  return materialise(obj)


def load_checkpoint(path: str) -> Any:
  """A torch.save file (.pth/.pt/.bin, zip or legacy format) as plain Python containers and numpy arrays, through
  the restricted unpickler: any global outside its table is an `UnsafeFile` error naming the file and the global
  (nothing in the file is imported or run); a file that is neither format is a ValueError."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"No checkpoint file {path}.")
  if zipfile.is_zipfile(path):
    try:
      return _read_zip(path)
    except zipfile.BadZipFile as e:
      raise ValueError(f"{path} is a damaged zip file: {e}") from e
  return _read_legacy(path)


_WRAPPERS = ("model", "state_dict", "model_state_dict", "module")


def as_state_dict(obj: Any, path: str) -> dict[str, np.ndarray]:
  """The state dict ({name: numpy array}) of what `load_checkpoint` read from `path` (named in errors): the object
  itself, or what it holds under 'model' / 'state_dict' / ... (VirTex's {"model": ..., "optimizer": ...,
  "iteration": ...}) when its top level has no tensors; a 'module.' prefix on every key (a DistributedDataParallel
  model's) is removed. An entry that is not a tensor is an error naming its key."""
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
