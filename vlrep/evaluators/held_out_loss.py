"""The method's own training loss on held-out images: validation for a method with no other evaluator of its data
(ICMLM's TP on your own data, whose tag-prediction loss is its task).

Each batch goes through the training preprocessing (`pp`, the run's `data.pp`) and `method.loss(variables, batch,
PRNGKey(seed), train=False)`: inference BatchNorm, no dropout, the same random draws (crops, masks) at every
evaluation. Only full batches count (a loss is a batch mean, and a padded row would count in it): the batch is the
held-out split's size when that is smaller than `batch_size`, and the rows of a last partial batch are reported as
`skipped`. Reports `loss` and the mean of every metric the loss returns, over the batches.

Config: dataset, data_dir, config_name, split, pp, batch_size, limit (first N images; 0 = all), seed, every_steps.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from vlrep.data import records
from vlrep.evaluators._inputs import EvalInputs, Model


class Evaluator:
  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.method = inputs.method
    self.builder = inputs.builder(config)
    self.inputs = inputs
    key = jax.random.PRNGKey(config.get("seed", 0))
    self.loss = jax.jit(lambda v, b: self.method.loss(v, b, key, False)[:2])

  def evaluate(self, model: Model) -> dict[str, float]:
    from jax.experimental import multihost_utils

    c = self.config
    split = records.first_examples(self.builder, c.split, c.get("limit", 0))
    hosts = self.inputs.num_hosts
    size = records.split_size(self.builder, split)
    batch_size = min(c.batch_size, size // hosts * hosts)
    if batch_size < 1:
      raise ValueError(f"{c.dataset}/{split} has {size} examples, too few for {hosts} hosts.")
    t0 = time.time()
    sums: dict[str, float] = {}
    batches = skipped = 0
    for batch in self.inputs.batches(self.builder, split, c.pp, self.method.fields, batch_size):
      real = batch.pop("_mask").astype(bool)
      if not real.all():
        skipped += int(real.sum())
        continue
      loss, metrics = self.loss(model.variables, batch)
      for k, v in {"loss": loss, **metrics}.items():
        sums[k] = sums.get(k, 0.0) + float(v)
      batches += 1
    names = sorted(sums)
    local = np.array([batches, skipped] + [sums[k] for k in names], np.float64)
    totals = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(local)).sum(0)
    if not totals[0]:
      raise ValueError(f"No full batch of {batch_size} in {c.dataset}/{split}: nothing to evaluate.")
    out = {k: float(v / totals[0]) for k, v in zip(names, totals[2:], strict=True)}
    out.update(batches=float(totals[0]), skipped=float(totals[1]))
    logging.info(
      "Held-out loss on %s/%s: %.4f over %d batches (%.1fs).",
      c.dataset,
      split,
      out["loss"],
      totals[0],
      time.time() - t0,
    )
    return out
