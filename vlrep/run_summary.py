"""A run folder's summary.json (WORKDIR/summary.json: flat metrics every tool adds its own keys to), read and merged
with numpy and vlrep's file helpers alone, so a torch-side command (the Detectron2 driver, which imports neither JAX
nor TensorFlow) writes its metrics the same way as the JAX side."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from vlrep import errors, safe_files

MAX_SUMMARY_BYTES = 64 << 20  # a summary of a few thousand metrics is a few hundred KB


def read_summary(workdir: str) -> dict[str, Any]:
  """WORKDIR/summary.json's metrics ({} without one); a file that is not a JSON object of metrics (a run folder
  from elsewhere may hold anything there) is one BadFile message."""
  path = os.path.join(workdir, "summary.json")
  if not os.path.lexists(path):
    return {}
  with errors.reading(path, what="run summary (JSON)", hint="Move it aside; vlrep writes a fresh one."):
    if not os.path.isfile(path) or os.path.getsize(path) > MAX_SUMMARY_BYTES:
      raise ValueError(f"not a regular file of at most {MAX_SUMMARY_BYTES >> 20} MB")
    with open(path) as f:
      summary = json.load(f)
    if not isinstance(summary, dict):
      raise ValueError(f"a JSON {type(summary).__name__}, not an object")
  return summary


def _plain(value: Any) -> Any:
  """A numpy (or JAX) scalar as a float; JSON's own values unchanged."""
  if isinstance(value, (bool, int, float, str, list, dict, type(None))):
    return value
  return float(value) if np.ndim(value) == 0 else value


def write_summary(workdir: str, values: dict[str, Any]) -> None:
  """Merges flat metrics into WORKDIR/summary.json (atomically, through safe_files: a link planted at the name or
  its temporary file is never followed; other tools add their own keys)."""
  summary = read_summary(workdir)
  summary.update({k: _plain(v) for k, v in values.items()})
  safe_files.write_json(os.path.join(workdir, "summary.json"), summary, root=workdir, sort_keys=True)
