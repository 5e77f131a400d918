"""A tiny CLIP run for tests: 32x32 synthetic scenes, a one-block ResNet with the ImageNet stem (so its backbone
exports), a one-layer text tower."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

import clip  # noqa: E402


def get_config(arg=None):
  c = clip.get_config("runlocal" + ("," + arg if arg else ""))
  data_dir = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
  own = c.data.name == "image_text"  # data=DIR: the test's own-data folder, its evaluators reading it
  if not own:
    c.data.update(config_name="tiny", data_dir=data_dir)
  if own:  # own-data runs evaluate on the data's held-out part; the synthetic probe is tested elsewhere
    del c.evals["probe"]
  c.method.update(embed_dim=16)
  c.method.backbone = dict(depth=10, width=8, bn_group_size=4)
  c.method.text = dict(hidden=32, num_layers=1, num_heads=2, max_len=40, dropout=0.0)
  c.tokenizer.vocab_size = 200
  c.batch_size = 8
  c.total_steps = 4
  c.optim.warmup_steps = 2
  c.checkpoint.update(every_steps=4, keep=10, async_save=False)  # saved at the run's end only: a save costs ~0.6 s
  c.log_every_steps = 1
  if "probe" in c.evals:
    c.evals.probe.update(config_name="tiny", data_dir=data_dir, batch_size=16, every_steps=0, costs=(0.1, 1.0))
  c.evals.retrieval.update(batch_size=8, limit=16)
  c.evals.retrieval.random_init = False  # the loop's random_init path is covered by the probe's; saves CI time
  if not own:
    c.evals.retrieval.update(config_name="tiny", data_dir=data_dir)
  return c
