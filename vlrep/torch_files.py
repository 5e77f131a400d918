"""Reading foreign tensor files without running them or letting them size vlrep's memory: vlrep's one restricted
unpickler, for torch.save's zip format (torch >= 1.6), its legacy format (older torch, or
`_use_new_zipfile_serialization=False`) and numpy's pickled `.npy` files (MMF's `_info.npy`), and its one
safetensors reader.

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

A TorchScript archive (`torch.jit.save`; OpenAI's CLIP `.pt` files) is a torch.save zip whose pickle names the
archive's own classes (`__torch__.<module> <Class>`, one per module of the scripted model) and a `code/` folder
that defines them. Here each such class is a stand-in that only keeps the attributes the pickle gives it (BUILD's
state: parameters, buffers, submodules, plain values); it runs nothing (calling it is an error), and the
archive's code/ is never read. `load_checkpoint` of such an archive gives its tensors as a flat state dict, named
by their attribute paths ('visual.conv1.weight'), as `Module.state_dict()` names them (plus any tensor the model
keeps as a plain attribute).

Any other global is an `UnsafeFile` error (a `vlrep.errors.UserError`) naming the file and the global, raised
when the unpickler meets it, before anything of it is imported or called. The callables of the table are fresh
objects of each load that refuse pickle's BUILD (which could otherwise set their attributes), and each one checks
its arguments.

The numpy globals never hand numpy anything it could misread: `numpy.dtype` and `_reconstruct` give stand-ins, not
numpy objects, so the state a pickle gives them (BUILD) is checked by vlrep, and numpy builds an array only from
a plain numeric dtype (bool, int, uint, float, complex) and bytes of exactly its size. A dtype's state may only be
a plain numeric dtype's (no fields, no subarray: a void dtype given an object field would read the raw bytes
that follow as object pointers); no void, structured, string or datetime dtype is built, and the one object dtype
is a 0-d array from a one-item list (what `np.save` of a dict writes, MMF's `_info.npy`), never from bytes.

Nothing a file declares sizes an allocation before it is checked against the bytes the file holds:
  - every pickle is read through `pickletools.genops` first (a malformed or truncated pickle stops there): a memo
    index may be at most one past the entries stored so far (pickle's C unpickler grows its memo to the index:
    a 9-byte `LONG_BINPUT 2**27` took 2.3 GB);
  - what a file's contents become (storages read, arrays and tensors built) is bounded by a budget of
    4 x the file's size + 256 MiB: a zip member is charged its declared decompressed size before it is read (a
    deflated 256 MB member in a 1 MB file is refused), each member is read once however many tensors refer to it,
    and a tensor may have no more elements than its storage (a stride-0 23000 x 23000 view of 4 bytes is refused);
  - legacy-format storage counts, `.npy` headers and safetensors headers are checked against the bytes that follow;
  - containers nest at most MAX_DEPTH deep and never contain themselves.
Every malformed file is a `vlrep.errors.BadFile` (a UserError: commands exit 2 with one message naming the file).

  load_checkpoint(path) -> Any                        a torch.save file's whole object
  load_state_dict(path) -> dict[str, np.ndarray]      its state dict, flat
  as_state_dict(obj, path) -> dict[str, np.ndarray]   the state dict of an object already read
  load_pickle(file, path) -> Any                      one plain pickle (no tensors) from an open file
  load_safetensors(path) -> dict[str, np.ndarray]     a .safetensors file, its header checked first
  is_torchscript(path) -> bool                        whether a file is a TorchScript archive
  safetensors_header(path) -> (tensors, metadata, start)   that check alone: {name: (dtype, shape, begin, end)}
A file that is not there is a `MissingFile` (a UserError and a FileNotFoundError).

A leaf module: it imports only vlrep.errors (itself a leaf), so any layer (data, models, importers, tools) may read
foreign files through it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import os
import pickle
import pickletools
import re
import struct
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

from vlrep import errors
from vlrep.errors import BadFile, UserError

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

# How deep containers may nest in a file (real checkpoints: under 10). Deeper, or a container that holds itself, is a
# BadFile: Python code that walks such an object (repr, ==, a conversion) would end in a RecursionError or never.
MAX_DEPTH = 100
# What a file's contents may become in memory: 4 x its size (its storages, a copy of each tensor, tied tensors
# sharing a storage) plus this much (small files: numpy's headers, Python objects of a pickle).
BUDGET_BASE = 256 * 2**20
BUDGET_PER_FILE_BYTE = 4

# numpy's own array and scalar rebuilders, wherever this numpy version keeps them (numpy.core or numpy._core).
_NUMPY_RECONSTRUCT = np.zeros(()).__reduce__()[0]
_NUMPY_SCALAR = np.float64(0).__reduce__()[0]
# The dtypes a pickle may name: bool, signed and unsigned ints, floats, complex (numpy's spelling in its pickles,
# e.g. 'f8', '<f4', 'b1', 'c16'), and 'O8' for the one object array allowed (see _Array).
_PLAIN_DTYPE = re.compile(r"[<>|=]?(b1|[iu][1248]|f(2|4|8|16)|c(8|16|32))")
_OBJECT_DTYPE = re.compile(r"\|?O[48]?")


class MissingFile(UserError, FileNotFoundError):
  """A file or folder vlrep was given (on the command line, or named by a run or a config) that is not there: a
  command exits 2 with its name, no traceback (still a FileNotFoundError to code that catches one)."""


class UnsafeFile(UserError):
  """A pickle asked for a global outside the restricted unpickler's table; nothing of it was imported or run."""


class _Budget:
  """The bytes a file's contents may take in memory (BUDGET_PER_FILE_BYTE x its size + BUDGET_BASE): each
  allocation the file's declared sizes ask for is charged before it is made."""

  def __init__(self, path: str, file_bytes: int):
    self.path, self.file_bytes = path, file_bytes
    self.left = BUDGET_PER_FILE_BYTE * file_bytes + BUDGET_BASE

  def charge(self, nbytes: int, what: str) -> None:
    if nbytes > self.left:
      limit = BUDGET_PER_FILE_BYTE * self.file_bytes + BUDGET_BASE
      raise BadFile(
        f"{self.path}: {what} would take {nbytes:,} bytes, more than a file of {self.file_bytes:,} bytes may: vlrep "
        f"gives a file's contents at most {BUDGET_PER_FILE_BYTE} x its size + {BUDGET_BASE >> 20} MiB "
        f"({limit:,} bytes here). The file declares sizes it does not hold (a crafted or damaged file)."
      )
    self.left -= nbytes


def _refuse_build(self, state):
  raise BadFile(f"a pickle sets the state of {type(self).__name__}, which is not data.")


class _Callable:
  """A callable of the restricted table: a fresh object per load that refuses BUILD."""

  __slots__ = ("fn",)
  __setstate__ = _refuse_build

  def __init__(self, fn):
    self.fn = fn

  def __call__(self, *args):
    return self.fn(*args)


class _Marker:
  """A global that is a name, not a callable (numpy.ndarray, torch.Tensor): compared by identity."""

  __slots__ = ("name",)
  __setstate__ = _refuse_build

  def __init__(self, name: str):
    self.name = name

  def __repr__(self) -> str:
    return self.name


class _Storage:
  """What a storage global (torch.FloatStorage, ...) stands for: its element type."""

  __slots__ = ("dtype",)
  __setstate__ = _refuse_build

  def __init__(self, name: str):
    self.dtype = np.dtype(_STORAGES[name])


class _Dtype:
  """numpy.dtype(spec, align, copy) in a pickle: a stand-in whose BUILD is checked, never a numpy dtype (whose own
  __setstate__ would take fields, subarrays and flags from the file)."""

  __slots__ = ("dtype", "built")

  def __init__(self, path: str, spec, *flags):
    if isinstance(spec, bytes):
      spec = spec.decode("latin1")
    if not (isinstance(spec, str) and (_PLAIN_DTYPE.fullmatch(spec) or _OBJECT_DTYPE.fullmatch(spec))):
      raise BadFile(f"{path}: a numpy dtype {str(spec)[:50]!r}; vlrep reads plain numeric arrays only.")
    if len(flags) > 2 or not all(isinstance(f, bool) for f in flags):
      raise BadFile(f"{path}: numpy.dtype({spec!r}, ...) with arguments {str(flags)[:80]}.")
    self.dtype, self.built = np.dtype(spec), False

  def __setstate__(self, state):
    # numpy writes (3, byteorder, None, None, None, -1, -1, flags): no subarray, names or fields, the default size
    # and alignment, and flags 0 (63 for the object dtype). Anything else is a dtype vlrep does not build.
    want_flags = 63 if self.dtype.hasobject else 0
    ok = isinstance(state, tuple) and len(state) == 8 and state[0] == 3 and state[1] in ("<", ">", "|", "=")
    if not (ok and state[2:5] == (None, None, None) and state[5:] == (-1, -1, want_flags)) or self.built:
      raise BadFile(f"a numpy dtype {self.dtype.str!r} given the state {str(state)[:120]}: not a plain dtype's.")
    if state[1] == ">" and self.dtype.itemsize > 1:
      self.dtype = self.dtype.newbyteorder(">")
    self.built = True


class _Array:
  """numpy's `_reconstruct(ndarray, (0,), b'b')` in a pickle: a stand-in whose BUILD state (version, shape, dtype,
  fortran order, raw bytes) becomes an array checked here; replaced by the array when the load ends."""

  __slots__ = ("value", "item", "budget")

  def __init__(self, budget: _Budget):
    self.value, self.item, self.budget = None, None, budget

  def __setstate__(self, state):
    path = self.budget.path
    if self.value is not None or not isinstance(state, tuple) or len(state) not in (4, 5):
      raise BadFile(f"{path}: a numpy array with the state {str(state)[:120]}.")
    shape, dtype, fortran, raw = state[-4:]
    if not (isinstance(dtype, _Dtype) and isinstance(fortran, bool) and _is_shape(shape)):
      raise BadFile(f"{path}: a numpy array of shape {str(shape)[:80]} and dtype {str(dtype)[:80]}.")
    if dtype.dtype.hasobject:  # np.save of one object (MMF's info dict): a 0-d array of a one-item list
      if shape != () or not (isinstance(raw, list) and len(raw) == 1):
        raise BadFile(f"{path}: a numpy object array of shape {shape}; vlrep reads numeric arrays only.")
      self.value, self.item = np.empty((), object), raw[0]
      return
    self.value = _array_from_bytes(raw, dtype.dtype, shape, "F" if fortran else "C", self.budget)


class _ScriptObject:
  """A TorchScript archive's object (`__torch__.<module> <Class>`): its class is a fresh subclass of this per global
  and load; an instance only holds the state BUILD gives it, once. Calling the class (REDUCE) is refused: pickle's
  NEWOBJ makes instances through __new__ alone."""

  qualname = "__torch__"

  def __new__(cls, *args):
    if args:
      raise BadFile(f"{cls.qualname} built with arguments {str(args)[:100]}: a TorchScript object takes none.")
    obj = super().__new__(cls)
    obj.state = None
    return obj

  def __init__(self, *args):
    raise BadFile(f"A call of {self.qualname}: a TorchScript archive's objects are rebuilt from data, never called.")

  def __setstate__(self, state):
    if self.state is not None or not isinstance(state, dict):
      raise BadFile(f"{self.qualname}: its state is set twice or is a {type(state).__name__}, not attributes.")
    self.state = state


def _script_class(module: str, name: str) -> type:
  return type("ScriptObject", (_ScriptObject,), {"qualname": f"{module}.{name}"[:200], "__slots__": ()})


def _script_state_dict(root, path: str) -> dict[str, np.ndarray]:
  """The tensors of a TorchScript archive's object tree (after `_finish`), by attribute path; other attributes
  (flags, numbers, strings) are not tensors and are left out."""
  if not isinstance(root, _ScriptObject):
    raise BadFile(f"{path}: a TorchScript archive whose data is a {type(root).__name__}, not a module.")
  out: dict[str, np.ndarray] = {}
  stack = [("", root)]
  while stack:
    prefix, obj = stack.pop()
    for key, value in (obj.state or {}).items():
      if not isinstance(key, str):
        raise BadFile(f"{path}: a TorchScript attribute named by a {type(key).__name__}.")
      if isinstance(value, np.ndarray):
        out[prefix + key] = value
      elif isinstance(value, _ScriptObject):
        stack.append((f"{prefix}{key}.", value))
  return dict(sorted(out.items()))


def _is_shape(shape) -> bool:
  return isinstance(shape, tuple) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)


def _array_from_bytes(raw, dtype: np.dtype, shape: tuple, order: str, budget: _Budget) -> np.ndarray:
  """An array of a plain dtype from exactly its bytes (a copy, charged to the budget)."""
  if isinstance(raw, str):  # protocol 2 wrote bytes as latin-1 text through _codecs.encode
    raw = raw.encode("latin1")
  if not isinstance(raw, (bytes, bytearray)):
    raise BadFile(f"{budget.path}: a numpy array whose data is a {type(raw).__name__}, not bytes.")
  if dtype.hasobject or dtype.kind not in "biufc" or len(raw) != math.prod(shape) * dtype.itemsize:
    raise BadFile(
      f"{budget.path}: a numpy array of shape {shape} and dtype {dtype.str} from {len(raw)} bytes of data "
      f"(it needs {math.prod(shape) * dtype.itemsize})."
    )
  budget.charge(len(raw), f"a numpy array of shape {shape}")
  array = np.frombuffer(raw, dtype).reshape(shape, order=order)
  # A bytearray (protocol 5's in-band buffer) is the pickle's own writable copy; bytes are read-only: copied.
  return array if isinstance(raw, bytearray) else array.copy()


def _dtype_of(storage_type: _Storage, path: str) -> np.dtype:
  dtype = getattr(storage_type, "dtype", None)
  if not (isinstance(storage_type, _Storage) and isinstance(dtype, np.dtype) and dtype in _STORAGE_DTYPES):
    raise BadFile(f"{path}: a storage of element type {dtype!r}.")
  return dtype


@dataclasses.dataclass
class _LazyTensor:
  """A tensor of a legacy-format file, whose storages follow the pickle: materialised once they are read."""

  storage: Any
  offset: int
  size: tuple
  stride: tuple


def _check_layout(path: str, numel: int, offset, size, stride) -> None:
  """A tensor's view must lie inside its storage (numpy's as_strided does not check, and would read other memory)
  and have no more elements than it: a stride-0 or overlapping view larger than its storage is refused, since
  copying it would take memory the file does not hold (a 23000 x 23000 view of one float: 2 GB)."""
  ints = lambda xs: all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
  if not (ints([offset]) and ints(size) and ints(stride) and len(size) == len(stride)):
    raise BadFile(f"{path}: a tensor with a malformed layout (offset {offset!r}, size {size!r}, stride {stride!r}).")
  if 0 in size:
    return
  last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
  if last >= numel:
    raise BadFile(f"{path}: a tensor reaches element {last} of a storage of {numel} elements.")
  if math.prod(size) > numel:
    raise BadFile(
      f"{path}: a tensor of size {tuple(size)} (stride {tuple(stride)}) has {math.prod(size):,} elements, more than "
      f"its storage's {numel:,}: a broadcast (stride-0) or overlapping view, which vlrep does not expand."
    )


def _as_array(storage: np.ndarray, offset: int, size, stride, path: str, budget: _Budget) -> np.ndarray:
  size, stride = tuple(size), tuple(stride)
  _check_layout(path, len(storage), offset, size, stride)
  if 0 in size:
    return np.zeros(size, storage.dtype)
  budget.charge(math.prod(size) * storage.itemsize, f"a tensor of size {size}")
  if not size:
    return storage[offset : offset + 1].reshape(()).copy()
  itemsize = storage.itemsize
  return np.lib.stride_tricks.as_strided(
    storage[offset:], shape=size, strides=tuple(s * itemsize for s in stride)
  ).copy()


def _safe_globals(path: str, rebuild_tensor, budget: _Budget | None = None) -> dict[tuple[str, str], Any]:
  """The restricted unpickler's whole table, {(module, name): what it stands for}, built fresh for each load.
  `rebuild_tensor(storage, offset, size, stride)` is the format's tensor builder; None: no tensors allowed."""
  budget = budget or _Budget(path, 0)
  ndarray = _Marker("numpy.ndarray")

  def encode_latin1(text, encoding="latin1"):  # how protocol 2 pickles bytes
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
      raise BadFile(f"{path}: _codecs.encode of {type(text).__name__} with {encoding!r}; only latin-1 text.")
    return text.encode("latin1")

  def dtype(spec, *flags):
    return _Dtype(path, spec, *flags)

  def plain(dtype) -> np.dtype:
    if not isinstance(dtype, _Dtype) or dtype.dtype.hasobject:
      raise BadFile(f"{path}: a numpy value of dtype {str(getattr(dtype, 'dtype', dtype))[:80]}.")
    return dtype.dtype

  def reconstruct(subtype, shape, code):  # numpy's _reconstruct(ndarray, (0,), b'b'): the array's contents follow
    if subtype is not ndarray or shape != (0,) or code not in (b"b", "b"):
      raise BadFile(f"{path}: numpy's _reconstruct of {str((subtype, shape, code))[:120]}; only plain arrays.")
    return _Array(budget)

  def scalar(dtype, data=None):  # a numpy scalar: its dtype and exactly its bytes
    dt = plain(dtype)
    return _array_from_bytes(data, dt, (), "C", budget)[()]

  def frombuffer(buffer, dtype, shape, order):  # how protocol 5 pickles numpy arrays
    if not (_is_shape(shape) and order in ("C", "F")):
      raise BadFile(f"{path}: numpy's _frombuffer with shape {str(shape)[:80]} and order {str(order)[:10]}.")
    return _array_from_bytes(buffer, plain(dtype), shape, order, budget)

  table: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): _Callable(encode_latin1),
    ("numpy", "ndarray"): ndarray,
    ("numpy", "dtype"): _Callable(dtype),
    ("torch", "Size"): tuple,
  }
  for core in ("numpy.core", "numpy._core"):  # numpy 1's and numpy 2's names
    table[(f"{core}.multiarray", "_reconstruct")] = _Callable(reconstruct)
    table[(f"{core}.multiarray", "scalar")] = _Callable(scalar)
    table[(f"{core}.numeric", "_frombuffer")] = _Callable(frombuffer)
  if rebuild_tensor is None:
    return table

  def tensor(storage, offset, size, stride, *unused):
    if not (isinstance(size, tuple) and isinstance(stride, tuple)):
      raise BadFile(f"{path}: a tensor of size {str(size)[:80]} and stride {str(stride)[:80]}.")
    return rebuild_tensor(storage, offset, size, stride)

  tensor = _Callable(tensor)

  def parameter(data, *unused):
    return data

  parameter = _Callable(parameter)
  tensor_type, parameter_type = _Marker("torch.Tensor"), _Marker("torch.nn.parameter.Parameter")

  def from_type(func, new_type, args, state):  # a Tensor or Parameter with Python attributes (dropped)
    if func not in (tensor, parameter) or new_type not in (tensor_type, parameter_type) or not isinstance(args, tuple):
      raise BadFile(f"{path}: _rebuild_from_type_v2 of {str(new_type)[:80]}: only plain tensors and parameters.")
    return func(*args)

  table.update(
    {
      ("torch._utils", "_rebuild_tensor"): tensor,
      ("torch._utils", "_rebuild_tensor_v2"): tensor,
      ("torch._utils", "_rebuild_parameter"): parameter,
      ("torch._utils", "_rebuild_parameter_with_state"): parameter,
      ("torch._tensor", "_rebuild_from_type_v2"): _Callable(from_type),
      ("torch", "Tensor"): tensor_type,
      ("torch.nn.parameter", "Parameter"): parameter_type,
    }
  )
  table.update({("torch", name): _Storage(name) for name in _STORAGES})
  return table


# ------------------------------------------------------------------------------------------------------------------
# One pickle: its opcodes checked, then unpickled through the table, then its stand-ins replaced.
# ------------------------------------------------------------------------------------------------------------------
class _Bounded:
  """A binary file seen by pickletools.genops: reads never ask for more than the file holds (an opcode's declared
  length would otherwise size a buffer), so a length past the end is a short read, which genops reports."""

  def __init__(self, f, end: int):
    self.f, self.end = f, end

  def read(self, n: int = -1) -> bytes:
    left = max(0, self.end - self.f.tell())
    return self.f.read(left if n is None or n < 0 else min(n, left))

  def readline(self) -> bytes:
    return self.f.readline(max(0, self.end - self.f.tell()))

  def tell(self) -> int:
    return self.f.tell()


def _read_pickle_bytes(f, path: str, part: str) -> bytes:
  """The bytes of the one pickle at `f`'s position (f is left after its STOP), once its opcodes are checked: well
  formed, every declared length inside the file, and every memo index at most one past the entries stored so far."""
  start = f.tell()
  end = f.seek(0, os.SEEK_END)
  f.seek(start)
  stored = 0
  try:
    for op, arg, _ in pickletools.genops(_Bounded(f, end)):
      if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
        if not (isinstance(arg, int) and 0 <= arg <= stored):
          raise BadFile(
            f"{path}{part}: a pickle memo index {arg} after {stored} stored objects: the unpickler would grow its "
            "memo to that size (a memory bomb, or a damaged file)."
          )
        stored = max(stored, arg + 1)
      elif op.name == "MEMOIZE":
        stored += 1
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 -- whatever genops makes of malformed bytes: the file is bad
    raise BadFile(f"{path}{part}: not a well-formed pickle ({type(e).__name__}: {str(e)[:200]}).") from e
  stop = f.tell()
  f.seek(start)
  data = f.read(stop - start)
  return data


def _load(
  file,
  path: str,
  part: str,
  budget: _Budget,
  rebuild_tensor=None,
  load_storage=None,
  finish=None,
  script_objects: bool = False,
) -> Any:
  """One pickle from `file` through the restricted table (`part` names which pickle of the file, for errors);
  `script_objects`: a TorchScript archive's pickle, whose `__torch__.*` classes are `_ScriptObject` stand-ins."""
  data = _read_pickle_bytes(file, path, part)
  table = _safe_globals(path, rebuild_tensor, budget)

  class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
      module = "builtins" if module == "__builtin__" else module  # protocol 2's name (Python 2)
      if script_objects and (module == "__torch__" or module.startswith("__torch__.")):
        if (module, name) not in table:
          table[(module, name)] = _script_class(module, name)
        return table[(module, name)]
      if (module, name) not in table:
        raise UnsafeFile(
          f"{path}{part} asks for {module}.{name}, which vlrep's restricted unpickler does not load: such a file "
          f"may hold only {_ALLOWED}. Nothing in it was run. Convert a checkpoint you trust to .safetensors."
        )
      return table[(module, name)]

    def persistent_load(self, pid):
      if load_storage is None or not (isinstance(pid, tuple) and pid and pid[0] in ("storage", b"storage")):
        raise BadFile(f"{path}{part}: unexpected persistent id {str(pid)[:200]}.")
      if len(pid) < 5 or not isinstance(pid[1], _Storage) or not isinstance(pid[2], str):
        raise BadFile(f"{path}{part}: malformed storage reference {str(pid)[:200]}.")
      return load_storage(*pid[1:])

  try:
    obj = RestrictedUnpickler(io.BytesIO(data)).load()
  except UserError as e:
    if str(e).startswith(path):
      raise
    raise BadFile(f"{path}{part}: {e}") from e
  except Exception as e:  # noqa: BLE001 -- anything a crafted pickle makes the unpickler raise: the file is bad
    raise BadFile(f"{path}{part} is not a pickle vlrep can read: {type(e).__name__}: {str(e)[:200]}") from e
  return _finish(obj, f"{path}{part}", finish)


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic)


def _finish(root, where: str, convert=None) -> Any:
  """The unpickled object with its stand-ins replaced by what they stand for (_Array -> its array, _Dtype -> its
  dtype, and `convert(x)`'s replacement of anything else it returns non-None for), walked without recursion:
  containers that nest deeper than MAX_DEPTH or contain themselves are refused."""
  done: dict[int, Any] = {}
  height: dict[int, int] = {}  # the longest chain of containers below each node, leaves 0
  on_path: set[int] = set()
  stack: list[tuple[Any, int, bool]] = [(root, 0, False)]
  while stack:
    node, depth, expanded = stack.pop()
    key = id(node)
    if not expanded:
      if key in done:
        continue
      if key in on_path:
        raise BadFile(f"{where}: a container that contains itself; vlrep reads trees of plain data only.")
      if isinstance(node, _LEAVES) or node is None:
        done[key], height[key] = node, 0
        continue
      if depth >= MAX_DEPTH:
        raise BadFile(f"{where}: containers nested more than {MAX_DEPTH} deep; vlrep reads flatter data only.")
      on_path.add(key)
      stack.append((node, depth, True))
      stack.extend((child, depth + 1, False) for child in _children(node, where))
      continue
    on_path.discard(key)
    # Shared references (the memo) can make a chain longer than any one walk's depth: heights count it exactly.
    height[key] = 1 + max((height[id(c)] for c in _children(node, where)), default=0)
    if height[key] > MAX_DEPTH:
      raise BadFile(f"{where}: containers nested more than {MAX_DEPTH} deep; vlrep reads flatter data only.")
    done[key] = _rebuilt(node, done, convert, where)
  return done[id(root)]


def _children(node, where: str):
  if isinstance(node, dict):
    return [*node.keys(), *node.values()]
  if isinstance(node, (list, tuple, set, frozenset)):
    return list(node)
  if isinstance(node, _Array):
    return [node.item] if node.value is not None and node.value.dtype.hasobject else []
  if isinstance(node, _LazyTensor):
    return []
  if isinstance(node, _ScriptObject):
    return [] if node.state is None else [node.state]
  if isinstance(node, (_Dtype, _Marker, _Storage, _Callable)) or callable(node):
    return []
  raise BadFile(f"{where}: an object of type {type(node).__name__}.")


def _rebuilt(node, done: dict, convert, where: str):
  new = lambda x: done[id(x)]
  if isinstance(node, dict):
    if all(new(k) is k for k in node) and all(new(v) is v for v in node.values()):
      return node
    return type(node)((new(k), new(v)) for k, v in node.items())
  if isinstance(node, list):
    node[:] = [new(x) for x in node]
    return node
  if isinstance(node, (tuple, set, frozenset)):
    items = [new(x) for x in node]
    return node if all(a is b for a, b in zip(items, node, strict=True)) else type(node)(items)
  if isinstance(node, _Array):
    if node.value is None:
      raise BadFile(f"{where}: a numpy array whose contents the pickle never gives.")
    if node.value.dtype.hasobject:
      node.value[()] = new(node.item)
    return node.value
  if isinstance(node, _Dtype):
    return node.dtype
  if isinstance(node, _ScriptObject):
    if node.state is not None:
      node.state = new(node.state)
    return node
  replaced = convert(node) if convert is not None else None
  if replaced is not None:
    return replaced
  if isinstance(node, (_Marker, _Storage, _Callable)) or callable(node):
    raise BadFile(f"{where}: holds a bare {getattr(node, 'name', type(node).__name__)}, not data.")
  return node


def load_pickle(file, path: str) -> Any:
  """One pickle of plain containers and numpy arrays (no tensors, no persistent ids) from the open, seekable binary
  `file` (`path` names it in errors), through the restricted table: e.g. the pickle of an
  `np.save(allow_pickle=True)`."""
  start = file.tell()
  size = file.seek(0, os.SEEK_END)
  file.seek(start)
  with errors.reading(path, what="pickle"):
    return _load(file, path, "", _Budget(path, size - start))


# ------------------------------------------------------------------------------------------------------------------
# torch.save's two formats.
# ------------------------------------------------------------------------------------------------------------------
def _read_zip(path: str, budget: _Budget):
  """torch.save's format since torch 1.6: a zip of `<name>/data.pkl` (the object, whose tensors refer to storages
  by key), `<name>/data/<key>` (each storage's bytes) and `<name>/byteorder` (torch >= 2.1)."""
  with zipfile.ZipFile(path) as archive:
    names = set(archive.namelist())
    pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl is None:
      raise BadFile(f"{path} is a zip file without data.pkl: not a torch checkpoint.")
    prefix = pkl[: -len("data.pkl")]

    def read(member: str, what: str) -> bytes:
      # The member's declared decompressed size is charged before it is read; zipfile stops at that size.
      info = archive.getinfo(member)
      budget.charge(info.file_size, f"{what} ({member}, decompressed)")
      return archive.read(info)

    if f"{prefix}byteorder" in names:
      if archive.getinfo(f"{prefix}byteorder").file_size > 16:
        raise BadFile(f"{path}: its byteorder entry is {archive.getinfo(f'{prefix}byteorder').file_size} bytes.")
      if archive.read(f"{prefix}byteorder").strip() not in (b"little", b""):
        raise BadFile(f"{path} was written on a big-endian machine; vlrep reads little-endian tensors only.")

    raw: dict[str, bytes] = {}  # each member read once, however many storages refer to it
    storages: dict[int, np.ndarray] = {}  # by id: the storages handed to the pickle, kept alive

    def load_storage(storage_type, key, location, numel, *unused):
      member = f"{prefix}data/{key}"
      if member not in names:
        raise BadFile(f"{path}: its pickle refers to storage {key!r}, which the archive lacks.")
      if key not in raw:
        raw[key] = read(member, "a storage")
      dtype = _dtype_of(storage_type, path)
      data = raw[key]
      storage = np.frombuffer(data, dtype, count=len(data) // dtype.itemsize)  # a view: no copy
      storages[id(storage)] = storage
      return storage

    def rebuild_tensor(storage, offset, size, stride):
      if id(storage) not in storages:  # e.g. an array the pickle built itself
        raise BadFile(f"{path}: a tensor whose storage is a {type(storage).__name__}, not one of the archive's.")
      return _as_array(storage, offset, size, stride, path, budget)

    data = read(pkl, "its pickle")
    script = _is_script_archive(names, prefix)
    obj = _load(io.BytesIO(data), path, f" ({pkl})", budget, rebuild_tensor, load_storage, script_objects=script)
    return _script_state_dict(obj, path) if script else obj


def _is_script_archive(names: set[str], prefix: str) -> bool:
  """A TorchScript archive (torch.jit.save) beside a torch.save zip: its `constants.pkl` and `code/` folder."""
  return f"{prefix}constants.pkl" in names and any(n.startswith(f"{prefix}code/") for n in names)


def is_torchscript(path: str) -> bool:
  """Whether `path` is a TorchScript archive (OpenAI's CLIP .pt files are): its tensors read by `load_checkpoint` as
  a flat state dict, nothing of its code run."""
  if not zipfile.is_zipfile(path):
    return False
  with errors.reading(path, what="torch checkpoint (zip)"):
    with zipfile.ZipFile(path) as archive:
      names = set(archive.namelist())
      pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
  return pkl is not None and _is_script_archive(names, pkl[: -len("data.pkl")])


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def _read_legacy(path: str, budget: _Budget):
  """torch.save's format before torch 1.6 (or with _use_new_zipfile_serialization=False): three small pickles
  (magic number, protocol version, system info), the object's pickle, the list of storage keys, then each storage
  as an int64 element count and its bytes. Every pickle goes through the restricted table."""
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    try:
      magic = _load(f, path, " (its first pickle, the magic number)", budget)
    except UnsafeFile:
      raise
    except BadFile as e:
      detail = str(e).removeprefix(path).removeprefix(" (its first pickle, the magic number)").lstrip(": ")
      raise BadFile(f"{path} is neither a zip nor a legacy torch checkpoint: {detail}") from e
    if not (isinstance(magic, int) and magic == _LEGACY_MAGIC):
      raise BadFile(f"{path} is neither a zip nor a legacy torch checkpoint (wrong magic number).")
    protocol = _load(f, path, " (the protocol version)", budget)
    if not (isinstance(protocol, int) and protocol == _LEGACY_PROTOCOL):
      raise BadFile(f"{path}: legacy torch protocol {str(protocol)[:50]}; vlrep reads {_LEGACY_PROTOCOL}.")
    sys_info = _load(f, path, " (the system info)", budget)
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is False:
      raise BadFile(f"{path}: system info {str(sys_info)[:200]}; vlrep reads little-endian files only.")
    dtypes: dict[str, np.dtype] = {}

    def load_storage(storage_type, key, location, numel, view_metadata=None):
      dtype = _dtype_of(storage_type, path)
      if dtypes.setdefault(key, dtype) != dtype:
        raise BadFile(f"{path}: storage {key!r} is read as both {dtypes[key]} and {dtype}.")
      if view_metadata is not None:
        if not (isinstance(view_metadata, tuple) and len(view_metadata) == 3 and isinstance(view_metadata[1], int)):
          raise BadFile(f"{path}: a storage view {str(view_metadata)[:100]}.")
        return ("view", key, view_metadata[1])
      return ("root", key, 0)

    def rebuild_tensor(storage, offset, size, stride):
      if not (isinstance(storage, tuple) and len(storage) == 3 and isinstance(storage[2], int)):
        raise BadFile(f"{path}: a tensor whose storage is a {type(storage).__name__}.")
      return _LazyTensor(storage, offset, size, stride)

    obj = _load(f, path, " (the object's pickle)", budget, rebuild_tensor, load_storage)
    keys = _load(f, path, " (the storage keys)", budget)
    if not (isinstance(keys, list) and all(isinstance(k, str) and k in dtypes for k in keys)):
      raise BadFile(f"{path}: the storage keys {str(keys)[:200]} are not the storages its tensors use.")
    data = {}
    for key in keys:
      dtype = dtypes[key]
      header = f.read(8)
      count = struct.unpack("<q", header)[0] if len(header) == 8 else -1
      left = size - f.tell()
      if count < 0 or count * dtype.itemsize > left:  # checked before the read sizes a buffer
        raise BadFile(
          f"{path} is truncated or damaged: storage {key!r} declares {count:,} elements of {dtype.itemsize} bytes, "
          f"and {left:,} bytes of the file are left."
        )
      budget.charge(count * dtype.itemsize, f"storage {key!r}")
      data[key] = np.frombuffer(f.read(count * dtype.itemsize), dtype)

  def materialise(x):
    if isinstance(x, _LazyTensor):
      _, key, view_offset = x.storage
      if key not in data:
        raise BadFile(f"{path}: a tensor refers to storage {key!r}, which the file does not hold.")
      return _as_array(data[key], view_offset + x.offset, x.size, x.stride, path, budget)
    return None

  return _finish(obj, path, materialise)


def load_checkpoint(path: str) -> Any:
  """A torch.save file (.pth/.pt/.bin, zip or legacy format) as plain Python containers and numpy arrays (a
  TorchScript archive: its tensors as a flat state dict, `_script_state_dict`), through
  the restricted unpickler: any global outside its table is an `UnsafeFile` error naming the file and the global
  (nothing in the file is imported or run); a file that is neither format, or is malformed, is a `BadFile`."""
  if not os.path.exists(path):
    raise MissingFile(f"No checkpoint file {path}.")
  with errors.reading(path, what="torch checkpoint (torch.save file)"):
    budget = _Budget(path, os.path.getsize(path))
    if zipfile.is_zipfile(path):
      return _read_zip(path, budget)
    return _read_legacy(path, budget)


_WRAPPERS = ("model", "state_dict", "model_state_dict", "module")


def as_state_dict(obj: Any, path: str) -> dict[str, np.ndarray]:
  """The state dict ({name: numpy array}) of what `load_checkpoint` read from `path` (named in errors): the object
  itself, or what it holds under 'model' / 'state_dict' / ... (VirTex's {"model": ..., "optimizer": ...,
  "iteration": ...}) when its top level has no tensors; a 'module.' prefix on every key (a DistributedDataParallel
  model's) is removed. An entry that is not a tensor is an error naming its key."""
  if not isinstance(obj, dict):
    raise BadFile(f"{path} holds a {type(obj).__name__}, not a state dict.")
  if not any(isinstance(v, np.ndarray) for v in obj.values()):
    inner = next((obj[k] for k in _WRAPPERS if isinstance(obj.get(k), dict)), None)
    if inner is None:
      raise BadFile(
        f"{path} holds no tensors at its top level nor under {_WRAPPERS}; its entries: {sorted(map(str, obj))[:10]}."
      )
    obj = inner
  bad = [k for k, v in obj.items() if not isinstance(v, np.ndarray)]
  if bad:
    raise BadFile(
      f"{path}: the state dict holds entries that are not tensors: {str(bad[:5])[:200]} ({str(obj[bad[0]])[:100]})."
    )
  if obj and all(isinstance(k, str) and k.startswith("module.") for k in obj):
    obj = {k[len("module.") :]: v for k, v in obj.items()}
  return dict(obj)


def load_state_dict(path: str) -> dict[str, np.ndarray]:
  """The state dict of a torch.save file, flat ({name: numpy array}): `as_state_dict(load_checkpoint(path), path)`."""
  return as_state_dict(load_checkpoint(path), path)


# ------------------------------------------------------------------------------------------------------------------
# safetensors: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (and an
# optional "__metadata__" of strings), then the tensors' bytes. Read here, the header checked before anything is
# allocated, so a malformed file is one BadFile (the safetensors package's SafetensorError and its allocations are
# never reached).
# ------------------------------------------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {
  "BOOL": np.bool_,
  "U8": np.uint8,
  "I8": np.int8,
  "U16": np.uint16,
  "I16": np.int16,
  "U32": np.uint32,
  "I32": np.int32,
  "U64": np.uint64,
  "I64": np.int64,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "F32": np.float32,
  "F64": np.float64,
  "C64": np.complex64,
  "F8_E4M3": ml_dtypes.float8_e4m3fn,
  "F8_E5M2": ml_dtypes.float8_e5m2,
}
# The safetensors package's own limit on the header.
SAFETENSORS_MAX_HEADER = 100_000_000


def safetensors_header(path: str) -> tuple[dict[str, tuple[np.dtype, tuple, int, int]], dict, int]:
  """({name: (dtype, shape, begin, end)}, metadata, data start) of a .safetensors file, every declared size checked
  against the file: the header's length inside the file, a JSON object, each tensor's dtype known, its shape
  non-negative ints, its offsets inside the data and exactly shape x itemsize apart, no two tensors overlapping.
  A `BadFile` naming the file otherwise."""
  with errors.reading(path, what="safetensors file", hint="Check that it is a whole .safetensors file."):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) != 8:
        raise BadFile(f"{path}: {size} bytes, too short for a safetensors file (an 8-byte header length first).")
      n = struct.unpack("<Q", head)[0]
      if n > min(size - 8, SAFETENSORS_MAX_HEADER):
        raise BadFile(f"{path}: a safetensors header of {n:,} bytes in a file of {size:,} bytes.")
      header = json.loads(f.read(n).decode("utf-8"))
    if not isinstance(header, dict):
      raise BadFile(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object.")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
      raise BadFile(f"{path}: the safetensors __metadata__ is not an object of strings.")
    data_bytes = size - 8 - n
    tensors, spans = {}, []
    for name, entry in header.items():
      where = f"{path}: tensor {name[:100]!r}"
      if not (isinstance(entry, dict) and set(entry) >= {"dtype", "shape", "data_offsets"}):
        raise BadFile(f"{where} is described by {str(entry)[:100]}, not dtype, shape and data_offsets.")
      dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
      if dtype not in SAFETENSORS_DTYPES:
        raise BadFile(f"{where} has dtype {str(dtype)[:20]!r}; known: {', '.join(SAFETENSORS_DTYPES)}.")
      dtype = np.dtype(SAFETENSORS_DTYPES[dtype])
      if not (isinstance(shape, list) and _is_shape(tuple(shape))):
        raise BadFile(f"{where} has shape {str(shape)[:100]}, not a list of non-negative integers.")
      ok = isinstance(offsets, list) and len(offsets) == 2 and _is_shape(tuple(offsets))
      if not ok or not offsets[0] <= offsets[1] <= data_bytes:
        raise BadFile(f"{where} has data offsets {str(offsets)[:100]} outside the file's {data_bytes:,} data bytes.")
      nbytes = math.prod(shape) * dtype.itemsize
      if offsets[1] - offsets[0] != nbytes:
        raise BadFile(
          f"{where}: shape {shape} of {dtype.name} needs {nbytes:,} bytes; its offsets span "
          f"{offsets[1] - offsets[0]:,}."
        )
      tensors[name] = (dtype, tuple(shape), offsets[0], offsets[1])
      spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
      if begin < end:
        raise BadFile(f"{path}: tensors {a[:100]!r} and {b[:100]!r} overlap in the file.")
    return tensors, metadata, 8 + n


def load_safetensors(path: str) -> dict[str, np.ndarray]:
  """A .safetensors file as {name: numpy array}, its header checked by `safetensors_header` before any tensor is
  read; a malformed file is a `BadFile` naming it."""
  if not os.path.exists(path):
    raise MissingFile(f"No safetensors file {path}.")
  tensors, _, start = safetensors_header(path)
  out = {}
  with errors.reading(path, what="safetensors file"), open(path, "rb") as f:
    for name, (dtype, shape, begin, end) in tensors.items():
      f.seek(start + begin)
      buf = bytearray(end - begin)
      if f.readinto(buf) != len(buf):
        raise BadFile(f"{path} is truncated: tensor {name[:100]!r} is incomplete.")
      out[name] = np.frombuffer(buf, dtype).reshape(shape)
  return out
