"""Pretraining methods. Each is a module here whose `Method` class has `fields`, `init`, `loss` and `features`
(README, "Architecture"); `config.method.name` names the module, or is the dotted path of a module elsewhere (a
method of your own, outside vlrep, with the same `Method` contract)."""

from __future__ import annotations

import importlib

import ml_collections

KNOWN = ("virtex", "classifier", "loctex", "mct", "icmlm", "vlbert")


def build(config: ml_collections.ConfigDict, vocab_size: int, concepts=None, answer_vocab=None):
  """The method named by `config.name`: the `Method` class of the module vlrep.methods.<name> (or of the module
  at that dotted path). `concepts` is the run's concept set (ICMLM), `answer_vocab` its VQA answers (vlbert);
  each is passed only when given."""
  if "." not in config.name and config.name not in KNOWN:
    raise ValueError(f"Unknown method {config.name!r}. Known methods: {', '.join(KNOWN)}, or a module's dotted path")
  module = importlib.import_module(config.name if "." in config.name else f"vlrep.methods.{config.name}")
  extra = {k: v for k, v in (("concepts", concepts), ("answer_vocab", answer_vocab)) if v is not None}
  return module.Method(config, vocab_size, **extra)
