"""A tiny VisualBERT / ViLBERT run for tests: 32x32 synthetic scenes, a one-block ResNet over box crops, the
packaged MiniLM's first layer."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

import vlbert  # noqa: E402


def get_config(arg=None):
  c = vlbert.get_config("runlocal" + ("," + arg if arg else ""))
  data_dir = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
  own = c.data.name == "image_text"  # data=DIR: the test's own-data folder, its evaluators reading it
  if not own:
    c.data.update(config_name="tiny", data_dir=data_dir)
  if c.data.split == "train[:6.25%]":
    c.data.split = "train"
  c.method.update(bert_layers=1, v_layers=1, v_hidden=32, v_heads=2, v_intermediate=64, bi_hidden=32, bi_heads=2)
  c.method.visual.update(backbone=dict(depth=10, width=8, bn_group_size=0), crop_size=16)
  c.batch_size = 8
  c.total_steps = 4
  c.optim.warmup_steps = 1
  c.checkpoint.update(every_steps=4, keep=10, async_save=False)  # saved at the run's end only: a save costs ~0.6 s
  c.log_every_steps = 1
  for ev in c.evals.values():
    ev.update(batch_size=8, limit=8, every_steps=0)
    if ev.get("dataset") != "image_text":
      ev.update(config_name="tiny", data_dir=data_dir)
  if "answers" in c:
    c.answers.size = 10
  return c
