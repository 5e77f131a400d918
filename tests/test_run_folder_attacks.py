"""A run folder from someone else is data (issue 76): the names its saved config holds resolve only among vlrep's own
modules, the paths it holds are only read, and nothing planted in it (a symlink at a name vlrep writes) makes vlrep
write outside it. Each attack is a real tiny run (the session's shared tiny VirTex run) with one file crafted, run as
the commands a user would type from the folder that holds the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
from conftest import ROOT, command_server
from PIL import Image

from vlrep import checkpoint, run_setup, run_summary, runs, safe_files
from vlrep.data import concepts, instances, pipeline, tokenizers

D = os.environ["VLREP_TEST_DATA_DIR"]
# The tiny data for the eval configs' runlocal entries (tests/test_docs_commands.py's TINY_EVAL).
TINY = lambda name: (f"--config.evals.{name}.data_dir={D}", f"--config.evals.{name}.config_name=tiny")
CAPTIONING = (f"--config={ROOT}/configs/eval/captioning.py:runlocal", *TINY("captioning_beam"))
CAPTIONING += ("--config.evals.captioning_beam.limit=4",)
SVM = (f"--config={ROOT}/configs/eval/voc07_svm.py:runlocal", *TINY("voc07_svm"))

PAYLOAD = """
import pathlib
pathlib.Path({marker!r}).write_text("the run folder's code ran")
Method = Evaluator = object
"""


def command(cwd, module, *args, timeout=300) -> subprocess.CompletedProcess:
  """`python -m MODULE ARGS` started in `cwd`, forked from the tests' command server. `python -m` puts the working
  directory first on sys.path (how a run folder's `payload.py` becomes importable as `RUN.payload`); the server's
  children get it on sys.path through PYTHONPATH, which they add as an interpreter's start does."""
  with tempfile.TemporaryDirectory() as logs:
    out, err = os.path.join(logs, "out"), os.path.join(logs, "err")
    child = command_server().start([module, *args], stdout=out, stderr=err, env={"PYTHONPATH": str(cwd)}, cwd=cwd)
    try:
      rc = child.wait(timeout)
    except subprocess.TimeoutExpired:
      os.killpg(child.pid, 9)
      raise
    with open(out, errors="replace") as f, open(err, errors="replace") as g:
      return subprocess.CompletedProcess([module, *args], rc, f.read(), g.read())


def assert_refused(proc, *words):
  """Exit 2, one message naming `words`, no traceback."""
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  for word in words:
    assert word in proc.stderr, (word, proc.stderr[-3000:])


def metadata_files(run) -> list[str]:
  return [
    os.path.join(d, "meta", "metadata")
    for sub in ("best", "checkpoints")
    for d in sorted(str(p) for p in (run / sub).iterdir() if p.name.isdigit())
  ]


def crafted_run(good, where, name: str, change) -> str:
  """A copy of the run `good` at `where`/`name` whose saved config (in every checkpoint) `change(config)` edited."""
  run = where / name
  shutil.copytree(good, run, ignore=shutil.ignore_patterns("events.out.*"))
  for path in metadata_files(run):
    with open(path) as f:
      meta = json.load(f)
    change(meta["config"])
    with open(path, "w") as f:
      json.dump(meta, f)
  return run


@pytest.fixture(scope="module")
def good_run(tiny_virtex_run):
  assert tiny_virtex_run.returncode == 0, tiny_virtex_run.stderr[-2000:]
  return tiny_virtex_run.workdir


# ----------------------------------------------------------------------------------------------------------------
# Names in a run are data.
# ----------------------------------------------------------------------------------------------------------------


def test_a_dotted_method_name_in_a_run_imports_nothing_from_it(tmp_path, good_run):
  """The issue's attack: `method.name="evilrun.payload"` and a payload.py beside the run, commands started from the
  folder that holds it. Each is refused (exit 2, the saved config's file and the name in one message), the payload
  never runs; the same through `main --config.init_from`."""
  marker = tmp_path / "pwned"
  run = crafted_run(good_run, tmp_path, "evilrun", lambda c: c["method"].update(name="evilrun.payload"))
  (run / "payload.py").write_text(PAYLOAD.format(marker=str(marker)))
  meta = os.path.join("best", "6", "meta", "metadata")
  proc = command(tmp_path, "vlrep.evaluate", *CAPTIONING, "--workdir=evilrun")  # rebuilds the run's method
  assert not marker.exists(), "the run folder's payload ran"
  assert_refused(proc, meta, "method.name='evilrun.payload'", "VLREP_OWN_MODULES")
  assert_refused(command(tmp_path, "vlrep.evaluate", *SVM, "--workdir=evilrun"), "evilrun.payload")
  ft = tmp_path / "ft"
  proc = command(tmp_path, "vlrep.main", f"--config={ROOT}/tests/tiny_finetune.py", "--config.init_from=evilrun",
                 f"--workdir={ft}")  # fmt: skip
  assert_refused(proc, "evilrun.payload")
  assert not marker.exists()
  assert set(os.listdir(tmp_path)) <= {"evilrun", "ft"} and not os.path.exists(ft / "checkpoints")
  # In a process: refused at load, whatever reads the run next; the user's own module is read once they name it.
  with pytest.raises(runs.ForeignName, match="evilrun.payload"):
    runs.load_run(str(run))
  with pytest.raises(runs.ForeignName, match="evilrun.payload"):
    runs.read_config(str(run))
  # The loop resuming a workdir only compares its saved config with the user's (a method of their own resumes).
  assert runs.read_config(str(run), resuming=True).method.name == "evilrun.payload"
  os.environ[runs.OWN_MODULES_ENV] = "evilrun.payload"
  try:
    assert runs.read_config(str(run)).method.name == "evilrun.payload"
  finally:
    del os.environ[runs.OWN_MODULES_ENV]
  assert not marker.exists()


def test_a_dotted_evaluator_type_or_a_dataset_namespace_in_a_run_is_refused(tmp_path, good_run):
  marker = tmp_path / "pwned"
  run = crafted_run(good_run, tmp_path, "evilrun", lambda c: c["evals"]["probe"].update(type="evilrun.payload"))
  (run / "payload.py").write_text(PAYLOAD.format(marker=str(marker)))
  assert_refused(command(tmp_path, "vlrep.evaluate", *SVM, "--workdir=evilrun"), "evals.probe.type='evilrun.payload'")
  assert not marker.exists()
  for i, (key, value) in enumerate([("name", "huggingface:evil"), ("name", "../evil"), ("config_name", "x/../y")]):
    crafted = crafted_run(good_run, tmp_path, f"data{i}", lambda c, k=key, v=value: c["data"].update({k: v}))
    with pytest.raises(runs.ForeignName, match=f"data.{key}="):
      runs.load_run(str(crafted))


# ----------------------------------------------------------------------------------------------------------------
# Paths saved in a run are only read.
# ----------------------------------------------------------------------------------------------------------------


def test_a_tokenizer_path_outside_the_run_is_only_read_never_built(tmp_path, good_run):
  """The issue's attack: a saved `tokenizer.path` outside the run, with `build_if_missing`: the caption tool and
  vlrep.evaluate refuse (the vocabulary is missing), and create nothing there."""
  outside = tmp_path / "outside"

  def point_outside(c):
    c["tokenizer"].update(path=str(outside / "sub" / "vocab.model"), build_if_missing=True)

  run = crafted_run(good_run, tmp_path, "run", point_outside)
  photo = tmp_path / "photo.png"
  Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(photo)
  # The run's own vocabulary copy (WORKDIR/tokenizer/, sha-checked against data_identity.json) is what the tools
  # read: the path the saved config names is neither read nor created.
  assert (run / "tokenizer").is_dir()
  ok = command(tmp_path, "vlrep.tools.caption", "--workdir=run", str(photo))
  assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-3000:]
  assert not outside.exists()
  # Without that copy the configured path is only read: missing, so a refusal, and nothing created there.
  shutil.rmtree(run / "tokenizer")
  assert_refused(command(tmp_path, "vlrep.tools.caption", "--workdir=run", str(photo)), "vocab.model", "does not exist")
  assert_refused(command(tmp_path, "vlrep.evaluate", *CAPTIONING, "--workdir=run"), "vocab.model")
  assert not outside.exists()
  assert runs.load_run(str(tmp_path / "run")).config.tokenizer.build_if_missing is False


def test_a_loaded_runs_concepts_and_generated_data_are_never_built(tmp_path, tiny_builder):
  """A concept set or a generated dataset a saved config names where none is: an error, nothing created."""
  cfg = runs.saved_config(
    {"method": {"name": "icmlm"}, "data": {"name": "synthetic_scenes"}, "concepts": {"path": "", "size": 4}},
    "meta",
  ).concepts
  cfg.update(kind="tags", path=str(tmp_path / "outside" / "concepts.json"), corpus_split="train", corpus_key="tags")
  with pytest.raises(concepts.MissingConcepts, match="never builds it"):
    concepts.ensure_concepts(cfg, tiny_builder, None)
  with pytest.raises(pipeline.DatasetNotPrepared, match="does not generate data"):
    pipeline.get_builder("synthetic_scenes", str(tmp_path / "outside"), "tiny", generate=False)
  outside = tmp_path / "outside"
  # What the tools that rebuild a loaded run call (attention maps, grounding: run_setup.build; evaluate, caption:
  # build_inputs) with a saved config whose data_dir is outside: read, never generated into.
  saved = runs.saved_config(
    {
      "method": {"name": "virtex"},
      "data": {"name": "synthetic_scenes", "config_name": "tiny", "data_dir": str(outside), "split": "train"},
      "tokenizer": {"path": "", "vocab_size": 50, "corpus_split": "train", "corpus_key": "captions"},
    },
    "meta",
  )
  for build in (run_setup.build, run_setup.build_inputs):
    with pytest.raises(pipeline.DatasetNotPrepared, match="does not generate data"):
      build(saved)
  assert not (tmp_path / "outside").exists()


# ----------------------------------------------------------------------------------------------------------------
# Writes never follow links.
# ----------------------------------------------------------------------------------------------------------------


def plant(path, target) -> None:
  """A symlink at `path` (and at `path`.tmp, the name vlrep's writers used) to `target`."""
  os.symlink(target, path)
  os.symlink(target, f"{path}.tmp")


def test_a_planted_summary_tmp_link_is_not_followed_by_evaluate(tmp_path, good_run):
  """The issue's attack: WORKDIR/summary.json.tmp -> a stand-in for ~/.bashrc; vlrep.evaluate completes and the
  file outside is untouched (and a link at summary.json itself is replaced by the run's own file)."""
  bashrc = tmp_path / "bashrc"
  bashrc.write_text("# my shell\n")
  run = tmp_path / "run"
  shutil.copytree(good_run, run)
  os.symlink(bashrc, run / "summary.json.tmp")
  proc = command(tmp_path, "vlrep.evaluate", *SVM, "--workdir=run")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert bashrc.read_text() == "# my shell\n"
  assert "voc07_svm/map" in json.loads((run / "summary.json").read_text())
  # summary.json itself a link to a JSON file outside: read, then replaced by a file of the run's own.
  other = tmp_path / "other.json"
  other.write_text('{"theirs": 1}')
  os.unlink(run / "summary.json")
  os.symlink(other, run / "summary.json")
  run_summary.write_summary(str(run), {"mine": 2.0})
  assert other.read_text() == '{"theirs": 1}' and not os.path.islink(run / "summary.json")
  assert json.loads((run / "summary.json").read_text()) == {"theirs": 1, "mine": 2.0}


def test_the_data_writers_do_not_follow_planted_links(tmp_path, tiny_builder):
  """The tokenizer, concept set and COCO instances writers: a link at the target or its old temporary name
  (`NAME.tmp`) to a file outside leaves that file as it was."""
  outside = tmp_path / "outside.txt"
  outside.write_text("keep")
  folder = tmp_path / "data"
  folder.mkdir()
  model = folder / "vocab.model"
  plant(model, outside)
  tokenizers.train_tokenizer(["a red circle", "a blue square"] * 20, str(model), 40)
  assert tokenizers.Tokenizer(str(model)).vocab_size > 5 and not os.path.islink(model)
  sets = folder / "concepts.json"
  plant(sets, outside)
  concepts.ConceptSet("tags", ["a", "b"], [5, 6]).save(str(sets))
  assert concepts.ConceptSet.load(str(sets)).words == ["a", "b"]
  coco = folder / "instances.json"
  plant(coco, outside)
  instances.write_json({"images": []}, str(coco))
  assert json.loads(coco.read_text()) == {"images": []}
  assert outside.read_text() == "keep"


def test_orbax_never_writes_through_a_linked_checkpoint_folder(tmp_path):
  """A run folder whose `best/` is a link outside: training in it is refused before orbax writes through it."""
  outside = tmp_path / "outside"
  outside.mkdir()
  run = tmp_path / "run"
  run.mkdir()
  os.symlink(outside, run / "best")
  with pytest.raises(safe_files.OutsideWrite, match="best"):
    checkpoint.Checkpointer(str(run))
  assert os.listdir(outside) == [] and not (run / "checkpoints").exists()


# ----------------------------------------------------------------------------------------------------------------
# The one writer (vlrep.safe_files), unit by unit.
# ----------------------------------------------------------------------------------------------------------------


def test_safe_files_replaces_a_linked_target_instead_of_following_it(tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_text("keep")
  target = tmp_path / "w" / "out.json"
  target.parent.mkdir()
  os.symlink(outside, target)
  safe_files.write_json(str(target), {"a": 1}, root=str(tmp_path / "w"))
  assert outside.read_text() == "keep" and not os.path.islink(target) and json.loads(target.read_text()) == {"a": 1}
  with safe_files.atomic_path(str(target), suffix=".npy", root=str(tmp_path / "w")) as tmp:
    assert tmp.endswith(".npy") and os.path.dirname(tmp) == str(target.parent)
    np.save(tmp, np.arange(3))
  assert np.load(target).tolist() == [0, 1, 2] and outside.read_text() == "keep"


def test_safe_files_refuses_a_linked_subfolder_under_its_root(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  root = tmp_path / "run"
  root.mkdir()
  os.symlink(outside, root / "sub")
  for write in (
    lambda: safe_files.write_text(str(root / "sub" / "x.txt"), "x", root=str(root)),
    lambda: safe_files.make_dirs(str(root / "sub" / "deeper"), root=str(root)),
    lambda: safe_files.write_text(str(tmp_path / "elsewhere.txt"), "x", root=str(root)),
  ):
    with pytest.raises(safe_files.OutsideWrite):
      write()
  assert os.listdir(outside) == [] and not (tmp_path / "elsewhere.txt").exists()


def test_safe_files_leaves_no_temporary_file_and_the_old_target_on_failure(tmp_path):
  target = tmp_path / "out.txt"
  target.write_text("old")
  with pytest.raises(RuntimeError, match="mid-write"):
    with safe_files.open_atomic(str(target), "w") as f:
      f.write("half")
      raise RuntimeError("mid-write")
  with pytest.raises(RuntimeError, match="mid-save"):
    with safe_files.atomic_path(str(target)) as tmp:
      with open(tmp, "w") as f:
        f.write("half")
      raise RuntimeError("mid-save")
  with pytest.raises(RuntimeError, match="mid-dir"):
    with safe_files.atomic_dir(str(tmp_path / "folder")) as tmp:
      (tmp_path / tmp / "f").write_text("half")
      raise RuntimeError("mid-dir")
  assert sorted(os.listdir(tmp_path)) == ["out.txt"] and target.read_text() == "old"
