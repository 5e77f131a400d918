"""A run's dataset builder, tokenizer and method, built from its config the one way the training loop,
`vlrep.evaluate` and the tools all build them; and the checks the loop makes before building anything: every
dataset the run reads is prepared, and a resumed run reads the data, tokenizer and method it was trained with."""

from __future__ import annotations

import json
import os

import jax
import ml_collections
from absl import logging

from vlrep import defaults, errors, evaluators, methods, safe_files
from vlrep.data import concepts, pipeline, tokenizers
from vlrep.errors import DatasetNotPrepared, UserError
from vlrep.models.bert import resolve_path


def build(config: ml_collections.ConfigDict, for_training: bool = False, run_data: RunData | None = None):
  """(the training data's TFDS builder, `EvalInputs`): the run's tokenizer (none for a method without text, e.g.
  the fine-tuning classifier), what its method needs from the data (a concept set: ICMLM, MCT's tags on own data;
  a VQA run's answer vocabulary) and the method built with it, on this process.

  `for_training` also checks that the training split has the fields the method's recipe requires (a clear error
  before anything starts, instead of a missing key mid-run). Only training generates a dataset generated on first
  use (synthetic_scenes): the tools that rebuild a loaded run with this function read its data where its saved
  config says, never write there.

  `run_data` (the training loop's): the prepared data and the tokenizer are checked against what the run in its
  workdir was trained with before the tokenizer is built (RunData.check: a changed dataset or vocabulary is
  refused unless allowed, and a run's tokenizer is never rebuilt: its own copy is used), then recorded."""
  data = config.data
  builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"), generate=for_training)
  coverage = {}
  if for_training:
    min_fraction = data.get("min_field_fraction", defaults.DATA_READING["min_field_fraction"])
    coverage = pipeline.check_required_fields(
      builder, data.split, data.get("requires", {}), config.method.name, min_fraction
    )
  if run_data:
    run_data.fields = coverage
  own_tokenizer = run_data.check(config, builder) if run_data else None
  inputs = _eval_inputs(config, builder, own_tokenizer)
  if run_data:
    tok = config.get("tokenizer")
    used = own_tokenizer or configured_tokenizer_file(tok, builder)
    own_bpe = bool(tok) and tok.get("kind", "bpe") == "bpe"
    run_data.record(builder, used, own_bpe, run_data.start_step)
  return builder, inputs


def build_inputs(config: ml_collections.ConfigDict, workdir: str | None = None):
  """`EvalInputs` of a trained or imported run, for commands that only apply it (vlrep.evaluate, the caption tool):
  the training data's builder is opened only when building them needs it (a vocabulary built from or stored next
  to the training data, a concept set, a method's `setup`), so an imported run with its own vocabulary needs no
  training dataset prepared.

  `config` is a run's saved config (`vlrep.runs` checked its names and turned its `build_if_missing` off), and
  everything it names is only read: a missing tokenizer, concept set or generated dataset is an error, never
  written at a path the run folder chose.

  `workdir`: the run's folder; its own copy of its vocabulary (WORKDIR/tokenizer/, checked against the sha256 in
  WORKDIR/data_identity.json) is read instead of the configured file, which a later prepare may have replaced."""
  data = config.data
  builder = None
  own_tokenizer = run_tokenizer_copy(workdir) if workdir and config.get("tokenizer") else None
  if _needs_training_data(config, own_tokenizer):  # read only: a saved config's data_dir is never generated into
    builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"), generate=False)
  return _eval_inputs(config, builder, own_tokenizer)


def run_tokenizer_copy(workdir: str) -> str | None:
  """WORKDIR/tokenizer/<file>, the vocabulary the run was trained with, when data_identity.json records one and
  the copy is intact (its sha256 as recorded); None otherwise (an older run, a run without a vocabulary)."""
  identity = read_identity(workdir)
  saved = (identity or {}).get("tokenizer") or {}
  if not saved.get("copy"):
    return None
  own = os.path.join(workdir, RUN_TOKENIZER_DIR, os.path.basename(str(saved["copy"])))
  if not os.path.isfile(own) or safe_files.sha256_of(own) != saved.get("sha256"):
    logging.warning("The run's own vocabulary copy %s is missing or not the one it recorded; not used.", own)
    return None
  return own


def _needs_training_data(config, tokenizer_file: str | None = None) -> bool:
  tok = config.get("tokenizer")
  own_bpe = tok and tok.get("kind", "bpe") == "bpe" and tok.get("special_tokens", "vlrep") == "vlrep"
  path = tokenizer_file or (tok.get("path") if tok else None)
  vocab_missing = own_bpe and not (path and os.path.exists(os.path.expanduser(path)))
  return bool(vocab_missing or config.get("concepts") or methods.has_setup(config.method.name))


def _eval_inputs(config, builder, tokenizer_file: str | None = None):
  """`tokenizer_file`: the vocabulary to read instead of the configured one (a resumed run's own copy)."""
  tok_config = config.get("tokenizer")
  if tok_config and tokenizer_file:
    tok_config = ml_collections.ConfigDict({**tok_config.to_dict(), "path": tokenizer_file, "build_if_missing": False})
  tokenizer = tokenizers.ensure_tokenizer(tok_config, builder) if tok_config else None
  needs = {**concepts.run_concepts(config, builder, tokenizer), **methods.setup(config, builder, tokenizer)}
  method = methods.build(methods.method_config(config), tokenizer.vocab_size if tokenizer else 0, **needs)
  return evaluators.EvalInputs(
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


# ----------------------------------------------------------------------------------------------------------
# What a run was trained on: the prepared dataset's fingerprint and the tokenizer's hash, in WORKDIR/data_identity.json.
# ----------------------------------------------------------------------------------------------------------
IDENTITY_FILE = "data_identity.json"
RUN_TOKENIZER_DIR = "tokenizer"  # WORKDIR/tokenizer/<file>: the run's own copy of its vocabulary
_MAX_IDENTITY_BYTES = 1 << 20  # a few KB; bounds what a crafted file can make the loop read


class ChangedDataError(UserError):
  """A run resumed (or started from `init_from` on the same dataset) whose prepared data or tokenizer differ from
  those its checkpoints were trained with."""


def dataset_identity(builder) -> dict:
  """The prepared dataset's identity: where it is, the fingerprint of the source it was prepared from (own data:
  `prepare`'s, image_text.check_source: index SHA-256, image files' names, sizes and times), and its splits'
  example counts and sizes (the only fingerprint of a dataset prepared without one: TFDS datasets, generated ones)."""
  metadata = builder.info.metadata or {}
  source = metadata.get("source") if hasattr(metadata, "get") else None
  return {
    "name": builder.name,
    "config": builder.builder_config.name if builder.builder_config else "",
    "version": str(builder.info.version),
    "data_dir": builder.data_dir,
    "generated": bool(getattr(type(builder), "generated_on_first_use", False)),
    "source": json.loads(json.dumps(source, default=str)) if source else None,
    "splits": {name: int(s.num_examples) for name, s in sorted(builder.info.splits.items())},
    "num_bytes": {name: int(s.num_bytes) for name, s in sorted(builder.info.splits.items())},
  }


def _describe_dataset(d: dict) -> str:
  where = f"{d.get('name')}{'/' + d['config'] if d.get('config') else ''} {d.get('version', '')} in {d.get('data_dir')}"
  source = d.get("source")
  if source:
    index = ", ".join(f"{n} sha256 {str(h)[:12]}" for n, h in sorted(dict(source.get("index") or {}).items()))
    files = f"{source.get('files')} image files or shards (listing sha256 {str(source.get('files_sha256'))[:12]})"
    origin = f"prepared from {index + '; ' if index else ''}{files}"
  else:
    origin = "generated by vlrep" if d.get("generated") else "no source fingerprint (prepared without one)"
  splits = ", ".join(f"{n} {c}" for n, c in dict(d.get("splits") or {}).items())
  return f"{where}, {origin}; examples: {splits or 'none'}"


def dataset_changes(old: dict, new: dict) -> list[str]:
  """What differs between two `dataset_identity`s, in words ([] when the data is the same)."""
  changes = []
  for key in ("name", "config", "version", "data_dir"):
    if old.get(key) != new.get(key):
      changes.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
  old_source, new_source = old.get("source"), new.get("source")
  if old_source or new_source:
    if not (old_source and new_source):
      changes.append("source fingerprint " + ("added" if new_source else "removed"))
    else:
      changes += [
        f"{name} changed"
        for name in sorted(set(old_source.get("index", {})) | set(new_source.get("index", {})))
        if old_source.get("index", {}).get(name) != new_source.get("index", {}).get(name)
      ]
      if old_source.get("files_sha256") != new_source.get("files_sha256"):
        changes.append(f"image files or shards changed ({old_source.get('files')} -> {new_source.get('files')})")
  old_splits, new_splits = dict(old.get("splits") or {}), dict(new.get("splits") or {})
  changes += [
    f"split {n}: {old_splits.get(n, 'absent')} -> {new_splits.get(n, 'absent')} examples"
    for n in sorted(set(old_splits) | set(new_splits))
    if old_splits.get(n) != new_splits.get(n)
  ]
  if not (old_source or new_source) and old.get("num_bytes") != new.get("num_bytes"):
    changes.append("the splits' stored sizes changed (the records were written again with other contents)")
  return changes


def configured_tokenizer_file(tok_config, builder) -> str | None:
  """The vocabulary file a tokenizer config names (a vlrep BPE without a path: beside the dataset, where
  `tokenizers.ensure_tokenizer` builds it; a WordPiece: its BERT folder's vocab.txt); None without a tokenizer."""
  if not tok_config:
    return None
  kind = tok_config.get("kind", "bpe")
  if kind == "wordpiece":
    return os.path.join(resolve_path(tok_config.path), "vocab.txt")
  if tok_config.get("path"):
    return os.path.expanduser(tok_config.path)
  return tokenizers.default_path(tok_config, builder) if kind == "bpe" else None


def tokenizer_identity(path: str | None) -> dict | None:
  if not path or not os.path.isfile(path):
    return None
  return {"path": os.path.abspath(path), "sha256": safe_files.sha256_of(path), "bytes": os.path.getsize(path)}


def read_identity(workdir: str) -> dict | None:
  """WORKDIR/data_identity.json (None when the run has none: trained by an older vlrep); a run folder may come
  from elsewhere, so a malformed file is one BadFile message."""
  path = os.path.join(workdir, IDENTITY_FILE)
  if not os.path.lexists(path):
    return None
  with errors.reading(path, what="run's data identity (JSON)", hint="Move it aside to resume without the check."):
    if not os.path.isfile(path) or os.path.getsize(path) > _MAX_IDENTITY_BYTES:
      raise ValueError(f"not a regular file of at most {_MAX_IDENTITY_BYTES >> 10} KB")
    with open(path) as f:
      identity = json.load(f)
    if not isinstance(identity, dict) or not isinstance(identity.get("dataset"), dict):
      raise ValueError("not a JSON object with a 'dataset' object")
    if identity.get("tokenizer") is not None and not isinstance(identity["tokenizer"], dict):
      raise ValueError("its 'tokenizer' is not an object")
    dataset, source = identity["dataset"], identity["dataset"].get("source")
    if source is not None and not (isinstance(source, dict) and isinstance(source.get("index", {}), dict)):
      raise ValueError("its dataset's 'source' is not a fingerprint object")
    if not all(isinstance(dataset.get(k, {}), dict) for k in ("splits", "num_bytes")):
      raise ValueError("its dataset's 'splits' or 'num_bytes' is not an object")
  return identity


class RunData:
  """The check a training run makes of its data and tokenizer against what its workdir was trained with
  (WORKDIR/data_identity.json), and the record it writes: `check` before the tokenizer is built (so a tokenizer is
  never rebuilt under a run that has one), `record` once the run's inputs are built."""

  def __init__(
    self, workdir: str, resuming: bool, start_step: int, allow_changed_data: bool = False, init_from: str = ""
  ) -> None:
    self.workdir, self.resuming, self.start_step = workdir, resuming, start_step
    self.allow, self.init_from = allow_changed_data, init_from
    self.saved = read_identity(workdir) if resuming else None
    self.changes: list[str] = []
    self.fields: dict = {}  # {field: {"examples", "of", "fraction"}}: the fields the method needs, counted

  def check(self, config, builder) -> str | None:
    """Refuses (ChangedDataError) to continue on other prepared data or another vocabulary than the run's, unless
    allowed; returns the vocabulary file the run must use instead of the configured one (its own copy), or None."""
    now = dataset_identity(builder)
    if not self.resuming:
      self._check_init_from(now)
      return None
    if self.saved is None:
      logging.warning(
        "The run in %s has no %s (trained by an older vlrep): resuming on %s without checking that it is the data "
        "it was trained on; recorded from now on.",
        self.workdir,
        IDENTITY_FILE,
        _describe_dataset(now),
      )
      return None
    before = self.saved["dataset"]
    self.changes = dataset_changes(before, now)
    configured = configured_tokenizer_file(config.get("tokenizer"), builder)
    saved_tok = self.saved.get("tokenizer")
    tok_now = tokenizer_identity(configured)
    tok_changed = bool(saved_tok and tok_now and tok_now["sha256"] != saved_tok.get("sha256"))
    if (self.changes or tok_changed) and not self.allow:
      lines = [f"The run in {self.workdir} was trained on other data than this command reads:"]
      if self.changes:
        lines += [
          f"  trained on: {_describe_dataset(before)}",
          f"  now:        {_describe_dataset(now)}",
          f"  changed:    {'; '.join(self.changes)}",
        ]
      if tok_changed:
        lines += [
          f"  tokenizer trained with: {saved_tok.get('path')} (sha256 {str(saved_tok.get('sha256'))[:12]})",
          f"  tokenizer now:          {tok_now['path']} (sha256 {tok_now['sha256'][:12]})",
        ]
      lines.append(
        "Use a fresh --workdir for the new data (--config.init_from=" + self.workdir + " starts from this run's "
        "backbone); to continue this run on it knowingly, pass --allow_changed_data (the run keeps its own "
        "tokenizer)."
      )
      raise ChangedDataError("\n".join(lines))
    if self.changes:
      logging.warning(
        "--allow_changed_data: the run in %s continues on changed data (%s): was %s; now %s.",
        self.workdir,
        "; ".join(self.changes),
        _describe_dataset(before),
        _describe_dataset(now),
      )
    if not saved_tok:
      return None
    if tok_now and tok_now["sha256"] == saved_tok.get("sha256"):
      return None
    # The configured vocabulary is missing (a re-prepare replaced the folder it lived in) or differs (allowed):
    # the run's embeddings belong to its own vocabulary, which it keeps; never rebuilt from the new data.
    own = os.path.join(self.workdir, RUN_TOKENIZER_DIR, os.path.basename(str(saved_tok.get("copy") or "")))
    if saved_tok.get("copy") and os.path.isfile(own) and safe_files.sha256_of(own) == saved_tok.get("sha256"):
      logging.warning(
        "The run's tokenizer %s is %s: the run keeps its own copy %s (a run never changes or rebuilds its vocabulary).",
        configured,
        "missing" if tok_now is None else "another vocabulary",
        own,
      )
      return own
    if tok_now is not None and not saved_tok.get("copy"):  # a vocabulary vlrep never builds (a BERT's), allowed
      logging.warning("--allow_changed_data: the run continues with the changed vocabulary %s.", configured)
      return None
    raise ChangedDataError(
      f"The run in {self.workdir} was trained with the tokenizer {saved_tok.get('path')} (sha256 "
      f"{str(saved_tok.get('sha256'))[:12]}), which is {'missing' if tok_now is None else 'another file now'}, and "
      f"the run holds no intact copy of it ({own}). Put that vocabulary back at {configured}; a run's tokenizer is "
      "never rebuilt, since its embeddings belong to the pieces it was trained with."
    )

  def _check_init_from(self, now: dict) -> None:
    """`init_from=RUN` on the dataset RUN was trained on, prepared again since: RUN's training images may sit in
    this run's held-out part now. Another dataset is the transfer init_from is for (only its backbone is copied)."""
    if not self.init_from:
      return
    source = read_identity(os.path.abspath(os.path.expanduser(self.init_from)))
    if source is None:
      return
    before = source["dataset"]
    same = all(before.get(k) == now.get(k) for k in ("name", "config", "data_dir"))
    changes = dataset_changes(before, now) if same else []
    if not changes:
      return
    message = (
      f"init_from={self.init_from} was trained on {_describe_dataset(before)}; this run reads that dataset changed "
      f"since ({'; '.join(changes)}): {_describe_dataset(now)}. Its held-out part may now hold images the source "
      "run trained on."
    )
    if not self.allow:
      raise ChangedDataError(message + " Pass --allow_changed_data to start from it knowingly.")
    logging.warning("--allow_changed_data: %s", message)

  def record(self, builder, tokenizer_file: str | None, copy_tokenizer: bool, start_step: int) -> None:
    """Writes WORKDIR/data_identity.json (process 0) when the run starts, resumes without one, or continues on
    changed data (each such start kept in its `history`). A run keeps the tokenizer it started with; a vlrep BPE
    vocabulary (`copy_tokenizer`: one that a re-prepare of its data folder removes) is copied into
    WORKDIR/tokenizer/, which a resume uses when the configured file is gone."""
    if jax.process_index() != 0:
      return
    previous = self.saved if self.resuming else None
    if previous is not None and not self.changes:
      return  # resumed on what it was trained with
    if previous is not None:
      tok = previous.get("tokenizer")  # continued on changed data (allowed): still its own vocabulary
    else:
      tok = tokenizer_identity(tokenizer_file)
      if tok and copy_tokenizer:
        copy = os.path.join(self.workdir, RUN_TOKENIZER_DIR, os.path.basename(tokenizer_file))
        safe_files.make_dirs(os.path.dirname(copy), root=self.workdir)
        with open(tokenizer_file, "rb") as f:
          safe_files.write_bytes(copy, f.read(), root=self.workdir)
        tok["copy"] = os.path.relpath(copy, self.workdir)
    now = dataset_identity(builder)
    entry = {"from_step": start_step, "dataset": now, "fields": self.fields, "allowed_changed_data": bool(self.changes)}
    history = list((previous or {}).get("history") or []) + [entry]
    identity = {"dataset": now, "tokenizer": tok, "history": history[-100:]}
    safe_files.write_json(os.path.join(self.workdir, IDENTITY_FILE), identity, root=self.workdir, indent=1)
