"""Foreign checkpoints in: one module per format (`vlrep/importers/<format>.py`), dispatched by name by
`vlrep.import_run`. Each module turns a published checkpoint into what a vlrep run holds (its config, parameters
and model state), with its key map written as data (a table of name patterns and transposes) that the matching
exporter reads too, so import -> export is the identity by construction.

A format module provides:

  DESCRIPTION: str                       one line for `--help` and for errors
  def expected_keys() -> ... (optional)   whatever `score` needs
  def score(keys: set[str]) -> tuple[float, list[str], list[str]]
      how well a state dict's key set matches this format (1.0: every key the format needs is there), the first
      missing keys and the first unexpected ones: a file that matches no format names the closest one.
  def read(checkpoint: str, vocab: str | None, **options) -> ImportedRun
      the run's contents; a clear error (naming the tensor and both shapes, the missing/unexpected keys, a
      vocabulary whose size differs from the embedding) before anything is written.

Safe loading only: safetensors, or `load_state_dict` below (a restricted unpickler: tensors, ordered dicts and
plain containers; no code runs).
"""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict


@dataclasses.dataclass
class ImportedRun:
  """What an importer produces: a training config as vlrep's own configs write it (so every consumer of runs
  rebuilds the model from it), the parameters and the model state (e.g. {'batch_stats': ...}) as numpy trees,
  and a note for the run's metadata (source file, format, what was dropped and why)."""

  config: ConfigDict
  params: dict
  model_state: dict
  note: dict
