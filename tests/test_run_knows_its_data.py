"""A run knows what it was trained on (issue 77): the prepared dataset's fingerprint and the tokenizer's hash are
saved with the run (WORKDIR/data_identity.json, the vocabulary copied into WORKDIR/tokenizer/); resuming on a
dataset prepared again from changed captions is refused (exit 2, both named) unless --allow_changed_data, and the
tokenizer is never rebuilt under a run that has one."""

import json
import os

import pytest
import tiny_virtex
from conftest import run_main
from PIL import Image
from skimage import data as skdata

from vlrep import run_setup, train
from vlrep.data import prepare

# A few real photographs (scikit-image's samples, downscaled), two or three captions each.
PHOTOS = {
  "chelsea": ("chelsea", ["a ginger cat looking to the right", "a cat on a sofa"]),
  "coffee": ("coffee", ["a cup of coffee on a saucer", "a spoon beside a cup", "coffee seen from above"]),
  "astronaut": ("astronaut", ["an astronaut holding a helmet", "a person in a white suit"]),
  "rocket": ("rocket", ["a rocket on its launch pad", "a rocket under a blue sky"]),
  "camera": ("camera", ["a man with a camera on a tripod", "a photographer in a field"]),
  "coins": ("coins", ["rows of old coins", "coins on a dark table", "many small coins"]),
  "moon": ("moon", ["the surface of the moon", "craters on the moon"]),
  "page": ("page", ["a page of printed text", "letters on a page"]),
}


def write_photos(root, drop=()) -> int:
  """captions.jsonl over the photos (less those in `drop`); returns the number of caption rows."""
  os.makedirs(root / "imgs", exist_ok=True)
  rows = []
  for name, (fn, captions) in PHOTOS.items():
    path = root / "imgs" / f"{name}.jpg"
    if not path.exists():
      image = Image.fromarray(getattr(skdata, fn)()).convert("RGB")
      image.thumbnail((64, 64))
      image.save(path, quality=90)
    if name not in drop:
      rows += [{"image": f"imgs/{name}.jpg", "caption": c} for c in captions]
  (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return len(rows)


def _config(data_dir, steps):
  config = tiny_virtex.get_config(f"data={data_dir},val=25")
  config.evals = {}
  config.total_steps, config.batch_size = steps, 4
  config.checkpoint.every_steps = steps
  return config


def test_a_run_refuses_to_resume_on_a_dataset_prepared_again_from_changed_captions(tmp_path, caplog):
  manual, data_dir, run = tmp_path / "mine", tmp_path / "tfds", tmp_path / "run"
  write_photos(manual)
  first = prepare.prepare("image_text", str(manual), str(data_dir))
  assert first["splits"] == {"train": 8}, first
  train.train_and_evaluate(_config(data_dir, 2), str(run))
  identity = json.loads((run / "data_identity.json").read_text())
  assert identity["dataset"]["splits"] == {"train": 8} and identity["dataset"]["source"]["files"] == 8
  vocab = identity["tokenizer"]
  assert (
    vocab["copy"].startswith("tokenizer/") and (run / vocab["copy"]).read_bytes() == open(vocab["path"], "rb").read()
  )

  # The user edits the captions (two photos' rows removed) and prepares again into the same --data_dir.
  write_photos(manual, drop=("moon", "page"))
  second = prepare.prepare("image_text", str(manual), str(data_dir))
  assert second["source"].startswith("rebuilt: captions.jsonl changed") and second["splits"] == {"train": 6}
  assert not os.path.exists(vocab["path"])  # the vocabulary lived in the version folder the rebuild replaced

  # Rerunning the training command with a longer total_steps: exit 2, both datasets named, nothing rebuilt.
  proc = run_main(
    run,
    "--config.total_steps=4",
    "--config.batch_size=4",
    "--config.evals={}",
    config=f"tests/tiny_virtex.py:data={data_dir},val=25",
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  said = proc.stderr
  assert f"The run in {run} was trained on other data than this command reads" in said
  assert "examples: train 8" in said and "examples: train 6" in said, said
  assert "captions.jsonl changed" in said and "split train: 8 -> 6 examples" in said and "8 image files" in said
  assert "--allow_changed_data" in said
  assert not os.path.exists(vocab["path"])  # the tokenizer was not rebuilt
  assert train.saved_steps(str(run)) == 2

  # Knowingly: the run continues on the new data with its own vocabulary (never rebuilt from the new captions).
  with caplog.at_level("WARNING"):
    summary = train.train_and_evaluate(_config(data_dir, 4), str(run), allow_changed_data=True)
  assert summary["steps"] == 4
  assert not os.path.exists(vocab["path"])
  assert any("keeps its own copy" in r.getMessage() for r in caplog.records)
  after = json.loads((run / "data_identity.json").read_text())
  assert after["tokenizer"] == vocab and after["dataset"]["splits"] == {"train": 6}
  assert [(h["from_step"], h["allowed_changed_data"]) for h in after["history"]] == [(0, False), (2, True)]

  # Resumed again on what it now records: no refusal, no flag needed, its own vocabulary.
  from vlrep.data import pipeline

  builder = pipeline.get_builder("image_text", str(data_dir))
  assert run_setup.RunData(str(run), True, 4).check(_config(data_dir, 6), builder) == str(run / vocab["copy"])

  # Reading the run (vlrep.evaluate, the caption tool) uses its own vocabulary too: the configured one is gone.
  from vlrep import runs

  loaded = runs.load_run(str(run), "latest")
  assert loaded.workdir == str(run)
  with pytest.raises(FileNotFoundError):  # what the tools met before: the vocabulary beside the old version
    run_setup.build_inputs(loaded.config)
  inputs = run_setup.build_inputs(loaded.config, loaded.workdir)
  assert inputs.tokenizer.path == str(run / vocab["copy"])

  # A run saved by an older vlrep (no data_identity.json) resumes with a warning, and is recorded from then on.
  os.remove(run / "data_identity.json")
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert train.train_and_evaluate(_config(data_dir, 6), str(run))["steps"] == 6
  assert any("has no data_identity.json" in r.getMessage() for r in caplog.records)
  assert json.loads((run / "data_identity.json").read_text())["history"][0]["from_step"] == 4


def test_changes_are_named_and_a_changed_vocabulary_is_refused(tmp_path):
  """The comparison itself: a rebuilt synthetic or TFDS dataset (no source fingerprint) by its counts and sizes; a
  vocabulary file that differs from the run's by its hash."""
  old = {
    "name": "synthetic_scenes",
    "config": "tiny",
    "version": "2.1.0",
    "data_dir": "/d",
    "source": None,
    "generated": True,
    "splits": {"train": 64, "val": 16},
    "num_bytes": {"train": 1000, "val": 200},
  }
  assert run_setup.dataset_changes(old, dict(old)) == []
  assert run_setup.dataset_changes(old, {**old, "num_bytes": {"train": 1001, "val": 200}}) == [
    "the splits' stored sizes changed (the records were written again with other contents)"
  ]
  assert run_setup.dataset_changes(old, {**old, "splits": {"train": 60, "val": 16}}) == [
    "split train: 64 -> 60 examples"
  ]
  assert "generated by vlrep" in run_setup._describe_dataset(old)

  # A workdir trained with one vocabulary, resumed with the configured file replaced by another.
  vocab = tmp_path / "vocab.model"
  vocab.write_bytes(b"one vocabulary")
  saved = {"dataset": old, "tokenizer": {**run_setup.tokenizer_identity(str(vocab)), "copy": "tokenizer/vocab.model"}}
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "data_identity.json").write_text(json.dumps(saved))
  vocab.write_bytes(b"another vocabulary")

  class Builder:  # what dataset_identity reads of a TFDS builder
    name, data_dir, builder_config = "synthetic_scenes", "/d", type("C", (), {"name": "tiny"})

    class info:
      version, metadata = "2.1.0", {}
      splits = {
        n: type("S", (), {"num_examples": c, "num_bytes": old["num_bytes"][n]}) for n, c in old["splits"].items()
      }

  Builder.generated_on_first_use = True
  from ml_collections import ConfigDict

  config = ConfigDict({"tokenizer": {"kind": "bpe", "path": str(vocab)}})
  with pytest.raises(run_setup.ChangedDataError, match=r"(?s)tokenizer trained with: .*vocab.model.*tokenizer now:"):
    run_setup.RunData(str(tmp_path / "run"), True, 6).check(config, Builder())
  # Allowed, but the run holds no copy of its vocabulary: refused rather than rebuilt or swapped.
  with pytest.raises(run_setup.ChangedDataError, match="never rebuilt"):
    run_setup.RunData(str(tmp_path / "run"), True, 6, allow_changed_data=True).check(config, Builder())
  # With its copy it keeps its own vocabulary.
  (tmp_path / "run" / "tokenizer").mkdir()
  (tmp_path / "run" / "tokenizer" / "vocab.model").write_bytes(b"one vocabulary")
  own = run_setup.RunData(str(tmp_path / "run"), True, 6, allow_changed_data=True).check(config, Builder())
  assert own == str(tmp_path / "run" / "tokenizer" / "vocab.model")
  # init_from=RUN on RUN's own dataset prepared again since: refused unless allowed; on another dataset (the
  # transfer init_from is for) or the same data, accepted.
  (tmp_path / "source").mkdir()
  (tmp_path / "source" / "data_identity.json").write_text(
    json.dumps({"dataset": {**old, "splits": {"train": 70, "val": 16}}, "tokenizer": None})
  )
  fresh = lambda allow=False: run_setup.RunData(str(tmp_path / "new"), False, 0, allow, str(tmp_path / "source"))
  with pytest.raises(run_setup.ChangedDataError, match=r"init_from=.*split train: 70 -> 64 examples.*held-out"):
    fresh().check(config, Builder())
  assert fresh(allow=True).check(config, Builder()) is None
  (tmp_path / "source" / "data_identity.json").write_text(
    json.dumps({"dataset": {**old, "name": "coco_captions2017", "splits": {"train": 70}}, "tokenizer": None})
  )
  assert fresh().check(config, Builder()) is None

  # A malformed identity file (a run folder may come from elsewhere) is one BadFile message naming it.
  for text in (
    "[1, 2",
    "[]",
    '{"dataset": {"source": [1]}}',
    '{"dataset": {"splits": 3}}',
    '{"dataset": {}, "tokenizer": 1}',
  ):
    (tmp_path / "run" / "data_identity.json").write_text(text)
    with pytest.raises(Exception, match="data_identity.json") as caught:
      run_setup.RunData(str(tmp_path / "run"), True, 6)
    assert type(caught.value).__name__ == "BadFile", text
