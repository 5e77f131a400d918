"""Every bad file given to a command is one message and exit status 2 (issue 76, item 5), and a Hugging Face folder's
code hooks are neither imported nor exported (item 6).

The commands, run as `python -m` runs them (their own flags and `app.run` wrappers): `vlrep.interop.import_run` (every
--format) on malformed checkpoints (empty, truncated, random bytes, a zip whose tensor entry is a symlink, an unknown
compression method, an encrypted entry, pickles nested 100000 deep or containing themselves, safetensors headers that
overflow, are not JSON, overlap) and on VisualBERT folders whose config.json or vocab.txt is malformed (not JSON,
not UTF-8, nested too deep, not an object, a zero head count, a size of the wrong type, 100000 layers over a
one-layer checkpoint); `vlrep.evaluate`, `vlrep.tools.caption` and `vlrep.tools.features` on run folders whose
files are malformed (checkpoint truncated, metadata garbage, a saved config that does not build, summary.json not
JSON, a tokenizer that is not a SentencePiece model) and on decompression-bomb and truncated images;
`vlrep.tools.convert_regions` on MMF dumps whose info files are malformed. Each ends with exit 2, stderr's message
starting with 'ERROR:' and naming the file, no traceback. The many cases of one command run in one process
(tests/bad_files_driver.py), so the suite pays one jax import per command.
"""

import glob
import io
import json
import os
import shutil
import struct
import zipfile
import zlib

import numpy as np
import pytest
from conftest import run_module
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from vlrep import runs
from vlrep.interop import import_run
from vlrep.interop.formats import visual_bert
from vlrep.interop.keymaps import ImportedRun, KeyMap


# ------------------------------------------------------------------------------------------------------------------
# Crafted files.
# ------------------------------------------------------------------------------------------------------------------
def _torch_zip(tensors: dict[str, np.ndarray]) -> bytes:
  """A zip-format torch.save file of a float32 state dict, written without torch (the layout torch writes:
  archive/data.pkl naming storages archive/data/<key>, archive/byteorder, archive/version)."""
  body = b"\x80\x02ccollections\nOrderedDict\n)R("
  for i, (name, x) in enumerate(tensors.items()):
    key = str(i).encode()
    storage = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX" + struct.pack("<I", len(key)) + key
    storage += b"X\x03\x00\x00\x00cpu" + b"J" + struct.pack("<i", x.size) + b"tQ"
    size = b"(" + b"".join(b"J" + struct.pack("<i", d) for d in x.shape) + b"t"
    strides = np.array(x.strides) // 4
    stride = b"(" + b"".join(b"J" + struct.pack("<i", int(s)) for s in strides) + b"t"
    rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x00" + size + stride + b"\x89"
    rebuild += b"ccollections\nOrderedDict\n)RtR"
    body += b"X" + struct.pack("<I", len(name)) + name.encode() + rebuild
  body += b"u."
  out = io.BytesIO()
  with zipfile.ZipFile(out, "w") as z:
    z.writestr("archive/data.pkl", body)
    z.writestr("archive/byteorder", "little")
    for i, x in enumerate(tensors.values()):
      z.writestr(f"archive/data/{i}", np.ascontiguousarray(x, "<f4").tobytes())
    z.writestr("archive/version", "3\n")
  return out.getvalue()


def _zip_patch(data: bytes, local_offset: int, central_offset: int, value: int, set_bits: bool = False) -> bytes:
  """`data` (a zip) with a two-byte field of every local and central header set to `value` (or its bits set)."""
  b = bytearray(data)
  for signature, offset in ((b"PK\x03\x04", local_offset), (b"PK\x01\x02", central_offset)):
    i = b.find(signature)
    while i >= 0:
      old = struct.unpack_from("<H", b, i + offset)[0]
      struct.pack_into("<H", b, i + offset, (old | value) if set_bits else value)
      i = b.find(signature, i + 4)
  return bytes(b)


def _zip_replacing(data: bytes, suffix: str, body: bytes, symlink: bool = False) -> bytes:
  """`data` (a zip) with the entry ending in `suffix` replaced by `body` (as a symlink entry if `symlink`)."""
  src, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
  with zipfile.ZipFile(out, "w") as z:
    for info in src.infolist():
      if info.filename.endswith(suffix):
        if symlink:
          info.create_system, info.external_attr = 3, 0o120777 << 16
        z.writestr(info, body)
      else:
        z.writestr(info, src.read(info.filename))
  return out.getvalue()


def _nested_dicts(depth: int) -> bytes:
  return b"\x80\x02" + b"}X\x01\x00\x00\x00a" * depth + b"K\x00" + b"s" * depth + b"."


SELF_REFERENCE = b"\x80\x02}q\x00X\x01\x00\x00\x00ah\x00s."  # {'a': <itself>}


def _safetensors(header: bytes) -> bytes:
  return struct.pack("<Q", len(header)) + header


def malformed_checkpoints(root) -> dict[str, str]:
  """{kind: path} of malformed checkpoint files, each built from a valid small state dict."""
  valid = _torch_zip({"conv1.weight": np.ones((4, 3, 7, 7), np.float32), "bn1.weight": np.ones(4, np.float32)})
  overflow = {"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}
  overlap = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
  overlap["b"] = {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}
  files = {
    "empty.pth": b"",
    "truncated.pth": valid[: len(valid) // 2],
    "random.pth": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
    "zip_symlink.pth": _zip_replacing(valid, "data/0", b"/etc/passwd", symlink=True),
    "zip_method99.pth": _zip_patch(valid, 8, 10, 99),
    "zip_encrypted.pth": _zip_patch(valid, 6, 8, 1, set_bits=True),
    "zip_deep.pth": _zip_replacing(valid, "data.pkl", _nested_dicts(100_000)),
    "zip_self_reference.pth": _zip_replacing(valid, "data.pkl", SELF_REFERENCE),
    "header_huge.safetensors": struct.pack("<Q", 2**63 - 1) + b"{}",
    "header_not_json.safetensors": _safetensors(b"abcdefgh"),
    "shape_overflow.safetensors": _safetensors(json.dumps(overflow).encode()) + bytes(16),
    "overlap.safetensors": _safetensors(json.dumps(overlap).encode()) + bytes(24),
  }
  os.makedirs(root, exist_ok=True)
  paths = {}
  for name, data in files.items():
    paths[name] = os.path.join(root, name)
    with open(paths[name], "wb") as f:
      f.write(data)
  return paths


WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]
BERT = dict(
  vocab_size=len(WORDS),
  hidden_size=8,
  num_hidden_layers=1,
  num_attention_heads=2,
  intermediate_size=16,
  max_position_embeddings=16,
  type_vocab_size=2,
  visual_embedding_dim=4,
  hidden_act="gelu",
  layer_norm_eps=1e-12,
  hidden_dropout_prob=0.1,
  attention_probs_dropout_prob=0.1,
)


def visual_bert_folder(folder, config=None, vocab: bytes | None = None) -> str:
  """A Hugging Face VisualBertForPreTraining folder (model.safetensors, config.json, vocab.txt) of a tiny model,
  built from vlrep's own key map (no torch or transformers needed); `config` replaces config.json's object (a
  dict) or bytes, `vocab` vocab.txt's bytes."""
  os.makedirs(folder, exist_ok=True)
  expected, _ = visual_bert.expected_shapes(BERT, 1, alignment=True)
  rng = np.random.default_rng(0)
  flat = {k: rng.normal(size=shape).astype(np.float32) for k, shape in expected.items()}
  base, heads, mmf = visual_bert.LAYOUTS["huggingface"]
  sd = KeyMap("VisualBERT", visual_bert.visual_bert_rules(base, heads, mmf)).to_foreign(flat)
  for copy, source in visual_bert.tied(base, heads).items():
    sd[copy] = sd[source].copy()
  save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, os.path.join(folder, "model.safetensors"))
  if config is None:
    config = {"model_type": "visual_bert", "architectures": ["VisualBertForPreTraining"], **BERT}
  with open(os.path.join(folder, "config.json"), "wb") as f:
    f.write(config if isinstance(config, bytes) else json.dumps(config).encode())
  with open(os.path.join(folder, "vocab.txt"), "wb") as f:
    f.write(vocab if vocab is not None else ("\n".join(WORDS) + "\n").encode())
  return str(folder)


def _png(width: int, height: int) -> bytes:
  """A valid 1-bit greyscale PNG of width x height black pixels: a few KB for any size."""
  chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
  row = b"\x00" + bytes((width + 7) // 8)
  compressor = zlib.compressobj(9)
  idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
  header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _random_png() -> bytes:
  from PIL import Image

  out = io.BytesIO()
  Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(out, "PNG")
  return out.getvalue()


def bad_images(root) -> dict[str, str]:
  """Decompression bombs (between PIL's warning and error bounds, and beyond), a truncated and a text file."""
  os.makedirs(root, exist_ok=True)
  files = {
    "bomb_warning.png": _png(12_000, 8_000),  # 96 M pixels: PIL only warns (1x-2x its bound) and would decode
    "bomb_error.png": _png(20_000, 10_000),  # 200 M pixels: PIL refuses on open
    "truncated.png": _random_png()[:2000],
    "text.jpg": b"not an image",
  }
  paths = {}
  for name, data in files.items():
    paths[name] = os.path.join(root, name)
    with open(paths[name], "wb") as f:
      f.write(data)
  return paths


def _resnet_run(workdir, config: dict) -> str:
  """A run folder with a ResNet-10 (width 8) backbone, written as vlrep.interop.import_run writes runs."""
  import jax
  import jax.numpy as jnp

  from vlrep.models import resnet

  net = resnet.ResNet(depth=10, width=8)
  variables = jax.tree.map(np.asarray, net.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), False))
  params = {"backbone": variables["params"]}
  state = {"batch_stats": {"backbone": variables["batch_stats"]}}
  import_run.write_run(str(workdir), ImportedRun(ConfigDict(config), params, state, {"format": "test"}), False)
  return str(workdir)


def _edit_meta(run: str, edit) -> None:
  for path in glob.glob(os.path.join(run, "*", "*", "meta", "metadata")):
    with open(path) as f:
      meta = json.load(f)
    edit(meta)
    with open(path, "w") as f:
      json.dump(meta, f)


def bad_runs(root) -> dict[str, tuple[str, str]]:
  """{kind: (run folder, the file the message must name)} of run folders with one malformed file each."""
  config = {"method": {"name": "classifier", "num_classes": 3, "backbone": {"depth": 10, "width": 8}}}
  config["data"] = {"name": "synthetic_scenes", "config_name": "tiny", "pp": "decode|inception_crop(32)|normalize"}
  valid = _resnet_run(os.path.join(root, "valid"), config)
  out = {}

  def copy(name):
    shutil.copytree(valid, os.path.join(root, name))
    return os.path.join(root, name)

  run = copy("truncated_checkpoint")
  for path in glob.glob(os.path.join(run, "*", "0", "state", "**", "*"), recursive=True):
    if os.path.isfile(path) and os.path.getsize(path) > 64:
      os.truncate(path, os.path.getsize(path) // 2)
  out["truncated_checkpoint"] = (run, run)
  run = copy("metadata_garbage")
  for path in glob.glob(os.path.join(run, "*", "0", "meta", "metadata")):
    with open(path, "wb") as f:
      f.write(b"\x00\xffnot json")
  out["metadata_garbage"] = (run, run)
  run = copy("config_not_a_section")
  _edit_meta(run, lambda meta: meta["config"].update(method=7))
  out["config_not_a_section"] = (run, os.path.join(run, "best", "0", "meta", "metadata"))
  run = copy("config_wrong_value")
  _edit_meta(run, lambda meta: meta["config"]["method"]["backbone"].update(depth="fifty"))
  out["config_wrong_value"] = (run, os.path.join(run, "best", "0", "meta", "metadata"))
  run = copy("summary_not_json")
  with open(os.path.join(run, "summary.json"), "w") as f:
    f.write('{"a": [1, 2')
  out["summary_not_json"] = (run, os.path.join(run, "summary.json"))
  run = copy("tokenizer_not_sentencepiece")
  vocab = os.path.join(run, "vocab.model")
  with open(vocab, "wb") as f:
    f.write(b"this is not a sentencepiece model")
  tokenizer = {"path": vocab, "kind": "bpe", "special_tokens": "virtex", "vocab_size": 8, "build_if_missing": False}
  _edit_meta(
    run, lambda meta: meta["config"].update(tokenizer=tokenizer, method={**config["method"], "name": "virtex"})
  )
  out["tokenizer_not_sentencepiece"] = (run, vocab)
  return out


# ------------------------------------------------------------------------------------------------------------------
# Running a command over many cases in one process.
# ------------------------------------------------------------------------------------------------------------------
def run_cases(module: str, cases: dict[str, list[str]], tmp_path) -> dict[str, dict]:
  """{case: {'rc', 'stderr'}} of `python -m MODULE ARGS` for each case's ARGS, in one process."""
  cases_path, results_path = tmp_path / f"{module}.cases.json", tmp_path / f"{module}.results.json"
  cases_path.write_text(json.dumps(cases))
  proc = run_module("bad_files_driver", module, str(cases_path), str(results_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(results_path.read_text())


def assert_refused(results: dict[str, dict], names: dict[str, str]) -> None:
  """Every case exited 2 with one 'ERROR: ' message naming its file (names[case]) and no traceback."""
  wrong = {}
  for case, result in results.items():
    err = result["stderr"]
    message = next((line for line in err.splitlines() if line.startswith("ERROR: ")), "")
    if result["rc"] != 2 or "Traceback" in err or names[case] not in message:
      wrong[case] = (result["rc"], message or err[-1500:])
  assert not wrong, json.dumps(wrong, indent=1)


# ------------------------------------------------------------------------------------------------------------------
# The tests.
# ------------------------------------------------------------------------------------------------------------------
def test_import_run_refuses_every_malformed_file_with_one_message(tmp_path):
  cases, names = {}, {}
  for kind, path in malformed_checkpoints(tmp_path / "files").items():
    for fmt in ("auto", "torchvision", "virtex", "visual_bert"):
      case = f"{fmt}: {kind}"
      cases[case] = [f"--format={fmt}", f"--checkpoint={path}", f"--workdir={tmp_path / 'runs' / case}"]
      names[case] = path
  vocab = tmp_path / "vocab.model"
  vocab.write_bytes(b"not a sentencepiece model")
  case = "virtex: vocabulary not SentencePiece"
  cases[case] = ["--format=virtex", f"--checkpoint={tmp_path / 'files' / 'empty.pth'}", f"--vocab={vocab}"]
  cases[case].append(f"--workdir={tmp_path / 'runs' / 'vocab'}")
  names[case] = str(vocab)
  config = {"model_type": "visual_bert", **BERT}
  folders = {
    "config.json not JSON": {"config": b'{"hidden_size": 8,'},
    "config.json not UTF-8": {"config": b'{"a": "\xff\xfe"}'},
    "config.json nested too deep": {"config": b"[" * 100_000 + b"]" * 100_000},
    "config.json not an object": {"config": b"[1, 2]"},
    "config.json zero heads": {"config": {**config, "num_attention_heads": 0}},
    "config.json size of the wrong type": {"config": {**config, "hidden_size": "8"}},
    "config.json 100000 layers": {"config": {**config, "num_hidden_layers": 100_000}},
    "vocab.txt not UTF-8": {"vocab": b"[PAD]\n\xff\xfe\n"},
  }
  for kind, spec in folders.items():
    folder = visual_bert_folder(tmp_path / "folders" / kind.replace(" ", "_"), **spec)
    case = f"visual_bert: {kind}"
    cases[case] = ["--format=visual_bert", f"--checkpoint={folder}", f"--workdir={tmp_path / 'runs' / case}"]
    names[case] = os.path.join(folder, kind.split()[0])
  # The same folders' weights malformed: a safetensors file the folder names.
  folder = visual_bert_folder(tmp_path / "folders" / "weights_truncated")
  weights = os.path.join(folder, "model.safetensors")
  os.truncate(weights, os.path.getsize(weights) // 2)
  cases["visual_bert: weights truncated"] = ["--format=visual_bert", f"--checkpoint={folder}"]
  cases["visual_bert: weights truncated"].append(f"--workdir={tmp_path / 'runs' / 'w'}")
  names["visual_bert: weights truncated"] = weights
  assert_refused(run_cases("vlrep.interop.import_run", cases, tmp_path), names)
  assert not os.path.exists(tmp_path / "runs")  # nothing written


def test_run_folder_commands_refuse_malformed_run_files_and_images(tmp_path):
  """evaluate, caption and features on run folders with one malformed file each, and on bad images."""
  runs_ = bad_runs(tmp_path / "runs")
  images = bad_images(tmp_path / "images")
  photo = tmp_path / "photo.png"
  photo.write_bytes(_png(48, 40))
  evaluate, caption, features, names = {}, {}, {}, {}
  for kind, (run, name) in runs_.items():
    names[kind] = name
    if kind != "tokenizer_not_sentencepiece":  # an SVM probe builds no tokenizer
      evaluate[kind] = ["--config=configs/eval/voc07_svm.py:runlocal", f"--workdir={run}"]
    if kind != "summary_not_json":  # the tools read no summary
      caption[kind] = [f"--workdir={run}", str(photo)]
      features[kind] = [f"--workdir={run}", str(photo), f"--out={tmp_path / 'out' / kind}.npy"]
  # The tokenizer matters to evaluations that build the run's method (captioning).
  evaluate["tokenizer, captioning"] = ["--config=configs/eval/captioning.py:runlocal"]
  evaluate["tokenizer, captioning"].append(f"--workdir={runs_['tokenizer_not_sentencepiece'][0]}")
  names["tokenizer, captioning"] = runs_["tokenizer_not_sentencepiece"][1]
  del features["tokenizer_not_sentencepiece"]  # features build no tokenizer
  valid = os.path.join(tmp_path, "runs", "valid")
  for kind, path in images.items():
    names[f"image {kind}"] = path
    caption[f"image {kind}"] = [f"--workdir={valid}", str(photo), path]
    features[f"image {kind}"] = [f"--workdir={valid}", path, str(photo), f"--out={tmp_path / 'out' / kind}.npy"]
  assert_refused(run_cases("vlrep.evaluate", evaluate, tmp_path), names)
  assert_refused(run_cases("vlrep.tools.caption", caption, tmp_path), names)
  results = run_cases("vlrep.tools.features", features, tmp_path)
  assert_refused(results, names)
  # The bombs are refused as such (counted among the images given), not decoded.
  message = results["image bomb_warning.png"]["stderr"]
  assert "1 of 2 image files refused" in message and "96000000 pixels" in message, message
  assert "decompression bomb" in results["image bomb_error.png"]["stderr"]
  assert not os.path.exists(tmp_path / "out")


def test_convert_regions_refuses_malformed_dumps_with_one_message(tmp_path):
  cases, names = {}, {}
  info_files = {
    "not_npy": b"random bytes, not an .npy file",
    "deep_pickle": None,
    "not_a_dict": None,
  }
  for kind, data in info_files.items():
    src = tmp_path / kind
    src.mkdir()
    np.save(src / "7.npy", np.zeros((2, 8), np.float32))
    if kind == "deep_pickle":
      with open(src / "7_info.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
        f.write(_nested_dicts(100_000))
    elif kind == "not_a_dict":
      np.save(src / "7_info.npy", np.zeros(3, np.float32))
    else:
      (src / "7_info.npy").write_bytes(data)
    cases[kind] = ["--format=mmf", f"--src={src}", f"--dst={tmp_path / 'out' / kind}"]
    names[kind] = str(src)
  cases["no source folder"] = ["--format=mmf", f"--src={tmp_path / 'none'}", f"--dst={tmp_path / 'out' / 'none'}"]
  names["no source folder"] = str(tmp_path / "none")
  assert_refused(run_cases("vlrep.tools.convert_regions", cases, tmp_path), names)


def test_a_folders_code_hooks_are_dropped_on_import_and_never_exported(tmp_path, capsys):
  """auto_map, custom_pipelines, trust_remote_code (at any depth) and the folder's *.py files: named as dropped in
  the run's note and on the console, absent from the imported run's config and note and from the exported
  config.json."""
  hooks = {
    "auto_map": {"AutoModel": "modeling_evil.EvilModel"},
    "custom_pipelines": {"evil": {"impl": "pipeline_evil.py"}},
    "trust_remote_code": True,
    "text_config": {"auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}, "keep_me": 1},
  }
  config = {"model_type": "visual_bert", **BERT, "initializer_range": 0.02, **hooks}
  folder = visual_bert_folder(tmp_path / "hf", config)
  with open(os.path.join(folder, "modeling_evil.py"), "w") as f:
    f.write("open('pwned', 'w').close()\n")
  workdir = str(tmp_path / "run")
  proc = run_module(
    "vlrep.interop.import_run", "--format=visual_bert", f"--checkpoint={folder}", f"--workdir={workdir}"
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  for key in ("auto_map", "custom_pipelines", "trust_remote_code", "text_config.auto_map", "Python files"):
    assert f"dropped config.json {key}:" in proc.stdout or f"dropped {key}:" in proc.stdout, (key, proc.stdout)
  assert "modeling_evil.py" in proc.stdout
  run = runs.load_run(workdir)
  hf_config = run.meta["import"]["hf_config"]
  assert hf_config["text_config"] == {"keep_me": 1} and hf_config["initializer_range"] == 0.02
  text = json.dumps({"config": run.config.to_dict(), "hf_config": hf_config})
  for key in ("auto_map", "custom_pipelines", "trust_remote_code", "modeling_evil"):
    assert key not in text, key
  assert sorted(os.listdir(workdir)) == ["best", "checkpoints", "summary.json", "vocab.txt"]
  out = visual_bert.write_folder(run, str(tmp_path / "export"))
  exported = json.loads((tmp_path / "export" / "config.json").read_text())
  assert exported["text_config"] == {"keep_me": 1} and exported["initializer_range"] == 0.02
  assert not visual_bert.code_hooks(exported) and not any(f.endswith(".py") for f in out["files"])
  # A run imported before the hooks were dropped (its note still holds them) exports without them too.
  run.meta["import"]["hf_config"] = {**hf_config, **hooks}
  visual_bert.write_folder(run, str(tmp_path / "export_old"))
  exported = json.loads((tmp_path / "export_old" / "config.json").read_text())
  assert not visual_bert.code_hooks(exported) and exported["text_config"] == {"keep_me": 1}
  assert not os.path.exists(tmp_path / "pwned") and not os.path.exists("pwned")


@pytest.mark.parametrize("hooked", ["auto_map", "trust_remote_code", "custom_pipelines", "remote_code_file"])
def test_code_hooks_are_found_at_any_depth(hooked):
  config = {"a": 1, "nested": {hooked: "x"}, "b": {"c": "modeling_x.py"}}
  assert visual_bert.code_hooks(config) == [f"nested.{hooked}", "b.c"]
  assert visual_bert.without_code_hooks(config) == {"a": 1, "nested": {}, "b": {}}
