"""Foreign files crafted to crash vlrep or to take its memory: each is one BadFile naming the file, in bounded memory.

The attacks of issue 76 against the loaders of torch files, numpy files, safetensors, BERT folders and region files
(vlrep.torch_files, vlrep.interop.formats, vlrep.data.region_files, vlrep.models.bert, vlrep.data.wordpiece):

  - the numpy dtype trick: a void dtype whose pickled state gives it an object field, then an array of it rebuilt
    from raw bytes, which numpy reads as object pointers (a segfault of `python -m vlrep.interop.import_run`);
  - memory bombs of a few bytes: a pickle memo index of 2**27 (9 bytes), a 2**28-element object array (32 bytes), a
    stride-0 23000 x 23000 tensor over one float, one deflated zip member referenced by 8 tensors, a zip member
    declaring 320 MB, legacy storage counts past the file, .npy / .npz headers declaring gigabytes;
  - deep and self-referencing pickles, deep JSON;
  - malformed safetensors (header length 2**63-1, not JSON, overlapping / negative / out-of-range offsets, a shape
    that disagrees with its bytes or overflows, an unknown dtype), malformed config.json and vocab.txt.

The files are written here; one child process loads them all through the API and reports, for each, the error and
its peak memory (`ru_maxrss` of the child itself, which only grows: the last value is the peak over every bomb);
a few go through `python -m vlrep.interop.import_run` as a user would run it, its peak memory measured by a wrapper
process
(`RUSAGE_CHILDREN` of the wrapper: that one command). Every bomb must stay under the baseline + 500 MB.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from conftest import ROOT

from vlrep.pytorch.resnet import ResNet as TorchResNet

MB = 2**20
HEADROOM = 500 * MB  # what a bomb may add to the baseline's peak memory


# ------------------------------------------------------------------------------------------------------------------
# Crafting: torch zip files with any pickle and storages, legacy files, the numpy dtype trick.
# ------------------------------------------------------------------------------------------------------------------
class _Storage:
  """A storage of the archive: pickled as torch.save's persistent id ('storage', torch.FloatStorage, key, ...)."""

  def __init__(self, key: str, numel: int):
    self.key, self.numel = key, numel


class _Tensor:
  """A tensor over a storage with any size and stride, pickled as torch.save pickles one."""

  def __init__(self, storage: _Storage, size, stride, offset: int = 0):
    self.storage, self.size, self.stride, self.offset = storage, tuple(size), tuple(stride), offset

  def __reduce__(self):
    args = (self.storage, self.offset, self.size, self.stride, False, collections.OrderedDict())
    return torch._utils._rebuild_tensor_v2, args


class _TorchPickler(pickle.Pickler):
  def persistent_id(self, obj):
    if isinstance(obj, _Storage):
      return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
    return None


def _torch_zip(obj, members: dict[str, bytes], deflate: bool = False) -> bytes:
  """A torch.save-layout zip: archive/data.pkl (obj, pickled as torch does) and archive/data/<key> members."""
  pkl = io.BytesIO()
  _TorchPickler(pkl, protocol=2).dump(obj)
  out = io.BytesIO()
  with zipfile.ZipFile(out, "w") as z:
    z.writestr("archive/data.pkl", pkl.getvalue())
    z.writestr("archive/byteorder", "little")
    z.writestr("archive/version", "3\n")
    for key, raw in members.items():
      z.writestr(f"archive/data/{key}", raw, zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
  return out.getvalue()


_RECONSTRUCT = np.zeros(()).__reduce__()[0]


class _VoidWithObjectField:
  """numpy.dtype('V8') whose pickled state gives it an object field at offset 0 and no object flag."""

  def __reduce__(self):
    return np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0)


class _PointerArray:
  """An array of that dtype rebuilt from raw bytes: numpy reads each 8 bytes as an object pointer."""

  def __init__(self, shape):
    self.shape = tuple(shape)

  def __reduce__(self):
    raw = struct.pack("<Q", 0xDEADBEEF) * int(np.prod(self.shape))
    return _RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, self.shape, _VoidWithObjectField(), False, raw)


def _resnet_zip(replace: dict) -> bytes:
  """A valid torchvision ResNet-18 (8 wide) state dict as torch.save writes it, with entries replaced."""
  torch.manual_seed(0)
  sd, members, obj = TorchResNet(18, 8).state_dict(), {}, collections.OrderedDict()
  for i, (name, t) in enumerate(sd.items()):
    t = t.float().contiguous()
    members[str(i)] = t.numpy().tobytes()
    obj[name] = _Tensor(_Storage(str(i), t.numel()), t.shape, t.stride())
  obj.update(replace)
  return _torch_zip(obj, members)


def _legacy_with_storage_count(count: int) -> bytes:
  """A legacy torch file of one float tensor whose storage's element count is `count` (8 bytes of data follow)."""
  buf = io.BytesIO()
  torch.save({"w": torch.ones(2)}, buf, _use_new_zipfile_serialization=False)
  data = buf.getvalue()
  # The storage section is the last 8 + 8 bytes: the int64 count (2) and two float32 ones.
  assert data[-16:-8] == struct.pack("<q", 2)
  return data[:-16] + struct.pack("<q", count) + data[-8:]


def _npy_header(descr: str, shape) -> bytes:
  f = io.BytesIO()
  np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": tuple(shape)})
  return f.getvalue()


def _entry(dtype: str, shape, offsets) -> dict:
  return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _safetensors(header, body: bytes = b"", length: int | None = None) -> bytes:
  raw = header if isinstance(header, bytes) else json.dumps(header).encode()
  return struct.pack("<Q", len(raw) if length is None else length) + raw + body


# A 9-byte pickle whose memo index makes pickle's C unpickler grow its memo to 2**27 entries (1 GB; 2.3 GB measured).
MEMO_BOMB = b"\x80\x02N" + b"r" + struct.pack("<I", 2**27) + b"."
# A 65-byte pickle: numpy's _reconstruct(ndarray, (2**28,), b'O') allocates 2**28 object pointers (2 GB).
OBJECT_BOMB = b"\x80\x03cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\x00\x00\x10\x85C\x01O\x87R."
DEEP_PICKLE = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."
SELF_REFERENCE = b"\x80\x02]q\x00h\x00a."  # a list that contains itself


def _bert_folder(path, config: dict | None = None, vocab: bytes | None = None) -> str:
  """A tiny Hugging Face BERT folder (1 layer, hidden 8, 2 heads, 8 words): config.json, vocab.txt and
  model.safetensors, with config.json's fields or vocab.txt replaced."""
  from safetensors.numpy import save_file

  os.makedirs(path)
  cfg = dict(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
  cfg.update(hidden_act="gelu", max_position_embeddings=16, type_vocab_size=2, model_type="bert")
  rng = np.random.default_rng(0)
  w = lambda *shape: rng.normal(size=shape).astype(np.float32)
  sd = {
    "embeddings.word_embeddings.weight": w(8, 8),
    "embeddings.position_embeddings.weight": w(16, 8),
    "embeddings.token_type_embeddings.weight": w(2, 8),
    "embeddings.LayerNorm.weight": w(8),
    "embeddings.LayerNorm.bias": w(8),
  }
  p = "encoder.layer.0."
  for name, (o, i) in {
    "attention.self.query": (8, 8),
    "attention.self.key": (8, 8),
    "attention.self.value": (8, 8),
    "attention.output.dense": (8, 8),
    "intermediate.dense": (16, 8),
    "output.dense": (8, 16),
  }.items():
    sd[f"{p}{name}.weight"], sd[f"{p}{name}.bias"] = w(o, i), w(o)
  for name in ("attention.output.LayerNorm", "output.LayerNorm"):
    sd[f"{p}{name}.weight"], sd[f"{p}{name}.bias"] = w(8), w(8)
  save_file(sd, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "wb") as f:
    f.write(config if isinstance(config, bytes) else json.dumps({**cfg, **(config or {})}).encode())
  with open(os.path.join(path, "vocab.txt"), "wb") as f:
    f.write(
      vocab
      if vocab is not None
      else "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]).encode() + b"\n"
    )
  return str(path)


def _crafted(d) -> list[tuple[str, str, str]]:
  """[(case, loader, path)] of every crafted file (written under `d`); loader names what the child calls."""
  d = str(d)
  cases = []

  def put(name: str, loader: str, data: bytes, ext: str) -> None:
    path = os.path.join(d, name.replace(" ", "_") + ext)
    with open(path, "wb") as f:
      f.write(data)
    cases.append((name, loader, path))

  one = _Storage("0", 1)
  # Pickles.
  put("memo bomb", "checkpoint", MEMO_BOMB, ".pth")
  out = io.BytesIO()
  with zipfile.ZipFile(out, "w") as z:
    z.writestr("archive/data.pkl", MEMO_BOMB)
  put("memo bomb in data.pkl", "checkpoint", out.getvalue(), ".pth")
  put("object-array bomb", "checkpoint", OBJECT_BOMB, ".pth")
  put("deep pickle", "checkpoint", DEEP_PICKLE, ".pth")
  put("self-referencing pickle", "checkpoint", SELF_REFERENCE, ".pth")
  dtype_trick = _torch_zip({"w": _Tensor(one, (1,), (1,)), "x": _PointerArray((4,))}, {"0": bytes(4)})
  put("numpy dtype trick", "checkpoint", dtype_trick, ".pth")
  # Tensors larger than their storage, zip members read many times or declaring more than the file holds.
  stride0 = {"w": _Tensor(one, (23000, 23000), (0, 0))}
  put("stride-0 tensor", "checkpoint", _torch_zip(stride0, {"0": bytes(4)}), ".pth")
  big = _Storage("0", 32 * MB)  # 128 MB of float32 zeros, deflated to about 128 KB
  repeated = {f"w{i}": _Tensor(big, (32 * MB,), (1,)) for i in range(8)}
  put("one deflated member read 8 times", "checkpoint", _torch_zip(repeated, {"0": bytes(128 * MB)}, True), ".pth")
  huge = {"w": _Tensor(_Storage("0", 80 * MB), (80 * MB,), (1,))}
  put("a member declaring 320 MB", "checkpoint", _torch_zip(huge, {"0": bytes(320 * MB)}, True), ".pth")
  put("legacy storage count 2**62", "checkpoint", _legacy_with_storage_count(2**62), ".pth")
  put("legacy storage count 2**40", "checkpoint", _legacy_with_storage_count(2**40), ".pth")
  put("legacy storage count -1", "checkpoint", _legacy_with_storage_count(-1), ".pth")
  # MMF info files and region files.
  put("info.npy memo bomb", "info_npy", _npy_header("|O", ()) + MEMO_BOMB, "_info.npy")
  put("info.npy object-array bomb", "info_npy", _npy_header("|O", ()) + OBJECT_BOMB, "_info.npy")
  put("npy header of 32 GB", "npy", _npy_header("<f4", (2**33,)) + bytes(16), ".npy")
  put("npy structured dtype", "npy", _npy_header("|V8", (2,)) + bytes(16), ".npy")
  npz = io.BytesIO()
  with zipfile.ZipFile(npz, "w") as z:
    z.writestr("features.npy", _npy_header("<f4", (2**31, 4)) + bytes(16))
  os.makedirs(os.path.join(d, "regions"))  # RegionStore reads a folder of <image_id>.npz files
  put("regions/1", "npz", npz.getvalue(), ".npz")
  # safetensors.
  for name, data in {
    "empty": b"",
    "header length 2**63-1": _safetensors({}, length=2**63 - 1),
    "header length past the file": _safetensors({}, length=10**6),
    "header not JSON": _safetensors(b"{not json"),
    "header not UTF-8": _safetensors(b'{"\xff": 1}'),
    "header a JSON list": _safetensors([1, 2]),
    "deeply nested header": _safetensors(b"[" * 100_000 + b"]" * 100_000),
    "overlapping offsets": _safetensors(
      {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
      },
      bytes(12),
    ),
    "negative offsets": _safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, bytes(4)),
    "offsets past the data": _safetensors(
      {"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, bytes(4)
    ),
    "shape disagrees with the offsets": _safetensors(
      {"a": {"dtype": "F64", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)
    ),
    "shape overflows": _safetensors(
      {"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, bytes(16)
    ),
    "negative shape": _safetensors({"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}, bytes(16)),
    "unknown dtype": _safetensors({"a": {"dtype": "Q99", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)),
    "entry not an object": _safetensors({"a": [1, 2, 3]}, bytes(16)),
  }.items():
    put(f"safetensors: {name}", "safetensors", data, ".safetensors")
  # BERT folders.
  for name, config, vocab in (
    ("config.json not JSON", b"{not json", None),
    ("config.json a list", b"[1, 2]", None),
    ("config.json not UTF-8", b'{"hidden_size": "\xff"}', None),
    ("config.json nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, None),
    ("zero heads", {"num_attention_heads": 0}, None),
    ("hidden size a string", {"hidden_size": "8"}, None),
    ("layers a float", {"num_hidden_layers": 1.5}, None),
    ("100000 layers", {"num_hidden_layers": 100_000}, None),
    ("3 layers of 1", {"num_hidden_layers": 3}, None),
    ("negative vocabulary", {"vocab_size": -8}, None),
    ("dropout 2", {"hidden_dropout_prob": 2}, None),
    ("activation a list", {"hidden_act": ["gelu"]}, None),
    ("vocab.txt not UTF-8", None, b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n\xff\xfe\nb\nc\n"),
  ):
    path = _bert_folder(os.path.join(d, "bert_" + name.replace(" ", "_").replace(".", "_")), config, vocab)
    cases.append((f"BERT folder: {name}", "bert", path))
  cases.append(("vocab.txt not UTF-8 (tokenizer)", "wordpiece", os.path.join(path, "vocab.txt")))
  return cases


# What the child process runs: every case through its loader, then a JSON line per case (the error, whether it is
# a vlrep UserError, its message, the process's peak memory so far).
_CHILD = r"""
import json, os, resource, sys, traceback
from vlrep import errors
from vlrep import torch_files
from vlrep.interop import keymaps
from vlrep.data import region_files, wordpiece
from vlrep.models import bert

def peak():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

LOADERS = {
  "checkpoint": lambda p: keymaps.load_state_dict(p),
  "safetensors": lambda p: keymaps.load_checkpoint(p),
  "info_npy": lambda p: region_files.load_pickled_npy(p),
  "npy": lambda p: region_files.load_npy(p),
  "npz": lambda p: region_files.RegionStore(os.path.dirname(p), 4),
  "bert": lambda p: bert.load_pretrained(p),
  "wordpiece": lambda p: wordpiece.WordPieceTokenizer(p),
}
cases = json.load(open(sys.argv[1]))
# The baseline: the valid files load (a BERT folder builds its model once), and the peak after them.
for loader, path in json.load(open(sys.argv[2])):
  LOADERS[loader](path)
print(json.dumps({"baseline": peak()}), flush=True)
for name, loader, path in cases:
  try:
    LOADERS[loader](path)
    out = {"error": None, "user_error": False, "message": ""}
  except BaseException as e:
    out = {"error": type(e).__name__, "user_error": isinstance(e, errors.UserError), "message": str(e)}
    if not out["user_error"]:
      out["message"] += "\n" + traceback.format_exc()[-1500:]
  print(json.dumps({"case": name, "peak": peak(), **out}), flush=True)
"""


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
  d = tmp_path_factory.mktemp("bombs")
  cases = _crafted(d)
  valid_dir = d / "valid"
  valid_dir.mkdir()
  valid = []
  with open(valid_dir / "resnet.pth", "wb") as f:
    f.write(_resnet_zip({}))
  valid.append(("checkpoint", str(valid_dir / "resnet.pth")))
  from safetensors.numpy import save_file

  save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(valid_dir / "a.safetensors"))
  valid.append(("safetensors", str(valid_dir / "a.safetensors")))
  valid.append(("bert", _bert_folder(str(valid_dir / "bert"))))
  np.save(valid_dir / "1_info.npy", {"bbox": np.zeros((2, 4), np.float32), "num_boxes": 2}, allow_pickle=True)
  valid.append(("info_npy", str(valid_dir / "1_info.npy")))
  return d, cases, valid


@pytest.fixture(scope="module")
def results(crafted):
  """{case: result} of the child that loads every crafted file, and its baseline peak memory."""
  d, cases, valid = crafted
  with open(d / "cases.json", "w") as f:
    json.dump(cases, f)
  with open(d / "valid.json", "w") as f:
    json.dump(valid, f)
  proc = subprocess.run(
    [sys.executable, "-c", _CHILD, str(d / "cases.json"), str(d / "valid.json")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  baseline = lines[0]["baseline"]
  return baseline, {r["case"]: r for r in lines[1:]}


def test_the_crafted_files_are_what_they_claim(crafted):
  # The dtype trick's array, the stride-0 tensor and the deflated member are what plain torch / numpy make of them.
  d, cases, _ = crafted
  paths = {name: path for name, _, path in cases}
  assert os.path.getsize(paths["memo bomb"]) == 9 and os.path.getsize(paths["object-array bomb"]) < 80
  assert os.path.getsize(paths["stride-0 tensor"]) < 2000
  assert os.path.getsize(paths["one deflated member read 8 times"]) < 2 * MB
  t = torch.load(paths["stride-0 tensor"], weights_only=False)["w"]
  assert t.shape == (23000, 23000) and t.stride() == (0, 0)
  sd = torch.load(paths["one deflated member read 8 times"], weights_only=False)
  assert len(sd) == 8 and sd["w0"].numel() == 32 * MB
  with zipfile.ZipFile(paths["a member declaring 320 MB"]) as z:
    assert z.getinfo("archive/data/0").file_size == 320 * MB
  with open(paths["info.npy memo bomb"], "rb") as f:
    np.lib.format.read_magic(f)
    assert np.lib.format.read_array_header_1_0(f)[2] == np.dtype("O")
    assert f.read() == MEMO_BOMB


def test_every_crafted_file_is_one_bad_file_error_naming_it(crafted, results):
  _, cases, _ = crafted
  _, got = results
  assert set(got) == {name for name, _, _ in cases}
  for name, loader, path in cases:
    r = got[name]
    assert r["user_error"], f"{name}: {r['error']}: {r['message'][-2000:]}"
    where = path if loader != "npz" else os.path.dirname(path)
    assert where in r["message"] or path in r["message"], (name, r["message"])
    assert "Traceback" not in r["message"], (name, r["message"])


def test_what_each_bomb_is_refused_for(results):
  _, got = results
  expect = {
    "memo bomb": "memo index 134217728",
    "memo bomb in data.pkl": "memo index 134217728",
    "object-array bomb": "_reconstruct",
    "deep pickle": "nested more than 100 deep",
    "self-referencing pickle": "contains itself",
    "numpy dtype trick": "numpy dtype 'V8'",
    "stride-0 tensor": "broadcast (stride-0) or overlapping view",
    "one deflated member read 8 times": "would take",
    "a member declaring 320 MB": "decompressed",
    "legacy storage count 2**62": "declares 4,611,686,018,427,387,904 elements",
    "legacy storage count -1": "declares -1 elements",
    "info.npy memo bomb": "memo index 134217728",
    "npy header of 32 GB": "bytes follow",
    "npy structured dtype": "plain numeric arrays only",
    "regions/1": "bytes follow",
    "safetensors: header length 2**63-1": "a safetensors header of 9,223,372,036,854,775,807 bytes",
    "safetensors: overlapping offsets": "overlap",
    "safetensors: negative offsets": "data offsets [-4, 0]",
    "safetensors: shape disagrees with the offsets": "needs 32 bytes",
    "safetensors: shape overflows": f"needs {2**126:,} bytes",
    "safetensors: unknown dtype": "dtype 'Q99'",
    "BERT folder: zero heads": "num_attention_heads is 0",
    "BERT folder: hidden size a string": "hidden_size is '8'",
    "BERT folder: 100000 layers": "num_hidden_layers is 100000",
    "BERT folder: 3 layers of 1": "weights hold 1 layers",
    "BERT folder: vocab.txt not UTF-8": "UnicodeDecodeError",
    "vocab.txt not UTF-8 (tokenizer)": "UnicodeDecodeError",
    "BERT folder: config.json nested 100000 deep": "nests deeper",
  }
  for name, words in expect.items():
    assert words in got[name]["message"], (name, got[name]["message"])


def test_no_bomb_takes_more_than_the_baseline_plus_500_mb(results):
  baseline, got = results
  # ru_maxrss only grows: each case's value is the peak up to it, so the first case past the line is the culprit.
  over = [(name, (r["peak"] - baseline) // MB) for name, r in got.items() if r["peak"] > baseline + HEADROOM]
  assert not over, f"baseline {baseline // MB} MB; first over: {over[:1]}"


# ------------------------------------------------------------------------------------------------------------------
# As a user runs it: python -m vlrep.interop.import_run, each command's peak memory measured by a wrapper process.
# ------------------------------------------------------------------------------------------------------------------
_WRAPPER = (
  "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
  "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr); "
  "sys.exit(p.returncode if p.returncode >= 0 else 128 - p.returncode)"
)


def _import_command(checkpoint, workdir) -> tuple[int, str, int]:
  """(exit status, stderr, peak memory in bytes) of `python -m vlrep.interop.import_run --format=torchvision`; a signal
  is 128 + its number (139: a segfault)."""
  argv = [sys.executable, "-m", "vlrep.interop.import_run", "--format=torchvision", f"--checkpoint={checkpoint}"]
  proc = subprocess.run(
    [sys.executable, "-c", _WRAPPER, *argv, f"--workdir={workdir}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  err = proc.stderr
  peak = int(err.rsplit("PEAK ", 1)[1].split()[0])
  return proc.returncode, err.rsplit("PEAK ", 1)[0], peak


def test_the_import_command_exits_2_on_the_dtype_trick_and_the_bombs_in_bounded_memory(crafted, tmp_path):
  d, cases, _ = crafted
  paths = {name: path for name, _, path in cases}
  segv = tmp_path / "segv.pth"  # the dtype trick in place of a valid ResNet-18's conv1.weight
  segv.write_bytes(_resnet_zip({"conv1.weight": _PointerArray((8, 3, 7, 7))}))
  empty = tmp_path / "empty.pth"
  empty.write_bytes(b"")
  rc, err, baseline = _import_command(empty, tmp_path / "run")
  assert rc == 2 and f"ERROR: {empty}" in err and "Traceback" not in err, err[-2000:]
  for name, path in (
    ("numpy dtype trick in a ResNet-18", str(segv)),
    ("memo bomb", paths["memo bomb"]),
  ):
    rc, err, peak = _import_command(path, tmp_path / "run")
    assert rc == 2, (name, rc, err[-2000:])  # not 139 (a segfault) nor 1 (a traceback)
    assert f"ERROR: {path}" in err and "Traceback" not in err, (name, err[-2000:])
    assert peak < baseline + HEADROOM, (name, peak // MB, baseline // MB)
    assert not (tmp_path / "run").exists()
