"""Pretraining methods. Each is a small class with `fields`, `init`, `loss` and `features` (see README)."""

from __future__ import annotations

import ml_collections


def build(config: ml_collections.ConfigDict, vocab_size: int):
  """Instantiates the method named by `config.name`."""
  name = config.name
  if name == "virtex":
    from vlrep.methods.virtex import VirTex

    return VirTex(config, vocab_size)
  if name == "classifier":
    from vlrep.methods.classifier import Classifier

    return Classifier(config, vocab_size)
  raise ValueError(f"Unknown method {name!r}. Known methods: virtex, classifier")
