"""Metrics and targets of the vision-and-language tasks: VQA answer vocabulary, soft scores and accuracy (VQA 2.0,
VizWiz), accuracy (SNLI-VE) and micro/macro F1 (MM-IMDB).

VQA accuracy is the official one (visualqa.org/evaluation.html): with the 10 human answers of a question, a
predicted answer scores min(1, #humans who gave it / 3), averaged over the 10 subsets of 9 humans. Answers are
normalised first (lower case, punctuation and articles removed, number words to digits), as the official
evaluation script does. The soft training targets are the same score for every answer of the vocabulary.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Sequence

import numpy as np

_ARTICLES = {"a", "an", "the"}
_NUMBERS = {
  "none": "0",
  "zero": "0",
  "one": "1",
  "two": "2",
  "three": "3",
  "four": "4",
  "five": "5",
  "six": "6",
  "seven": "7",
  "eight": "8",
  "nine": "9",
  "ten": "10",
}
_CONTRACTIONS = {"dont": "don't", "doesnt": "doesn't", "isnt": "isn't", "arent": "aren't", "cant": "can't"}
_PUNCT = re.compile(r"[;/\[\]\"{}()=+\\_\-><@`,?!*#%^&$~|:]")
_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")


def normalize_answer(answer: str) -> str:
  """The official VQA answer normalisation (a compact version of its processPunctuation/processDigitArticle)."""
  a = answer.replace("\n", " ").replace("\t", " ").strip().lower()
  a = _PUNCT.sub("", a)
  a = _PERIOD.sub("", a)
  words = []
  for w in a.split():
    w = _NUMBERS.get(w, w)
    if w in _ARTICLES:
      continue
    words.append(_CONTRACTIONS.get(w, w))
  return " ".join(words)


def build_answer_vocab(answers: Iterable[Sequence[str]], size: int, min_count: int = 1) -> list[str]:
  """The `size` most frequent normalised answers over all annotations (ties broken alphabetically, so the
  vocabulary is a pure function of the data)."""
  counts = collections.Counter(normalize_answer(a) for answer_list in answers for a in answer_list)
  counts.pop("", None)
  ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
  return [a for a, c in ranked[:size] if c >= min_count]


def answer_score(human_answers: Sequence[str], answer: str) -> float:
  """VQA accuracy of `answer` against the human answers: mean over leave-one-out subsets of min(1, matches/3).
  With fewer than 10 annotations (synthetic data, VizWiz's occasional gaps) the same formula runs over what there
  is; a single annotation gives 1 for a match."""
  humans = [normalize_answer(h) for h in human_answers]
  answer = normalize_answer(answer)
  if not humans:
    return 0.0
  if len(humans) == 1:
    return float(humans[0] == answer)
  matches = sum(h == answer for h in humans)
  # Leaving out human i: matches among the other len-1 answers.
  return float(np.mean([min(1.0, (matches - (h == answer)) / 3.0) for h in humans]))


def soft_scores(human_answers: Sequence[str], vocab_index: dict[str, int]) -> tuple[np.ndarray, bool]:
  """(float32[len(vocab)] VQA scores of every vocabulary answer, whether any human answer is in the vocabulary).
  A question whose answers are all outside the vocabulary gets an all-zero row: its loss still pushes every answer
  down (as MMF trains), and at evaluation it scores what the metric gives the prediction (always 0 when no human
  answer is in the vocabulary)."""
  out = np.zeros((len(vocab_index),), np.float32)
  normalized = [normalize_answer(h) for h in human_answers]
  for a in set(normalized):
    if a in vocab_index:
      out[vocab_index[a]] = answer_score(normalized, a)
  return out, bool(out.any())


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
