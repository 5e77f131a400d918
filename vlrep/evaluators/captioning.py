"""Captioning evaluation: decode captions for a split with the forward model, score them with COCO metrics.

Config: dataset, data_dir, config_name, split, pp (must produce 'image'), references ('captions'), decoding
('greedy' | 'beam' | 'nucleus' | 'virtex_official': kdexd/virtex's evaluation beam search, vlrep.decoding),
beam_size, per_node_beam_size (virtex_official), top_p, max_len, batch_size, limit (first N images; 0 = all),
examples (how many decoded captions to log), every_steps, random_init.
Needs a model with a forward captioning direction (VirTex 'captioning', 'bicaptioning' or 'cappa').
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from vlrep import decoding, methods
from vlrep.data import records
from vlrep.evaluators import _caption_metrics
from vlrep.evaluators._inputs import EvalInputs, Model


def captioner_for(method, config):
  """The jitted captioner of a VirTex method, or a clear error for models that cannot caption."""
  model = getattr(method, "model", None)
  directions = getattr(model, "directions", ())
  if model is None or getattr(model, "head", None) != "transformer" or "forward" not in directions:
    raise ValueError(
      "Captioning needs a model with a forward captioning head (VirTex task 'captioning', 'bicaptioning' or "
      "'cappa'); "
      f"this run's method is {methods.name_of(method)} with directions {tuple(directions)}."
    )
  method_name = config.get("decoding", "beam")
  # vlrep's decoders feed [SOS] and the words (max_len + 1 positions); the official one drops [SOS] after the first
  # step, so it decodes as many tokens as the head has positions (the official MAX_DECODING_STEPS).
  max_len = min(config.get("max_len", 30), model.max_len - (method_name != "virtex_official"))
  kwargs = {}
  if method_name == "beam":
    kwargs["beam_size"] = config.get("beam_size", 5)
  elif method_name == "virtex_official":
    kwargs["beam_size"] = config.get("beam_size", 5)
    kwargs["per_node_beam_size"] = config.get("per_node_beam_size", 2)
  elif config.get("decoding") == "nucleus":
    kwargs["top_p"] = config.get("top_p", 0.9)
  return decoding.make_captioner(model, max_len, method_name, **kwargs)


class Evaluator:
  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    if config.get("decoding", "beam") not in decoding.METHODS:
      raise ValueError(f"Unknown decoding {config.decoding!r}; expected one of {decoding.METHODS}.")
    for key in ("method", "tokenizer"):
      if getattr(inputs, key) is None:
        raise ValueError(f"The captioning evaluator needs the run's {key}.")
    self.method, self.tokenizer = inputs.method, inputs.tokenizer
    self.caption = captioner_for(self.method, config)
    self.builder = inputs.builder(config)
    self.inputs = inputs

  def evaluate(self, model: Model) -> dict[str, float]:
    from jax.experimental import multihost_utils

    c = self.config
    split = records.first_examples(self.builder, c.split, c.get("limit", 0))
    t0 = time.time()
    refs_all = records.read_example_texts(self.builder, split, c.get("references", "captions"))
    rng = jax.random.PRNGKey(c.get("seed", 0))
    tokens, masks = [], []
    for i, batch in enumerate(self.inputs.batches(self.builder, split, c.pp, ("image",), c.batch_size)):
      t, _ = self.caption(model.variables, batch["image"], jax.random.fold_in(rng, i))
      tokens.append(np.asarray(t))
      masks.append(batch["_mask"].astype(bool))
    tokens, masks = np.concatenate(tokens), np.concatenate(masks)
    if self.inputs.num_hosts > 1:
      tokens = np.asarray(multihost_utils.process_allgather(tokens))  # [hosts, n, T]
      masks = np.asarray(multihost_utils.process_allgather(masks))
    else:
      tokens, masks = tokens[None], masks[None]
    candidates = {}
    for h in range(tokens.shape[0]):
      for j in np.flatnonzero(masks[h]):
        candidates[h + j * self.inputs.num_hosts] = self.tokenizer.decode(tokens[h, j].tolist())
    references = {i: refs_all[i] for i in candidates}
    t1 = time.time()
    scores = _caption_metrics.score_all(candidates, references)
    for i in list(candidates)[: c.get("examples", 3)]:
      logging.info("Caption %d: %r (reference: %r)", i, candidates[i], references[i][0])
    logging.info(
      "Captioning (%s): %d images, decoding %.1fs, metrics %.1fs: %s",
      c.get("decoding", "beam"),
      len(candidates),
      t1 - t0,
      time.time() - t1,
      ", ".join(f"{k}={v:.2f}" for k, v in scores.items()),
    )
    scores["mean_length"] = float(np.mean([len(_caption_metrics.normalize(x)) for x in candidates.values()]))
    return scores
