"""Masked-token prediction (ICMLM's proxy task) on held-out captions: top-1 / top-5 accuracy of the masked concept.

Every occurrence of a concept token in the first `num_captions` captions of the first `limit` images is masked in
turn (one (image, caption, position) triplet each) and predicted by `method.predict_masked`. A text-only run
(ICMLM variant 'text_only') reports the same metrics without the image, so the two summaries compare directly.

Config: dataset, data_dir, config_name, split, pp (must give 'image' and 'captions'), num_captions (0: every
caption of each image; images may have different numbers, they are '' padded to the same width), max_len,
batch_size (triplets per forward pass), limit, every_steps.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from vlrep.data import records
from vlrep.evaluators._inputs import EvalInputs, Model, caption_width, with_fixed_captions


class Evaluator:
  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.method = inputs.method
    if not hasattr(self.method, "predict_masked") or getattr(self.method, "variant", "") == "tp":
      raise ValueError("The masked_tokens evaluator needs an ICMLM method that predicts masked tokens (not 'tp').")
    self.tokenizer = inputs.tokenizer
    if self.tokenizer is None:
      raise ValueError("The masked_tokens evaluator needs the run's WordPiece tokenizer (config.tokenizer).")
    self.concept_mask = np.asarray(self.method.concept_mask)
    self.builder = inputs.builder(config)
    self.inputs = inputs
    self.predict = jax.jit(lambda v, x, t, p: jax.lax.top_k(self.method.predict_masked(v, x, t, p), 5)[1])

  def triplets(self, captions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, tokens [M, T], position) for every concept occurrence in `captions` [B, C] (strings)."""
    rows, toks, pos = [], [], []
    for r, caps in enumerate(captions):
      for cap in caps:  # already the first num_captions (run: with_fixed_captions)
        text = cap.decode("utf-8") if isinstance(cap, bytes) else str(cap)
        if not text.strip():
          continue
        ids, _ = self.tokenizer.encode(text, self.config.max_len)
        for p in np.flatnonzero(self.concept_mask[ids]):
          rows.append(r)
          toks.append(ids)
          pos.append(p)
    if not rows:
      return np.zeros((0,), np.int64), np.zeros((0, self.config.max_len), np.int32), np.zeros((0,), np.int32)
    return np.array(rows), np.stack(toks), np.array(pos, np.int32)

  def evaluate(self, model: Model) -> dict[str, float]:
    from jax.experimental import multihost_utils

    c = self.config
    split = records.first_examples(self.builder, c.split, c.get("limit", 0))
    t0 = time.time()
    hits1 = hits5 = count = 0
    bs = c.batch_size
    width = caption_width(self.builder, split, "captions", c.num_captions)
    pp = with_fixed_captions(c.pp, "captions", width)
    for batch in self.inputs.batches(self.builder, split, pp, ("image", "captions"), bs):
      real = batch["_mask"].astype(bool)
      caps = np.array(batch["captions"], dtype=object).reshape(len(real), width)
      caps[~real] = b""
      rows, toks, pos = self.triplets(caps)
      for start in range(0, len(rows), bs):
        n = min(bs, len(rows) - start)
        sel = np.arange(start, start + bs) % len(rows)  # a full batch (one compilation); extra rows ignored
        top5 = np.asarray(self.predict(model.variables, batch["image"][rows[sel]], toks[sel], pos[sel]))[:n]
        target = toks[sel][np.arange(n), pos[sel][:n]]
        hits1 += int(np.sum(top5[:, 0] == target))
        hits5 += int(np.sum(np.any(top5 == target[:, None], axis=1)))
        count += n
    totals = np.asarray(multihost_utils.process_allgather(np.array([hits1, hits5, count]))).reshape(-1, 3).sum(0)
    hits1, hits5, count = (int(x) for x in totals)
    if not count:
      raise ValueError(f"No concept word occurs in the captions of {c.dataset}/{split}: nothing to evaluate.")
    out = {"top1": 100.0 * hits1 / count, "top5": 100.0 * hits5 / count, "count": float(count)}
    logging.info(
      "Masked tokens: %d concept occurrences (%.1fs): top-1 %.1f%%, top-5 %.1f%%",
      count,
      time.time() - t0,
      out["top1"],
      out["top5"],
    )
    return out
