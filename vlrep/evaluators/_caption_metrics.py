"""COCO caption metrics: CIDEr-D and BLEU-1..4 in Python (no Java), METEOR and SPICE through pycocoevalcap.

The definitions follow the coco-caption toolkit (Vedantam et al. for CIDEr-D: n-grams 1-4, TF-IDF with
document frequencies from the evaluated references, clipped candidate counts, Gaussian length penalty with
sigma 6, times 10; Papineni et al. for BLEU, corpus level with the closest reference length, as coco-caption's
Bleu scorer computes it). Text is normalised by `normalize` (lower case, punctuation removed), a close stand-in
for coco-caption's Java PTB tokenizer. METEOR and SPICE need Java and the jars of the `pycocoevalcap` package;
they are computed only when both are present (SPICE also needs `stanford-corenlp-3.6.0.jar` in
pycocoevalcap/spice/lib/, which pycocoevalcap would download; vlrep never downloads it).
"""

from __future__ import annotations

import math
import re
import shutil
from collections import Counter

_PUNCT = re.compile(r"[^a-z0-9' ]+")


def normalize(text: str) -> list[str]:
  return _PUNCT.sub(" ", text.lower()).split()


def _ngrams(words: list[str], n: int) -> Counter:
  return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def cider_d(candidates: dict, references: dict, n: int = 4, sigma: float = 6.0) -> tuple[float, dict]:
  """CIDEr-D over {id: caption} and {id: [reference captions]}: (corpus score, {id: score})."""
  ids = list(candidates)
  refs = {i: [normalize(r) for r in references[i]] for i in ids}
  cands = {i: normalize(candidates[i]) for i in ids}
  # Document frequency: in how many images' reference sets each n-gram appears.
  df: Counter = Counter()
  for i in ids:
    df.update({g for r in refs[i] for k in range(1, n + 1) for g in _ngrams(r, k)})
  log_num_docs = math.log(float(len(ids)))

  def vectors(words):
    vec, norms = [], []
    for k in range(1, n + 1):
      counts = _ngrams(words, k)
      v = {g: c * (log_num_docs - math.log(max(1.0, df[g]))) for g, c in counts.items()}
      vec.append(v)
      norms.append(math.sqrt(sum(x * x for x in v.values())))
    return vec, norms, len(words)

  def sim(vc, vr, nc, nr, lc, lr):
    delta = float(lc - lr)
    out = []
    for k in range(n):
      # Clipped: the candidate's weight of an n-gram counts at most the reference's.
      val = sum(min(w, vr[k][g]) * vr[k][g] for g, w in vc[k].items() if g in vr[k])
      if nc[k] != 0 and nr[k] != 0:
        val /= nc[k] * nr[k]
      out.append(val * math.exp(-(delta**2) / (2 * sigma**2)))
    return out

  per_image = {}
  for i in ids:
    vc, nc, lc = vectors(cands[i])
    total = [0.0] * n
    for r in refs[i]:
      vr, nr, lr = vectors(r)
      total = [a + b for a, b in zip(total, sim(vc, vr, nc, nr, lc, lr), strict=True)]
    score = sum(total) / n / max(len(refs[i]), 1) * 10.0
    per_image[i] = score
  return (sum(per_image.values()) / max(len(per_image), 1)), per_image


def bleu(candidates: dict, references: dict, n: int = 4) -> list[float]:
  """Corpus BLEU-1..n (coco-caption's 'closest' reference length for the brevity penalty)."""
  matched = [0.0] * n
  total = [0.0] * n
  cand_len = ref_len = 0
  tiny = 1e-9
  for i, c in candidates.items():
    cw = normalize(c)
    rws = [normalize(r) for r in references[i]]
    cand_len += len(cw)
    ref_len += min((abs(len(r) - len(cw)), len(r)) for r in rws)[1]
    for k in range(1, n + 1):
      counts = _ngrams(cw, k)
      max_ref: Counter = Counter()
      for r in rws:
        for g, cnt in _ngrams(r, k).items():
          max_ref[g] = max(max_ref[g], cnt)
      matched[k - 1] += sum(min(cnt, max_ref[g]) for g, cnt in counts.items())
      total[k - 1] += max(len(cw) - k + 1, 0)
  scores, log_sum = [], 0.0
  for k in range(n):
    log_sum += math.log((matched[k] + tiny) / (total[k] + tiny))
    scores.append(math.exp(log_sum / (k + 1)))
  bp = 1.0 if cand_len >= ref_len else math.exp(1 - ref_len / max(cand_len, 1))
  return [s * bp for s in scores]


def java_metrics(candidates: dict, references: dict) -> dict[str, float]:
  """METEOR and SPICE via pycocoevalcap when Java and the package are installed; {} otherwise."""
  if shutil.which("java") is None:
    return {}
  try:
    from pycocoevalcap.meteor.meteor import Meteor
  except ImportError:
    return {}
  out = {}
  gts = {i: [" ".join(normalize(r)) for r in references[i]] for i in candidates}
  res = {i: [" ".join(normalize(candidates[i]))] for i in candidates}
  try:
    out["meteor"] = float(Meteor().compute_score(gts, res)[0]) * 100
  except Exception as e:  # noqa: BLE001 - a broken Java setup must not lose the other metrics
    out["meteor_error"] = str(e)[:200]
  # SPICE needs Stanford CoreNLP's jar beside pycocoevalcap's; it would try to download it, so only run it
  # when a user has put it there.
  import os
  import sys

  package_dir = os.path.dirname(os.path.dirname(sys.modules[Meteor.__module__].__file__))  # a namespace package
  corenlp = os.path.join(package_dir, "spice", "lib", "stanford-corenlp-3.6.0.jar")
  if os.path.exists(corenlp):
    try:
      from pycocoevalcap.spice.spice import Spice

      out["spice"] = float(Spice().compute_score(gts, res)[0]) * 100
    except Exception as e:  # noqa: BLE001 - keep CIDEr/BLEU/METEOR when SPICE's Java side fails
      out["spice_error"] = str(e)[:200]
  return {k: v for k, v in out.items() if not k.endswith("_error")}


def score_all(candidates: dict, references: dict) -> dict[str, float]:
  """{'cider', 'bleu1'..'bleu4', and 'meteor'/'spice' when available}, CIDEr and BLEU x 100 as papers print them."""
  if not candidates:
    raise ValueError("No captions to score.")
  missing = [i for i in candidates if not references.get(i)]
  if missing:
    raise ValueError(f"{len(missing)} captions have no references, e.g. {missing[:3]}.")
  out = {"cider": cider_d(candidates, references)[0] * 100}
  out.update({f"bleu{k + 1}": b * 100 for k, b in enumerate(bleu(candidates, references))})
  out.update(java_metrics(candidates, references))
  return out
