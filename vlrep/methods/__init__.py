"""Pretraining methods. Each is a module here whose `Method` class has `fields`, `init`, `loss` and `features`
(README, "Architecture"); `config.method.name` names the module, or is the dotted path of a module elsewhere (a
method of your own, outside vlrep, with the same `Method` contract)."""

from __future__ import annotations

import importlib

import ml_collections

KNOWN = ("virtex", "classifier", "loctex", "mct", "icmlm", "vlbert")


def _module(name: str):
  if "." not in name and name not in KNOWN:
    raise ValueError(f"Unknown method {name!r}. Known methods: {', '.join(KNOWN)}, or a module's dotted path")
  return importlib.import_module(name if "." in name else f"vlrep.methods.{name}")


def setup(config: ml_collections.ConfigDict, builder, tokenizer) -> dict:
  """What the run's method needs from its data before it is built: its module's optional
  `setup(config, builder, tokenizer) -> dict` (VQA runs: their answer vocabulary; a config's concept set comes
  from `data.concepts.run_concepts` beside it). The dict is the Method's extra keyword arguments and joins the
  preprocessing ops' context."""
  module = _module(config.method.name)
  return module.setup(config, builder, tokenizer) if hasattr(module, "setup") else {}


def build(config: ml_collections.ConfigDict, vocab_size: int, **needs):
  """The method named by `config.name`: the `Method` class of the module vlrep.methods.<name> (or of the module
  at that dotted path), given what `setup` returned."""
  return _module(config.name).Method(config, vocab_size, **needs)
