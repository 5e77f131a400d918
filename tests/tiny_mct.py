"""A tiny MCT run for tests: 32x32 synthetic scenes, one-block ResNet, a queue of 32 keys."""

import os
import sys

from vlrep import defaults

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

import mct  # noqa: E402


def get_config(arg=None):
  c = mct.get_config("runlocal" + ("," + arg if arg else ""))
  data_dir = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
  own = c.data.name == "image_text"  # data=DIR: the test's own-data folder, its evaluators reading it
  if not own:
    c.data.update(config_name="tiny", data_dir=data_dir)
  if own:  # own-data runs evaluate on the data's held-out part; the synthetic probe is tested elsewhere
    del c.evals["probe"]
  c.data.pp = c.data.pp.replace("inception_crop(64,", "inception_crop(32,")
  c.method.update(head_hidden=32, intra_dim=8, inter_dim=16, queue_size=32)
  c.method.backbone = dict(depth=10, width=8, bn_group_size=4)
  c.method.text = dict(hidden=32, num_layers=1, num_heads=2, max_len=40, dropout=0.1)
  c.tokenizer.vocab_size = 200
  c.batch_size = 8
  c.total_steps = 6
  c.optim.warmup_steps = 2
  c.checkpoint.update(every_steps=3, keep=10, async_save=False)
  c.log_every_steps = 1
  if "probe" in c.evals:
    c.evals.probe.update(config_name="tiny", data_dir=data_dir, batch_size=16, every_steps=0, costs=(0.1, 1.0))
  c.evals.retrieval.update(batch_size=8, limit=16)
  c.evals.vsepp.update(batch_size=8, train_limit=16, test_limit=16)
  c.evals.vsepp.update(embed_dim=16, word_dim=8, epochs=2, lr_update_epochs=1, train_batch_size=16)
  c.evals.vsepp.random_init = False  # the loop's random_init path is covered by retrieval's; saves CI time
  if own:  # the held-out retrieval validates own-data runs; VSE++ on it is config-tested (test_own_data.py)
    del c.evals["vsepp"]
    return c
  c.evals.retrieval.update(config_name="tiny", data_dir=data_dir)
  c.evals.vsepp.update(config_name="tiny", data_dir=data_dir)
  c.evals.tagging = dict(defaults.TAGGING_COCO, **defaults.TAGGING_RUNLOCAL)
  c.evals.tagging.update(config_name="tiny", data_dir=data_dir, batch_size=8, train_limit=24, test_limit=16)
  c.evals.tagging.update(hidden=16, epochs=2, train_batch_size=8)
  return c
