"""A run's dataset builder, tokenizer and method, built from its config the one way the training loop,
`vlrep.evaluate` and the tools all build them."""

from __future__ import annotations

import os

import jax
import ml_collections

from vlrep import evaluators, methods
from vlrep.data import concepts, pipeline, tokenizers


def build(config: ml_collections.ConfigDict, for_training: bool = False):
  """(the training data's TFDS builder, `RunInputs`): the run's tokenizer (none for a method without text, e.g.
  the fine-tuning classifier), what its method needs from the data (a concept set: ICMLM, MCT's tags on own data;
  a VQA run's answer vocabulary) and the method built with it, on this process.

  `for_training` also checks that the training split has the fields the method's recipe requires (a clear error
  before anything starts, instead of a missing key mid-run)."""
  data = config.data
  builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"))
  if for_training:
    pipeline.check_required_fields(builder, data.split, data.get("requires", {}), config.method.name)
  return builder, _run_inputs(config, builder)


def build_inputs(config: ml_collections.ConfigDict):
  """`RunInputs` of a trained or imported run, for commands that only apply it (vlrep.evaluate, the caption tool):
  the training data's builder is opened only when building them needs it (a vocabulary built from or stored next
  to the training data, a concept set, a method's `setup`), so an imported run with its own vocabulary needs no
  training dataset prepared."""
  data = config.data
  builder = None
  if _needs_training_data(config):
    builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"))
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
