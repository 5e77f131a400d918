"""Pretraining methods. Each is a class with `fields`, `init`, `loss` and `features` (README, "Architecture")."""

from __future__ import annotations

import ml_collections


def build(config: ml_collections.ConfigDict, vocab_size: int, concepts=None, answer_vocab=None):
  """Instantiates the method named by `config.name`. `concepts` is the run's concept set (ICMLM);
  `answer_vocab` its VQA answers (vlbert)."""
  name = config.name
  if name == "virtex":
    from vlrep.methods.virtex import VirTex

    return VirTex(config, vocab_size)
  if name == "classifier":
    from vlrep.methods.classifier import Classifier

    return Classifier(config, vocab_size)
  if name == "loctex":
    from vlrep.methods.loctex import LocTex

    return LocTex(config, vocab_size)
  if name == "mct":
    from vlrep.methods.mct import MCT

    return MCT(config, vocab_size)
  if name == "icmlm":
    from vlrep.methods.icmlm import ICMLM

    return ICMLM(config, vocab_size, concepts)
  if name == "vlbert":
    from vlrep.methods.vlbert import VLBert

    return VLBert(config, vocab_size, answer_vocab)
  raise ValueError(f"Unknown method {name!r}. Known methods: virtex, classifier, loctex, mct, icmlm, vlbert")
