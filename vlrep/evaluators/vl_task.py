"""Evaluation of a VisualBERT / ViLBERT run on every (image, text) pair of a split.

Config: dataset, data_dir, config_name, split, pp (must produce the method's fields plus `answers` / `label`, with
`vl_pairs(..., sample=False)` so that every pair is scored once), metric, batch_size, limit, every_steps, seed.
  metric='vqa'       VQA accuracy of the top answer against the human answers (`answers`); questions whose
                     answers are all outside the vocabulary count, and score what the metric gives (0).
  metric='accuracy'  top-1 accuracy against `label` (SNLI-VE).
  metric='f1'        micro / macro F1 of sigmoid > 0.5 against the multi-hot `targets` (MM-IMDB).
  metric='mlm'       masked-token top-1 accuracy with BERT's masking (a pretraining run's objective on held-out
                     text), with a fixed seed so every evaluation masks the same tokens.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from vlrep.data import records
from vlrep.evaluators import _vl_metrics
from vlrep.evaluators._inputs import EvalInputs, Model

METRICS = ("vqa", "accuracy", "f1", "mlm")


class Evaluator:
  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    if config.metric not in METRICS:
      raise ValueError(f"Unknown vl_task metric {config.metric!r}; known: {METRICS}")
    method = inputs.method
    if method is None or not hasattr(method, "classify"):
      raise ValueError("The vl_task evaluator needs a vlbert run (a method with `classify`).")
    if config.metric != "mlm" and method.task != "classify":
      raise ValueError(f"metric={config.metric!r} needs a fine-tuning run (method.task='classify').")
    self.config, self.method = config, method
    self.builder = inputs.builder(config)
    self.inputs = inputs
    self.vocab = inputs.needs.get("answer_vocab") or []
    if config.metric == "vqa" and not self.vocab:
      raise ValueError("metric='vqa' needs the run's answer vocabulary (config.answers).")
    self._classify = jax.jit(method.classify)
    self._mlm = jax.jit(method.mlm_predictions)

  def evaluate(self, model: Model) -> dict[str, float]:
    c, variables = self.config, model.variables
    if self.inputs.num_hosts > 1:
      raise NotImplementedError("vl_task evaluates on one host; run `vlrep.evaluate` on a single host.")
    split = records.first_examples(self.builder, c.split, c.get("limit", 0))
    fields = tuple(self.method.fields) + {"vqa": ("answers",), "accuracy": ("label",)}.get(c.metric, ())
    t0 = time.time()
    rng = jax.random.PRNGKey(c.get("seed", 0))
    scores, hits, masked = [], 0.0, 0.0
    preds, labels = [], []
    batches = self.inputs.batches(self.builder, split, c.pp, fields, c.batch_size)  # one host (checked above)
    for i, batch in enumerate(batches):
      mask = (batch["pair_mask"] & batch["_mask"][:, None]).reshape(-1)
      arrays = {k: v for k, v in batch.items() if k in self.method.fields}
      if c.metric == "mlm":
        pred, target, picked = (np.asarray(x) for x in self._mlm(variables, arrays, jax.random.fold_in(rng, i)))
        picked = picked & mask[:, None]
        hits += float(((pred == target) & picked).sum())
        masked += float(picked.sum())
        continue
      logits = np.asarray(self._classify(variables, arrays))[mask]
      if c.metric == "vqa":
        answers = batch["answers"].reshape(-1, batch["answers"].shape[-1])[mask]
        for row, humans in zip(logits, answers, strict=True):
          humans = [h.decode("utf-8") if isinstance(h, bytes) else str(h) for h in humans]
          scores.append(_vl_metrics.answer_score([h for h in humans if h], self.vocab[int(np.argmax(row))]))
      elif c.metric == "accuracy":
        scores.extend((np.argmax(logits, -1) == batch["label"].reshape(-1)[mask]).astype(float))
      else:
        preds.append(logits > 0)
        labels.append(batch["targets"].reshape(-1, logits.shape[-1])[mask] > 0.5)
    if c.metric == "mlm":
      out = {"mlm_accuracy": 100.0 * hits / max(masked, 1.0), "masked_tokens": masked}
    elif c.metric == "f1":
      out = _vl_metrics.f1_scores(np.concatenate(preds), np.concatenate(labels))
      out["pairs"] = float(sum(len(p) for p in preds))
    else:
      out = {c.metric: 100.0 * float(np.mean(scores)) if scores else 0.0, "pairs": float(len(scores))}
    logging.info("vl_task (%s) on %s: %s in %.1fs", c.metric, split, out, time.time() - t0)
    return out
