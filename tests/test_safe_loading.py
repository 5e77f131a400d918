"""Loading a foreign file runs nothing in it: crafted attack files of every kind, through every route that reads one.

Every payload here is live: unpickled by a plain `pickle.loads` (or `torch.load(weights_only=False)`) it creates a
marker file. Each route must refuse it where the pickle asks for the callable, with an error naming the file and
the global (vlrep.torch_files.UnsafeFile), and the marker must not appear. The kinds: a bare pickle; a
legacy-format
torch file with the payload in each of its five pickles (magic number, protocol, system info, object, storage
keys), among them a valid legacy ResNet-18 whose storage-key list is the payload; a zip-format file with the
payload inside its data.pkl or as the whole data.pkl; an MMF training checkpoint with a payload entry; a Hugging
Face BERT folder whose pytorch_model.bin is any of those; an MMF `_info.npy`; and a run directory (what
`vlrep.evaluate` and `vlrep.main --config.init_from` read) whose every file is a payload. The payloads reach their
callable by each pickle opcode that can name one (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT1) and call os.system,
builtins.exec and subprocess.check_call.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import io
import json
import os
import pickle
import pickletools
import re
import shutil
import subprocess
import zipfile

import numpy as np
import pytest
import torch
from conftest import ROOT, run_module

from vlrep import runs, torch_files
from vlrep.data import region_files
from vlrep.errors import BadFile
from vlrep.interop import import_run
from vlrep.models import bert
from vlrep.pytorch.resnet import ResNet as TorchResNet

FORMATS = ("torchvision", "virtex", "visual_bert", "auto")


class _Call:
  """An object whose unpickling calls func(*args): a payload."""

  def __init__(self, func, *args):
    self.func, self.args = func, args

  def __reduce__(self):
    return self.func, self.args


def _payloads(marker) -> dict[str, tuple[bytes, str]]:
  """{kind: (pickle bytes, the global it asks for)}: each creates `marker` when a plain unpickler reads it."""
  m = str(marker)
  touch = _Call(os.system, f"touch {m}")
  return {
    "GLOBAL os.system": (pickle.dumps(touch, protocol=2), "posix.system"),
    "STACK_GLOBAL os.system": (pickle.dumps(touch, protocol=4), "posix.system"),
    "builtins.exec": (pickle.dumps(_Call(exec, f"open({m!r}, 'w').close()"), protocol=2), "builtins.exec"),
    "subprocess": (pickle.dumps(_Call(subprocess.check_call, ["touch", m]), protocol=3), "subprocess.check_call"),
    "INST": (f"(S'touch {m}'\nios\nsystem\n.".encode(), "os.system"),  # protocol 0's instance opcode
    "OBJ": (f"(cos\nsystem\nS'touch {m}'\no.".encode(), "os.system"),  # protocol 1's
  }


def _legacy_parts(data: bytes) -> tuple[list[bytes], bytes]:
  """A legacy torch file's five pickles (magic number, protocol, system info, object, storage keys) and the storage
  bytes after them."""
  f, parts = io.BytesIO(data), []
  for _ in range(5):
    start = f.tell()
    for _op in pickletools.genops(f):  # stops after the pickle's STOP
      pass
    parts.append(data[start : f.tell()])
  return parts, data[f.tell() :]


LEGACY_SLOTS = ("magic number", "protocol version", "system info", "object's pickle", "storage keys")


def _legacy_bytes(obj) -> bytes:
  buf = io.BytesIO()
  torch.save(obj, buf, _use_new_zipfile_serialization=False)
  return buf.getvalue()


def _small_state_dict():
  return collections.OrderedDict(weight=torch.arange(6.0).reshape(2, 3), bias=torch.ones(2))


def _zip_with_data_pkl(payload: bytes) -> bytes:
  """A real zip-format torch file whose data.pkl is replaced by `payload`."""
  src, out = io.BytesIO(), io.BytesIO()
  torch.save(_small_state_dict(), src)
  with zipfile.ZipFile(src) as a, zipfile.ZipFile(out, "w") as b:
    for name in a.namelist():
      b.writestr(name, payload if name.endswith("/data.pkl") else a.read(name))
  return out.getvalue()


@pytest.fixture(scope="module")
def resnet18_legacy(tmp_path_factory):
  """A valid legacy-format ResNet-18 state dict (torchvision's names and shapes) and the state dict."""
  torch.manual_seed(0)
  sd = TorchResNet(18).state_dict()
  path = tmp_path_factory.mktemp("r18") / "resnet18_legacy.pth"
  torch.save(sd, path, _use_new_zipfile_serialization=False)
  return path, sd


def _crafted_files(directory, marker, payload: bytes, resnet18: bytes) -> dict[str, str]:
  """{kind: path} of every kind of crafted file around one payload."""
  os.makedirs(directory, exist_ok=True)
  files = {"bare pickle": payload}
  parts, storages = _legacy_parts(_legacy_bytes(_small_state_dict()))
  for i, slot in enumerate(LEGACY_SLOTS):
    files[f"legacy, {slot}"] = b"".join(parts[:i] + [payload] + parts[i + 1 :]) + storages
  parts, storages = _legacy_parts(resnet18)
  files["legacy resnet18, storage keys"] = b"".join(parts[:4] + [payload]) + storages
  files["zip, whole data.pkl"] = _zip_with_data_pkl(payload)
  paths = {}
  for kind, data in files.items():
    paths[kind] = os.path.join(directory, re.sub(r"\W+", "_", kind) + ".pth")
    with open(paths[kind], "wb") as f:
      f.write(data)
  # Written by torch's own pickler: a payload inside an otherwise valid checkpoint (an MMF training checkpoint's
  # layout: the state dict under 'model', the trainer's objects beside it), in both formats.
  mmf = {"model": _small_state_dict(), "trainer": _Call(os.system, f"touch {marker}"), "num_updates": 88000}
  for legacy in (False, True):
    kind = f"{'legacy' if legacy else 'zip'}, MMF checkpoint entry"
    paths[kind] = os.path.join(directory, re.sub(r"\W+", "_", kind) + ".pth")
    torch.save(mmf, paths[kind], _use_new_zipfile_serialization=not legacy)
  return paths


def _bert_folder(directory, weights: str) -> str:
  """A Hugging Face BERT folder (config.json, vocab.txt) whose pytorch_model.bin is `weights`."""
  os.makedirs(directory)
  config = dict(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
  config.update(hidden_act="gelu", max_position_embeddings=16, model_type="bert")
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(directory, "vocab.txt"), "w") as f:
    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]) + "\n")
  shutil.copyfile(weights, os.path.join(directory, "pytorch_model.bin"))
  return directory


def _assert_refused(call, path, asks: str, marker) -> None:
  with pytest.raises(torch_files.UnsafeFile) as e:
    call()
  assert str(path) in str(e.value) and f"asks for {asks}," in str(e.value), str(e.value)
  assert "Nothing in it was run" in str(e.value)
  assert not os.path.exists(marker)


# ------------------------------------------------------------------------------------------------------------------
# The payloads are live, and the files are otherwise what they claim to be.
# ------------------------------------------------------------------------------------------------------------------
def test_the_payloads_run_code_when_unpickled_plainly(tmp_path, resnet18_legacy):
  marker = tmp_path / "pwned"
  for kind, (payload, _) in _payloads(marker).items():
    pickle.loads(payload)
    assert marker.exists(), kind
    marker.unlink()
  # In a legacy file's system-info slot, torch.load without weights_only runs it (what plain pickle.load did here).
  parts, storages = _legacy_parts(_legacy_bytes(_small_state_dict()))
  path = tmp_path / "sys_info.pth"
  path.write_bytes(b"".join(parts[:2] + [_payloads(marker)["GLOBAL os.system"][0]] + parts[3:]) + storages)
  with contextlib.suppress(Exception):  # whatever torch makes of os.system's return value as the system info
    torch.load(path, weights_only=False)
  assert marker.exists()
  marker.unlink()
  # The splitter cuts a legacy file into its five pickles: put back together, the ResNet-18 loads to its tensors.
  path, sd = resnet18_legacy
  parts, storages = _legacy_parts(path.read_bytes())
  assert b"".join(parts) + storages == path.read_bytes()
  assert pickle.loads(parts[0]) == 0x1950A86A20F9469CFC6C and pickle.loads(parts[1]) == 1001
  got = torch_files.load_state_dict(str(path))
  assert got.keys() == sd.keys() and len(pickle.loads(parts[4])) == len(sd)
  for k, v in sd.items():
    np.testing.assert_array_equal(got[k], v.numpy(), err_msg=k)


# ------------------------------------------------------------------------------------------------------------------
# Every payload in every kind of file: refused by the one restricted unpickler.
# ------------------------------------------------------------------------------------------------------------------
def test_every_payload_in_every_kind_of_file_is_refused_naming_the_file_and_the_global(tmp_path, resnet18_legacy):
  marker = tmp_path / "pwned"
  resnet18 = resnet18_legacy[0].read_bytes()
  for payload_kind, (payload, asks) in _payloads(marker).items():
    paths = _crafted_files(tmp_path / re.sub(r"\W+", "_", payload_kind), marker, payload, resnet18)
    for file_kind, path in paths.items():
      wants = "posix.system" if "MMF" in file_kind else asks  # torch pickled these entries itself
      _assert_refused(lambda path=path: torch_files.load_checkpoint(path), path, wants, marker)
    # The legacy slot is named in the error.
    with pytest.raises(torch_files.UnsafeFile, match=r"system_info\.pth \(the system info\) asks for "):
      torch_files.load_checkpoint(paths["legacy, system info"])


def test_an_extension_code_names_its_callable_and_is_refused_too(tmp_path):
  marker = tmp_path / "pwned"
  copyreg.add_extension("posix", "system", 0xF1)  # EXT1: the callable named by a registered number
  try:
    payload = pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=2)
    assert any(op.name == "EXT1" for op, _, _ in pickletools.genops(payload))
    path = tmp_path / "ext.pth"
    path.write_bytes(payload)
    _assert_refused(lambda: torch_files.load_checkpoint(str(path)), path, "posix.system", marker)
  finally:
    copyreg.remove_extension("posix", "system", 0xF1)


# ------------------------------------------------------------------------------------------------------------------
# Every route that reads a foreign file.
# ------------------------------------------------------------------------------------------------------------------
def test_import_run_and_the_bert_folder_loader_refuse_every_kind(tmp_path, resnet18_legacy):
  marker = tmp_path / "pwned"
  payload, asks = _payloads(marker)["GLOBAL os.system"]
  paths = _crafted_files(tmp_path / "files", marker, payload, resnet18_legacy[0].read_bytes())
  for kind, path in paths.items():
    workdir = tmp_path / "run"
    for fmt in FORMATS:
      call = lambda fmt=fmt, path=path: import_run.import_run(fmt, path, str(workdir))
      _assert_refused(call, path, asks, marker)
      assert not workdir.exists() and not os.path.exists(f"{workdir}.importing"), (kind, fmt)
    # The BERT folder loader of ICMLM / VisualBERT / ViLBERT configs (method.bert_path), and the folder import.
    folder = _bert_folder(tmp_path / re.sub(r"\W+", "_", kind), path)
    weights = os.path.join(folder, "pytorch_model.bin")
    _assert_refused(lambda folder=folder: bert.load_pretrained(folder), weights, asks, marker)
    _assert_refused(lambda folder=folder: bert.read_state_dict(folder), weights, asks, marker)
    call = lambda folder=folder: import_run.import_run("visual_bert", folder, str(workdir))
    _assert_refused(call, weights, asks, marker)


def _cli_import(fmt, checkpoint, workdir):
  return run_module("vlrep.interop.import_run", f"--format={fmt}", f"--checkpoint={checkpoint}", f"--workdir={workdir}")


def test_the_reported_files_are_refused_by_the_import_command(tmp_path, resnet18_legacy):
  # The three files that ran code through `python -m vlrep.interop.import_run --format=torchvision` (or auto), and a
  # BERT
  # folder through --format=visual_bert, a zip-format payload through --format=virtex.
  marker = tmp_path / "pwned"
  payload, asks = _payloads(marker)["GLOBAL os.system"]
  paths = _crafted_files(tmp_path / "files", marker, payload, resnet18_legacy[0].read_bytes())
  cases = [
    (fmt, paths[kind], paths[kind])
    for kind in ("bare pickle", "legacy, system info", "legacy resnet18, storage keys")
    for fmt in ("torchvision", "auto")
  ]
  folder = _bert_folder(tmp_path / "bert", paths["zip, MMF checkpoint entry"])
  cases += [
    ("virtex", paths["zip, whole data.pkl"], paths["zip, whole data.pkl"]),
    ("visual_bert", folder, os.path.join(folder, "pytorch_model.bin")),
  ]
  for fmt, checkpoint, named in cases:
    proc = _cli_import(fmt, checkpoint, tmp_path / "run")
    assert proc.returncode != 0 and not marker.exists(), (fmt, checkpoint, proc.stderr[-2000:])
    assert f"{named}" in proc.stderr and f"asks for {asks}," in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_the_import_command_exits_2_without_a_traceback(tmp_path):
  marker = tmp_path / "pwned"
  path = tmp_path / "bare.pth"
  path.write_bytes(_payloads(marker)["GLOBAL os.system"][0])
  proc = _cli_import("torchvision", path, tmp_path / "run")
  assert not marker.exists() and f"{path} (its first pickle, the magic number) asks for posix.system" in proc.stderr
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_the_region_conversion_command_exits_2_on_a_payload_info_file(tmp_path):
  marker = tmp_path / "pwned"
  src = tmp_path / "mmf"
  src.mkdir()
  np.save(src / "1.npy", np.zeros((2, 2048), np.float32))
  with open(src / "1_info.npy", "wb") as f:  # an object-array .npy header, then the payload as its pickle
    np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
    f.write(_payloads(marker)["GLOBAL os.system"][0])
  proc = run_module("vlrep.tools.convert_regions", "--format=mmf", f"--src={src}", f"--dst={tmp_path / 'out'}")
  assert not marker.exists() and "asks for posix.system" in proc.stderr, proc.stderr[-2000:]
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_mmf_region_conversion_refuses_a_payload_info_file(tmp_path):
  marker = tmp_path / "pwned"
  src, dst = tmp_path / "mmf", tmp_path / "out"
  src.mkdir()
  info = {"bbox": np.array([[0, 0, 10, 10], [5, 5, 20, 20]], np.float32), "num_boxes": 2}
  info.update(image_width=20, image_height=40, cls_prob=np.eye(2, 3, dtype=np.float32))
  np.save(src / "42.npy", np.ones((2, 8), np.float32))
  np.save(src / "42_info.npy", info, allow_pickle=True)
  # A features file that is a pickle: np.load without allow_pickle reads no pickle; a counted skip.
  np.save(src / "43.npy", np.array(_Call(os.system, f"touch {marker}"), dtype=object), allow_pickle=True)
  np.save(src / "43_info.npy", info, allow_pickle=True)
  assert region_files.convert_mmf(str(src), str(dst)) == {"converted": 1, "skipped_no_info": 0, "skipped_bad": 1}
  assert not marker.exists()
  for kind, (payload, asks) in _payloads(marker).items():
    evil = src / "44_info.npy"
    np.save(src / "44.npy", np.ones((2, 8), np.float32))
    with open(evil, "wb") as f:  # an object-array .npy header, then the payload as its pickle
      np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
      f.write(payload)
    if kind == "GLOBAL os.system":
      np.load(evil, allow_pickle=True)  # numpy's own allow_pickle load runs it
      assert marker.exists()
      marker.unlink()
    _assert_refused(lambda: region_files.convert_mmf(str(src), str(dst)), evil, asks, marker)


def test_evaluate_and_init_from_read_no_pickle_of_a_poisoned_run(tmp_path):
  """`vlrep.evaluate --workdir` and `vlrep.main --config.init_from` read vlrep run directories (orbax: JSON and
  tensorstore, no pickle). A real imported run with every file replaced by a payload: each a clear error, nothing
  runs."""
  marker = tmp_path / "pwned"
  torch.save(TorchResNet(18, 8).state_dict(), tmp_path / "r18w8.pth")
  good = tmp_path / "good"
  import_run.import_run("torchvision", str(tmp_path / "r18w8.pth"), str(good))
  assert runs.read_config(str(good)).method.backbone  # the real layout, readable before it is poisoned
  poisoned = tmp_path / "poisoned"
  shutil.copytree(good, poisoned)
  payload = _payloads(marker)["GLOBAL os.system"][0]
  files = [os.path.join(d, f) for d, _, fs in os.walk(poisoned) for f in fs]
  assert len(files) > 5
  for path in files:
    with open(path, "wb") as f:
      f.write(payload)
  with pytest.raises(RuntimeError, match=re.escape(f"No checkpoint of {poisoned} restores")):
    runs.load_run(str(poisoned))
  proc = run_module("vlrep.evaluate", "--config=configs/eval/voc07_svm.py", f"--workdir={poisoned}")
  assert proc.returncode != 0 and f"No checkpoint of {poisoned} restores" in proc.stderr, proc.stderr[-2000:]
  proc = run_module(
    "vlrep.main",
    "--config=tests/tiny_finetune.py",
    f"--config.init_from={poisoned}",
    f"--workdir={tmp_path / 'ft'}",
  )
  assert proc.returncode != 0 and f"No checkpoint of {poisoned} has a readable config" in proc.stderr
  assert not marker.exists()


# ------------------------------------------------------------------------------------------------------------------
# The table's own callables take no arguments they should not, and tensors stay inside their storages.
# ------------------------------------------------------------------------------------------------------------------
def _zip_of(pickle_bytes: bytes, storages: dict[str, bytes]) -> bytes:
  out = io.BytesIO()
  with zipfile.ZipFile(out, "w") as z:
    z.writestr("archive/data.pkl", pickle_bytes)
    for key, raw in storages.items():
      z.writestr(f"archive/data/{key}", raw)
  return out.getvalue()


# The archive's storage '0' (4 float32 elements), by persistent id as torch.save writes it.
_STORAGE_0 = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"


def _tensor_pickle(offset: int, size, stride, storage: bytes = _STORAGE_0) -> bytes:
  """A hand-written data.pkl: {'x': _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())}."""
  ints = lambda xs: b"(" + b"".join(b"K" + bytes([x]) for x in xs) + b"t"
  return (
    b"\x80\x02}X\x01\x00\x00\x00xctorch._utils\n_rebuild_tensor_v2\n("
    + storage
    + b"K"
    + bytes([offset])
    + ints(size)
    + ints(stride)
    + b"\x89ccollections\nOrderedDict\n)RtRs."
  )


def test_allowed_callables_check_their_arguments(tmp_path):
  path = tmp_path / "t.pth"
  floats = np.arange(4, dtype=np.float32).tobytes()
  path.write_bytes(_zip_of(_tensor_pickle(1, (3,), (1,)), {"0": floats}))
  np.testing.assert_array_equal(torch_files.load_checkpoint(str(path))["x"], [1, 2, 3])  # the hand-written form
  for size, stride in (((4,), (1,)), ((2, 2), (3, 1)), ((2,), (200,))):  # past the storage's end: never read
    path.write_bytes(_zip_of(_tensor_pickle(1, size, stride), {"0": floats}))
    with pytest.raises(ValueError, match=r"t\.pth: a tensor reaches element \d+ of a storage of 4 elements"):
      torch_files.load_checkpoint(str(path))
  # A storage the pickle built itself (a numpy array) instead of one of the archive's.
  own = pickle.dumps(np.zeros(1000, np.float32), protocol=2)[2:-1]  # the array's opcodes, without PROTO / STOP
  path.write_bytes(_zip_of(_tensor_pickle(0, (2,), (1,), own), {}))
  with pytest.raises(ValueError, match="not one of the archive's"):
    torch_files.load_checkpoint(str(path))
  # protocol 2's bytes come through _codecs.encode: latin-1 text only, not another codec.
  for encoding, ok in (("latin1", True), ("rot13", False), ("zlib", False)):
    data = b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00abX" + bytes([len(encoding), 0, 0, 0]) + encoding.encode()
    path.write_bytes(_zip_of(data + b"\x86R.", {}))
    if ok:
      assert torch_files.load_checkpoint(str(path)) == b"ab"
    else:
      with pytest.raises(ValueError, match="only latin-1 text"):
        torch_files.load_checkpoint(str(path))
  # A legacy file whose storage keys name a storage no tensor uses, or whose storage bytes are cut short.
  parts, storages = _legacy_parts(_legacy_bytes(_small_state_dict()))
  path.write_bytes(b"".join(parts[:4] + [pickle.dumps(["elsewhere"], protocol=2)]) + storages)
  with pytest.raises(ValueError, match="are not the storages its tensors use"):
    torch_files.load_checkpoint(str(path))
  path.write_bytes(b"".join(parts) + storages[:-3])
  with pytest.raises(ValueError, match="is truncated"):
    torch_files.load_checkpoint(str(path))
  # Numpy arrays and containers (a Detectron2-style pickle; MMF's info files) rebuild; ndarray from protocol 2 too.
  want = {"model": {"w": np.arange(3.0)}, "__author__": "x", "tags": {1, 2}, "blob": b"\x00\xff"}
  for protocol in (2, 3, 4, 5):
    got = torch_files.load_pickle(io.BytesIO(pickle.dumps(want, protocol=protocol)), "d2.pkl")
    np.testing.assert_array_equal(got["model"]["w"], want["model"]["w"])
    assert got["tags"] == {1, 2} and got["blob"] == b"\x00\xff" and got["__author__"] == "x"


def test_the_docs_name_every_global_the_unpickler_allows():
  with open(os.path.join(ROOT, "docs", "interop.md")) as f:
    doc = f.read()
  assert "inert placeholder" not in doc
  paragraph = doc[doc.index("**Loading is safe.**") :].split("\n\n")[0]
  table = torch_files._safe_globals("x.pth", rebuild_tensor=lambda *args: None)
  for module, name in table:
    assert f"`{name}`" in paragraph or f".{name}`" in paragraph or name.endswith("Storage"), (module, name)
  assert "`torch.FloatStorage`" in paragraph and "UnsafeFile" in paragraph and "`.safetensors`" in paragraph


# ------------------------------------------------------------------------------------------------------------------
# What legitimate checkpoints hold still loads.
# ------------------------------------------------------------------------------------------------------------------
class _WarmupLR(torch.optim.lr_scheduler.LambdaLR):
  """A scheduler whose multiplier is a bound method, as VirTex's LinearWarmupCosineWithDecayLR."""

  def __init__(self, optimizer, warmup: int):
    self.warmup = warmup
    super().__init__(optimizer, self._multiplier)

  def _multiplier(self, step):
    return min(1.0, (step + 1) / self.warmup)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_training_checkpoints_with_optimizer_scheduler_and_scaler_state_load(tmp_path, legacy):
  torch.manual_seed(0)
  model = TorchResNet(18, 8)
  sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
  adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
  scheduler = _WarmupLR(sgd, warmup=10)
  for i, p in enumerate(model.parameters()):  # gradients without a forward pass: the step fills the state
    p.grad = torch.full_like(p, 0.01 * i)
  sgd.step(), adamw.step(), scheduler.step()
  tagged = torch.ones(2)
  tagged.note = "a tensor with a Python attribute"  # pickled through torch._tensor._rebuild_from_type_v2
  ckpt = {  # VirTex's CheckpointManager layout, plus what other trainers keep
    "model": model.state_dict(),
    "optimizer": sgd.state_dict(),
    "adamw": adamw.state_dict(),
    "scheduler": scheduler.state_dict(),
    "scaler": torch.amp.GradScaler("cpu").state_dict(),
    "iteration": 1,
    "extra": {"size": torch.Size([2, 3]), "tagged": tagged, "param": torch.nn.Parameter(torch.zeros(3))},
  }
  path = tmp_path / "ckpt.pth"
  torch.save(ckpt, path, _use_new_zipfile_serialization=not legacy)
  got = torch_files.load_checkpoint(str(path))
  sd = torch_files.load_state_dict(str(path))
  assert sd.keys() == ckpt["model"].keys()
  for k, v in ckpt["model"].items():
    np.testing.assert_array_equal(sd[k], v.numpy(), err_msg=k)
  momentum = got["optimizer"]["state"][0]["momentum_buffer"]
  np.testing.assert_array_equal(momentum, sgd.state_dict()["state"][0]["momentum_buffer"].numpy())
  assert got["optimizer"]["param_groups"][0]["nesterov"] is True
  assert int(got["adamw"]["state"][0]["step"]) == 1 and got["scheduler"]["last_epoch"] == 1
  assert got["extra"]["size"] == (2, 3) and list(got["extra"]["tagged"]) == [1, 1]


# ------------------------------------------------------------------------------------------------------------------
# numpy values: every plain dtype rebuilds as numpy pickles it; nothing else does (vlrep builds the dtype and the
# array, numpy never sees a dtype state or raw bytes it could misread).
# ------------------------------------------------------------------------------------------------------------------
class _Reduce:
  """An object whose pickle is exactly `reduce` (a crafted numpy value)."""

  def __init__(self, *reduce):
    self.reduce = reduce

  def __reduce__(self):
    return self.reduce


_PLAIN = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
_PLAIN += (np.float16, np.float32, np.float64, np.complex64, np.complex128)


def test_numpy_arrays_and_scalars_of_every_plain_dtype_rebuild_in_every_protocol():
  rng = np.random.default_rng(0)
  for dtype in _PLAIN:
    values = {
      "0-d": np.asarray(rng.integers(0, 100)).astype(dtype),
      "1-d": rng.integers(0, 100, size=5).astype(dtype),
      "F order": np.asfortranarray(rng.integers(0, 100, size=(2, 3)).astype(dtype)),
      "empty": np.zeros((0, 4), dtype),
      "scalar": np.asarray(rng.integers(0, 100)).astype(dtype)[()],
      "big-endian": rng.integers(0, 100, size=3).astype(np.dtype(dtype).newbyteorder(">")),
    }
    for protocol in (2, 3, 4, 5):
      # (protocol 2 pickles an empty array's b'' as builtins.bytes(), a global outside the table)
      values = {k: v for k, v in values.items() if protocol > 2 or v.size}
      got = torch_files.load_pickle(io.BytesIO(pickle.dumps(values, protocol=protocol)), "v.pkl")
      for kind, want in values.items():
        assert type(got[kind]) is type(want) and got[kind].dtype == want.dtype, (dtype, protocol, kind)
        np.testing.assert_array_equal(got[kind], want, err_msg=f"{dtype} {protocol} {kind}")
  # np.save of a dict (MMF's info files): a 0-d object array, the one object array built (from its one item).
  got = torch_files.load_pickle(io.BytesIO(pickle.dumps(np.array({"a": np.ones(2)}, dtype=object))), "info.npy")
  assert got.shape == () and got.dtype == object and set(got.item()) == {"a"}


def test_numpy_values_that_are_not_plain_numbers_are_refused_before_numpy_builds_them(tmp_path):
  reconstruct = np.zeros(()).__reduce__()[0]
  void_with_object = _Reduce(np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0))
  f8_with_fields = _Reduce(np.dtype, ("f8", False, True), (3, "<", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0))
  raw_array = lambda dtype, shape, raw: _Reduce(reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dtype, False, raw))
  cases = {
    "unicode": (np.array(["ab"]), "numpy dtype 'U2'"),
    "bytes": (np.array([b"ab"]), "numpy dtype 'S2'"),
    "structured": (np.zeros(2, "i4,f4"), "numpy dtype"),
    "datetime": (np.array(["2020-01-01"], "datetime64[D]"), "numpy dtype 'M8'"),
    "object 1-d": (np.array([1, "a"], dtype=object), "object array of shape (2,)"),
    "the dtype trick": (raw_array(void_with_object, (1,), bytes(8)), "numpy dtype 'V8'"),
    "a float dtype given fields": (raw_array(f8_with_fields, (1,), bytes(8)), "not a plain dtype's"),
    "more elements than bytes": (raw_array(np.dtype("f8"), (1000,), bytes(8)), "from 8 bytes of data"),
    "an object array from bytes": (raw_array(np.dtype("O"), (), bytes(8)), "object array of shape ()"),
    "_reconstruct allocating": (_Reduce(reconstruct, (np.ndarray, (2**28,), b"O")), "numpy's _reconstruct of"),
    "a scalar of the wrong size": (_Reduce(np.float64(0).__reduce__()[0], (np.dtype("f8"), b"abc")), "from 3 bytes"),
  }
  for name, (value, words) in cases.items():
    data = pickle.dumps(value, protocol=2)
    with pytest.raises(BadFile) as e:
      torch_files.load_pickle(io.BytesIO(data), f"{name}.pkl")
    assert str(e.value).startswith(f"{name}.pkl") and words in str(e.value), (name, str(e.value))
  # pickle's BUILD on a callable of the table (numpy.dtype itself) sets nothing: refused.
  with pytest.raises(BadFile, match="sets the state of _Callable"):
    torch_files.load_pickle(io.BytesIO(b"\x80\x02cnumpy\ndtype\n}b."), "build.pkl")
  # The same checks hold for the MMF info files' loader.
  path = tmp_path / "1_info.npy"
  with open(path, "wb") as f:
    np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
    f.write(pickle.dumps(raw_array(void_with_object, (1,), bytes(8)), protocol=2))
  with pytest.raises(BadFile, match=re.escape(f"{path}: a numpy dtype 'V8'")):
    region_files.load_pickled_npy(str(path))
