"""VOC07 linear-SVM probe (VirTex appendix A.1): per-class LinearSVC on frozen, pooled backbone features.

Protocol: features of the trainval and test splits (global-average-pooled, l2-normalised); for each class an
SVM `LinearSVC(penalty='l2', dual=True, max_iter=2000, tol=1e-4, class_weight={1: 2, -1: 1},
loss='squared_hinge')` per cost C, the cost chosen by 3-fold cross-validated AP on trainval, refit on all of
trainval; VOC07 11-point AP on test ignoring 'difficult' labels (0); mAP over classes. Images whose only
instances of a class are difficult are left out of that class's training set too.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from absl import logging
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import StratifiedKFold
from sklearn.svm import LinearSVC

DEFAULT_COSTS = (0.01, 0.1, 1.0, 10.0)


def voc07_ap(scores: np.ndarray, labels: np.ndarray) -> float:
  """VOC2007 11-point interpolated average precision. labels in {1, -1}; difficult (0) already removed."""
  order = np.argsort(-scores, kind="stable")
  tp = (labels[order] > 0).astype(np.float64)
  fp = 1.0 - tp
  npos = tp.sum()
  if npos == 0:
    return float("nan")
  tp, fp = np.cumsum(tp), np.cumsum(fp)
  recall = tp / npos
  precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
  ap = 0.0
  for t in np.arange(0.0, 1.1, 0.1):
    p = precision[recall >= t]
    ap += (p.max() if p.size else 0.0) / 11.0
  return float(ap)


def _svm(cost: float) -> LinearSVC:
  return LinearSVC(
    penalty="l2",
    dual=True,
    max_iter=2000,
    tol=1e-4,
    class_weight={1: 2, -1: 1},
    loss="squared_hinge",
    C=cost,
    random_state=0,
  )


def fit_and_score(train_x, train_y, test_x, test_y, costs=DEFAULT_COSTS, folds: int = 3) -> dict:
  """Runs the protocol on features and {1, 0, -1} label matrices. Returns mAP and per-class details."""
  # Classes are independent; liblinear releases the GIL, so threads use every core.
  with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
    results = list(
      pool.map(lambda c: _one_class(c, train_x, train_y, test_x, test_y, costs, folds), range(train_y.shape[1]))
    )
  aps = np.array([r[0] for r in results])
  return {"map": float(np.nanmean(aps) * 100), "ap_per_class": (aps * 100).tolist(), "costs": [r[1] for r in results]}


def _one_class(c, train_x, train_y, test_x, test_y, costs, folds) -> tuple[float, float]:
  keep = train_y[:, c] != 0
  x, y = train_x[keep], train_y[keep, c]
  if (y > 0).sum() < folds or (y < 0).sum() < folds:
    logging.warning("Class %d has too few positives/negatives to cross-validate; skipped.", c)
    return float("nan"), float("nan")
  cv = StratifiedKFold(folds, shuffle=True, random_state=0)
  cv_ap = []
  for cost in costs:
    fold_aps = []
    for tr, va in cv.split(x, y):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = _svm(cost).fit(x[tr], y[tr])
      fold_aps.append(voc07_ap(clf.decision_function(x[va]), y[va]))
    cv_ap.append(np.mean(fold_aps))
  best = costs[int(np.argmax(cv_ap))]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ConvergenceWarning)
    clf = _svm(best).fit(x, y)
  keep_test = test_y[:, c] != 0
  return voc07_ap(clf.decision_function(test_x[keep_test]), test_y[keep_test, c]), best


class Voc07Svm:
  """Evaluator: extracts features of two splits with the current backbone and runs the SVM protocol.

  Config: dataset, data_dir, config_name, train_split, test_split, pp (must produce 'image' and 'labels'),
  batch_size (global), feature ('pre_logits'), l2_normalize, costs, folds, every_steps, random_init.
  """

  def __init__(self, config, context: dict, host: int = 0, num_hosts: int = 1):
    from vlrep.data import pipeline

    self.config = config
    self.feature_key = config.get("feature", "pre_logits")
    self.builder = pipeline.get_builder(config.dataset, config.get("data_dir"), config.get("config_name"))
    self.context, self.host, self.num_hosts = context, host, num_hosts
    import jax

    if config.batch_size % jax.device_count():
      raise ValueError(f"Eval batch_size {config.batch_size} is not divisible by the {jax.device_count()} devices.")

  def _features(self, split, features_fn):
    from vlrep.data import pipeline

    feats, labels = [], []
    batches = pipeline.eval_batches(
      self.builder,
      split,
      self.config.pp,
      ("image", "labels"),
      self.config.batch_size // self.num_hosts,
      self.host,
      self.num_hosts,
      self.context,
    )
    for local in batches:
      f, batch = features_fn(local)
      m = batch["_mask"].astype(bool)
      feats.append(f[m])
      labels.append(batch["labels"][m])
    x = np.concatenate(feats).astype(np.float64)
    if self.config.get("l2_normalize", True):
      x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return x, np.concatenate(labels)

  def run(self, features_fn: Callable) -> dict[str, float]:
    """features_fn(local batch) -> (global features np[B, D], global batch np dict)."""
    t0 = time.time()
    train_x, train_y = self._features(self.config.train_split, features_fn)
    test_x, test_y = self._features(self.config.test_split, features_fn)
    t1 = time.time()
    result = fit_and_score(
      train_x, train_y, test_x, test_y, tuple(self.config.get("costs", DEFAULT_COSTS)), self.config.get("folds", 3)
    )
    logging.info(
      "VOC07 SVM: %d train / %d test images, features %.1fs, SVMs %.1fs, mAP %.2f",
      len(train_x),
      len(test_x),
      t1 - t0,
      time.time() - t1,
      result["map"],
    )
    return {"map": result["map"]}
