"""vlrep.bench.memory: the compiled step's per-device memory falls with microbatches (the tiny CLIP, whose loss mixes
the whole batch: the gradient cache's case), a setting the loop refuses is listed as refused, and --time times each
setting beside the one-shot step."""

import os

from vlrep.bench import memory

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_memory_falls_with_microbatches_and_refused_settings_are_named():
  label, path, arg, devices = memory.parse_method(os.path.join(TESTS, "tiny_clip.py") + "@1", 8)
  assert (label, arg, devices) == ("tiny_clip", None, 1)
  # 8 examples in 3 microbatches: refused before anything compiles.
  rows = memory.memory_table(label, path, arg, devices, memory.grid([1, 2, 3], ["none"]))
  one, two, three = rows
  assert "batch_size=8 does not split into microbatches=3" in three["refused"], three
  assert two["argument_bytes"] == one["argument_bytes"]  # the same state and batch come in
  # The activations of one microbatch of 4 instead of the batch of 8: were every microbatch's activations kept
  # (or the whole batch's forward pass), temp would not fall.
  assert two["temp_bytes"] < 0.75 * one["temp_bytes"], (one, two)
  assert two["vs_one_shot"] < 0.8, two
  # The gradient cache runs the towers' forward pass twice (CLIP's combine is not linear in the embeddings): more
  # model FLOPs than one pass, less than two.
  assert 1.0 < two["flops_vs_one_shot"] < 1.5, two
  table = memory.memory_markdown(rows)
  assert "| tiny_clip | 1 | 8 (4) | 2 | none |" in table and "refused" in table, table


def test_time_table_times_each_setting_beside_the_one_shot_step():
  path = os.path.join(TESTS, "tiny_clip.py")
  timed = memory.time_table("tiny_clip", path, None, [(2, "none")], 8, 32, 1, 1)
  one, two = timed["rows"]
  assert (one["microbatches"], one["remat"], one["vs_one_shot"]) == (1, "none", 1.0), one
  assert two["microbatches"] == 2 and two["step_seconds"] > 0 and two["vs_one_shot"] > 0, two
  assert "| tiny_clip | 8 | 2 | none |" in memory.time_markdown(timed["rows"])
