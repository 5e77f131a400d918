"""A run's dataset builder, tokenizer and method, built from its config the one way the training loop,
`vlrep.evaluate` and the tools all build them; and the checks the loop makes before building anything: every
dataset the run reads is prepared, and a resumed run reads the data, tokenizer and method it was trained with."""

from __future__ import annotations

import os

import jax
import ml_collections

from vlrep import evaluators, methods
from vlrep.data import concepts, pipeline, tokenizers
from vlrep.errors import DatasetNotPrepared, UserError


def build(config: ml_collections.ConfigDict, for_training: bool = False):
  """(the training data's TFDS builder, `RunInputs`): the run's tokenizer (none for a method without text, e.g.
  the fine-tuning classifier), what its method needs from the data (a concept set: ICMLM, MCT's tags on own data;
  a VQA run's answer vocabulary) and the method built with it, on this process.

  `for_training` also checks that the training split has the fields the method's recipe requires (a clear error
  before anything starts, instead of a missing key mid-run). Only training generates a dataset generated on first
  use (synthetic_scenes): the tools that rebuild a loaded run with this function read its data where its saved
  config says, never write there."""
  data = config.data
  builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"), generate=for_training)
  if for_training:
    pipeline.check_required_fields(builder, data.split, data.get("requires", {}), config.method.name)
  return builder, _run_inputs(config, builder)


def build_inputs(config: ml_collections.ConfigDict):
  """`RunInputs` of a trained or imported run, for commands that only apply it (vlrep.evaluate, the caption tool):
  the training data's builder is opened only when building them needs it (a vocabulary built from or stored next
  to the training data, a concept set, a method's `setup`), so an imported run with its own vocabulary needs no
  training dataset prepared.

  `config` is a run's saved config (`vlrep.runs` checked its names and turned its `build_if_missing` off), and
  everything it names is only read: a missing tokenizer, concept set or generated dataset is an error, never
  written at a path the run folder chose."""
  data = config.data
  builder = None
  if _needs_training_data(config):  # read only: a saved config's data_dir is never generated into
    builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"), generate=False)
  return _run_inputs(config, builder)


def _needs_training_data(config) -> bool:
  tok = config.get("tokenizer")
  own_bpe = tok and tok.get("kind", "bpe") == "bpe" and tok.get("special_tokens", "vlrep") == "vlrep"
  vocab_missing = own_bpe and not (tok.get("path") and os.path.exists(os.path.expanduser(tok.path)))
  return bool(vocab_missing or config.get("concepts") or methods.has_setup(config.method.name))


def _run_inputs(config, builder):
  tokenizer = tokenizers.ensure_tokenizer(config.tokenizer, builder) if config.get("tokenizer") else None
  needs = {**concepts.run_concepts(config, builder, tokenizer), **methods.setup(config, builder, tokenizer)}
  method = methods.build(config.method, tokenizer.vocab_size if tokenizer else 0, **needs)
  return evaluators.RunInputs(
    tokenizer=tokenizer, method=method, needs=needs, host=jax.process_index(), num_hosts=jax.process_count()
  )


def check_datasets_prepared(config: ml_collections.ConfigDict) -> None:
  """Opens every dataset the run reads (the training data, each evaluator's `dataset`) before anything is built:
  a missing one is found in seconds, not after the model's creation (a minute for a ResNet-50) or the first
  evaluation, and all missing ones are named at once, each with the command that prepares it."""
  reads = {"data": (config.data.name, config.data.get("data_dir"), config.data.get("config_name"))}
  for name, e in config.get("evals", {}).items():
    if e.get("dataset"):
      reads[f"evals.{name}"] = (e.dataset, e.get("data_dir"), e.get("config_name"))
  missing: dict[str, list[str]] = {}  # the error's message -> the config entries reading that dataset
  for where, (name, data_dir, config_name) in reads.items():
    try:
      pipeline.get_builder(name, data_dir, config_name)
    except DatasetNotPrepared as e:
      missing.setdefault(str(e), []).append(where)
  if not missing:
    return
  lines = [f"{len(missing)} dataset(s) this run reads are not prepared (nothing was built or trained):"]
  for message, used_by in missing.items():
    lines.append(f"- for {', '.join(used_by)}: {message}")
  if any(w.startswith("evals.") for used_by in missing.values() for w in used_by):
    lines.append("Or train without those evaluations (--config.evals={} drops them all) and evaluate later.")
  raise DatasetNotPrepared("\n".join(lines))


class ChangedInputsError(UserError):
  """A run resumed with another dataset, tokenizer or method than its checkpoints were trained with."""


def inputs_of(config) -> dict[str, object]:
  """What a run's checkpoints are tied to: its training data (dataset, config, folder, split), its tokenizer (all
  its settings but whether to build a missing one) and its method."""
  tok = config.get("tokenizer") or {}
  data, tokenizer = config.data, dict(tok.to_dict() if hasattr(tok, "to_dict") else tok)
  tokenizer.pop("build_if_missing", None)
  if tokenizer.get("path"):
    tokenizer["path"] = _folder(tokenizer["path"])
  return {
    "data.name": data.name,
    "data.config_name": data.get("config_name") or "",
    "data.data_dir": _folder(data.get("data_dir") or ""),
    "data.split": data.split,
    "tokenizer": tokenizer,
    "method.name": config.method.name,
  }


def _folder(path: str) -> str:
  return os.path.abspath(os.path.expanduser(path)) if path and "://" not in path else path


def check_resumed_inputs(saved: ml_collections.ConfigDict, config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses to resume the run in `workdir` (trained with the `saved` config) with other training data, another
  tokenizer or another method: it would train on with a new tokenizer, a vocabulary built from other captions, and
  rewrite the run's summary, silently. `--allow_changed_data` (vlrep.main) continues it knowingly."""
  before, now = inputs_of(saved), inputs_of(config)
  changed = [k for k in now if before.get(k) != now[k]]
  if not changed:
    return
  lines = [f"The run in {workdir} was trained with other inputs than this command gives:"]
  lines += [f"  {k}: trained with {before.get(k)!r}, now {now[k]!r}" for k in changed]
  lines.append(
    "Use a fresh --workdir for the new data, or the config it was trained with; to continue this run on the new "
    "inputs knowingly, pass --allow_changed_data."
  )
  raise ChangedInputsError("\n".join(lines))
