"""The config stays a value: what a run derives from it (its length in steps, the backbone architecture init_from
adopts, the recipe's duration the command line replaces) is computed beside it, never written back into it; the
checkpoints record the config the model was built from, so that evaluate, export and resume rebuild that model."""

from __future__ import annotations

import tiny_finetune

from vlrep import runs, train


def test_training_leaves_the_config_as_loaded_and_records_the_model_it_built(tiny_virtex_run, tmp_path):
  assert tiny_virtex_run.returncode == 0, tiny_virtex_run.stderr[-2000:]
  config = tiny_finetune.get_config()  # the recipe trains 3 steps
  # Epochs given on the command line (a quarter of the 64 tiny training scenes at batch 8: 2 steps) replace the
  # recipe's steps; init_from's run is a ResNet-10 of width 8, this config's backbone a ResNet-18 of width 16.
  config.update(init_from=str(tiny_virtex_run.workdir), total_epochs=0.25, evals={})
  config.method.backbone.update(depth=18, width=16)
  config.lock()
  before = config.to_dict()
  workdir = str(tmp_path / "ft")
  summary = train.train_and_evaluate(config, workdir, command_line_keys={"total_epochs"})
  assert config.to_dict() == before
  assert summary["steps"] == 2
  saved = runs.read_config(workdir)
  assert (saved.method.backbone.depth, saved.method.backbone.width) == (10, 8)
  assert (saved.total_steps, saved.total_epochs) == (0, 0.25)
  # Resumed with the same config and command line: the same plan, nothing trained again, the config untouched.
  summary = train.train_and_evaluate(config, workdir, command_line_keys={"total_epochs"})
  assert summary["steps"] == 2 and config.to_dict() == before


def test_the_plan_reads_the_config_and_the_split_size_only():
  config = tiny_finetune.get_config()
  config.update(total_steps=0, total_epochs=2.5)
  config.optim.warmup_epochs = 0.5
  before = config.to_dict()
  plan = train.TrainingPlan.of(config, 64)
  assert plan == train.TrainingPlan(num_examples=64, steps_per_epoch=8.0, total_steps=20, warmup_steps=4)
  assert config.to_dict() == before
