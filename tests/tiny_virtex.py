"""A tiny VirTex run for tests: 32x32 synthetic scenes, a ResNet with one block per stage and 8 channels."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

import virtex  # noqa: E402


def get_config(arg=None):
  c = virtex.get_config("runlocal" + ("," + arg if arg else ""))
  data_dir = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
  own = c.data.name == "image_text"  # data=DIR: the test's own-data folder, its evaluators reading it
  if not own:
    c.data.update(config_name="tiny", data_dir=data_dir)
  if own:  # own-data runs evaluate on the data's held-out part; the synthetic probe is tested elsewhere
    del c.evals["probe"]
  c.data.pp = c.data.pp.replace("64", "32")
  c.method.update(hidden=32, num_layers=1, max_len=40, backbone=dict(depth=10, width=8, bn_group_size=4))
  c.tokenizer.vocab_size = 200
  c.batch_size = 8
  c.total_steps = 6
  c.optim.warmup_steps = 2
  c.checkpoint.update(every_steps=6, keep=10, async_save=False)  # saved at the run's end only: a save costs ~0.6 s
  c.log_every_steps = 1
  if "probe" in c.evals:
    c.evals.probe.update(config_name="tiny", data_dir=data_dir, batch_size=16, every_steps=0, costs=(0.1, 1.0))
  if "captioning" in c.evals:
    c.evals.captioning.update(batch_size=8, limit=8, max_len=6)
    if not own:
      c.evals.captioning.update(config_name="tiny", data_dir=data_dir)
  return c
