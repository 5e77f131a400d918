"""vlrep.tools.train_metrics reads back exactly what the training loop's writer logged."""

import numpy as np
import pytest
from clu import metric_writers

from vlrep.tools import train_metrics


def test_reads_scalars_per_step_filters_tags_skips_images_and_prefers_the_latest_file(tmp_path):
  writer = metric_writers.create_default_writer(str(tmp_path))
  writer.write_scalars(1, {"train/loss": 2.5, "train/grad_norm": 44.25})
  writer.write_scalars(2, {"train/loss": 2.0})
  writer.write_images(2, {"attention": np.zeros((1, 4, 4, 3), np.float32)})
  writer.write_scalars(5, {"probe/map": 31.5})
  writer.close()

  rows = train_metrics.read_scalars(str(tmp_path))
  assert rows == {1: {"train/loss": 2.5, "train/grad_norm": 44.25}, 2: {"train/loss": 2.0}, 5: {"probe/map": 31.5}}
  assert train_metrics.read_scalars(str(tmp_path), ["grad_norm", "probe/"]) == {
    1: {"train/grad_norm": 44.25},
    5: {"probe/map": 31.5},
  }
  table = train_metrics.format_rows(rows).splitlines()
  assert table[0].split() == ["step", "probe/map", "train/grad_norm", "train/loss"]
  assert table[2].split() == ["2", "2.0000"]  # blank cells for tags not logged at that step
  assert train_metrics.format_rows(rows, "csv").splitlines()[1] == "1,,44.25,2.5"

  # A resumed run writes a second event file; its value for a step already logged wins.
  import time

  time.sleep(1.1)  # event files are named by the second they were opened
  writer = metric_writers.create_default_writer(str(tmp_path))
  writer.write_scalars(2, {"train/loss": 1.5})
  writer.close()
  assert train_metrics.read_scalars(str(tmp_path), ["train/loss"])[2] == {"train/loss": 1.5}

  with pytest.raises(FileNotFoundError, match="No events.out.tfevents"):
    train_metrics.read_scalars(str(tmp_path / "missing"))
