"""The shareable folder (--format=vlrep): what export writes reads back bit for bit as a run, and a crafted folder
is a clear BadFile with nothing executed, unpickled or written."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
from conftest import ROOT, imported_resnet18, run_module

from vlrep import run_setup, runs
from vlrep.errors import BadFile
from vlrep.interop import export
from vlrep.interop.formats import vlrep as vlrep_format


@pytest.fixture(scope="module")
def exported(tiny_virtex_run, tmp_path_factory):
  """(the tiny VirTex run, its folder exported by the command)."""
  out = tmp_path_factory.mktemp("shared") / "virtex_shared"
  proc = run_module("vlrep.interop.export", f"--workdir={tiny_virtex_run.workdir}", "--format=vlrep", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "Exported step" in proc.stdout
  return runs.load_run(str(tiny_virtex_run.workdir)), str(out)


def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def test_export_then_read_gives_the_same_run(exported):
  run, out = exported
  assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "tokenizer.model"]
  back = runs.load_run(out)
  want, got = _flat(run.variables), _flat(back.variables)
  assert sorted(want) == sorted(got)
  assert any(k.startswith("batch_stats/") for k in got) and any(k.startswith("params/textual_head/") for k in got)
  for k in want:
    assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
  assert back.config.method.to_dict() == run.config.method.to_dict()
  assert back.step == run.step
  assert back.config.data.pp == run.config.data.pp
  assert back.config.tokenizer.path == os.path.join(out, "tokenizer.model")
  config = json.load(open(os.path.join(out, "config.json")))
  runs.check_data_only(config, "config.json")  # no path, no data_dir
  assert "data_dir" not in config["data"]
  card = open(os.path.join(out, "README.md")).read()
  assert "virtex" in card and f"{run.step} steps" in card and "synthetic_scenes" in card
  # The run's own metrics, each evaluation's under what measured it (its evals entry, the evaluator, the data).
  summary = json.load(open(os.path.join(run.workdir, "summary.json")))
  for name, entry in run.config.evals.items():
    assert f"`{name}`: the run's `evals.{name}`, the {entry.type} evaluator on {entry.dataset}" in card
  metrics = [k for k, v in summary.items() if "/" in k and k.split("/")[0] in run.config.evals and isinstance(v, float)]
  assert metrics and all(f"| {k} | {summary[k]:.4g} |" in card for k in metrics)
  assert card.index("`probe`: the run's") < card.index("| probe/map |") < card.index("Training:")


def test_the_cards_evaluator_configs_are_the_ones_in_configs_eval():
  files = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs", "eval")) if f.endswith(".py"))
  assert sorted(vlrep_format.EVAL_CONFIGS) == files


def test_features_from_the_folder_equal_the_runs(exported):
  run, out = exported
  back = runs.load_run(out)
  images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
  for key in ("pre_logits", "grid"):
    want, _ = runs.backbone_fn(run)({"image": images}, key)
    got, _ = runs.backbone_fn(back)({"image": images}, key)
    assert np.array_equal(want, got), key


def test_export_refuses_a_non_empty_folder_without_overwrite(exported, tiny_virtex_run, tmp_path):
  _, out = exported
  before = {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)}
  with pytest.raises(export.keymaps.OutExists):
    export.export(str(tiny_virtex_run.workdir), "vlrep", out)
  assert {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)} == before


def _copy(out, tmp_path):
  crafted = tmp_path / "crafted"
  shutil.copytree(out, crafted)
  return str(crafted)


def _edit_config(folder, edit):
  path = os.path.join(folder, "config.json")
  config = json.load(open(path))
  edit(config)
  json.dump(config, open(path, "w"))


@pytest.mark.parametrize(
  "edit, message",
  [
    (lambda c: c["method"].update(name="payload.evil"), "not the plain name"),
    (lambda c: c["method"].update(name="/abs/evil"), "a path"),
    (lambda c: c["data"].update(name="/etc/data"), "a path"),
    (lambda c: c["tokenizer"].update(file="../outside.model"), "a path"),
    (lambda c: c["tokenizer"].update(sha256="0" * 64), "SHA-256"),
  ],
)
def test_crafted_config_is_refused(exported, tmp_path, edit, message):
  folder = _copy(exported[1], tmp_path)
  _edit_config(folder, edit)
  before = sorted(os.listdir(folder))
  with pytest.raises(BadFile, match=message):
    runs.load_run(folder)
  assert sorted(os.listdir(folder)) == before


def test_oversized_safetensors_header_is_refused(exported, tmp_path):
  folder = _copy(exported[1], tmp_path)
  weights = os.path.join(folder, "model.safetensors")
  with open(weights, "r+b") as f:
    f.write(struct.pack("<Q", 10**12))
  with pytest.raises(BadFile, match="header"):
    runs.load_run(folder)


def test_truncated_weights_are_refused(exported, tmp_path):
  folder = _copy(exported[1], tmp_path)
  weights = os.path.join(folder, "model.safetensors")
  os.truncate(weights, os.path.getsize(weights) - 100)
  with pytest.raises(BadFile, match="model.safetensors"):
    runs.load_run(folder)


def test_python_file_beside_is_never_imported(exported, tmp_path, monkeypatch):
  folder = _copy(exported[1], tmp_path)
  marker = tmp_path / "imported"
  for name in ("payload.py", "config.py", "vlrep.py", "__init__.py"):
    (tmp_path / "crafted" / name).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
  (tmp_path / "crafted" / "extra.pkl").write_bytes(b"\x80\x04crafted")
  monkeypatch.chdir(folder)
  monkeypatch.syspath_prepend(folder)
  run = runs.load_run(folder)
  runs.backbone_fn(run)
  assert not marker.exists()


def test_symlinked_weights_pointing_outside_are_refused(exported, tmp_path):
  folder = _copy(exported[1], tmp_path)
  outside = tmp_path / "outside.safetensors"
  shutil.move(os.path.join(folder, "model.safetensors"), outside)
  os.symlink(outside, os.path.join(folder, "model.safetensors"))
  with pytest.raises(BadFile, match="outside the folder"):
    runs.load_run(folder)


def test_huggingface_cache_layout_reads(exported, tmp_path):
  """snapshot_download's folder: snapshots/<revision>/FILE, each a link into the repository's blobs/."""
  repo = tmp_path / "models--someone--virtex"
  snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
  snapshot.mkdir(parents=True)
  blobs.mkdir()
  for i, name in enumerate(sorted(os.listdir(exported[1]))):
    shutil.copy(os.path.join(exported[1], name), blobs / f"blob{i}")
    os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snapshot / name)
  back = runs.load_run(str(snapshot))
  assert back.step == exported[0].step


def test_export_command_exits_2_on_an_existing_folder(exported, tiny_virtex_run):
  _, out = exported
  proc = run_module("vlrep.interop.export", f"--workdir={tiny_virtex_run.workdir}", "--format=vlrep", f"--out={out}")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "--overwrite" in proc.stderr


def test_folder_tokenizer_is_the_runs(exported, tiny_virtex_run):
  """The caption tool's and vlrep.evaluate's inputs (run_setup.build_inputs) read the folder's own vocabulary."""
  run, out = exported
  back = runs.load_run(out)
  assert back.workdir == out  # what the caption tool and vlrep.evaluate hand to build_inputs
  theirs = run_setup.build_inputs(back.config, back.workdir).tokenizer
  ours = run_setup.build_inputs(run.config, str(tiny_virtex_run.workdir)).tokenizer
  assert theirs.path == os.path.join(out, "tokenizer.model")
  caption = "a red square left of a blue circle"
  assert np.array_equal(theirs.encode(caption, 16)[0], ours.encode(caption, 16)[0])


def test_load_run_reads_a_shared_folder_and_the_features_tool_gives_the_runs_features(exported, tmp_path):
  """`runs.load_run` opens the folder as it opens a run folder, so `vlrep.tools.features` (a real photograph,
  skimage's astronaut) gives the run's features to the bit; a checkpoint step is refused: the folder has one."""
  from PIL import Image
  from skimage import data as photos

  from vlrep.tools import features

  run, out = exported
  photo = tmp_path / "astronaut.jpg"
  Image.fromarray(photos.astronaut()).save(photo, quality=90)
  theirs = features.extract(out, [str(photo)])
  ours = features.extract(run.workdir, [str(photo)])
  for key in ("pooled", "grid"):
    np.testing.assert_array_equal(theirs[key], ours[key])
  assert theirs["step"] == ours["step"]
  with pytest.raises(runs.NotARun, match="one model"):
    runs.load_run(out, checkpoint="3")


# -- runs without a tokenizer, and runs whose tokenizer the folder cannot hold --------------------------------------
def _card_code(folder: str, photo: str) -> str:
  """The model card's Loading block, its FOLDER and photo.jpg the test's own."""
  card = open(os.path.join(folder, "README.md")).read()
  code = card.split("## Loading", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
  return code.replace('"FOLDER"', repr(folder)).replace('"photo.jpg"', repr(photo))


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
  """A real photograph (skimage's astronaut) as a JPEG."""
  from PIL import Image
  from skimage import data as photos

  path = tmp_path_factory.mktemp("photo") / "astronaut.jpg"
  Image.fromarray(photos.astronaut()).save(path, quality=90)
  return str(path)


@pytest.fixture(scope="module")
def torchvision_exported(tmp_path_factory):
  """(the run imported from a torchvision ResNet-18 state dict written by torch.save, random weights and BatchNorm
  statistics, as tests/test_features.py writes it; its folder exported by the command)."""
  root = tmp_path_factory.mktemp("in1k_r18")
  _, run = imported_resnet18(str(root))
  out = root / "shared"
  proc = run_module("vlrep.interop.export", f"--workdir={run}", "--format=vlrep", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  return run, str(out)


def test_a_run_without_a_tokenizer_exports_and_reads_back_bit_equal(torchvision_exported, photo):
  """An imported torchvision run (a classifier's config, no tokenizer section): config.json says "tokenizer": null,
  no vocabulary is written, and the folder reads back as the run: its variables to the bit, its config without a
  tokenizer, and the features tool (a real photograph) gives the run's features to the bit."""
  from vlrep.tools import features

  workdir, out = torchvision_exported
  run, back = runs.load_run(workdir), runs.load_run(out)
  assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
  assert json.load(open(os.path.join(out, "config.json")))["tokenizer"] is None
  assert "tokenizer" not in run.config and "tokenizer" not in back.config
  assert back.config.method.to_dict() == run.config.method.to_dict() and back.config.method.name == "classifier"
  want, got = _flat(run.variables), _flat(back.variables)
  assert sorted(want) == sorted(got) and any(k.startswith("batch_stats/backbone/") for k in got)
  for k in want:
    assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
  theirs, ours = features.extract(out, [photo]), features.extract(workdir, [photo])
  for key in ("pooled", "grid"):
    assert theirs[key].shape[-1] == 512
    np.testing.assert_array_equal(theirs[key], ours[key])


def test_a_folder_without_a_tokenizer_never_opens_one_beside_it(torchvision_exported, tmp_path):
  """A vocabulary dropped beside a "tokenizer": null folder is no part of it: the run has no tokenizer still."""
  folder = _copy(torchvision_exported[1], tmp_path)
  (tmp_path / "crafted" / "tokenizer.model").write_bytes(b"\x00not a vocabulary")
  back = runs.load_run(folder)
  assert "tokenizer" not in back.config
  assert run_setup.build_inputs(back.config, back.workdir).tokenizer is None


def test_card_of_a_run_without_text_loads_it_with_its_own_lines(torchvision_exported, photo):
  """The card's Loading block runs as written (vlrep.load, encode_images) and offers nothing the run cannot do."""
  out = torchvision_exported[1]
  code = _card_code(out, photo)
  assert "vlrep.load(" in code and "snapshot_download" in code
  assert "caption" not in code and "zero_shot" not in code and "encode_text" not in code
  assert "tokenizer.model" not in open(os.path.join(out, "README.md")).read()
  scope = {}
  exec(code, scope)  # noqa: S102 -- the card's own code, on the test's folder and photo
  got = scope["model"].encode_images([photo])
  assert got["pooled"].shape == (1, 512) and got["grid"].shape[0] == 1


def test_card_of_a_captioner_shows_and_runs_its_captions(exported, photo):
  """The tiny VirTex run (bicaptioning) captions and scores labels: its card shows both, and they run as written."""
  _, out = exported
  code = _card_code(out, photo)
  assert "model.caption(" in code and "model.zero_shot(" in code and "encode_text" not in code
  scope = {}
  exec(code, scope)  # noqa: S102 -- the card's own code, on the test's folder and photo
  model = scope["model"]
  assert len(model.caption([photo], max_len=5)) == 1


@pytest.mark.parametrize(
  "method, card",
  [
    ({"name": "clip"}, ("zero_shot", "encode_text")),
    ({"name": "mct"}, ("zero_shot", "encode_text")),
    ({"name": "loctex"}, ("zero_shot", "encode_text")),
    ({"name": "virtex", "task": "captioning"}, ("caption", "zero_shot")),
    ({"name": "virtex", "task": "cappa"}, ("caption", "zero_shot")),
    ({"name": "virtex", "task": "masked_lm"}, ()),  # no forward captioner: neither captions nor scores captions
    ({"name": "virtex", "task": "token_classification"}, ()),
    ({"name": "classifier"}, ()),
    ({"name": "icmlm"}, ()),
  ],
)
def test_card_lines_follow_the_method(method, card):
  from vlrep.interop.formats import vlrep as folder_format

  assert folder_format.uses(method) == card


def _without_tokenizer(config):
  config["tokenizer"] = None


@pytest.mark.parametrize("method", ["virtex", "loctex"])
def test_a_text_method_with_a_null_tokenizer_is_refused_at_load(method, request, tmp_path):
  """A crafted config.json saying "tokenizer": null (its vocabulary removed) for a method that reads captions: a
  BadFile naming config.json at load time, not an error inside the method on first use."""
  run = request.getfixturevalue(f"tiny_{method}_run")
  out = tmp_path / "shared"
  export.export(str(run.workdir), "vlrep", str(out))
  os.remove(out / "tokenizer.model")
  _edit_config(str(out), _without_tokenizer)
  with pytest.raises(BadFile, match=r"config\.json says \"tokenizer\": null, but method .* reads text \(tokens"):
    runs.load_run(str(out))


@pytest.mark.parametrize("value", ["bpe", 0, []])
def test_a_tokenizer_that_is_neither_an_object_nor_null_is_refused(exported, tmp_path, value):
  folder = _copy(exported[1], tmp_path)
  _edit_config(folder, lambda c: c.update(tokenizer=value))
  with pytest.raises(BadFile, match="config.json: 'tokenizer' is neither an object nor null"):
    runs.load_run(folder)


def test_a_wordpiece_run_is_refused_saying_what_to_share(exported, tmp_path):
  """A run with BERT's WordPiece vocabulary (as a CLIP text=bert or imported VisualBERT run's config has it): the
  folder cannot carry a BERT folder, so export says so and what to share instead, and writes nothing."""
  import dataclasses

  from vlrep.interop.formats import vlrep as folder_format

  run = exported[0]
  config = run.config.copy_and_resolve_references()
  config.tokenizer = {"kind": "wordpiece", "path": str(tmp_path / "bert")}
  wordpiece = dataclasses.replace(run, config=config)
  out = tmp_path / "shared"
  with pytest.raises(export.keymaps.NotExportable) as refused:
    folder_format.export(wordpiece, str(out))
  message = str(refused.value)
  assert "WordPiece" in message and "BPE vocabulary or none" in message and "Share the run folder" in message
  assert not out.exists() and sorted(os.listdir(tmp_path)) == []
