"""What every format module of vlrep/interop/formats/ shares: the run an importer produces (`ImportedRun`), key
maps as data (`Rule`s read both ways by `KeyMap`, with every layout change in the one `TRANSFORMS` table), safe
loading of checkpoint files, and which format's keys a file fits (`closest_format`).

A format module (`vlrep/interop/formats/<format>.py`, found with `vlrep.modules.get("interop.formats", name,
"format")`) provides, for the directions it supports:

  DESCRIPTION: str                       one line for `--help` and for errors
  def score(keys: set[str]) -> tuple[float, list[str], list[str]]                              (import)
      how well a state dict's key set matches this format (1.0: every key the format needs is there), the first
      missing keys and the first unexpected ones: a file that matches no format names the closest one.
  def read(checkpoint: str, vocab: str | None, *, contents=None, config=None, **options) -> ImportedRun
      (import) the run's contents; a clear error (naming the tensor and both shapes, the missing/unexpected keys, a
      vocabulary whose size differs from the embedding) before anything is written. `contents`: what
      `load_checkpoint` read from the file when the caller read it already (--format=auto reads it to score it), so
      a checkpoint is read once. `config`: a recipe's config to start the run's from; None: the format builds it
      (the model as published: no file of the repository's configs/ is read).
  OUT_SUFFIXES: tuple[str, ...]                                                                 (export)
      what --out may end in (empty: a folder)
  def export(run: vlrep.runs.Run, out: str, overwrite: bool) -> dict                            (export)
      writes the run in the format to `out`; returns {'keys', 'parameters', 'step', ...}. A run the format cannot
      hold is a UserError saying why, before anything is written.

Safe loading only: safetensors, or torch.save files through `vlrep.torch_files` (`load_checkpoint` and
`load_state_dict` below; a restricted unpickler: tensors, ordered dicts and plain containers; any other object the
file asks for is an error naming the file and the global, and no code runs).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np
from ml_collections import ConfigDict

from vlrep import modules, torch_files
from vlrep.errors import BadFile, UserError


@dataclasses.dataclass
class ImportedRun:
  """What an importer produces: a training config as vlrep's own configs write it (so every consumer of runs
  rebuilds the model from it), the parameters and the model state (e.g. {'batch_stats': ...}) as numpy trees,
  and a note for the run's metadata (source file, format, what was dropped and why)."""

  config: ConfigDict
  params: dict
  model_state: dict
  note: dict
  # Files the run keeps beside its checkpoints ({path relative to the run directory: source file}), e.g. the
  # vocabulary its config's tokenizer names; `vlrep.interop.import_run` copies them.
  files: dict = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------------------------------------------
# Export: what every exporting format shares.
# ------------------------------------------------------------------------------------------------------------------
class NotExportable(UserError):
  """A by-design refusal: the run, the format or --out cannot give the file asked for (the message says why)."""


class OutExists(UserError, FileExistsError):
  """--out is a non-empty folder and --overwrite was not given (folder formats)."""


def refusal(call, *args):
  """`call(*args)`, a format's own check of a run, whose ValueErrors are refusals that say what the run lacks (a
  VirTex export of a CLIP run, a VisualBERT export of a run with another embedding): one message, exit 2."""
  try:
    return call(*args)
  except UserError:
    raise
  except ValueError as e:
    raise NotExportable(str(e)) from e


def out_root(out: str) -> str:
  """The folder the user named for --out: every file is written inside it, never through a link in it."""
  return os.path.dirname(os.path.abspath(out))


def parameter_count(sd: dict) -> int:
  """The parameters of a foreign state dict (BatchNorm statistics and counters are not parameters)."""
  stats = ("running_mean", "running_var", "num_batches_tracked")
  return sum(int(np.prod(v.shape)) for k, v in sd.items() if not k.endswith(stats))


def require_torch(why: str):
  """The torch module, for the formats that write torch.save files; vlrep's JAX side runs without PyTorch
  installed, so it is imported only when such a file is written, and its absence is said with `why`."""
  try:
    import torch
  except ImportError as e:
    raise NotExportable(f"{why} (import torch failed: {e})") from e
  return torch


# ------------------------------------------------------------------------------------------------------------------
# Which format a file is: the import formats' scores of its keys.
# ------------------------------------------------------------------------------------------------------------------
def import_formats() -> list[str]:
  """The formats that import (their module has `score` and `read`), by name."""
  return [name for name in modules.available("interop.formats") if hasattr(format_module(name), "read")]


def export_formats() -> list[str]:
  """The formats that export (their module has `export`), by name."""
  return [name for name in modules.available("interop.formats") if hasattr(format_module(name), "export")]


def format_module(name: str):
  """vlrep.interop.formats.<name>, or a UserError listing the formats."""
  return modules.get("interop.formats", name, "format")


def closest_format(keys: set[str]) -> tuple[str, float, list[str], list[str]]:
  """(format, score, first missing keys, first unexpected keys) of the import format whose `score` is highest."""
  best = None
  for name in import_formats():
    s, missing, unexpected = format_module(name).score(keys)
    if best is None or s > best[1]:
      best = (name, s, missing, unexpected)
  if best is None:
    raise ValueError("No import format has a `score`.")
  return best


def no_format_error(path: str, keys: set[str], fmt: str, score: float, missing, unexpected) -> BadFile:
  """The error for a file that is not (or not wholly) in a format: what it is closest to and how it differs."""
  sample = sorted(keys)[:5]
  return BadFile(
    f"{path} matches no import format: the closest is {fmt!r} (score {score:.2f} of 1), but "
    f"{len(missing)} keys it needs are missing (first: {missing[:5]}) and {len(unexpected)} of the file's keys are "
    f"unexpected (first: {unexpected[:5]}). The file has {len(keys)} tensors, e.g. {sample}."
  )


# ------------------------------------------------------------------------------------------------------------------
# Safe loading: safetensors, or torch.save files through vlrep.torch_files (a restricted unpickler; no code runs).
# ------------------------------------------------------------------------------------------------------------------
def load_checkpoint(path: str) -> Any:
  """A .safetensors file as {name: array} (`vlrep.torch_files.load_safetensors`: every declared size checked
  first); any other file (.pth/.pt/.bin: torch.save, zip or legacy format) through `vlrep.torch_files.load_checkpoint`:
  plain Python containers and numpy arrays; a file that asks for any other object is a `torch_files.UnsafeFile`
  error naming the file and the global (nothing in it is imported or run). A malformed file is a
  `vlrep.errors.BadFile` naming it."""
  if not path.endswith(".safetensors"):
    return torch_files.load_checkpoint(path)
  return torch_files.load_safetensors(path)  # its header checked against the file before anything is read


def load_state_dict(path: str) -> dict[str, np.ndarray]:
  """The state dict of a checkpoint file ({name: numpy array}, `vlrep.torch_files.as_state_dict`): the file's
  top level, or what it holds under 'model' / 'state_dict' (VirTex's {"model": ..., "optimizer": ..., "iteration":
  ...}); a 'module.' prefix on every key (a DistributedDataParallel model's) is removed. Read once by whoever needs
  it and passed on (`read(..., state_dict=...)`)."""
  if not os.path.exists(path):
    raise torch_files.MissingFile(f"No checkpoint file {path}.")
  return torch_files.as_state_dict(load_checkpoint(path), path)


# ------------------------------------------------------------------------------------------------------------------
# Key maps as data: one table per format, read by its importer and its exporter.
# ------------------------------------------------------------------------------------------------------------------
# Dead rows: a vocabulary row that the foreign model does not have (an official VirTex vocabulary lacks vlrep's
# separate [UNK] id) gets this output bias: exp(-1e4 + any real logit) is 0 in float32, so the softmax over the
# foreign vocabulary is unchanged, the row is never predicted and its gradient is exactly 0.
DEAD_LOGIT = -1e4


def _vocab_to_foreign(x, order):
  if order is None:
    return x
  keep = order >= 0
  out = np.zeros((int(order.max()) + 1,) + x.shape[1:], x.dtype)
  out[order[keep]] = x[keep]
  return out


def _vocab_to_vlrep(x, order, dead):
  if order is None:
    return x
  out = x[np.maximum(order, 0)].copy()
  out[order < 0] = dead
  return out


# Every layout change of every format, in one table. name: (vlrep layout -> foreign layout, foreign layout -> vlrep
# layout given the vlrep shape); ctx['vocab_order']: `tokenizers.virtex_vocabulary_order` when the foreign
# vocabulary's ids are ordered otherwise than the run's.
TRANSFORMS = {
  "same": (lambda x, ctx: x, lambda x, shape, ctx: x),
  # Convolution kernel: Flax HWIO <-> torch OIHW.
  "conv": (lambda x, ctx: np.transpose(x, (3, 2, 0, 1)), lambda x, shape, ctx: np.transpose(x, (2, 3, 1, 0))),
  # Dense kernel [in, out] <-> torch Linear weight [out, in].
  "linear": (lambda x, ctx: x.T, lambda x, shape, ctx: x.T),
  # Attention projections: DenseGeneral kernel [H, heads, d] <-> one block [heads * d, H] of torch's in_proj_weight.
  "heads_in": (lambda x, ctx: x.reshape(x.shape[0], -1).T, lambda x, shape, ctx: x.T.reshape(shape)),
  "heads_bias": (lambda x, ctx: x.reshape(-1), lambda x, shape, ctx: x.reshape(shape)),
  # Attention output: DenseGeneral kernel [heads, d, H] <-> torch's out_proj.weight [H, heads * d].
  "heads_out": (lambda x, ctx: x.reshape(-1, x.shape[-1]).T, lambda x, shape, ctx: x.T.reshape(shape)),
  # Vocabulary rows (embedding table [V, H], output bias [V], classifier kernel [C, V]) in the run's id order.
  "vocab_rows": (
    lambda x, ctx: _vocab_to_foreign(x, ctx.get("vocab_order")),
    lambda x, shape, ctx: _vocab_to_vlrep(x, ctx.get("vocab_order"), 0.0),
  ),
  "vocab_bias": (
    lambda x, ctx: _vocab_to_foreign(x, ctx.get("vocab_order")),
    lambda x, shape, ctx: _vocab_to_vlrep(x, ctx.get("vocab_order"), DEAD_LOGIT),
  ),
  "vocab_linear": (
    lambda x, ctx: _vocab_to_foreign(x.T, ctx.get("vocab_order")),
    lambda x, shape, ctx: _vocab_to_vlrep(x, ctx.get("vocab_order"), 0.0).T,
  ),
  # The sentence-image head's two logits in the other order (a kernel, its bias): VisualBERT's are (the text
  # matches the image, random), vlrep's alignment head's (not aligned, aligned).
  "linear_swap2": (lambda x, ctx: x.T[::-1], lambda x, shape, ctx: x[::-1].T),
  "swap2": (lambda x, ctx: x[::-1], lambda x, shape, ctx: x[::-1]),
}


@dataclasses.dataclass(frozen=True)
class Rule:
  """One tensor of a run and its foreign name(s).

  vlrep: its path in the run's variables ('params/...', 'batch_stats/...'); '{}' stands for a number, the same
    numbers in the same order as in `foreign`. None: a foreign tensor without a vlrep counterpart (see `absent`).
  foreign: the foreign key; further keys are tied copies that hold the identical tensor (checked on import,
    written on export).
  transform: a TRANSFORMS name (the layout change).
  part: (i, n): the tensor is the i-th of n equal blocks along the foreign tensor's first axis (torch's fused
    in_proj_weight holds Q, K and V).
  absent: for vlrep=None: 'zeros' (a block that is exactly redundant, dropped on import with its largest
    magnitude noted, written as zeros on export), 'counter' (an integer buffer kept in the run's note and written
    back) or 'dropped' (not part of a vlrep run, e.g. a classifier head; named in the note, not exported).
  """

  vlrep: str | None
  foreign: tuple[str, ...]
  transform: str = "same"
  part: tuple[int, int] = (0, 1)
  absent: str = ""

  def __post_init__(self):
    if self.transform not in TRANSFORMS:
      raise ValueError(f"Unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}")


def rule(vlrep: str | None, *foreign: str, transform: str = "same", part=(0, 1), absent: str = "") -> Rule:
  return Rule(vlrep, tuple(foreign), transform, tuple(part), absent)


def _regex(pattern: str) -> re.Pattern:
  return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


def _fill(pattern: str, groups) -> str:
  return pattern.replace("{}", "{}").format(*groups)


def _natural(key: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
  """{'a': {'b': x}} -> {'a/b': x}."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


@dataclasses.dataclass
class Converted:
  """What `KeyMap.to_vlrep` read: the run's variables (flat), the foreign keys it dropped (with their shapes), the
  integer counters it kept, and the largest magnitude of each exactly-redundant block it dropped."""

  variables: dict[str, np.ndarray]
  dropped: dict[str, list[int]]
  counters: dict[str, int]
  redundant_max: dict[str, float]


class KeyMap:
  """A format's table of `Rule`s, read both ways: a foreign state dict -> a run's variables (`to_vlrep`, checking
  every shape, tied copy and key) and back (`to_foreign`)."""

  def __init__(self, name: str, rules: list[Rule]):
    self.name = name
    self.rules = list(rules)
    self._vlrep = [(_regex(r.vlrep), r) for r in self.rules if r.vlrep is not None]
    self._foreign = [(_regex(f), r, i) for r in self.rules for i, f in enumerate(r.foreign)]

  def foreign_patterns(self) -> list[re.Pattern]:
    return [p for p, _, _ in self._foreign]

  def matches(self, key: str) -> bool:
    return any(p.match(key) for p, _, _ in self._foreign)

  def _rule_for(self, path: str):
    for regex, r in self._vlrep:
      m = regex.match(path)
      if m:
        return r, [_fill(f, m.groups()) for f in r.foreign]
    raise KeyError(f"{self.name}: no foreign name for the run's variable {path!r} (the key map lacks a rule).")

  def to_vlrep(self, sd: dict[str, np.ndarray], expected: dict[str, tuple], ctx: dict | None = None) -> Converted:
    """The run's variables (flat paths -> float32 arrays of the `expected` shapes) from a foreign state dict.

    Errors (before anything is written): a shape that differs (naming the tensor and both shapes), tied copies that
    differ, keys the model needs that are missing and keys that nothing reads."""
    ctx = ctx or {}
    out, used, missing = {}, set(), []
    for path in sorted(expected):
      r, keys = self._rule_for(path)
      shape = tuple(expected[path])
      main = keys[0]
      if main not in sd:
        missing.append(main)
        continue
      x = np.asarray(sd[main])
      i, n = r.part
      want = np.shape(TRANSFORMS[r.transform][0](np.zeros(shape, np.float32), ctx))
      if n > 1:
        full = (want[0] * n,) + tuple(want[1:])
        if x.shape != full:
          raise ValueError(
            f"Shape mismatch: {main} is {tuple(x.shape)} in the checkpoint, but the model built from its other "
            f"tensors needs {full} for {path} ({shape} in vlrep's layout)."
          )
        x = x[i * want[0] : (i + 1) * want[0]]
      elif x.shape != tuple(want):
        raise ValueError(
          f"Shape mismatch: {main} is {tuple(x.shape)} in the checkpoint, but the model built from its other tensors "
          f"needs {tuple(want)} for {path} ({shape} in vlrep's layout)."
        )
      for copy in keys[1:]:
        if copy not in sd:
          missing.append(copy)
        elif not np.array_equal(np.asarray(sd[copy]), np.asarray(sd[main])):
          diff = float(np.max(np.abs(np.asarray(sd[copy], np.float64) - np.asarray(sd[main], np.float64))))
          raise ValueError(
            f"{copy} should be a tied copy of {main} (the same tensor in the reference model) but differs from it "
            f"(largest difference {diff:.3g}); the checkpoint is not a {self.name} model as its code writes it."
          )
      used.update(keys)
      y = np.asarray(TRANSFORMS[r.transform][1](x, shape, ctx))
      out[path] = contiguous(y).astype(np.float32)
    dropped, counters, redundant = {}, {}, {}
    unexpected = []
    for key in sorted(sd, key=_natural):
      hits = [(r, i) for p, r, i in self._foreign if p.match(key) and r.vlrep is None]
      if key in used and not hits:
        continue
      if not hits:
        if key not in used:
          unexpected.append(key)
        continue
      for r, _ in hits:
        x = np.asarray(sd[key])
        if r.absent == "zeros":
          j, n = r.part
          block = x.reshape(n, -1)[j] if n > 1 else x
          redundant[key if n == 1 else f"{key}[{j}/{n}]"] = float(np.max(np.abs(block))) if block.size else 0.0
        elif r.absent == "counter":
          counters[key] = int(x)
        else:
          dropped[key] = list(x.shape)
    if missing or unexpected:
      raise ValueError(
        f"The checkpoint is not a complete {self.name} model of the shape its tensors suggest: "
        f"{len(missing)} keys missing (first: {missing[:5]}), {len(unexpected)} unexpected (first: {unexpected[:5]})."
      )
    return Converted(out, dropped, counters, redundant)

  def to_foreign(self, flat: dict[str, np.ndarray], ctx: dict | None = None) -> dict[str, np.ndarray]:
    """The foreign state dict of a run's variables (flat paths): each tensor in the foreign layout under its name
    and its tied copies' names; the blocks of a fused tensor concatenated, an 'absent: zeros' block as zeros.
    Counters ('absent: counter') are the caller's to add."""
    ctx = ctx or {}
    blocks: dict[str, dict[int, np.ndarray]] = {}
    sizes: dict[str, int] = {}
    for path in sorted(flat):
      r, keys = self._rule_for(path)
      y = np.asarray(TRANSFORMS[r.transform][0](np.asarray(flat[path]), ctx))
      i, n = r.part
      for key in keys:
        blocks.setdefault(key, {})[i] = y
        sizes[key] = n
    out = {}
    for key in sorted(blocks, key=_natural):
      parts, n = blocks[key], sizes[key]
      for j in range(n):
        if j in parts:
          continue
        fill = [r for p, r, _ in self._foreign if p.match(key) and r.vlrep is None and r.part == (j, n)]
        if not fill or fill[0].absent != "zeros":
          raise ValueError(f"{self.name}: block {j} of {n} of {key} has no value in the run and no rule to fill it.")
        parts[j] = np.zeros_like(next(iter(parts.values())))
      out[key] = contiguous(np.concatenate([parts[j] for j in range(n)], 0) if n > 1 else parts[0])
    return out


def contiguous(x: np.ndarray) -> np.ndarray:
  """`x` in C order with its own shape (np.ascontiguousarray makes a 0-d tensor, a logit scale, 1-d)."""
  return np.ascontiguousarray(x).reshape(np.shape(x))
