"""VOC07 linear-SVM probe (VirTex appendix A.1; ICMLM's variant): per-class LinearSVC on frozen, pooled features.

Protocol, as the official VirTex evaluation runs it (kdexd/virtex, scripts/clf_voc07.py): features of the trainval
and test splits (global-average-pooled, l2-normalised); for each class an SVM `LinearSVC(penalty='l2',
loss='squared_hinge', max_iter=2000, class_weight={1: 2, -1: 1})` per cost C, trained with every trainval image
(images whose only instances of the class are 'difficult' are negatives, as in the official code), the cost
chosen by 3-fold cross-validated average precision on trainval (`cross_val_score(cv=3,
scoring='average_precision')`: unshuffled stratified folds, the first of equal costs), refit on all of trainval;
test AP is scikit-learn's `average_precision_score` over the test images, leaving out those whose only instances are
difficult; mAP over classes. `ap='11point'` scores with the VOC2007 devkit's 11-point interpolated AP instead.

On a single-label dataset (`label_key` a class id per image, e.g. your own image_folder classes) each class's
SVM is one class against the rest: the class's images are its positives, every other image a negative.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
from absl import logging
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import average_precision_score
from sklearn.model_selection import StratifiedKFold
from sklearn.svm import LinearSVC

from vlrep import preemption
from vlrep.evaluators import _linear_svm, linear_probe
from vlrep.evaluators._inputs import EvalInputs, Model

DEFAULT_COSTS = (0.01, 0.1, 1.0, 10.0)
AP_KINDS = ("sklearn", "11point")


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


def average_precision(scores: np.ndarray, labels: np.ndarray, ap: str = "sklearn") -> float:
  """AP of `scores` for labels in {1, -1} (difficult already removed): scikit-learn's (the official VirTex
  evaluation's) or the VOC2007 11-point one. NaN where there is no positive."""
  if ap == "11point":
    return voc07_ap(scores, labels)
  if ap != "sklearn":
    raise ValueError(f"Unknown AP {ap!r}; expected one of {AP_KINDS}.")
  if not (labels > 0).any():
    return float("nan")
  return float(average_precision_score(labels > 0, scores))


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


ICMLM_COSTS = tuple(10.0**e for e in range(-5, 3))  # ICMLM's wider cost search (1e-5 .. 100)


def class_folds(train_y: np.ndarray, folds: int) -> np.ndarray:
  """[N, K] cross-validation fold of each image for each class; -1 for every image of a class that is skipped.

  Difficult labels (0) are negatives, as in the official evaluation. The folds are those `cross_val_score(cv=3)`
  gives a classifier (scikit-learn's unshuffled StratifiedKFold); both solvers use them. A class with fewer
  positives or negatives than folds cannot be cross-validated: all -1, and its AP is NaN.
  """
  out = np.full(train_y.shape, -1, np.int32)
  for c in range(train_y.shape[1]):
    y = np.where(train_y[:, c] > 0, 1, -1)
    if (y > 0).sum() < folds or (y < 0).sum() < folds:
      continue
    for f, (_, va) in enumerate(StratifiedKFold(folds).split(y, y)):
      out[va, c] = f
  return out


def fit_and_score(
  train_x,
  train_y,
  test_x,
  test_y,
  costs=DEFAULT_COSTS,
  folds: int = 3,
  solver: str = "jax",
  tol: float = 1e-3,
  ap: str = "sklearn",
  more_tests: dict | None = None,
) -> dict:
  """Runs the protocol on features and {1, 0 (difficult), -1} label matrices. Returns mAP and per-class details.

  solver='sklearn' is the reference (liblinear, one fit after the other); solver='jax' fits every class x cost x
  fold together (_linear_svm.py) and agrees with it to a fraction of a point (tests). ap: 'sklearn' (official) or
  '11point'. more_tests: {name: (x, y)} scored by the same SVMs (e.g. a validation split), as 'map_<name>'.
  'map_cv': the mean over classes of the cross-validated AP at each class's chosen cost, from the training
  features alone (held out from every test split: what a recipe may select checkpoints on).
  """
  if ap not in AP_KINDS:
    raise ValueError(f"Unknown AP {ap!r}; expected one of {AP_KINDS}.")
  fold_ids = class_folds(train_y, folds)
  skipped = [c for c in range(train_y.shape[1]) if (fold_ids[:, c] < 0).all()]
  for c in skipped:
    logging.warning("Class %d has too few positives/negatives to cross-validate; skipped.", c)
  parts = [(None, test_x, test_y)] + [(name, x, y) for name, (x, y) in (more_tests or {}).items()]
  all_test_x = np.concatenate([x for _, x, _ in parts])
  if solver == "sklearn":
    # One fit after the other: liblinear's dual solver shuffles coordinates with one process-wide random generator,
    # reseeded by each fit, so fits run in threads race on it and an unconverged fit (C = 10) depends on the
    # interleaving: the same problem would give different mAPs from run to run.
    results = [
      _one_class_sklearn(c, train_x, train_y, all_test_x, fold_ids, costs, folds, ap) for c in range(train_y.shape[1])
    ]
  elif solver == "jax":
    results = _all_classes_jax(train_x, train_y, all_test_x, fold_ids, costs, folds, tol, ap)
  else:
    raise ValueError(f"Unknown SVM solver {solver!r}; expected 'jax' or 'sklearn'.")
  out = {"costs": [cost for _, cost, _ in results]}
  cv = np.array([cv_ap for _, _, cv_ap in results])
  out["map_cv"] = float(np.nanmean(cv) * 100) if not np.isnan(cv).all() else float("nan")
  start = 0
  for name, x, y in parts:
    aps = np.full(y.shape[1], np.nan)
    for c, (scores, _, _) in enumerate(results):
      if scores is not None:
        keep = y[:, c] != 0  # difficult: left out at test
        aps[c] = average_precision(scores[start : start + len(x)][keep], y[keep, c], ap)
    start += len(x)
    key = "map" if name is None else f"map_{name}"
    out[key] = float(np.nanmean(aps) * 100) if not np.isnan(aps).all() else float("nan")
    if name is None:
      out["ap_per_class"] = (aps * 100).tolist()
  return out


def _one_class_sklearn(
  c, train_x, train_y, test_x, fold_ids, costs, folds, ap
) -> tuple[np.ndarray | None, float, float]:
  """(test scores of class c's SVM at the cross-validated cost, that cost, its cross-validated AP); (None, NaN,
  NaN) for a skipped class."""
  preemption.check()  # SIGTERM: stop between classes
  fold = fold_ids[:, c]
  if (fold < 0).all():
    return None, float("nan"), float("nan")
  y = np.where(train_y[:, c] > 0, 1, -1)
  cv_ap = []
  for cost in costs:
    fold_aps = []
    for f in range(folds):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = _svm(cost).fit(train_x[fold != f], y[fold != f])
      fold_aps.append(average_precision(clf.decision_function(train_x[fold == f]), y[fold == f], ap))
    cv_ap.append(np.mean(fold_aps))
  best = int(np.argmax(cv_ap))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ConvergenceWarning)
    clf = _svm(costs[best]).fit(train_x, y)
  return clf.decision_function(test_x), costs[best], float(cv_ap[best])


def _all_classes_jax(
  train_x, train_y, test_x, fold_ids, costs, folds, tol, ap
) -> list[tuple[np.ndarray | None, float, float]]:
  """Every class x fold (plus the full trainval fit) as one batch of SVMs, per cost, warm-started along costs.
  Per class: (test scores at the cross-validated cost, that cost, its cross-validated AP)."""
  import jax.numpy as jnp

  n, k = train_y.shape
  # Problem p = (class c, fold f); f == folds is the fit on all of trainval.
  cls = np.repeat(np.arange(k), folds + 1)
  fold = np.tile(np.arange(folds + 1), k)
  y = np.where(train_y[:, cls] > 0, 1.0, -1.0).astype(np.float32)
  in_set = (fold_ids[:, cls] >= 0) & (fold_ids[:, cls] != fold[None])
  class_weight = np.where(y > 0, 2.0, 1.0)
  # The solver works in the eigenbasis of the (bias-augmented) Gram matrix, shared by all problems: its Jacobi
  # preconditioner then captures the features' correlations (see _linear_svm.py).
  # Everything but the solver runs in NumPy: eager JAX ops would each compile once, which costs more than
  # these few products on the host (the first probe of a process pays for compilation).
  xa = np.concatenate([train_x, np.ones((n, 1))], axis=1).astype(np.float32)
  rot = _linear_svm.eigenbasis(xa)
  xr = xa @ rot
  xr_device = jnp.asarray(xr)
  test_xa = np.concatenate([test_x, np.ones((len(test_x), 1))], axis=1).astype(np.float32)
  full = fold == folds
  cv_ap = np.full((len(costs), k), np.nan)
  test_scores = {}
  w_host = np.zeros((xr.shape[1], len(cls)), np.float32)
  for i in np.argsort(costs):  # ascending costs: each warm-starts the next
    preemption.check()  # SIGTERM: stop between costs
    s = (costs[i] * class_weight * in_set).astype(np.float32)
    w, b, _ = _linear_svm.solve(xr_device, y, s, tol=tol, append_bias=False, w_init=w_host)
    w_host = np.concatenate([np.asarray(w), np.asarray(b)[None]], axis=0)
    train_scores = xr @ w_host
    test_scores[i] = test_xa @ (rot @ w_host[:, full])
    for c in range(k):
      if (fold_ids[:, c] < 0).all():
        continue
      aps = []
      for f in range(folds):
        va = fold_ids[:, c] == f
        aps.append(average_precision(train_scores[va, c * (folds + 1) + f], y[va, c * (folds + 1)], ap))
      cv_ap[i, c] = np.mean(aps)
  results = []
  for c in range(k):
    if np.isnan(cv_ap[:, c]).all():
      results.append((None, float("nan"), float("nan")))
      continue
    best = int(np.nanargmax(cv_ap[:, c]))
    results.append((test_scores[best][:, c], costs[best], float(cv_ap[best, c])))
  return results


def one_vs_rest(class_ids: np.ndarray, num_classes: int) -> np.ndarray:
  """[N] class ids -> [N, num_classes] targets in the protocol's form: 1 for the image's class, -1 for the rest."""
  class_ids = np.asarray(class_ids, np.int64)
  if len(class_ids) and (class_ids.min() < 0 or class_ids.max() >= num_classes):
    raise ValueError(f"Class ids outside [0, {num_classes}) for the SVM probe.")
  return np.where(np.eye(num_classes, dtype=bool)[class_ids], 1, -1).astype(np.int32)


def pool_features(x: np.ndarray, pooling: str) -> np.ndarray:
  """'gap': features as given ([B, D]); '2x2': a [B, H, W, C] grid average-pooled to 2x2 and flattened (ICMLM)."""
  if pooling == "gap":
    return x.reshape(len(x), -1) if x.ndim == 2 else x.mean(axis=(1, 2))
  if pooling == "2x2":
    if x.ndim != 4:
      raise ValueError(f"2x2 pooling needs a spatial feature grid [B, H, W, C]; got shape {x.shape}.")
    _, h, w, _ = x.shape
    # PyTorch's AdaptiveAvgPool2d((2, 2)) cells (what ICMLM used): [floor(i*H/2), ceil((i+1)*H/2)).
    cell = lambda i, n: slice(i * n // 2, -(-(i + 1) * n // 2))
    cells = [x[:, cell(i, h), cell(j, w)].mean(axis=(1, 2)) for i in range(2) for j in range(2)]
    return np.concatenate(cells, axis=1)
  raise ValueError(f"Unknown pooling {pooling!r}; expected 'gap' or '2x2'.")


# The metrics that score the config's test split: a run may keep its best checkpoint by one of them only when it
# says so (`select_on_test`; evaluators.selection_rule). 'map_val' (a val_split) and 'map_cv' (cross-validation on
# the training split) are held out from it.
TEST_METRICS = ("map",)


class Evaluator:
  """Evaluator: extracts features of two splits with the current backbone and runs the SVM protocol.

  Config: dataset, data_dir, config_name, train_split, test_split, pp (must produce 'image' and `label_key`),
  label_key ('labels', VOC's {1, 0, -1} per class; or a class id per image: one class against the rest, the
  classes counted by the dataset's ClassLabel at label_key unless num_classes is set), batch_size (global), feature
  ('pre_logits'; 'grid' with pooling '2x2' for ICMLM's variant), pooling ('gap' | '2x2'), l2_normalize, costs,
  folds, solver ('jax' | 'sklearn'), ap ('sklearn' | '11point'), val_split (optional: a split scored by the same
  SVMs as 'map_val', on which hyperparameters are chosen; test_split is only reported), every_steps, random_init.
  """

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.feature_key = config.get("feature", "pre_logits")
    self.builder = inputs.builder(config)
    self.inputs = inputs
    self.label_key = config.get("label_key", "labels")
    import jax

    if config.batch_size % jax.device_count():
      raise ValueError(f"Eval batch_size {config.batch_size} is not divisible by the {jax.device_count()} devices.")

  def _features(self, split, features_fn):
    """(features [N, D], labels [N, classes]) of a split, through features_fn(local batch) -> (global features
    np[B, ...], global batch np dict)."""
    feats, labels = [], []
    fields = ("image", self.label_key)
    for local in self.inputs.batches(self.builder, split, self.config.pp, fields, self.config.batch_size):
      f, batch = features_fn(local)
      m = batch["_mask"].astype(bool)
      feats.append(pool_features(f[m], self.config.get("pooling", "gap")))
      labels.append(batch[self.label_key][m])
    if not feats:
      raise ValueError(f"Split {split!r} of {self.config.dataset} yielded no images for the SVM probe.")
    x = np.concatenate(feats).astype(np.float64)
    if not np.isfinite(x).all():
      raise FloatingPointError(f"The backbone gave non-finite features on {split!r}; the checkpoint is broken.")
    if self.config.get("l2_normalize", True):
      x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    y = np.concatenate(labels)
    if y.ndim == 1:  # a class id per image
      num_classes = self.config.get("num_classes") or linear_probe.dataset_num_classes(self.builder, self.label_key)
      y = one_vs_rest(y, num_classes)
    return x, y

  def evaluate(self, model: Model) -> dict[str, float]:
    features_fn = model.extractor(self.feature_key)
    t0 = time.time()
    train_x, train_y = self._features(self.config.train_split, features_fn)
    test_x, test_y = self._features(self.config.test_split, features_fn)
    val_split = self.config.get("val_split", "")
    more_tests = {"val": self._features(val_split, features_fn)} if val_split else None
    t1 = time.time()
    result = fit_and_score(
      train_x,
      train_y,
      test_x,
      test_y,
      tuple(self.config.get("costs", DEFAULT_COSTS)),
      self.config.get("folds", 3),
      solver=self.config.get("solver", "jax"),
      ap=self.config.get("ap", "sklearn"),
      more_tests=more_tests,
    )
    logging.info(
      "VOC07 SVM (%s): %d train / %d test images, features %.1fs, SVMs %.1fs, mAP %.2f",
      self.config.get("solver", "jax"),
      len(train_x),
      len(test_x),
      t1 - t0,
      time.time() - t1,
      result["map"],
    )
    return {k: result[k] for k in ("map", "map_val", "map_cv") if k in result}
