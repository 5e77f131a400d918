"""Metrics and targets of the vision-and-language tasks: VQA answer vocabulary, soft scores and accuracy (VQA 2.0,
VizWiz), accuracy (SNLI-VE) and micro/macro F1 (MM-IMDB).

VQA accuracy is the official one (visualqa.org/evaluation.html): with the 10 human answers of a question, a
predicted answer scores min(1, #humans who gave it / 3), averaged over the 10 subsets of 9 humans. Answers are
normalised first (lower case, punctuation and articles removed, number words to digits), as the official
evaluation script does. The soft training targets are the same score for every answer of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The answer functions live with the data (its soft targets use them); re-exported here for the evaluators.
from vlrep.data.vqa_answers import answer_score, build_answer_vocab, normalize_answer, soft_scores  # noqa: F401


def vqa_accuracy(predictions: Sequence[str], human_answers: Sequence[Sequence[str]]) -> float:
  """Mean VQA accuracy in percent."""
  if not predictions:
    return 0.0
  return 100.0 * float(np.mean([answer_score(h, p) for p, h in zip(predictions, human_answers, strict=True)]))


def f1_scores(predicted: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """Micro and macro F1 (percent) of bool[N, C] predictions against bool[N, C] labels. A class with no positive
  label and no positive prediction has F1 0, as scikit-learn's default (zero_division=0) reports it."""
  p, y = np.asarray(predicted, bool), np.asarray(labels, bool)
  tp = (p & y).sum(0).astype(np.float64)
  fp = (p & ~y).sum(0).astype(np.float64)
  fn = (~p & y).sum(0).astype(np.float64)
  denom = 2 * tp + fp + fn
  per_class = np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
  micro_denom = 2 * tp.sum() + fp.sum() + fn.sum()
  micro = 2 * tp.sum() / micro_denom if micro_denom > 0 else 0.0
  return {"micro_f1": 100.0 * float(micro), "macro_f1": 100.0 * float(per_class.mean())}
