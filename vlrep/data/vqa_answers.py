"""VQA answers as the official evaluation treats them: normalisation, the answer vocabulary of a training split,
and each answer's score against the human answers (min(1, #humans who gave it / 3), averaged over the 10 subsets of
9 humans). The data pipeline builds its soft training targets from these; vlrep.evaluators._vl_metrics scores
predictions with the same functions.
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
