r"""Prints a run's logged metrics per step, read from its TensorBoard event files (what the loop's writer wrote).

  python -m vlrep.tools.train_metrics --workdir=/tmp/loctex_local --metrics=grad_norm,contrastive_loss
  python -m vlrep.tools.train_metrics --workdir=/tmp/loctex_local --metrics=train/ --format=csv

`--metrics` is a comma-separated list of substrings of the tag names (`train/grad_norm`, `probe/map`, ...); an
empty list prints every scalar. Steps are rows, tags columns; a tag not logged at a step is left blank.
"""

from __future__ import annotations

import collections
import glob
import os

import numpy as np
import tensorflow as tf
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The run's workdir (holds events.out.tfevents.*).")
flags.DEFINE_string("metrics", "", "Comma-separated substrings of the tags to print; empty = all scalars.")
flags.DEFINE_enum("format", "table", ["table", "csv"], "Output format.")


def read_scalars(workdir: str, patterns: list[str] | None = None) -> dict[int, dict[str, float]]:
  """{step: {tag: value}} for every scalar whose tag contains one of `patterns` (all when empty); a later
  event file or record overrides an earlier one at the same step and tag (a resumed run logs some steps twice)."""
  files = sorted(glob.glob(os.path.join(os.path.expanduser(workdir), "events.out.tfevents.*")), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f"No events.out.tfevents.* in {workdir}: not a vlrep workdir, or nothing logged yet.")
  rows: dict[int, dict[str, float]] = collections.defaultdict(dict)
  for path in files:
    for event in tf.compat.v1.train.summary_iterator(path):  # TensorFlow's own event-file reader
      for value in event.summary.value:
        if patterns and not any(p in value.tag for p in patterns):
          continue
        if value.HasField("tensor"):
          array = tf.make_ndarray(value.tensor)
          if array.size != 1 or not np.issubdtype(array.dtype, np.number):
            continue  # images, text, histograms
          rows[int(event.step)][value.tag] = float(array.reshape(()))
        elif value.HasField("simple_value"):
          rows[int(event.step)][value.tag] = float(value.simple_value)
  return dict(sorted(rows.items()))


def format_rows(rows: dict[int, dict[str, float]], fmt: str = "table") -> str:
  tags = sorted({tag for values in rows.values() for tag in values})
  if fmt == "csv":
    lines = [",".join(["step", *tags])]
    lines += [",".join([str(s), *(f"{v[t]:.6g}" if t in v else "" for t in tags)]) for s, v in rows.items()]
    return "\n".join(lines)
  cells = [["step", *tags]] + [[str(s), *(f"{v[t]:.4f}" if t in v else "" for t in tags)] for s, v in rows.items()]
  widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
  return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells)


def main(argv):
  del argv
  patterns = [p for p in FLAGS.metrics.split(",") if p]
  rows = read_scalars(FLAGS.workdir, patterns)
  if not rows:
    raise SystemExit(f"No scalar in {FLAGS.workdir} matches {patterns}.")
  print(format_rows(rows, FLAGS.format))


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
