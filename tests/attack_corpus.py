r"""Issue 76's attack corpus: crafted files and run folders, each run through the commands that read it, as commands.

`write_corpus(root)` writes every crafted file and run folder under `root` and returns the cases: dicts of
  name      unique, for the table;
  kind      the corpus kind (pickle payload, memory bomb, malformed safetensors, crafted run folder, ...);
  entry     the module run as `python -m` (vlrep.interop.import_run, vlrep.evaluate, ...); `label` the entry as the
  table
            shows it (with import_run's --format);
  argv      its arguments; `cwd` the folder it starts from;
  expect    the exit statuses allowed (2: refused with one message; a planted symlink beside a legitimate run may
            also end in 0, what matters there is that the link's target is untouched);
  names     a path the error message must name; `markers`: files the payloads create when anything runs them
            (must not exist); `absent`: paths that must not be created (a refused import's workdir, a folder
            outside the run); `sentinels`: files outside the run that planted symlinks point at (content and mtime
            must not change);
  baseline  a trivial case (missing file, or a valid run stopped early) whose peak memory is the entry point's
            baseline; `mode`: 'fork' or 'subprocess' (a real `python -m` process, for the cases where `python -m`'s
            sys.path and working directory are what the attack needs); `path_add`: folders put first on sys.path
            (the Detectron2 stand-in); `forbidden`: strings the written run must not carry (code hooks);
  target    the crafted file or folder (the corpus's count); `control`: code a control child runs instead;
  bug       a known vlrep bug the case shows, not fixed yet: the failure table says so (the judge is the same).

The shared folders (`shared_folders`) are the base run given a BPE vocabulary and exported with --format=vlrep, then
copies of it crafted (a module named as the method, config.json's size, nesting and paths, links, weights, the
tokenizer's SHA-256, sizes that would take the machine's memory), each through vlrep.predict and the features tool;
the valid folder and the Hugging Face cache layout of it (snapshots/<rev>/ linking into blobs/) must load (exit 0).

`python tests/attack_corpus.py CASES.json RESULTS.json` is the driver: it imports JAX, TensorFlow, torch and
vlrep's command modules once (no JAX backend started), then for each case forks a child that runs the command's
module as `__main__` (runpy, as `python -m`, its working directory first on sys.path; absl's `app.run` with the
command's own exit-2 wiring), its stdout and stderr in a file. `os.wait4` gives each child's exit status and its
own peak RSS; a watchdog kills a child past its time or past the driver's RSS + KILL_MB (the memory bombs would
otherwise take the machine). After each case it records which markers exist (and removes them), which absent
paths appeared and which sentinels changed (and restores them), so each finding belongs to one case.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import re
import runpy
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import threading
import time
import traceback
import warnings
import zipfile
import zlib

import numpy as np
import torch
from official_virtex_fixture import build_vocab
from safetensors.numpy import load_file, save_file
from test_safe_loading import _bert_folder, _crafted_files, _legacy_bytes, _legacy_parts, _payloads, _zip_of

from vlrep import runs, safe_files
from vlrep.bench import forkserver
from vlrep.interop import import_run
from vlrep.interop.formats import vlrep as vlrep_format
from vlrep.pytorch.resnet import ResNet as TorchResNet

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
KILL_MB = 1500  # a child whose RSS grows this far past the driver's is killed (the limit tested is 500 MB)
TIMEOUT_S = 90
MARGIN_MB = 500  # issue 76: peak memory under the command's baseline + 500 MB
# Every command that reads a foreign file or run folder (issue 76's list).
ENTRY_POINTS = (
  "vlrep.interop.import_run",
  "vlrep.interop.export",
  "vlrep.evaluate",
  "vlrep.tools.caption",
  "vlrep.tools.features",
  "vlrep.pytorch.detectron2_transfer",
  "vlrep.data.prepare",
  "vlrep.tools.convert_regions",
  "vlrep.main",
  "vlrep.predict",
)

# What the commands import, imported once by the driver before it forks (no JAX backend is started).
PREIMPORT = (
  "torch",
  *forkserver.HEAVY,
  "safetensors.numpy",
  "sentencepiece",
  "PIL.Image",
  "vlrep.interop.import_run",
  "vlrep.interop.export",
  "vlrep.evaluate",
  "vlrep.train",
  "vlrep.tools.caption",
  "vlrep.tools.features",
  "vlrep.tools.convert_regions",
  "vlrep.pytorch.detectron2_transfer",
  "vlrep.data.pipeline",
  "vlrep.predict",
)


# ------------------------------------------------------------------------------------------------------------------
# The driver: one forked child per case.
# ------------------------------------------------------------------------------------------------------------------
def _child(case: dict, log: str) -> None:
  """In the forked child: run the case's module as `python -m` would, then exit with its status."""
  code = 1
  try:
    os.setsid()  # its own process group: the watchdog's kill reaches what it starts
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    cwd = case.get("cwd") or ROOT
    os.chdir(cwd)
    sys.path[0] = cwd  # `python -m` puts the working directory first on sys.path
    sys.path[1:1] = case.get("path_add", [])
    sys.argv = [case["entry"], *case["argv"]]
    code = 0
    try:
      if case.get("control"):  # the harness's own controls: code that does what the corpus must not
        exec(case["control"], {"__name__": "__main__"})
      else:
        runpy.run_module(case["entry"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
      if e.code is None or isinstance(e.code, int):
        code = e.code or 0
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:  # noqa: BLE001 -- what `python -m` prints, then its exit status
      traceback.print_exc()
      code = 1
    threading._shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit(code)


def _rss_kb(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
  except (OSError, ValueError, IndexError):
    return 0


def _snapshot(path: str):
  try:
    st = os.stat(path)
    with open(path, "rb") as f:
      return f.read(), st.st_mtime_ns
  except OSError:
    return None


def run_case(case: dict, log_dir: str, kill_rss_kb: int) -> dict:
  """Runs one case in a child; its exit status, peak RSS (KB), log and what it did outside."""
  log = os.path.join(log_dir, re.sub(r"\W+", "_", case["name"]) + ".log")
  sentinels = {p: _snapshot(p) for p in case.get("sentinels", [])}
  start = time.time()
  if case.get("mode") == "subprocess":
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*case.get("path_add", []), *filter(None, [env.get("PYTHONPATH")])])
    with open(log, "wb") as out:
      proc = subprocess.Popen(
        [sys.executable, "-m", case["entry"], *case["argv"]],
        cwd=case.get("cwd") or ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=out,
        start_new_session=True,
      )
    pid = proc.pid
  else:
    pid = os.fork()
    if pid == 0:
      _child(case, log)
  killed, timeout = None, case.get("timeout", TIMEOUT_S)
  while True:
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if done:
      break
    if not killed and _rss_kb(pid) > kill_rss_kb:
      killed = f"RSS over {kill_rss_kb // 1024} MB"
    elif not killed and time.time() - start > timeout:
      killed = f"over {timeout} s"
    if killed:
      try:
        os.killpg(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      _, status, usage = os.wait4(pid, 0)
      break
    time.sleep(0.01)
  if case.get("mode") == "subprocess":
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it
  with open(log, errors="replace") as f:
    text = f.read()
  result = {
    "name": case["name"],
    "rc": os.waitstatus_to_exitcode(status),
    "killed": killed,
    "maxrss_kb": usage.ru_maxrss,
    "seconds": round(time.time() - start, 2),
    "traceback": "Traceback (most recent call last)" in text or "Fatal Python error" in text,
    "log_tail": text[-3000:],
    "markers_found": [],
    "absent_found": [],
    "sentinels_changed": [],
  }
  for path in case.get("markers", []):
    if os.path.lexists(path):
      result["markers_found"].append(path)
      os.remove(path)
  for path in case.get("absent", []):
    if os.path.lexists(path):
      result["absent_found"].append(path)
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
      else:
        os.remove(path)
  result["forbidden_found"] = []
  forbidden = case.get("forbidden")
  if forbidden and os.path.isdir(forbidden["dir"]):
    for d, _, files in os.walk(forbidden["dir"]):
      for name in files:
        with open(os.path.join(d, name), "rb") as f:
          data = f.read()
        if name == "metadata":  # a checkpoint's meta: its config must not carry them (its import note may say so)
          data = json.dumps(json.loads(data).get("config", {})).encode()
        elif name in ("commit_success.txt", "_CHECKPOINT_METADATA"):  # orbax's, naming the path
          continue
        found = [s for s in forbidden["strings"] if s.encode() in data or s in name]
        if found:
          result["forbidden_found"].append(f"{os.path.relpath(os.path.join(d, name), forbidden['dir'])}: {found}")
  for path, before in sentinels.items():
    if _snapshot(path) != before:
      result["sentinels_changed"].append(path)
      if before is not None:
        if os.path.lexists(path) and not os.path.isfile(path):
          os.remove(path)
        with open(path, "wb") as f:
          f.write(before[0])
        os.utime(path, ns=(before[1], before[1]))
  return result


def driver(cases_path: str, results_path: str) -> None:
  import importlib

  sys.modules.setdefault("triton", None)  # as conftest: triton after TensorFlow crashes the process
  warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
  with open(cases_path) as f:
    cases = json.load(f)
  for module in PREIMPORT:
    importlib.import_module(module)
  kill_rss_kb = _rss_kb(os.getpid()) + KILL_MB * 1024
  log_dir = os.path.join(os.path.dirname(os.path.abspath(results_path)), "logs")
  os.makedirs(log_dir, exist_ok=True)
  results = []
  # Baselines first: each entry point's trivial cases.
  for case in sorted(cases, key=lambda c: not c.get("baseline")):
    results.append(run_case(case, log_dir, kill_rss_kb))
    with open(results_path, "w") as f:
      json.dump(results, f, indent=1)


# ------------------------------------------------------------------------------------------------------------------
# The corpus.
# ------------------------------------------------------------------------------------------------------------------
IMPORT_FORMATS = ("auto", "torchvision", "virtex", "visual_bert")


def _slug(text: str) -> str:
  return re.sub(r"\W+", "_", text).strip("_")


def _write(path, data) -> str:
  path = os.fspath(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb" if isinstance(data, bytes) else "w") as f:
    f.write(data)
  return path


def _case(name: str, kind: str, entry: str, argv, **kw) -> dict:
  case = {"name": name, "kind": kind, "entry": entry, "label": entry.replace("vlrep.", ""), "argv": [], "expect": [2]}
  case.update(kw)
  case["argv"] = [os.fspath(a) for a in argv]
  if case.get("names") and "target" not in case:
    case["target"] = case["names"]
  return case


def _import_cases(root, name, kind, checkpoint, formats=IMPORT_FORMATS, markers=(), argv=()) -> list[dict]:
  """`vlrep.interop.import_run` of one file in each --format: refused naming it, no workdir left."""
  cases = []
  for fmt in formats:
    work = os.path.join(root, "out", _slug(f"{name} {fmt}"))
    args = [f"--format={fmt}", f"--checkpoint={checkpoint}", f"--workdir={work}", *argv]
    cases.append(
      _case(
        f"{name} [{fmt}]",
        kind,
        "vlrep.interop.import_run",
        args,
        label=f"import_run --format={fmt}",
        names=os.fspath(checkpoint),
        markers=[os.fspath(m) for m in markers],
        absent=[work, work + ".importing"],
      )
    )
  return cases


class _Reduce:
  """Pickles as func(*args), then BUILD with `state`: any object graph a crafted pickle can ask for."""

  def __init__(self, func, args, state=None):
    self.func, self.args, self.state = func, args, state

  def __reduce__(self):
    return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


class _Storage:
  """Stands for one storage of a hand-written zip archive (its persistent id)."""

  def __init__(self, key: str, numel: int):
    self.key, self.numel = key, numel


def _tensor(storage: _Storage, offset: int, size, stride):
  return _Reduce(torch._utils._rebuild_tensor_v2, (storage, offset, tuple(size), tuple(stride), False, {}))


def _archive_pickle(obj) -> bytes:
  """data.pkl as torch.save writes it: storages by persistent id ('storage', FloatStorage, key, 'cpu', numel)."""

  class Pickler(pickle.Pickler):
    def persistent_id(self, obj):
      if isinstance(obj, _Storage):
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
      return None

  buf = io.BytesIO()
  Pickler(buf, protocol=2).dump(obj)
  return buf.getvalue()


def _torch_zip(path, data_pkl: bytes, storages: dict, deflate=False) -> str:
  """A zip-format torch file: archive/data.pkl and archive/data/KEY members ({key: bytes or a count of zero
  bytes, written in 1 MB pieces}), stored or deflated."""
  os.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
  method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
  with zipfile.ZipFile(path, "w", method) as z:
    z.writestr("archive/data.pkl", data_pkl)
    z.writestr("archive/version", "3\n")
    for key, raw in storages.items():
      if isinstance(raw, bytes):
        z.writestr(f"archive/data/{key}", raw)
        continue
      with z.open(f"archive/data/{key}", "w", force_zip64=True) as f:
        piece = bytes(1 << 20)
        for _ in range(raw >> 20):
          f.write(piece)
  return os.fspath(path)


def pickle_payloads(root) -> list[dict]:
  """Each payload kind (GLOBAL, STACK_GLOBAL, INST, OBJ; os.system, exec, subprocess) in each container: a bare
  pickle, each of a legacy file's five pickles, a legacy ResNet-18's storage keys, a zip's data.pkl, an MMF
  checkpoint's entry (zip and legacy); in a Hugging Face BERT folder; as an MMF `_info.npy`."""
  torch.manual_seed(0)
  resnet18 = _legacy_bytes(TorchResNet(18, 8).state_dict())
  cases = []
  for kind in _payloads("m"):
    marker = os.path.join(root, "markers", _slug(kind))
    payload = _payloads(marker)[kind][0]
    paths = _crafted_files(os.path.join(root, "pickles", _slug(kind)), marker, payload, resnet18)
    for file_kind, path in paths.items():
      # Every container in --format=auto; the command's other formats on one payload kind and on the bare pickle.
      formats = IMPORT_FORMATS if kind == "GLOBAL os.system" or file_kind == "bare pickle" else ("auto",)
      cases += _import_cases(root, f"{kind} in {file_kind}", "pickle payload", path, formats, [marker])
    folder = _bert_folder(os.path.join(root, "bert", _slug(kind)), paths["zip, whole data.pkl"])
    cases += _import_cases(root, f"{kind} in a BERT folder", "pickle payload", folder, ("visual_bert",), [marker])
    src = os.path.join(root, "mmf", _slug(kind))
    np.save(_write(os.path.join(src, "1.npy"), b""), np.zeros((2, 8), np.float32))
    info = os.path.join(src, "1_info.npy")
    with open(info, "wb") as f:  # an object-array .npy header, then the payload as its pickle
      np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
      f.write(payload)
    argv = ["--format=mmf", f"--src={src}", f"--dst={os.path.join(root, 'out', 'mmf_' + _slug(kind))}"]
    name = f"{kind} in an MMF _info.npy"
    cases.append(_case(name, "pickle payload", "vlrep.tools.convert_regions", argv, names=info, markers=[marker]))
  return cases


def _resnet_zip(path, replace: dict) -> str:
  """A valid torchvision ResNet-18 (width 8) state dict as a hand-written zip torch file, with the entries of
  `replace` (name -> crafted object) in place of its tensors: what reaches the importer's conversion."""
  torch.manual_seed(0)
  entries, storages = collections.OrderedDict(), {}
  for i, (name, value) in enumerate(TorchResNet(18, 8).state_dict().items()):
    if name.endswith("num_batches_tracked"):
      continue
    if name in replace:
      entries[name] = replace[name]
      continue
    storages[str(i)] = value.float().contiguous().numpy().tobytes()
    entries[name] = _tensor(_Storage(str(i), value.numel()), 0, tuple(value.shape), tuple(value.stride()))
  return _torch_zip(path, _archive_pickle(entries), storages)


def _void_object_array(shape=(1,)):
  """A void dtype whose __setstate__ gives it an object field (flags 0), then raw bytes as its contents: numpy reads
  the bytes as object pointers (a segfault when the array is copied or converted)."""
  dtype = _Reduce(np.dtype, ("V8", False, True), (3, "|", None, ("f",), {"f": (np.dtype("O"), 0)}, 8, 1, 0))
  raw = b"\x41" * (8 * int(np.prod(shape)))
  return _Reduce(np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, tuple(shape), dtype, False, raw))


def numpy_dtype_trick(root) -> list[dict]:
  """The void-dtype object array as conv1.weight of an otherwise valid torchvision state dict."""
  path = _resnet_zip(os.path.join(root, "numpy", "segv.pth"), {"conv1.weight": _void_object_array((8, 3, 7, 7))})
  return _import_cases(root, "object field in a void dtype", "numpy dtype trick", path)


def memory_bombs(root) -> list[dict]:
  """Files of a few bytes or kilobytes that ask for gigabytes."""
  d = os.path.join(root, "bombs")
  cases = []
  memo = b"\x80\x02Nr" + struct.pack("<I", 2**27) + b"."  # LONG_BINPUT 2**27: the unpickler's memo grows to it
  files = {"memo index 2**27 (bare)": _write(os.path.join(d, "memo.pth"), memo)}
  files["memo index 2**27 (zip data.pkl)"] = _torch_zip(os.path.join(d, "memo_zip.pth"), memo, {})
  objects = _Reduce(np._core.multiarray._reconstruct, (np.ndarray, (2**28,), np.dtype("O")), None)
  files["object ndarray of 2**28"] = _resnet_zip(os.path.join(d, "objects.pth"), {"conv1.weight": objects})
  data = _archive_pickle(
    {
      "w": _Reduce(
        np._core.multiarray._reconstruct, (np.ndarray, (2**28,), b"b"), (1, (2**28,), np.dtype("float64"), False, b"")
      )
    }
  )
  files["float ndarray of 2**28 from 0 bytes"] = _torch_zip(os.path.join(d, "floats.pth"), data, {})
  data = _archive_pickle({"w": _tensor(_Storage("0", 1), 0, (23000, 23000), (0, 0))})
  files["stride-0 23000x23000 tensor"] = _torch_zip(os.path.join(d, "stride0.pth"), data, {"0": bytes(4)})
  big = _Storage("0", 2**26)
  data = _archive_pickle({f"w{i}": _tensor(big, 0, (2**26,), (1,)) for i in range(8)})
  path = _torch_zip(os.path.join(d, "member8.pth"), data, {"0": 2**28}, deflate=True)
  files["256 MB deflated member referenced 8 times"] = path
  parts, storages = _legacy_parts(_legacy_bytes(collections.OrderedDict(w=torch.ones(2))))
  huge = struct.pack("<q", 2**61) + storages[8:]  # the storage's element count
  files["legacy storage count 2**61"] = _write(os.path.join(d, "legacy_count.pth"), b"".join(parts) + huge)
  huge = struct.pack("<q", -5) + storages[8:]
  files["legacy storage count -5"] = _write(os.path.join(d, "legacy_negative.pth"), b"".join(parts) + huge)
  for name, path in files.items():
    cases += _import_cases(root, name, "memory bomb", path, ("auto", "torchvision"))
  return cases


def _safetensors(header, body: bytes = b"", length=None) -> bytes:
  text = header if isinstance(header, bytes) else json.dumps(header).encode()
  return struct.pack("<Q", len(text) if length is None else length) + text + body


def malformed_safetensors(root) -> list[dict]:
  d = os.path.join(root, "safetensors")
  files = {
    "header length 2**63-1": _safetensors({}, length=2**63 - 1),
    "header length past the file": _safetensors({}, length=10**6),
    "header not JSON": _safetensors(b"{not json"),
    "header a JSON list": _safetensors([1, 2]),
    "overlapping offsets": _safetensors(
      {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
      },
      bytes(24),
    ),
    "negative offsets": _safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, bytes(4)),
    "offsets past the data": _safetensors(
      {"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, bytes(4)
    ),
    "dtype and shape disagree with the offsets": _safetensors(
      {"a": {"dtype": "F64", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)
    ),
    "shape overflows": _safetensors(
      {"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, bytes(16)
    ),
    "unknown dtype": _safetensors({"a": {"dtype": "Q99", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)),
    "deeply nested header": _safetensors(b"[" * 100000 + b"]" * 100000),
    "empty": b"",
  }
  cases = []
  for name, data in files.items():
    path = _write(os.path.join(d, _slug(name) + ".safetensors"), data)
    cases += _import_cases(root, f"safetensors: {name}", "malformed safetensors", path, ("auto", "torchvision"))
  return cases


def garbage_files(root) -> list[dict]:
  """Files that are not what they claim: empty, truncated, random, odd zips, self-referencing and deep pickles."""
  d = os.path.join(root, "garbage")
  valid = io.BytesIO()
  torch.save(collections.OrderedDict(w=torch.ones(2)), valid)
  valid = valid.getvalue()
  files = {
    "empty": b"",
    "random bytes": np.random.default_rng(0).bytes(4096),
    "truncated zip": valid[: len(valid) // 2],
    "truncated legacy": _legacy_bytes(collections.OrderedDict(w=torch.ones(64)))[:-100],
    "self-referencing pickle": _zip_of(b"\x80\x02]q\x00h\x00a.", {}),
    "pickle nested 100000 deep": _zip_of(b"\x80\x02" + b"]" * 100000 + b"a" * 99999 + b".", {}),
    "dict nested 100000 deep": _zip_of(b"\x80\x02" + b"}X\x01\x00\x00\x00k" * 100000 + b"}" + b"s" * 100000 + b".", {}),
  }
  # A zip whose data.pkl is a symlink entry (unix mode 0o120777), one with an unknown compression method (99) and
  # one with the encryption flag set.
  out = io.BytesIO()
  with zipfile.ZipFile(out, "w") as z:
    info = zipfile.ZipInfo("archive/data.pkl")
    info.external_attr = 0o120777 << 16
    z.writestr(info, "/etc/passwd")
  files["zip with a symlink entry"] = out.getvalue()
  raw = bytearray(valid)
  for sig in (b"PK\x03\x04", b"PK\x01\x02"):  # every local and central header: compression method 99
    start = 0
    while (at := raw.find(sig, start)) >= 0:
      offset = at + (8 if sig == b"PK\x03\x04" else 10)
      raw[offset : offset + 2] = struct.pack("<H", 99)
      start = at + 4
  files["zip compression method 99"] = bytes(raw)
  raw = bytearray(valid)
  for sig in (b"PK\x03\x04", b"PK\x01\x02"):  # the general-purpose flag's bit 0: encrypted
    start = 0
    while (at := raw.find(sig, start)) >= 0:
      offset = at + (6 if sig == b"PK\x03\x04" else 8)
      raw[offset] |= 1
      start = at + 4
  files["encrypted zip"] = bytes(raw)
  cases = []
  for name, data in files.items():
    path = _write(os.path.join(d, _slug(name) + ".pth"), data)
    cases += _import_cases(root, f"garbage: {name}", "garbage file", path, ("auto", "torchvision"))
  return cases


def malformed_mmf(root) -> list[dict]:
  """MMF region dumps (`vlrep.tools.convert_regions`): bombs and malformed `_info.npy` / features files."""
  cases = []

  def source(name, info: bytes, features=None):
    src = os.path.join(root, "mmf_bad", _slug(name))
    _write(os.path.join(src, "7_info.npy"), info)
    if features is None:
      np.save(_write(os.path.join(src, "7.npy"), b""), np.zeros((2, 8), np.float32))
    else:
      _write(os.path.join(src, "7.npy"), features)
    argv = ["--format=mmf", f"--src={src}", f"--dst={os.path.join(root, 'out', 'mmf_bad_' + _slug(name))}"]
    kind = "memory bomb" if "bomb" in name else "malformed MMF file"
    cases.append(_case(f"MMF: {name}", kind, "vlrep.tools.convert_regions", argv, names=src))

  def object_npy(pickle_bytes: bytes) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
    return f.getvalue() + pickle_bytes

  memo = b"\x80\x02Nr" + struct.pack("<I", 2**27) + b"."
  source("memo bomb _info.npy", object_npy(memo))
  objects = pickle.dumps(_Reduce(np._core.multiarray._reconstruct, (np.ndarray, (2**28,), np.dtype("O"))), protocol=2)
  source("object ndarray bomb _info.npy", object_npy(objects))
  source("_info.npy truncated", object_npy(pickle.dumps({"bbox": np.zeros((2, 4))}, protocol=2)[:-9]))
  source("_info.npy not an npy file", b"not numpy at all")
  source("_info.npy nested 100000 deep", object_npy(b"\x80\x02" + b"]" * 100000 + b"a" * 99999 + b"."))
  trick = pickle.dumps({"bbox": _void_object_array(), "num_boxes": 1}, protocol=2)
  source("_info.npy numpy dtype trick", object_npy(trick))
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**40, 2048)})
  info = io.BytesIO()
  np.save(info, {"bbox": np.zeros((2, 4), np.float32), "num_boxes": 2}, allow_pickle=True)
  source("features bomb .npy header 2**40 x 2048", info.getvalue(), header.getvalue())
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (393216, 2048)})
  source("features bomb .npy header of 3 GB", info.getvalue(), header.getvalue() + bytes(4096))
  return cases


def _tar_bomb(path, member_bytes: int) -> str:
  """A gzip tar shard holding one KEY.jpg of `member_bytes` zero bytes (and its caption), written without ever
  holding the member: fully flushed deflate pieces of 1 MB of zeros, repeated."""
  head = tarfile.TarInfo("0001.jpg")
  head.size = member_bytes
  header = head.tobuf(format=tarfile.GNU_FORMAT)
  caption = tarfile.TarInfo("0001.txt")
  caption.size = 5
  tail = bytes(-member_bytes % 512) + caption.tobuf(format=tarfile.GNU_FORMAT) + b"a dog" + bytes(507) + bytes(1024)
  comp = zlib.compressobj(9, zlib.DEFLATED, -15)
  piece_raw = bytes(1 << 20)
  piece = comp.compress(piece_raw) + comp.flush(zlib.Z_FULL_FLUSH)
  crc = zlib.crc32(header)
  body = [comp.compress(header) + comp.flush(zlib.Z_FULL_FLUSH)]
  zero_crc_state = crc
  for _ in range(member_bytes >> 20):
    zero_crc_state = zlib.crc32(piece_raw, zero_crc_state)
  crc = zlib.crc32(tail, zero_crc_state)
  end = comp.compress(tail) + comp.flush(zlib.Z_FINISH)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff")
    f.write(body[0])
    for _ in range(member_bytes >> 20):
      f.write(piece)
    f.write(end)
    f.write(struct.pack("<II", crc, (len(header) + member_bytes + len(tail)) & 0xFFFFFFFF))
  return path


def prepare_sources(root) -> list[dict]:
  """`vlrep.data.prepare --dataset=image_text`: a 1 MB gzip shard with a 1 GB member; index rows naming files
  outside --manual_dir (an absolute path, ../, a symlink)."""
  cases = []
  outside = _write(os.path.join(root, "outside_data", "secret.png"), _png(8, 8))

  def case(name, manual, kind):
    data_dir = os.path.join(root, "out", "tfds_" + _slug(name))
    argv = ["--dataset=image_text", f"--manual_dir={manual}", f"--data_dir={data_dir}"]
    cases.append(_case(f"prepare: {name}", kind, "vlrep.data.prepare", argv, names=manual))

  manual = os.path.join(root, "prepare", "bomb")
  _tar_bomb(os.path.join(manual, "shard-000.tar"), 2**30)  # 1 GB: twice the margin, half the time to skip
  case("gzip shard with a 1 GB member", manual, "memory bomb")
  for name, image in (
    ("absolute path", outside),
    ("../ path", "../../outside_data/secret.png"),
    ("symlink", "link.png"),
  ):
    manual = os.path.join(root, "prepare", _slug(name))
    os.makedirs(manual)
    if name == "symlink":
      os.symlink(outside, os.path.join(manual, "link.png"))
    _write(os.path.join(manual, "captions.jsonl"), json.dumps({"image": image, "caption": "a secret"}) + "\n")
    case(f"index row outside --manual_dir ({name})", manual, "prepare source")
  return cases


def _png(width: int, height: int) -> bytes:
  """An 8-bit greyscale PNG of zeros, written by hand (no pixels held for a big one)."""

  def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

  comp = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: fully flushed pieces of zero rows, repeated
  rows_per_piece = max(1, (1 << 20) // (width + 1))
  raw = bytes((width + 1) * rows_per_piece)
  piece = comp.compress(raw) + comp.flush(zlib.Z_FULL_FLUSH)
  rest = bytes((width + 1) * (height % rows_per_piece))
  adler = 1
  for _ in range(height // rows_per_piece):
    adler = zlib.adler32(raw, adler)
  adler = zlib.adler32(rest, adler)
  idat = b"\x78\xda" + piece * (height // rows_per_piece) + comp.compress(rest) + comp.flush()
  idat += struct.pack(">I", adler)
  ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# A stand-in for Detectron2 (not installed here, nor in CI), as much of it as the driver uses. Its checkpointer
# does what Detectron2's does with a .pkl (DetectionCheckpointer._load_file: plain pickle.load), and resumes as
# fvcore's Checkpointer does (OUTPUT_DIR/last_checkpoint names the file): a crafted file it is handed runs.
DETECTRON2_STUB = {
  "detectron2/__init__.py": "",
  "detectron2/utils/__init__.py": "",
  "detectron2/utils/comm.py": (
    "def get_world_size():\n  return 1\n\n\ndef is_main_process():\n  return True\n\n\ndef synchronize():\n  pass\n"
  ),
  "detectron2/layers/__init__.py": "def get_norm(norm, channels):\n  return None\n",
  "detectron2/modeling/__init__.py": "",
  "detectron2/modeling/roi_heads/__init__.py": (
    "class _Registry:\n  def register(self):\n    return lambda cls: cls\n\n\nROI_HEADS_REGISTRY = _Registry()\n\n\n"
    "class Res5ROIHeads:\n  pass\n"
  ),
  "detectron2/evaluation/__init__.py": "COCOEvaluator = LVISEvaluator = PascalVOCDetectionEvaluator = None\n",
  "detectron2/data/__init__.py": (
    "class DatasetCatalog:\n  @staticmethod\n  def list():\n    return ['stub_train', 'stub_test']\n\n\n"
    "class _Meta(dict):\n  evaluator_type = 'coco'\n\n\n"
    "class MetadataCatalog:\n  @staticmethod\n  def get(name):\n    return _Meta(evaluator_type='coco')\n"
  ),
  "detectron2/data/datasets/__init__.py": (
    "def register_coco_instances(*a):\n  pass\n\n\nregister_lvis_instances = register_coco_instances\n"
  ),
  "detectron2/data/datasets/pascal_voc.py": "def register_pascal_voc(*a):\n  pass\n",
  "detectron2/config/__init__.py": """import yaml


class CfgNode(dict):
  def __getattr__(self, key):
    try:
      return self[key]
    except KeyError as e:
      raise AttributeError(key) from e

  def __setattr__(self, key, value):
    self[key] = value

  def merge_from_file(self, path):
    with open(path) as f:
      _merge(self, yaml.safe_load(f) or {})

  def merge_from_list(self, pairs):
    for key, value in zip(pairs[0::2], pairs[1::2]):
      *path, last = key.split('.')
      node = self
      for part in path:
        node = node[part]
      node[last] = yaml.safe_load(value)

  def freeze(self):
    pass


def _merge(node, new):
  for key, value in new.items():
    if isinstance(value, dict):
      _merge(node.setdefault(key, CfgNode()), value)
    else:
      node[key] = value


def _node(d):
  return CfgNode({k: _node(v) if isinstance(v, dict) else v for k, v in d.items()})


def get_cfg():
  return _node({
    'MODEL': {'DEVICE': 'cpu', 'WEIGHTS': '', 'MASK_ON': False, 'PIXEL_MEAN': [103.53, 116.28, 123.675],
              'PIXEL_STD': [1.0, 1.0, 1.0],
              'RESNETS': {'DEPTH': 50, 'STEM_OUT_CHANNELS': 64, 'RES2_OUT_CHANNELS': 256, 'WIDTH_PER_GROUP': 64,
                          'NORM': 'FrozenBN', 'STRIDE_IN_1X1': True},
              'FPN': {'NORM': ''}, 'ROI_BOX_HEAD': {'NORM': ''}, 'ROI_MASK_HEAD': {'NORM': ''}},
    'INPUT': {'FORMAT': 'BGR', 'MASK_FORMAT': 'polygon'},
    'DATASETS': {'TRAIN': ('stub_train',), 'TEST': ()},
    'DATALOADER': {'NUM_WORKERS': 0},
    'SOLVER': {'MAX_ITER': 1},
    'TEST': {'PRECISE_BN': {'NUM_ITER': 200}},
    'OUTPUT_DIR': '',
  })
""",
  "detectron2/engine/__init__.py": """import os
import pickle


def launch(func, num_gpus, dist_url=None, args=()):
  func(*args)


def default_setup(cfg, args):
  pass


class DefaultTrainer:
  def __init__(self, cfg):
    self.cfg, self.start_iter = cfg, 0

  def resume_or_load(self, resume=True):
    path = self.cfg.MODEL.WEIGHTS
    last = os.path.join(self.cfg.OUTPUT_DIR, 'last_checkpoint')
    if resume and os.path.exists(last):
      with open(last) as f:
        path = os.path.join(self.cfg.OUTPUT_DIR, f.read().strip())
    if path.endswith('.pkl'):
      with open(path, 'rb') as f:
        pickle.load(f, encoding='latin1')

  def train(self):
    return {}

  @classmethod
  def test(cls, cfg, model, evaluators):
    return {}
""",
}

D2_YAML = """INPUT:
  FORMAT: RGB
MODEL:
  PIXEL_MEAN: [123.675, 116.280, 103.530]
  PIXEL_STD: [58.395, 57.120, 57.375]
  RESNETS:
    STRIDE_IN_1X1: False
DATASETS:
  TRAIN: [stub_train]
  TEST: []
"""


def _edit_config(run: str, edit) -> None:
  """Applies edit(config dict) to the config every checkpoint of `run` saved (its meta/metadata JSON)."""
  for d, _, files in os.walk(run):
    if os.path.basename(d) == "meta" and "metadata" in files:
      path = os.path.join(d, "metadata")
      with open(path) as f:
        meta = json.load(f)
      edit(meta["config"])
      with open(path, "w") as f:
        json.dump(meta, f)


def hugging_face_folders(root) -> list[dict]:
  """A valid tiny Hugging Face VisualBERT folder (config.json, model.safetensors, vocab.txt), each file then
  damaged or crafted: `vlrep.interop.import_run --format=visual_bert` (and auto) of the folder."""
  import transformers  # here only: the driver, which imports this module too, never needs it (seconds, memory)

  torch.manual_seed(0)
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(11)]
  config = transformers.VisualBertConfig(
    vocab_size=len(words),
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=16,
    max_position_embeddings=16,
    type_vocab_size=2,
    visual_embedding_dim=8,
    hidden_act="gelu",
  )
  valid = os.path.join(root, "hf", "valid")
  transformers.VisualBertForPreTraining(config).save_pretrained(valid)
  _write(os.path.join(valid, "vocab.txt"), "\n".join(words) + "\n")
  with open(os.path.join(valid, "config.json")) as f:
    good = json.load(f)
  marker = os.path.join(root, "markers", "hf_remote_code")
  crafted = {
    "config.json not JSON": {"config.json": "{not json"},
    "config.json nested 100000 deep": {"config.json": "[" * 100000 + "]" * 100000},
    "config.json num_hidden_layers 100000": {"config.json": {**good, "num_hidden_layers": 100000}},
    "config.json num_attention_heads 0": {"config.json": {**good, "num_attention_heads": 0}},
    "config.json hidden_size a string": {"config.json": {**good, "hidden_size": "x"}},
    "config.json vocab_size 10**9": {"config.json": {**good, "vocab_size": 10**9}},
    "config.json a list": {"config.json": [1, 2, 3]},
    "vocab.txt not UTF-8": {"vocab.txt": b"\xff\xfe\x80" * 50},
    "vocab.txt empty": {"vocab.txt": b""},
    "model.safetensors header past the file": {"model.safetensors": _safetensors({}, length=10**6)},
    "pytorch_model.bin a memo bomb": {"model.safetensors": None, "pytorch_model.bin": b"\x80\x02Nr\x00\x00\x00\x08."},
  }
  cases = []
  for name, files in crafted.items():
    folder = os.path.join(root, "hf", _slug(name))
    shutil.copytree(valid, folder)
    for fname, content in files.items():
      path = os.path.join(folder, fname)
      if content is None:
        os.remove(path)
      else:
        _write(path, json.dumps(content) if isinstance(content, (dict, list)) else content)
    cases += _import_cases(root, f"HF folder: {name}", "malformed HF folder", folder, ("visual_bert", "auto"))
  # Code hooks: an auto_map naming a module shipped in the folder, trust_remote_code. The import may succeed, but
  # nothing runs and the hooks are not carried into the run.
  folder = os.path.join(root, "hf", "code_hooks")
  shutil.copytree(valid, folder)
  _write(os.path.join(folder, "modeling_evil.py"), f"open({marker!r}, 'w').close()\n")
  hooks = {"AutoModel": "modeling_evil.EvilModel", "AutoConfig": "modeling_evil.EvilConfig"}
  _write(os.path.join(folder, "config.json"), json.dumps({**good, "auto_map": hooks, "trust_remote_code": True}))
  for case in _import_cases(
    root, "HF folder: code hooks in config.json, a module beside it", "malformed HF folder", folder, ("visual_bert",)
  ):
    case.update(expect=[0, 2], markers=[marker], absent=case["absent"][1:])
    case["forbidden"] = {
      "dir": case["argv"][2].split("=", 1)[1],
      "strings": ["auto_map", "trust_remote_code", "modeling_evil"],
    }
    cases.append(case)
  return cases


def base_run(root) -> str:
  """A valid run: a random torchvision ResNet-18 (width 8) imported by vlrep.interop.import_run."""
  torch.manual_seed(0)
  weights = os.path.join(root, "base", "r18w8.pth")
  os.makedirs(os.path.dirname(weights))
  torch.save(TorchResNet(18, 8).state_dict(), weights)
  run = os.path.join(root, "base", "run")
  import_run.import_run("torchvision", weights, run)
  return run


def captioner_run(root) -> str:
  """A valid captioner run (it reads its vocabulary): the committed tiny official VirTex checkpoint
  (tests/fixtures/virtex_official) imported by vlrep.interop.import_run --format=virtex. Written once per corpus."""
  run = os.path.join(root, "base", "captioner")
  if not os.path.isdir(run):
    fixture = os.path.join(TESTS, "fixtures", "virtex_official")
    checkpoint, vocab = os.path.join(fixture, "bicaptioning_tiny.pth"), os.path.join(fixture, "vocab.model")
    import_run.import_run("virtex", checkpoint, run, vocab=vocab, heads=2)
  return run


def _copy_run(base: str, to: str, edit=None) -> str:
  shutil.copytree(base, to)
  if edit:
    _edit_config(to, edit)
  return to


def _export_folder(run: str, out: str) -> str:
  """`vlrep.interop.export --format=vlrep` of `run` to `out` (the shared folder vlrep.predict and vlrep.load read)."""
  vlrep_format.export(runs.load_run(run), out)
  return out


def shared_folders(root, base: str) -> list[dict]:
  """A valid shared folder (the base run, given a BPE vocabulary, exported with --format=vlrep: config.json,
  model.safetensors, tokenizer.model, README.md), then copies of it each crafted: through `vlrep.predict` and
  `vlrep.tools.features --workdir=DIR` (both read shared folders)."""
  vocab = os.path.join(root, "shared_src", "vocab.model")
  os.makedirs(os.path.dirname(vocab))
  build_vocab(vocab, 60)
  run = _copy_run(
    base,
    os.path.join(root, "shared_src", "run"),
    lambda c: c.update(tokenizer={"kind": "bpe", "path": vocab, "special_tokens": "vlrep"}),
  )
  valid = _export_folder(run, os.path.join(root, "shared", "valid"))
  with open(os.path.join(valid, "config.json")) as f:
    good = json.load(f)
  assert good["tokenizer"] and os.path.isfile(os.path.join(valid, "tokenizer.model")), good  # what the cases damage
  photo = os.path.join(root, "images", "photo.png")
  out = os.path.join(root, "out")
  cases = []

  def commands(folder, tag, kind="crafted shared folder", expect=(2,), markers=(), sentinels=(), names=None, **kw):
    o = os.path.join(out, "shared_" + _slug(tag))
    each = {
      "predict embed": ("vlrep.predict", [f"--model={folder}", "embed", photo]),
      "predict embed grid": ("vlrep.predict", [f"--model={folder}", "embed", "--features=pooled,grid", photo]),
      "features": ("vlrep.tools.features", [f"--workdir={folder}", f"--out={o}_features.npy", photo]),
    }
    for key, (entry, argv) in each.items():
      cases.append(
        _case(
          f"shared folder: {tag} [{key}]",
          kind,
          entry,
          argv,
          expect=list(expect),
          markers=list(markers),
          sentinels=list(sentinels),
          target=folder,
          names=names if names is not None else folder,
          absent=[f"{o}_features.npy"] if 2 in expect and 0 not in expect else [],
          **kw,
        )
      )

  def crafted(tag, files=None, config=None):
    """A copy of the valid folder; `files` {name: bytes, str or None (removed)}; `config` edits config.json."""
    folder = os.path.join(root, "shared", _slug(tag))
    shutil.copytree(valid, folder)
    for name, content in (files or {}).items():
      path = os.path.join(folder, name)
      if os.path.lexists(path):
        os.remove(path)
      if content is not None:
        _write(path, content)
    if config:
      c = json.loads(json.dumps(good))
      config(c)
      _write(os.path.join(folder, "config.json"), json.dumps(c))
    return folder

  # The valid folder itself: read (exit 0), else the other cases prove nothing.
  commands(valid, "valid (exported)", kind="shared folder (valid)", expect=[0], names="")
  # The Hugging Face cache layout: snapshots/<rev>/ files are links into blobs/, the one legitimate link.
  hub = os.path.join(root, "shared", "hub", "models--someone--tiny")
  snapshot = os.path.join(hub, "snapshots", "0123abcd")
  os.makedirs(snapshot)
  os.makedirs(os.path.join(hub, "blobs"))
  for name in os.listdir(valid):
    blob = safe_files.sha256_of(os.path.join(valid, name))
    shutil.copy(os.path.join(valid, name), os.path.join(hub, "blobs", blob))
    os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
  commands(snapshot, "Hugging Face cache layout (links into blobs/)", kind="shared folder (valid)", expect=[0])

  # A module beside config.json, named as the method: nothing may import it, even from the folder as cwd.
  marker = os.path.join(root, "markers", "shared_payload")
  folder = crafted(
    "method.name payload.evil",
    files={"payload.py": f"open({marker!r}, 'w').close()\n\n\nclass evil:\n  pass\n\n\ndef build(*a, **k):\n  pass\n"},
    config=lambda c: c["method"].update(name="payload.evil"),
  )
  commands(folder, "method.name payload.evil, payload.py beside it", markers=[marker])
  for sub in (["embed"], ["caption"]):
    cases.append(
      _case(
        f"shared folder: method.name payload.evil, cwd the folder [predict {sub[0]}, python -m]",
        "crafted shared folder",
        "vlrep.predict",
        ["--model=.", *sub, photo],
        cwd=folder,
        mode="subprocess",
        markers=[marker],
        target=folder,
        names=folder,
      )
    )
  cases.append(
    _case(
      "shared folder: method.name payload.evil, cwd the folder [features, python -m]",
      "crafted shared folder",
      "vlrep.tools.features",
      ["--workdir=.", f"--out={os.path.join(out, 'shared_payload_cwd.npy')}", photo],
      cwd=folder,
      mode="subprocess",
      markers=[marker],
      target=folder,
      names=folder,
    )
  )

  config = "config.json"
  # config.json itself.
  each = {
    "config.json over 1 MB": {config: json.dumps({**good, "padding": "x" * (1 << 21)})},
    "config.json nested 100000 deep": {config: "[" * 100000 + "]" * 100000},
    "config.json method nested 100000 deep": {
      config: json.dumps(good)[:-1] + ', "deep": ' + "[" * 100000 + "]" * 100000 + "}"
    },
    "config.json not JSON": {config: "{not json"},
    "config.json not UTF-8": {config: b"\xff\xfe\x80" * 50},
    "config.json a list": {config: "[1, 2, 3]"},
    "config.json format missing": {config: json.dumps({k: v for k, v in good.items() if k != "format"})},
    "config.json missing": {config: None},
    "model.safetensors missing": {"model.safetensors": None},
  }
  for tag, files in each.items():
    commands(crafted(tag, files=files), tag)
  # Paths in the config: data only.
  each = {
    "data.data_dir /etc": lambda c: c["data"].update(data_dir="/etc"),
    "tokenizer file ../../x": lambda c: c["tokenizer"].update(file="../../x"),
    "tokenizer file an absolute path": lambda c: c["tokenizer"].update(file="/etc/passwd"),
    "method.bert_path ~/.ssh": lambda c: c["method"].update(bert_path="~/.ssh"),
    "method.backbone a string": lambda c: c["method"].update(backbone="resnet"),
    "tokenizer kind wordpiece": lambda c: c["tokenizer"].update(kind="wordpiece"),
    "step -1": lambda c: c.update(step=-1),
  }
  for tag, edit in each.items():
    commands(crafted(tag, config=edit), tag)
  # The tokenizer file a link to a file outside (not the hub layout): refused, the file untouched.
  sentinel = _write(os.path.join(root, "outside", "shared_secret.model"), "a file of the user's\n")
  folder = crafted("tokenizer.model a symlink outside", files={"tokenizer.model": None})
  os.symlink(sentinel, os.path.join(folder, "tokenizer.model"))
  commands(folder, "tokenizer.model a symlink outside", sentinels=[sentinel])
  folder = crafted("model.safetensors a symlink outside", files={"model.safetensors": None})
  os.symlink(os.path.join(valid, "model.safetensors"), os.path.join(folder, "model.safetensors"))
  commands(folder, "model.safetensors a symlink outside")
  # A link named snapshots/<rev>/ that leads elsewhere than blobs/: not the hub layout.
  fake = os.path.join(root, "shared", "fake_hub", "snapshots", "rev")
  shutil.copytree(valid, fake)
  os.remove(os.path.join(fake, "tokenizer.model"))
  os.symlink(sentinel, os.path.join(fake, "tokenizer.model"))
  commands(fake, "snapshots/<rev>/tokenizer.model a symlink outside blobs/", sentinels=[sentinel])
  # The tokenizer file changed after export: its SHA-256 no longer the recorded one.
  with open(os.path.join(valid, "tokenizer.model"), "rb") as f:
    vocab_bytes = f.read()
  folder = crafted("tokenizer.model sha256 mismatch", files={"tokenizer.model": vocab_bytes + b"\0"})
  commands(folder, "tokenizer.model sha256 mismatch")
  marker2 = os.path.join(root, "markers", "shared_tokenizer_payload")
  folder = crafted("tokenizer.model a pickle", files={"tokenizer.model": _payloads(marker2)["GLOBAL os.system"][0]})
  digest = safe_files.sha256_of(os.path.join(folder, "tokenizer.model"))
  c = json.loads(json.dumps(good))
  c["tokenizer"]["sha256"] = digest  # recorded as it is: the file must still not be run or accepted
  _write(os.path.join(folder, "config.json"), json.dumps(c))
  # A method without text may never open its vocabulary (exit 0); what matters is that nothing runs.
  commands(folder, "tokenizer.model a pickle payload, its sha256 recorded", expect=[0, 2], markers=[marker2])

  # A captioner's folder, which reads its vocabulary: valid (exit 0), then its tokenizer.model crafted with the new
  # SHA-256 recorded (a folder crafted whole, not damaged), or its tokenizer null.
  cap_valid = _export_folder(captioner_run(root), os.path.join(root, "shared", "captioner_valid"))
  with open(os.path.join(cap_valid, "config.json")) as f:
    cap_config = json.load(f)

  def captioner_commands(folder, tag, kind="crafted shared folder", expect=(2,), markers=()):
    for key, argv in (
      ("predict caption", ["caption", "--beam_size=2", "--max_len=5", photo]),
      ("predict zero-shot", ["zero-shot", "--labels=cat,dog", photo]),
    ):
      cases.append(
        _case(
          f"shared folder, a captioner: {tag} [{key}]",
          kind,
          "vlrep.predict",
          [f"--model={folder}", *argv],
          expect=list(expect),
          markers=list(markers),
          target=folder,
          names=folder if expect == (2,) else "",
        )
      )

  def captioner_folder(tag, vocabulary: bytes | None):
    folder = os.path.join(root, "shared", "captioner_" + _slug(tag))
    shutil.copytree(cap_valid, folder)
    c = json.loads(json.dumps(cap_config))
    os.remove(os.path.join(folder, "tokenizer.model"))
    if vocabulary is None:
      c["tokenizer"] = None
    else:
      _write(os.path.join(folder, "tokenizer.model"), vocabulary)
      c["tokenizer"]["sha256"] = safe_files.sha256_of(os.path.join(folder, "tokenizer.model"))
    _write(os.path.join(folder, "config.json"), json.dumps(c))
    return folder

  captioner_commands(cap_valid, "valid (exported)", kind="shared folder (valid)", expect=(0,))
  marker3 = os.path.join(root, "markers", "shared_captioner_tokenizer")
  each = {
    "tokenizer.model a pickle payload, its sha256 recorded": _payloads(marker3)["GLOBAL os.system"][0],
    "tokenizer.model random bytes, its sha256 recorded": np.random.default_rng(3).bytes(900),
    "tokenizer.model empty, its sha256 recorded": b"",
    "tokenizer null": None,
  }
  for tag, vocabulary in each.items():
    captioner_commands(captioner_folder(tag, vocabulary), tag, markers=[marker3])

  # model.safetensors crafted.
  with open(os.path.join(valid, "model.safetensors"), "rb") as f:
    weights = f.read()
  tensors = load_file(os.path.join(valid, "model.safetensors"))
  outside_name = os.path.join(root, "shared_src", "outside_name.safetensors")
  save_file({**tensors, "evil/x": np.zeros(2, np.float32)}, outside_name)
  f32 = {"dtype": "F32", "shape": [2]}
  each = {
    "model.safetensors header length 2**63-1": _safetensors({}, length=2**63 - 1),
    "model.safetensors header past the file": _safetensors({}, length=10**6),
    "model.safetensors overlapping tensors": _safetensors(
      {"params/a": {**f32, "data_offsets": [0, 8]}, "params/b": {**f32, "data_offsets": [4, 12]}}, b"\0" * 12
    ),
    "model.safetensors tensor past the data": _safetensors(
      {"params/a": {"dtype": "F32", "shape": [10**9], "data_offsets": [0, 4 * 10**9]}}, b"\0" * 8
    ),
    "model.safetensors truncated": weights[: len(weights) // 2],
    "model.safetensors tensor name outside params/ batch_stats/": open(outside_name, "rb").read(),
    "model.safetensors a tensor name ../x": _safetensors({"params/../x": {**f32, "data_offsets": [0, 8]}}, b"\0" * 8),
    "model.safetensors a pickle": _payloads(marker2)["GLOBAL os.system"][0],
    "model.safetensors empty": b"",
  }
  for tag, data in each.items():
    commands(crafted(tag, files={"model.safetensors": data}), tag, markers=[marker2])

  # Memory bombs in the config: an input side of 100000 px (vlrep.inference caps it at 4096), a backbone too wide
  # for its weights to fit (refused before anything is allocated).
  each = {
    "data.image_size 100000": lambda c: c["data"].update(image_size=100000, pp=""),
    "data.pp inception_crop(100000)": lambda c: c["data"].update(pp="decode|inception_crop(100000)"),
    "data.pp resize(100000)": lambda c: c["data"].update(pp="decode|resize(100000)|normalize"),
    "method.backbone.width 10**6": lambda c: (
      c["method"]["backbone"].update(width=10**6),
      c["architecture"].update(width=10**6),
    ),
    "method.backbone.depth 10**6": lambda c: (
      c["method"]["backbone"].update(depth=10**6),
      c["architecture"].update(depth=10**6),
    ),
  }
  for tag, edit in each.items():
    commands(crafted(tag, config=edit), tag, kind="memory bomb")
  # A classifier head of 10**9 classes: the commands here use the backbone alone, so they may ignore it (exit 0);
  # what matters is that nothing of that size is allocated.
  folder = crafted("method.num_classes 10**9", config=lambda c: c["method"].update(num_classes=10**9))
  commands(folder, "method.num_classes 10**9 (head unused)", kind="memory bomb", expect=[0, 2])
  return cases


def run_folders(root, base: str) -> list[dict]:
  """Crafted run folders through every command that reads a run."""
  cases = []
  out = os.path.join(root, "out")
  photo = _write(os.path.join(root, "images", "photo.png"), _png(48, 40))
  eval_none = _write(
    os.path.join(root, "eval_none.py"),
    "from ml_collections import ConfigDict\n\n\ndef get_config(arg=None):\n  return ConfigDict({'evals': {}})\n",
  )
  captioning = os.path.join(ROOT, "configs", "eval", "captioning.py")
  finetune = os.path.join(ROOT, "tests", "tiny_finetune.py")

  def commands(run, tag, markers=(), absent=(), sentinels=(), expect=(2,), cwd=None, only=None, names=None):
    """The run through evaluate, caption, features, export and main --config.init_from; a refusal names the run
    (or `names`)."""
    o = os.path.join(out, _slug(tag))
    each = {
      "evaluate": ("vlrep.evaluate", [f"--config={captioning}", f"--workdir={run}"]),
      "caption": ("vlrep.tools.caption", [f"--workdir={run}", photo]),
      "features": ("vlrep.tools.features", [f"--workdir={run}", f"--out={o}_features.npy", "--size=32", photo]),
      "export": ("vlrep.interop.export", [f"--workdir={run}", "--format=torchvision", f"--out={o}_export.safetensors"]),
      "main": ("vlrep.main", [f"--config={finetune}", f"--config.init_from={run}", f"--workdir={o}_main"]),
      "predict": ("vlrep.predict", [f"--model={run}", "embed", photo]),
    }
    for key, (entry, argv) in each.items():
      if only and key not in only:
        continue
      allowed = list(expect[key] if isinstance(expect, dict) else expect)
      cases.append(
        _case(
          f"{tag} [{key}]",
          "crafted run folder",
          entry,
          argv,
          cwd=cwd,
          expect=allowed,
          markers=list(markers),
          absent=list(absent),
          sentinels=list(sentinels),
          target=os.path.join(cwd, run) if cwd else run,
          names=names or (os.path.join(cwd, run) if cwd else run),
        )
      )

  # A dotted method.name, the module shipped beside the run in the folder the command starts from.
  start = os.path.join(root, "start_dotted")
  marker = os.path.join(root, "markers", "dotted_method_name")
  _copy_run(base, os.path.join(start, "evilrun"), lambda c: c["method"].update(name="evilrun.payload"))
  _write(os.path.join(start, "evilrun", "payload.py"), f"open({marker!r}, 'w').close()\n")
  # Only commands that build the method must refuse it; the others may ignore a name they never resolve.
  expect = {"evaluate": [2], "caption": [2], "features": [0, 2], "export": [0, 2], "main": [2], "predict": [2]}
  commands("evilrun", "dotted method.name", [marker], expect=expect, cwd=start)
  for key, entry, argv in (
    ("evaluate", "vlrep.evaluate", [f"--config={captioning}", "--workdir=evilrun"]),
    ("caption", "vlrep.tools.caption", ["--workdir=evilrun", photo]),
    ("predict", "vlrep.predict", ["--model=evilrun", "caption", photo]),
  ):
    cases.append(
      _case(
        f"dotted method.name [{key}, python -m]",
        "crafted run folder",
        entry,
        argv,
        cwd=start,
        mode="subprocess",
        markers=[marker],
        names=os.path.join(start, "evilrun"),
      )
    )

  # A symlink planted at a name vlrep writes inside the run, pointing at a file outside it.
  sentinel = _write(os.path.join(root, "outside", "bashrc"), "# the user's own file\n")
  run = _copy_run(base, os.path.join(root, "runs", "summary_tmp_link"))
  os.symlink(sentinel, os.path.join(run, "summary.json.tmp"))
  cases.append(
    _case(
      "summary.json.tmp symlink [evaluate]",
      "crafted run folder",
      "vlrep.evaluate",
      [f"--config={eval_none}", f"--workdir={run}"],
      expect=[0, 2],
      sentinels=[sentinel],
      target=run,
    )
  )
  sentinel2 = _write(os.path.join(root, "outside", "settings.json"), '{"mine": 1}\n')
  run = _copy_run(base, os.path.join(root, "runs", "summary_link"))
  os.remove(os.path.join(run, "summary.json"))
  os.symlink(sentinel2, os.path.join(run, "summary.json"))
  cases.append(
    _case(
      "summary.json symlink [evaluate]",
      "crafted run folder",
      "vlrep.evaluate",
      [f"--config={eval_none}", f"--workdir={run}"],
      expect=[0, 2],
      sentinels=[sentinel2],
      target=run,
    )
  )
  run = _copy_run(base, os.path.join(root, "runs", "export_tmp_link"))
  os.symlink(sentinel, os.path.join(run, "backbone.pkl.tmp"))
  cases.append(
    _case(
      "backbone.pkl.tmp symlink [export --format=detectron2]",
      "crafted run folder",
      "vlrep.interop.export",
      [f"--workdir={run}", "--format=detectron2", f"--out={os.path.join(run, 'backbone.pkl')}"],
      expect=[0, 2],
      sentinels=[sentinel],
      target=run,
    )
  )
  feats = os.path.join(root, "out_links", "features.npy")
  os.makedirs(os.path.dirname(feats))
  for name in ("features.npy.writing.npy", "features.npy.json.writing"):
    os.symlink(sentinel, os.path.join(os.path.dirname(feats), name))
  cases.append(
    _case(
      "features' temporary names symlinked [features]",
      "crafted run folder",
      "vlrep.tools.features",
      [f"--workdir={base}", f"--out={feats}", "--size=32", photo],
      expect=[0, 2],
      sentinels=[sentinel],
      target=os.path.dirname(feats),
    )
  )

  # A saved tokenizer.path outside the run, missing, with build_if_missing: nothing may be created there.
  outside_tok = os.path.join(root, "outside_tokenizer")
  data_dir = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")

  def tokenizer_outside(c):
    c["tokenizer"] = {"kind": "bpe", "path": os.path.join(outside_tok, "sub", "vocab.model"), "vocab_size": 60}
    c["tokenizer"].update(build_if_missing=True, corpus_split="train", corpus_key="captions")
    c["data"].update(name="synthetic_scenes", config_name="tiny", data_dir=data_dir)

  # The caption commands refuse a classifier before its vocabulary: they get the captioner's copy (an imported VirTex).
  captioner = captioner_run(root)
  run = _copy_run(base, os.path.join(root, "runs", "tokenizer_outside"), tokenizer_outside)
  commands(run, "tokenizer.path outside", absent=[outside_tok], only=("evaluate",), names=outside_tok)
  special = {"special_tokens": "virtex"}  # the imported VirTex's own
  run = _copy_run(
    captioner,
    os.path.join(root, "runs", "tokenizer_outside_captioner"),
    lambda c: (tokenizer_outside(c), c["tokenizer"].update(special)),
  )
  for key, entry, argv in (
    ("caption", "vlrep.tools.caption", [f"--workdir={run}", photo]),
    ("predict caption", "vlrep.predict", [f"--model={run}", "caption", photo]),
    ("predict zero-shot", "vlrep.predict", [f"--model={run}", "zero-shot", "--labels=cat,dog", photo]),
  ):
    cases.append(
      _case(
        f"tokenizer.path outside, a captioner [{key}]",
        "crafted run folder",
        entry,
        argv,
        absent=[outside_tok],
        target=run,
        names=outside_tok,
      )
    )

  # A vocabulary that is not a sentencepiece model, inside the run.
  bad_vocab = _write(os.path.join(root, "runs", "bad_vocab_files", "vocab.model"), np.random.default_rng(1).bytes(600))
  run = _copy_run(
    base, os.path.join(root, "runs", "bad_vocab"), lambda c: c.update(tokenizer={"kind": "bpe", "path": bad_vocab})
  )
  cap = _copy_run(
    captioner,
    os.path.join(root, "runs", "bad_vocab_captioner"),
    lambda c: c["tokenizer"].update(path=bad_vocab, **special),
  )
  for key, entry, argv in (
    ("evaluate", "vlrep.evaluate", [f"--config={captioning}", f"--workdir={run}"]),
    ("caption", "vlrep.tools.caption", [f"--workdir={cap}", photo]),
    ("predict caption", "vlrep.predict", [f"--model={cap}", "caption", photo]),
    ("predict zero-shot", "vlrep.predict", [f"--model={cap}", "zero-shot", "--labels=cat,dog", photo]),
  ):
    cases.append(_case(f"vocabulary not sentencepiece [{key}]", "malformed vocabulary", entry, argv, names=bad_vocab))

  # Every file of the run replaced by a payload.
  marker = os.path.join(root, "markers", "poisoned_run")
  run = _copy_run(base, os.path.join(root, "runs", "poisoned"))
  payload = _payloads(marker)["GLOBAL os.system"][0]
  for d, _, files in os.walk(run):
    for f in files:
      _write(os.path.join(d, f), payload)
  commands(run, "every file a payload", [marker])
  # Its checkpoint metadata not JSON, or nested 100000 deep.
  for tag, text in (("metadata not JSON", "{not json"), ("metadata nested 100000 deep", "[" * 100000 + "]" * 100000)):
    run = _copy_run(base, os.path.join(root, "runs", _slug(tag)))
    for d, _, _files in os.walk(run):
      if os.path.basename(d) == "meta":
        _write(os.path.join(d, "metadata"), text)
    commands(run, tag, only=("evaluate", "export", "main", "predict"))
  # A run whose saved preprocessing crops 100000 px: the image commands refuse it within memory, naming the run.
  run = _copy_run(
    base, os.path.join(root, "runs", "crop_100000"), lambda c: c["data"].update(pp="decode|inception_crop(100000)")
  )
  npy = os.path.join(out, "crop_100000.npy")
  for key, entry, argv in (
    ("predict embed", "vlrep.predict", [f"--model={run}", "embed", photo]),
    ("features", "vlrep.tools.features", [f"--workdir={run}", f"--out={npy}", photo]),
    ("caption", "vlrep.tools.caption", [f"--workdir={run}", photo]),
  ):
    cases.append(
      _case(
        f"data.pp inception_crop(100000) in the run's config [{key}]",
        "memory bomb",
        entry,
        argv,
        names=run,
        target=run,
        absent=[npy],
      )
    )
  # A run whose backbone has the small stem: export refuses it by design.
  run = _copy_run(
    base, os.path.join(root, "runs", "small_stem"), lambda c: c["method"]["backbone"].update(stem="cifar")
  )
  commands(run, "small-stem run", only=("export",))
  # main --config.init_from naming a payload file rather than a run.
  marker = os.path.join(root, "markers", "init_from_file")
  path = _write(os.path.join(root, "runs", "init_from.pth"), _payloads(marker)["GLOBAL os.system"][0])
  cases.append(
    _case(
      "init_from a payload file [main]",
      "crafted run folder",
      "vlrep.main",
      [f"--config={finetune}", f"--config.init_from={path}", f"--workdir={os.path.join(out, 'init_from_file')}"],
      markers=[marker],
      names=path,
    )
  )

  # A decompression-bomb PNG (196 M pixels in a few hundred KB) to the image tools.
  bomb = _write(os.path.join(root, "images", "bomb.png"), _png(14000, 14000))
  for key, entry, argv in (
    ("caption", "vlrep.tools.caption", [f"--workdir={base}", bomb]),
    ("features", "vlrep.tools.features", [f"--workdir={base}", f"--out={os.path.join(out, 'bomb.npy')}", bomb]),
    ("predict embed", "vlrep.predict", [f"--model={base}", "embed", bomb]),
    ("predict zero-shot", "vlrep.predict", [f"--model={base}", "zero-shot", "--labels=cat,dog", bomb]),
  ):
    cases.append(_case(f"decompression-bomb PNG [{key}]", "memory bomb", entry, argv, names=bomb))
  # Crafted images to vlrep.predict: each checked before the model opens, refused naming the file.
  marker = os.path.join(root, "markers", "predict_image_payload")
  png = _png(48, 40)
  images = {
    "PNG truncated": ("truncated.png", png[: len(png) // 2]),
    "a pickle payload named .jpg": ("payload.jpg", _payloads(marker)["GLOBAL os.system"][0]),
    "random bytes named .png": ("random.png", np.random.default_rng(2).bytes(4000)),
    "empty file named .jpg": ("empty.jpg", b""),
  }
  for tag, (fname, data) in images.items():
    image = _write(os.path.join(root, "images", "predict", fname), data)
    for sub in (["embed"], ["caption"]):
      cases.append(
        _case(
          f"image: {tag} [predict {sub[0]}]",
          "crafted image",
          "vlrep.predict",
          [f"--model={base}", *sub, photo, image],
          markers=[marker],
          names=image,
        )
      )

  # Detectron2: a last_checkpoint the run ships, naming a payload .pkl; the driver must not hand it over.
  stub = os.path.join(root, "d2stub")
  for name, text in DETECTRON2_STUB.items():
    _write(os.path.join(stub, name), text)
  yaml_path = _write(os.path.join(root, "d2", "stub.yaml"), D2_YAML)
  marker = os.path.join(root, "markers", "detectron2_last_checkpoint")
  run = _copy_run(
    base, os.path.join(root, "runs", "d2_resume"), lambda c: c["method"]["backbone"].update(depth=50, width=64)
  )
  _write(os.path.join(run, "detectron2", "stub", "last_checkpoint"), "model_final.pkl")
  _write(os.path.join(run, "detectron2", "stub", "model_final.pkl"), _payloads(marker)["GLOBAL os.system"][0])
  cases.append(
    _case(
      "Detectron2 last_checkpoint shipped in the run [detectron2_transfer]",
      "crafted run folder",
      "vlrep.pytorch.detectron2_transfer",
      [f"--workdir={run}", f"--config-file={yaml_path}"],
      path_add=[stub],
      markers=[marker],
      names=run,
    )
  )
  # Its output folder a symlink to a folder outside the run: nothing may be written there.
  elsewhere = os.path.join(root, "outside", "d2_elsewhere")
  os.makedirs(elsewhere)
  run = _copy_run(
    base, os.path.join(root, "runs", "d2_link"), lambda c: c["method"]["backbone"].update(depth=50, width=64)
  )
  os.makedirs(os.path.join(run, "detectron2"))
  os.symlink(elsewhere, os.path.join(run, "detectron2", "stub"))
  cases.append(
    _case(
      "Detectron2 output folder a symlink outside [detectron2_transfer]",
      "crafted run folder",
      "vlrep.pytorch.detectron2_transfer",
      [f"--workdir={run}", f"--config-file={yaml_path}"],
      path_add=[stub],
      absent=[
        os.path.join(elsewhere, n)
        for n in ("backbone.safetensors", "backbone.json", "backbone.pkl", "last_checkpoint", "transfer_results.json")
      ],
      names=run,
    )
  )
  return cases


def baselines(root, base: str) -> list[dict]:
  """Each entry point's trivial cases: their peak RSS is its baseline."""
  out = os.path.join(root, "out")
  photo = os.path.join(root, "images", "photo.png")
  weights = os.path.join(root, "base", "r18w8.pth")
  eval_none = os.path.join(root, "eval_none.py")
  mmf = os.path.join(root, "mmf_valid")
  np.save(_write(os.path.join(mmf, "5.npy"), b""), np.ones((2, 8), np.float32))
  info = {"bbox": np.array([[0, 0, 10, 10], [5, 5, 20, 20]], np.float32), "num_boxes": 2}
  info.update(image_width=20, image_height=40, cls_prob=np.eye(2, 3, dtype=np.float32))
  np.save(os.path.join(mmf, "5_info.npy"), info, allow_pickle=True)
  manual = os.path.join(root, "prepare_valid")
  _write(os.path.join(manual, "a.png"), _png(16, 16))
  _write(os.path.join(manual, "captions.jsonl"), json.dumps({"image": "a.png", "caption": "a grey square"}) + "\n")
  d2_yaml = os.path.join(root, "d2", "stub.yaml")
  stub = os.path.join(root, "d2stub")
  run = _copy_run(base, os.path.join(root, "runs", "baseline"))
  shared = os.path.join(root, "shared", "valid")
  each = [
    ("vlrep.predict", [f"--model={run}", "embed", photo], {}),
    ("vlrep.predict", [f"--model={shared}", "embed", "--features=pooled,grid", photo], {}),
    ("vlrep.interop.import_run", [f"--checkpoint={weights}", f"--workdir={out}/baseline_import"], {}),
    ("vlrep.interop.import_run", [f"--checkpoint={root}/missing.pth", f"--workdir={out}/baseline_import2"], {}),
    ("vlrep.tools.convert_regions", [f"--src={mmf}", f"--dst={out}/baseline_mmf"], {}),
    ("vlrep.data.prepare", ["--dataset=image_text", f"--manual_dir={manual}", f"--data_dir={out}/baseline_tfds"], {}),
    ("vlrep.evaluate", [f"--config={eval_none}", f"--workdir={run}"], {}),
    ("vlrep.tools.caption", [f"--workdir={run}", photo], {}),
    ("vlrep.tools.features", [f"--workdir={run}", f"--out={out}/baseline.npy", "--size=32", photo], {}),
    ("vlrep.interop.export", [f"--workdir={run}", "--format=torchvision", f"--out={out}/baseline.safetensors"], {}),
    (
      "vlrep.main",
      [
        f"--config={ROOT}/tests/tiny_finetune.py",
        f"--config.init_from={root}/missing",
        f"--workdir={out}/baseline_main",
      ],
      {},
    ),
    (
      "vlrep.pytorch.detectron2_transfer",
      [f"--workdir={root}/missing", f"--config-file={d2_yaml}"],
      {"path_add": [stub]},
    ),
  ]
  # A real `python -m` process's: the caption tool on a valid run.
  each.append(("vlrep.tools.caption", [f"--workdir={run}", photo], {"mode": "subprocess"}))
  cases = []
  for i, (entry, argv, kw) in enumerate(each):
    cases.append(_case(f"baseline {i} {entry}", "baseline", entry, argv, baseline=True, expect=[0, 1, 2], **kw))
  return cases


def controls(root) -> list[dict]:
  """Children that do what the corpus must never make a command do: the judge must flag each (a harness that
  could not see code run, a traceback, a write outside or memory would pass anything)."""
  marker = os.path.join(root, "markers", "control")
  sentinel = _write(os.path.join(root, "outside", "control_sentinel"), "untouched\n")
  each = {
    "control: code runs": (f"open({marker!r}, 'w').close()", {"markers": [marker]}),
    "control: traceback": ("raise ValueError('boom')", {}),
    "control: writes outside": (f"open({sentinel!r}, 'w').write('changed')", {"sentinels": [sentinel]}),
    "control: memory": ("import numpy; x = numpy.ones(800 << 20, numpy.uint8)", {}),
    "control: creates a folder": (f"import os; os.makedirs({os.path.join(root, 'outside', 'made')!r})", {}),
  }
  cases = []
  for name, (code, kw) in each.items():
    kw = dict(kw)
    if "folder" in name:
      kw["absent"] = [os.path.join(root, "outside", "made")]
    cases.append(_case(name, "control", "vlrep.interop.import_run", [], control=code, expect=[2], **kw))
  return cases


def write_corpus(root) -> list[dict]:
  """Writes the whole corpus under `root`; its cases, every one of them a file or folder crafted here."""
  root = os.path.abspath(os.fspath(root))
  os.makedirs(os.path.join(root, "markers"), exist_ok=True)
  base = base_run(root)
  cases = []
  for generate in (pickle_payloads, numpy_dtype_trick, memory_bombs, malformed_safetensors, garbage_files):
    cases += generate(root)
  cases += malformed_mmf(root) + prepare_sources(root) + run_folders(root, base)
  cases += hugging_face_folders(root) + shared_folders(root, base) + baselines(root, base) + controls(root)
  # import_run's cases name their format in the label; the others: the entry point.
  for case in cases:
    case.setdefault("mode", "fork")
  return cases


# ------------------------------------------------------------------------------------------------------------------
# Judging the results; the tables.
# ------------------------------------------------------------------------------------------------------------------
def _group(case: dict) -> str:
  """Whose baseline a case's memory is measured against: its command's (forked children share the driver's
  imports), or that of a real `python -m` process."""
  return "python -m" if case.get("mode") == "subprocess" else case["entry"]


def judge(cases: list[dict], results: list[dict], controls: bool = False) -> list[dict]:
  """One row per case (the controls' with `controls`): what it did, and why it fails (empty when it passes)."""
  by_name = {r["name"]: r for r in results}
  baseline: dict[str, int] = {}
  for case in cases:
    if case.get("baseline") and case["name"] in by_name:
      baseline[_group(case)] = max(baseline.get(_group(case), 0), by_name[case["name"]]["maxrss_kb"])
  rows = []
  for case in cases:
    if case.get("baseline") or bool(case.get("control")) != controls:
      continue
    r = by_name.get(case["name"])
    if r is None:
      rows.append({"case": case["name"], "entry": case["label"], "why": ["not run (the driver died?)"]})
      continue
    delta_mb = (r["maxrss_kb"] - baseline[_group(case)]) / 1024
    why = []
    if r["killed"]:
      why.append(f"killed: {r['killed']}")
    elif r["rc"] not in case["expect"]:
      why.append(f"exit {r['rc']}" + (" (signal)" if r["rc"] < 0 else ""))
    if r["traceback"]:
      why.append("traceback")
    if r["rc"] == 2 and "ERROR" not in r["log_tail"]:
      why.append("no ERROR message")
    if r["rc"] == 2 and case.get("names") and case["names"] not in r["log_tail"]:
      why.append("message does not name the file")
    if r["markers_found"]:
      why.append("MARKER: code ran")
    if r["absent_found"]:
      why.append("wrote " + ", ".join(os.path.basename(p) for p in r["absent_found"]))
    if r.get("forbidden_found"):
      why.append("carried " + "; ".join(r["forbidden_found"])[:200])
    if r["sentinels_changed"]:
      why.append("OVERWROTE a file outside")
    if delta_mb > MARGIN_MB or r["killed"] and "RSS" in r["killed"]:
      why.append(f"memory +{delta_mb:.0f} MB")
    rows.append(
      {
        "case": case["name"],
        "kind": case["kind"],
        "entry": case["label"],
        "rc": r["rc"],
        "traceback": r["traceback"],
        "delta_mb": round(delta_mb),
        "seconds": r["seconds"],
        "why": why,
        "bug": case.get("bug", ""),
        "last_line": _last_line(r["log_tail"]),
      }
    )
  return rows


def _last_line(text: str) -> str:
  lines = [ln for ln in text.strip().splitlines() if ln.strip()]
  return lines[-1][:160] if lines else ""


def failure_table(rows: list[dict]) -> str:
  """The failing cases as a Markdown table."""
  failing = [r for r in rows if r["why"]]
  lines = [
    f"{len(failing)} of {len(rows)} cases fail.",
    "",
    "| case | entry point | exit | traceback | RSS delta MB | why | last line of output |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in failing:
    cells = [r["case"], r["entry"], r.get("rc", ""), "yes" if r.get("traceback") else "no", r.get("delta_mb", "")]
    why = "; ".join(r["why"]) + (f" (KNOWN BUG, not fixed yet: {r['bug']})" if r.get("bug") else "")
    cells += [why, r.get("last_line", "").replace("|", "/")]
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def crafted_inputs(cases: list[dict]) -> set[str]:
  """The distinct crafted files and folders the cases attack with."""
  return {c["target"] for c in cases if c.get("target")}


def corpus_table(cases: list[dict]) -> str:
  """Case kinds x entry points, with counts: the table docs/reliability.md shows."""
  cases = [c for c in cases if not c.get("baseline") and not c.get("control")]
  kinds = list(dict.fromkeys(c["kind"] for c in cases))
  entries = list(dict.fromkeys(c["label"] + (" (python -m)" if c.get("mode") == "subprocess" else "") for c in cases))
  count = collections.Counter(
    (c["kind"], c["label"] + (" (python -m)" if c.get("mode") == "subprocess" else "")) for c in cases
  )
  lines = ["| entry point | " + " | ".join(kinds) + " | total |", "|---|" + "---|" * (len(kinds) + 1)]
  for e in entries:
    cells = [str(count[(k, e)] or "") for k in kinds]
    lines.append(f"| `{e}` | " + " | ".join(cells) + f" | {sum(count[(k, e)] for k in kinds)} |")
  totals = [str(sum(count[(k, e)] for e in entries)) for k in kinds]
  lines.append("| total | " + " | ".join(totals) + f" | {len(cases)} |")
  return "\n".join(lines)


if __name__ == "__main__":
  driver(sys.argv[1], sys.argv[2])
