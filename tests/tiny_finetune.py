"""A tiny fine-tuning run for tests: the classifier on tiny synthetic scenes, backbone shaped like tiny_virtex's."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import finetune  # noqa: E402
import tiny_virtex  # noqa: E402


def get_config(arg=None):
  c = finetune.get_config("runlocal" + ("," + arg if arg else ""))
  data_dir = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
  c.data.update(config_name="tiny", data_dir=data_dir, pp=c.data.pp.replace("64", "32"))
  c.method.backbone = tiny_virtex.get_config().method.backbone.to_dict()  # so a tiny VirTex run initialises it
  c.batch_size = 8
  c.total_epochs = 0.0
  c.total_steps = 3
  c.checkpoint.update(every_steps=3, keep=2, async_save=False)
  c.log_every_steps = 1
  for ev in c.evals.values():  # 'val' (accuracy), or labels=presence's 'probe'
    ev.update(config_name="tiny", data_dir=data_dir, batch_size=8)
  return c
