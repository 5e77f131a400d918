"""Nothing a run trained is lost, and a run starts only on what it can finish: an exception after training steps
saves the trained state first; the last step is on disk before the final evaluations; a resume on other data,
tokenizer or method is refused (unless allowed); every dataset the run reads is checked before the model is built;
a command line's duration replaces the recipe's; a recipe without its BERT folder says what to pass."""

import json
import os
import time

import pytest
from conftest import final_params, load_tiny_config, run_main
from test_evaluation import _load_config as load_config

from vlrep import run_setup, train, train_state
from vlrep.errors import DatasetNotPrepared
from vlrep.evaluators import captioning


class FailingCaptioning:
  """The captioning evaluator's `run`, replaced: records the checkpoint steps on disk at each call and raises
  at the steps in `fail_at` (an evaluation that crashes, as LocTex's retrieval did on its own data)."""

  def __init__(self, workdir, fail_at):
    self.workdir, self.fail_at, self.calls = workdir, set(fail_at), []

  def __call__(self, evaluator, model):
    folder = os.path.join(self.workdir, "checkpoints")
    on_disk = sorted(int(p) for p in os.listdir(folder) if p.isdigit()) if os.path.isdir(folder) else []
    self.calls.append(on_disk)
    if len(self.calls) in self.fail_at:
      raise RuntimeError(f"evaluation {len(self.calls)} failed")
    return {"cider": 1.0}

  def install(self, monkeypatch):
    monkeypatch.setattr(captioning.Evaluator, "evaluate", lambda evaluator, model: self(evaluator, model))
    return self


def _config(total_steps):
  """tiny_virtex with one evaluator (captioning, every 2 steps) and no periodic checkpoint before the end."""
  config = load_tiny_config()
  config.evals = {"captioning": config.evals.captioning}
  config.evals.captioning.every_steps = 2
  config.total_steps = total_steps
  config.checkpoint.every_steps = 1000
  return config


def test_a_failing_evaluation_saves_the_trained_state_first_and_the_last_step_is_saved_before_the_final_ones(
  tmp_path, monkeypatch
):
  workdir = str(tmp_path / "run")
  # An evaluation that fails after 2 steps, with no checkpoint due: the error propagates, step 2 is saved first.
  fail = FailingCaptioning(workdir, fail_at={1}).install(monkeypatch)
  with pytest.raises(RuntimeError, match="evaluation 1 failed") as caught:
    train.train_and_evaluate(_config(4), workdir)
  assert fail.calls == [[]]  # nothing was saved when it ran: the save came after it failed
  assert final_params(workdir)[0] == 2  # step 2 on disk, and it restores
  note = "\n".join(caught.value.__notes__)
  assert f"stopped at step 2: the trained state was saved first, in {workdir}/checkpoints/2" in note, note
  assert not os.path.exists(os.path.join(workdir, "summary.json"))

  # Resumed, it trains steps 3-4; the final evaluation runs with step 4 already on disk, and fails.
  fail = FailingCaptioning(workdir, fail_at={1}).install(monkeypatch)
  with pytest.raises(RuntimeError, match="evaluation 1 failed") as caught:
    train.train_and_evaluate(_config(4), workdir)
  assert fail.calls == [[2, 4]]
  assert f"stopped at step 4, which is saved in {workdir}/checkpoints/4" in "\n".join(caught.value.__notes__)

  # Run again once the evaluation works: nothing to train, the final evaluation runs on step 4 and the run finishes.
  fine = FailingCaptioning(workdir, fail_at=()).install(monkeypatch)
  summary = train.train_and_evaluate(_config(4), workdir)
  assert fine.calls == [[2, 4]] and summary["steps"] == 4 and summary["captioning/cider"] == 1.0
  saved = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert saved["preempted"] is False and saved["captioning/cider"] == 1.0
  # Once finished, a rerun evaluates nothing again and keeps the summary's metrics.
  again = FailingCaptioning(workdir, fail_at={1}).install(monkeypatch)
  assert train.train_and_evaluate(_config(4), workdir)["captioning/cider"] == 1.0 and again.calls == []

  # The same run on other data (a different split) is refused before anything is built, naming both splits ...
  proc = run_main(workdir, "--config.data.split=train[:50%]", "--config.total_steps=5", "--config.evals={}")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "data.split: trained with 'train', now 'train[:50%]'" in proc.stderr and "Traceback" not in proc.stderr
  assert "--allow_changed_data" in proc.stderr
  # ... and another tokenizer (a vocabulary of another size) too; --allow_changed_data lets it continue.
  proc = run_main(workdir, "--config.tokenizer.vocab_size=300", "--config.evals={}", "--config.total_steps=5")
  assert proc.returncode == 2 and "tokenizer: trained with {" in proc.stderr, proc.stderr[-3000:]
  assert "'vocab_size': 200" in proc.stderr and "'vocab_size': 300" in proc.stderr
  # The allowed resume also trains for a duration given on the command line in other units than the config's
  # (tiny_virtex says total_steps=6, warmup_steps=2): 40 examples = 5 batches of 8, so one step more.
  proc = run_main(
    workdir,
    "--config.data.split=train[:50%]",
    "--allow_changed_data",
    "--config.evals={}",
    "--config.total_examples=40",
    "--config.optim.warmup_examples=8",
  )
  assert proc.returncode == 0 and "Resumed from step 4" in proc.stderr, proc.stderr[-3000:]
  assert "total_steps, optim.warmup_steps set to 0" in proc.stderr and "5 steps (" in proc.stderr
  assert "warmup 1." in proc.stderr and "Finished 5 steps" in proc.stdout
  assert final_params(workdir)[0] == 5


def test_every_dataset_the_run_reads_is_checked_before_anything_is_built(tmp_path, monkeypatch):
  config = load_tiny_config(f"data={tmp_path / 'mine'}")  # own data, not prepared
  config.evals.probe = load_config("virtex", "").evals.probe  # the recipe's VOC07 probe
  config.evals.probe.data_dir = str(tmp_path / "tfds")

  def must_not_run(*args, **kwargs):
    raise AssertionError("built something before checking the datasets")

  monkeypatch.setattr(run_setup, "build", must_not_run)
  monkeypatch.setattr(train_state, "fresh", must_not_run)
  t0 = time.time()
  with pytest.raises(DatasetNotPrepared) as caught:
    train.train_and_evaluate(config, str(tmp_path / "run"))
  seconds = time.time() - t0
  said = str(caught.value)
  assert said.startswith("2 dataset(s) this run reads are not prepared"), said
  assert f"- for data, evals.captioning: Dataset 'image_text' is not prepared in {tmp_path / 'mine'}" in said
  assert f"- for evals.probe: Dataset 'voc2007' is not prepared in {tmp_path / 'tfds'}" in said
  assert "--dataset=image_text --manual_dir=PATH" in said and "--dataset=voc2007 --manual_dir=PATH" in said
  assert seconds < 10, seconds
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_duration_on_the_command_line_replaces_the_recipes():
  # LocTex's recipe trains 600 epochs with 20 warmup epochs; steps given on the command line replace both.
  config = load_config("loctex", "")
  assert config.total_epochs == 600.0 and config.optim.warmup_epochs == 20.0
  config.total_steps, config.optim.warmup_steps = 2, 1
  before = config.to_dict()
  set_keys = {"total_steps", "optim.warmup_steps"}
  assert train.replaced_durations(config, set_keys) == {"total_epochs": 0.0, "optim.warmup_epochs": 0.0}
  trained = train.config_as_trained(config, set_keys, {})
  assert train.to_steps(trained, "total", 100.0, 8) == 2 and train.to_steps(trained.optim, "warmup", 100.0, 8) == 1
  assert config.to_dict() == before  # the user's config is only read
  # Untouched when the command line sets no duration; two units set by the user stay an error.
  config = load_config("loctex", "")
  assert train.replaced_durations(config, {"batch_size"}) == {}
  assert train.config_as_trained(config, {"batch_size"}, {}).to_dict() == config.to_dict()
  config = load_config("loctex", "")
  config.total_steps = 2
  trained = train.config_as_trained(config, {"total_steps", "total_epochs"}, {})
  with pytest.raises(ValueError, match="Set exactly one of total_steps"):
    train.to_steps(trained, "total", 100.0, 8)


def test_a_recipe_without_its_bert_folder_exits_2_saying_what_to_pass(tmp_path):
  proc = run_main(
    tmp_path / "run", "--config.method.bert_path=", "--config.tokenizer.path=", config="tests/tiny_icmlm.py"
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "ERROR: No BERT folder given" in proc.stderr and "pass bert=PATH" in proc.stderr
  assert "Traceback" not in proc.stderr
