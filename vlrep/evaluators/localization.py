"""Localization of words: how well a LocTex model's image-caption attention points at the objects named.

For every token of an object word (a class name, e.g. 'circle' or 'squares') whose ground-truth mask is not
empty, with the attention softmax over the grid cells of each map the method gives (LocTex: '1x', '2x', ...
from the localization projections, and 'contrastive' from the contrastive projections):
  pointing_<map>   the fraction of tokens whose most-attended cell overlaps the named class's visible
                   instances (the pointing game; a cell counts if any pixel of them lies in it);
  iou_<map>        mean IoU between the cells attended at least half as much as the top cell and the
                   ground-truth cells;
  chance_<map>     the pointing accuracy of a uniformly random cell (mean ground-truth area fraction).

Config: dataset, data_dir, config_name, split, pp (must give 'image', 'tokens' and 'trace_mask_<R>' with the
ground truth, e.g. via oracle_word_masks(match_traces=False)), grid_sizes (R per map, in the method's scale
order; the contrastive map uses the first), batch_size, limit (first N images; 0 = all), every_steps.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from vlrep.data import records
from vlrep.evaluators._inputs import EvalInputs, Model


def pointing_and_iou(attention: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """attention [B, T, R, R] (any non-negative map), truth [B, T, R, R] binary. Returns per supervised token
  (truth not empty): hit (bool), IoU, chance (truth area fraction)."""
  b, t = attention.shape[:2]
  att = attention.reshape(b * t, -1)
  gt = truth.reshape(b * t, -1) > 0
  keep = gt.any(axis=1)
  att, gt = att[keep], gt[keep]
  hit = gt[np.arange(len(att)), att.argmax(axis=1)]
  attended = att >= 0.5 * att.max(axis=1, keepdims=True)
  iou = (attended & gt).sum(1) / np.maximum((attended | gt).sum(1), 1)
  return hit, iou, gt.mean(axis=1)


class Evaluator:
  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.method = inputs.method
    if not hasattr(self.method, "attention"):
      raise ValueError(
        "The localization evaluator needs a method with image-caption attention maps (LocTex); this run's is "
        f"{type(self.method).__name__}."
      )
    self.grid_sizes = tuple(config.grid_sizes)
    run_sizes = tuple(getattr(self.method, "grid_sizes", ()))
    if run_sizes and run_sizes != self.grid_sizes[: len(run_sizes)]:
      raise ValueError(
        f"This run's attention maps are {' and '.join(f'{r}x{r}' for r in run_sizes)} (its method.grid_sizes "
        f"{run_sizes}) but the evaluator's grid_sizes are {self.grid_sizes}: evaluate with "
        f"--config=configs/eval/localization.py:sizes={'+'.join(map(str, run_sizes))}."
      )
    self.builder = inputs.builder(config)
    self.inputs = inputs
    self.attention = jax.jit(self.method.attention)

  def evaluate(self, model: Model) -> dict[str, float]:
    from jax.experimental import multihost_utils

    c = self.config
    split = records.first_examples(self.builder, c.split, c.get("limit", 0))
    fields = ("image", "tokens", *(f"trace_mask_{r}" for r in self.grid_sizes))
    t0 = time.time()
    sums: dict[str, np.ndarray] = {}
    for batch in self.inputs.batches(self.builder, split, c.pp, fields, c.batch_size):
      maps = self.attention(model.variables, batch["image"], batch["tokens"])
      real = batch["_mask"].astype(bool)
      for name, att in maps.items():
        r = np.asarray(att).shape[-1]
        key = f"trace_mask_{r}"
        if key not in batch:
          raise ValueError(f"Map {name!r} is {r}x{r} but the pipeline gives no {key} (grid_sizes {self.grid_sizes}).")
        hit, iou, chance = pointing_and_iou(np.asarray(att)[real], batch[key][real])
        acc = sums.setdefault(name, np.zeros(4))
        acc += [hit.sum(), iou.sum(), chance.sum(), len(hit)]
    names = sorted(sums)
    totals = np.stack([sums[n] for n in names])
    if self.inputs.num_hosts > 1:
      totals = np.asarray(multihost_utils.process_allgather(totals)).sum(0)
    out = {}
    for name, (hits, ious, chance, n) in zip(names, totals, strict=True):
      n = max(n, 1)
      out[f"pointing_{name}"] = 100.0 * hits / n
      out[f"iou_{name}"] = 100.0 * ious / n
      out[f"chance_{name}"] = 100.0 * chance / n
    out["tokens"] = float(totals[0, 3]) if len(totals) else 0.0
    logging.info(
      "Localization on %s/%s (%.1fs): %s",
      self.builder.name,
      split,
      time.time() - t0,
      ", ".join(f"{k}={v:.2f}" for k, v in out.items()),
    )
    return out
