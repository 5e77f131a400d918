"""A tiny LocTex run for tests: 32x32 synthetic scenes (grids 2x2 at 1x, 4x4 at 2x: the small stem
of runlocal, output stride 16), one-block ResNet."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

import loctex  # noqa: E402


def get_config(arg=None):
  c = loctex.get_config("runlocal" + ("," + arg if arg else ""))
  data_dir = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
  sizes = tuple(s // 2 for s in c.method.grid_sizes)
  own = c.data.name == "image_text"  # data=DIR: the test's own-data folder
  if not own:
    c.data.update(config_name="tiny", data_dir=data_dir)
  if own:  # own-data runs evaluate on the data's held-out part; the synthetic probe is tested elsewhere
    del c.evals["probe"]
  c.data.pp = c.data.pp.replace("inception_crop(64,", "inception_crop(32,").replace(
    str(c.method.grid_sizes), str(sizes)
  )
  c.method.grid_sizes = sizes
  c.method.update(embed_dim=16)
  c.method.backbone = dict(depth=10, width=8, bn_group_size=4, stem="small", stem_stride=2)
  c.method.text = dict(hidden=32, num_layers=1, num_heads=2, max_len=60, dropout=0.1)
  c.tokenizer.vocab_size = 200
  c.batch_size = 8
  c.total_steps = 6
  c.optim.warmup_steps = 2
  c.checkpoint.update(every_steps=3, keep=10, async_save=False)
  c.log_every_steps = 1
  if "probe" in c.evals:
    c.evals.probe.update(config_name="tiny", data_dir=data_dir, batch_size=16, every_steps=0, costs=(0.1, 1.0))
  if "localization" in c.evals:
    loc = c.evals.localization
    loc.update(config_name="tiny", data_dir=data_dir, batch_size=8, limit=16, grid_sizes=sizes)
    loc.pp = loc.pp.replace(str(tuple(s * 2 for s in sizes)), str(sizes))
  return c
