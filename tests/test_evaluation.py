"""Downstream evaluation: the SVM solvers, linear probe, caption decoding and metrics, and their commands."""

import importlib.util
import json
import os
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, load_tiny_config, run_main, run_module
from ml_collections import ConfigDict
from sklearn.svm import LinearSVC

from vlrep import decoding, evaluators
from vlrep.data import records
from vlrep.evaluators import _caption_metrics, _linear_svm, linear_probe, voc07_svm


# ------------------------------------------------------------------------------------------------------ #
# VOC07 SVM: the JAX solver against scikit-learn.
# ------------------------------------------------------------------------------------------------------ #
def _svm_problem(seed=0, n=300, d=40):
  rng = np.random.default_rng(seed)
  y = np.where(rng.random(n) < 0.3, 1.0, -1.0)
  x = rng.normal(size=(n, d)) + 0.4 * y[:, None] * (rng.random(d) < 0.3)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  return x, y


@pytest.mark.parametrize("cost", [0.01, 1.0, 10.0])
def test_jax_svm_solves_liblinears_objective(cost):
  x, y = _svm_problem()
  s = cost * np.where(y > 0, 2.0, 1.0)
  w, b, info = _linear_svm.solve(x, y[:, None], s[:, None], tol=1e-5)
  ours = _linear_svm.squared_hinge_objective(x, y[:, None], s[:, None], w, b)[0]
  ref = LinearSVC(C=cost, class_weight={1: 2, -1: 1}, tol=1e-6, max_iter=100_000, dual=True).fit(x, y)
  theirs = _linear_svm.squared_hinge_objective(x, y[:, None], s[:, None], ref.coef_.T, ref.intercept_)[0]
  assert float(info["grad_ratio"].max()) <= 1e-5
  assert abs(ours - theirs) <= 1e-4 * theirs, (ours, theirs)
  # The same optimum in the eigenbasis (what the probe uses): rotations leave the problem unchanged.
  xa = jnp.concatenate([x, np.ones((len(x), 1))], axis=1).astype(jnp.float32)
  rot = _linear_svm.eigenbasis(xa)
  wr, br, _ = _linear_svm.solve(xa @ rot, y[:, None], s[:, None], tol=1e-5, append_bias=False)
  full = rot @ jnp.concatenate([wr, br[None]], axis=0)
  np.testing.assert_allclose(full[:-1, 0], np.asarray(w)[:, 0], atol=2e-3 * np.abs(w).max())


def _multilabel(seed, n=400, d=32, k=4, signal=1.0):
  rng = np.random.default_rng(seed)
  labels = np.where(rng.random((n, k)) < 0.25, 1, -1)
  labels[rng.random((n, k)) < 0.05] = 0  # 'difficult'
  x = rng.normal(size=(n, d))
  x[:, :k] += signal * (labels > 0)
  return x, labels


def test_fit_and_score_jax_agrees_with_sklearn():
  x, y = _multilabel(0, signal=2.0)
  results = {s: voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], solver=s) for s in ("jax", "sklearn")}
  assert 60 < results["sklearn"]["map"] < 99  # neither trivial nor hopeless
  assert abs(results["jax"]["map"] - results["sklearn"]["map"]) < 0.3
  assert results["jax"]["costs"] == results["sklearn"]["costs"]
  # The cross-validated score (what recipes select checkpoints on) agrees too, and is a real held-out score.
  assert 50 < results["sklearn"]["map_cv"] < 99
  assert abs(results["jax"]["map_cv"] - results["sklearn"]["map_cv"]) < 0.5
  # The reference is deterministic: its unconverged C = 10 fits once varied with thread interleaving (liblinear's
  # random generator is process-wide), most under load, so repeat it with the other cores busy.
  stop = threading.Event()

  def burn():  # keeps a core busy (numpy releases the GIL) without holding on to what it computes
    while not stop.is_set():
      np.linalg.svd(x, compute_uv=False)

  burners = [threading.Thread(target=burn) for _ in range(2)]
  for t in burners:
    t.start()
  try:
    again = {voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], solver="sklearn")["map"] for _ in range(4)}
  finally:
    stop.set()
    for t in burners:
      t.join()
  assert again == {results["sklearn"]["map"]}
  # Separable features give 100; pure noise stays near the positive rate (chance AP), far from 100.
  separable = np.c_[np.where(y > 0, 3.0, -3.0), np.zeros((len(y), 4))]
  assert voc07_svm.fit_and_score(separable[:250], y[:250], separable[250:], y[250:])["map"] == pytest.approx(100)
  noise = np.random.default_rng(1).normal(size=x.shape)
  assert voc07_svm.fit_and_score(noise[:250], y[:250], noise[250:], y[250:])["map"] < 45
  with pytest.raises(ValueError, match="Unknown SVM solver"):
    voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], solver="liblinear")


def _official_virtex_svm_map(train_x, train_y, test_x, test_y, costs=voc07_svm.DEFAULT_COSTS, drop_difficult=False):
  """The official VirTex evaluation (kdexd/virtex scripts/clf_voc07.py) written out with scikit-learn's own
  pieces: difficult (0) are negatives in training, cross_val_score(cv=3, scoring='average_precision') picks the cost
  (strictly better only), test AP is average_precision_score over the non-difficult test images."""
  from sklearn.metrics import average_precision_score
  from sklearn.model_selection import cross_val_score

  aps = []
  for c in range(train_y.shape[1]):
    rows = train_y[:, c] != 0 if drop_difficult else slice(None)  # drop_difficult: another protocol, for contrast
    y = np.where(train_y[rows, c] > 0, 1, -1)
    best_ap, best_clf = 0.0, None
    for cost in costs:
      # vlrep's estimator settings (dual coordinate descent, fixed seed): the test checks the protocol around it.
      clf = LinearSVC(C=cost, class_weight={1: 2, -1: 1}, penalty="l2", loss="squared_hinge", max_iter=2000,
                      dual=True, tol=1e-4, random_state=0)  # fmt: skip
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = cross_val_score(clf, train_x[rows], y, cv=3, scoring="average_precision")
        clf.fit(train_x[rows], y)
      if scores.mean() > best_ap:
        best_ap, best_clf = scores.mean(), clf
    keep = test_y[:, c] != 0
    aps.append(average_precision_score(test_y[keep, c] > 0, best_clf.decision_function(test_x[keep])))
  return 100 * float(np.mean(aps))


def test_probe_is_the_official_virtex_protocol():
  x, y = _multilabel(3, signal=1.5)
  # Difficult images that look like positives: as negatives in training (official) they change the SVMs, so
  # leaving them out of training gives another mAP, so the test tells the two protocols apart.
  x[:, :4] += 1.5 * (y == 0)
  official = _official_virtex_svm_map(x[:250], y[:250], x[250:], y[250:])
  assert abs(official - _official_virtex_svm_map(x[:250], y[:250], x[250:], y[250:], drop_difficult=True)) > 0.05
  ours = voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], solver="sklearn")
  assert ours["map"] == pytest.approx(official, abs=1e-9)
  assert 55 < official < 99
  jax_map = voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], solver="jax")["map"]
  assert abs(jax_map - official) < 0.3
  # Every training image has a fold for every class (difficult ones too), in cross_val_score's unshuffled order.
  folds = voc07_svm.class_folds(y[:250], 3)
  assert (folds >= 0).all()
  from sklearn.model_selection import StratifiedKFold

  for f, (_, va) in enumerate(StratifiedKFold(3).split(x[:250], y[:250, 0] > 0)):
    assert (folds[va, 0] == f).all()
  # The AP is scikit-learn's on the same scores; the 11-point devkit AP stays available and differs.
  rng = np.random.default_rng(0)
  scores, labels = rng.normal(size=200), np.where(rng.random(200) < 0.3, 1, -1)
  from sklearn.metrics import average_precision_score

  assert voc07_svm.average_precision(scores, labels) == pytest.approx(average_precision_score(labels > 0, scores))
  assert voc07_svm.average_precision(scores, labels, "11point") == voc07_svm.voc07_ap(scores, labels)
  assert voc07_svm.average_precision(scores, labels, "11point") != pytest.approx(
    voc07_svm.average_precision(scores, labels), abs=1e-3
  )
  eleven = voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], solver="sklearn", ap="11point")["map"]
  assert eleven != pytest.approx(official, abs=1e-3)
  with pytest.raises(ValueError, match="Unknown AP"):
    voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], ap="voc12")
  # A validation split is scored by the same SVMs: passing the test split as 'val' gives the test mAP again.
  both = voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:], more_tests={"val": (x[250:], y[250:])})
  assert both["map_val"] == pytest.approx(both["map"])


def test_icmlm_2x2_pooling():
  grid = np.arange(2 * 4 * 4 * 3, dtype=np.float64).reshape(2, 4, 4, 3)
  pooled = voc07_svm.pool_features(grid, "2x2")
  assert pooled.shape == (2, 12)
  np.testing.assert_allclose(pooled[0, :3], grid[0, :2, :2].mean(axis=(0, 1)))  # top-left cell first
  np.testing.assert_allclose(pooled[0, 9:], grid[0, 2:, 2:].mean(axis=(0, 1)))  # bottom-right last
  np.testing.assert_allclose(voc07_svm.pool_features(grid, "gap"), grid.mean(axis=(1, 2)))
  # Grids smaller than 2x2 (tiny inputs) repeat cells, as PyTorch's AdaptiveAvgPool2d does; 3x3 cells overlap.
  one = voc07_svm.pool_features(grid[:, :1, :1], "2x2")
  np.testing.assert_allclose(one, np.tile(grid[:, 0, 0], (1, 4)))
  three = voc07_svm.pool_features(grid[:, :3, :3], "2x2")
  np.testing.assert_allclose(three[0, :3], grid[0, :2, :2].mean(axis=(0, 1)))
  np.testing.assert_allclose(three[0, 9:], grid[0, 1:3, 1:3].mean(axis=(0, 1)))
  with pytest.raises(ValueError, match="spatial feature grid"):
    voc07_svm.pool_features(grid.mean(axis=(1, 2)), "2x2")


# ------------------------------------------------------------------------------------------------------ #
# Linear probe.
# ------------------------------------------------------------------------------------------------------ #
def test_linear_probe_learns_separable_classes_and_not_noise():
  rng = np.random.default_rng(0)
  centers = rng.normal(size=(5, 16)) * 3
  y = rng.integers(0, 5, 600)
  x = (centers[y] + rng.normal(size=(600, 16))).astype(np.float32)
  cfg = ConfigDict(dict(lr=0.3, epochs=20, batch_size=50, momentum=0.9, schedule="cosine"))

  def fit(x, y):
    order = np.concatenate([rng.permutation(500) for _ in range(21)])
    batches = lambda i: (x[order[i * 50 : (i + 1) * 50]], y[order[i * 50 : (i + 1) * 50]], np.ones(50, np.float32))
    w, b = linear_probe.train_linear(batches, 16, 5, 200, cfg, 10.0)
    return linear_probe.topk_accuracy(x[500:] @ w + b, y[500:], 1)

  assert fit(x, y) > 95
  assert fit(rng.normal(size=x.shape).astype(np.float32), y) < 45  # 5 classes: chance is 20
  step = linear_probe.make_schedule(ConfigDict(dict(lr=30.0, schedule="step", milestones=(6, 8))), 100, 10.0)
  assert float(step(59)) == 30.0 and float(step(61)) == pytest.approx(6.0) and float(step(81)) == pytest.approx(1.2)


def test_icmlm_svm_config_searches_the_papers_cost_range():
  """ICMLM's appendix: 40 costs between 1e-5 and 1e5 (log scale), 2x2-pooled last-stage features."""
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  from eval import voc07_svm as svm_config

  c = svm_config.get_config("variant=icmlm").evals.voc07_svm_icmlm
  assert len(c.costs) == 40 and c.costs[0] == pytest.approx(1e-5) and c.costs[-1] == pytest.approx(1e5)
  assert np.allclose(np.diff(np.log10(c.costs)), 10 / 39) and (c.feature, c.pooling) == ("grid", "2x2")


def test_mct_linear_probe_config_is_the_papers_protocol():
  """MCT 4.2: 60 epochs, LR 30 / 5 at epochs 30, 40, 50, no weight decay, batch 256, no training augmentation."""
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  from eval import linear_probe as probe_config

  mct = probe_config.get_config("variant=mct").evals.linear_probe_mct
  assert (mct.epochs, mct.milestones, mct.lr, mct.step_factor, mct.weight_decay, mct.batch_size) == (
    60,
    (30, 40, 50),
    30.0,
    0.2,
    0.0,
    256,
  )
  assert mct.pp_train == mct.pp_eval and "inception_crop" not in mct.pp_train
  local = probe_config.get_config("variant=mct,runlocal").evals.linear_probe_mct
  assert local.milestones == (15, 20, 25) and local.pp_train == local.pp_eval  # same fractions of 30 epochs


# ------------------------------------------------------------------------------------------------------ #
# Caption metrics (reference values computed with pycocoevalcap 1.2's Cider and Bleu on the same text).
# ------------------------------------------------------------------------------------------------------ #
REFS = {
  1: [
    "a man riding a horse on a beach.",
    "a person rides a brown horse along the sand.",
    "man on horseback near the ocean.",
  ],
  2: ["two dogs playing with a red ball in the grass.", "a pair of dogs chase a ball on a lawn."],
  3: [
    "a plate of food with broccoli and rice.",
    "a white plate topped with rice and vegetables.",
    "broccoli and rice on a dish.",
  ],
  4: ["a red double decker bus driving down the street.", "a bus on a city street."],
}
CANDS = {
  1: "a man riding a horse on the beach.",
  2: "a dog playing with a ball.",
  3: "a plate of rice and broccoli.",
  4: "a red bus on a street.",
}


def test_cider_and_bleu_match_coco_caption():
  cider, per_image = _caption_metrics.cider_d(CANDS, REFS)
  assert cider == pytest.approx(2.2345994444900334, rel=1e-9)
  assert [per_image[i] for i in CANDS] == pytest.approx(
    [2.904167694202904, 1.37757161495137, 2.318802608202403, 2.3378558606034563], rel=1e-9
  )
  bleu = _caption_metrics.bleu(CANDS, REFS)
  assert bleu == pytest.approx(
    [0.8244268452831607, 0.6706894456136369, 0.5313140670701283, 0.40743483401842784], rel=1e-8
  )
  # Swapping captions between images ruins CIDEr.
  swapped = {1: CANDS[3], 2: CANDS[4], 3: CANDS[1], 4: CANDS[2]}
  assert _caption_metrics.cider_d(swapped, REFS)[0] < 0.3
  with pytest.raises(ValueError, match="no references"):
    _caption_metrics.score_all({9: "a cat"}, REFS)


# ------------------------------------------------------------------------------------------------------ #
# Decoding, on a toy model whose next-token distribution depends on the previous token only.
# ------------------------------------------------------------------------------------------------------ #
V = 10
A, B, C, D = 5, 6, 7, 8


def _markov_logits_fn(table):
  table = jnp.log(jnp.asarray(table) + 1e-9)

  def fn(tokens):
    return table[tokens]  # [N, T, V]: row of the previous token

  return fn


def _table():
  t = np.full((V, V), 0.0)
  t[decoding.SOS, [A, B]] = [0.55, 0.45]  # greedy takes A ...
  t[A, [C, D]] = [0.5, 0.5]  # ... after which nothing is likely (0.55 * 0.5 = 0.275)
  t[B, decoding.EOS] = 1.0  # ... while B then [EOS] has 0.45
  t[C, decoding.EOS] = t[D, decoding.EOS] = 1.0
  t[decoding.EOS, decoding.EOS] = 1.0
  t[decoding.PAD, decoding.PAD] = 1.0
  return t


def test_greedy_beam_and_nucleus_decoding():
  fn = _markov_logits_fn(_table())
  greedy = np.asarray(decoding.greedy(fn, 1, 5))[0]
  assert greedy[0] == A and greedy[2] == decoding.EOS and (greedy[3:] == decoding.PAD).all()
  beam, score = decoding.beam_search(fn, 1, 5, beam_size=3)
  assert list(np.asarray(beam)[0][:2]) == [B, decoding.EOS] and (np.asarray(beam)[0][2:] == decoding.PAD).all()
  assert float(score[0]) == pytest.approx(np.log(0.45), abs=1e-4)
  # A tiny nucleus keeps only the most likely token: greedy. A full one samples B about 45% of the time.
  np.testing.assert_array_equal(np.asarray(decoding.nucleus(fn, 1, 5, jax.random.PRNGKey(0), top_p=0.01))[0], greedy)
  firsts = np.asarray(decoding.nucleus(fn, 400, 3, jax.random.PRNGKey(1), top_p=1.0))[:, 0]
  assert 0.35 < np.mean(firsts == B) < 0.55 and set(firsts.tolist()) <= {A, B}


# ------------------------------------------------------------------------------------------------------ #
# The commands on a tiny trained run: evaluate, caption, export, sweep, notebook.
# ------------------------------------------------------------------------------------------------------ #
@pytest.fixture(scope="module")
def tiny_run(tiny_virtex_run):
  assert tiny_virtex_run.returncode == 0, tiny_virtex_run.stderr[-3000:]
  return str(tiny_virtex_run.workdir)


def _tiny_eval_config(**overrides):
  train = load_tiny_config()
  probe = dict(train.evals.probe)
  probe.update(solver="jax")
  data = dict(dataset="synthetic_scenes", config_name="tiny", data_dir=train.data.data_dir)
  evals = {
    "svm": probe,
    "svm_icmlm": {**probe, "feature": "grid", "pooling": "2x2", "costs": (0.01, 1.0, 100.0)},
    "linear": dict(
      type="linear_probe",
      **data,
      train_split="train",
      test_split="val",
      num_classes=10,
      pp_train="decode|flip_lr_swap_words(keys=())|normalize|largest_object_label",
      pp_eval="decode|normalize|largest_object_label",
      mode="images",
      epochs=1,
      batch_size=16,
      lr=0.3,
    ),
    "captions": dict(
      type="captioning",
      **data,
      split="val",
      pp="decode|normalize",
      decoding="beam",
      beam_size=2,
      max_len=12,
      batch_size=16,
    ),
  }
  evals.update(overrides)
  return ConfigDict({"evals": evals})


def test_evaluate_command_writes_every_metric(tiny_run):
  from vlrep import evaluate

  results = evaluate.evaluate(_tiny_eval_config(), tiny_run)
  summary = json.loads(open(os.path.join(tiny_run, "summary.json")).read())
  for key in ("svm/map", "svm_icmlm/map", "linear/top1", "linear/top5", "captions/cider", "captions/bleu4"):
    assert key in results and key in summary and np.isfinite(summary[key]), key
  assert 0 <= results["linear/top1"] <= results["linear/top5"] <= 100
  assert summary["svm/checkpoint_step"] == 6 and "probe/map" in summary  # beside the training metrics
  # The standalone probe reproduces the training loop's final probe (same checkpoint, same protocol).
  assert results["svm/map"] == pytest.approx(summary["probe/map"], abs=0.3)


def test_evaluate_bad_inputs(tiny_run, tmp_path):
  from vlrep import evaluate

  with pytest.raises(ValueError, match="Unknown evaluator type"):
    evaluate.evaluate(ConfigDict({"evals": {"x": {"type": "voc12_svm"}}}), tiny_run)
  with pytest.raises(ValueError, match="Unknown evaluations"):
    evaluate.evaluate(_tiny_eval_config(), tiny_run, names=["nope"])
  bad_split = _tiny_eval_config(svm={**dict(load_tiny_config().evals.probe), "test_split": "probe_valid"})
  with pytest.raises(ValueError, match="Split 'probe_valid' not in"):
    evaluate.evaluate(bad_split, tiny_run, names=["svm"])
  from vlrep.errors import UserError

  # A folder that is not a run is the user's to fix: one message, exit 2 from the command (issue 76).
  with pytest.raises(UserError, match="has no checkpoint"):
    evaluate.evaluate(_tiny_eval_config(), str(tmp_path))
  with pytest.raises(ValueError, match="Unknown dataset"):
    evaluate.evaluate(
      _tiny_eval_config(svm={**dict(load_tiny_config().evals.probe), "dataset": "no_such_set"}), tiny_run, names=["svm"]
    )


def test_unprepared_tfds_dataset_names_the_build_command(tmp_path):
  from vlrep.data import pipeline

  with pytest.raises(FileNotFoundError, match="tfds build imagenet2012"):
    pipeline.get_builder("imagenet2012", str(tmp_path))


def test_evaluate_cli(tiny_run):
  proc = run_module(
    "vlrep.evaluate",
    "--config=configs/eval/voc07_svm.py:runlocal",
    f"--workdir={tiny_run}",
    "--config.evals.voc07_svm.config_name=tiny",
    f"--config.evals.voc07_svm.data_dir={load_tiny_config().data.data_dir}",
    "--config.evals.voc07_svm.costs=(0.1,1.0)",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "voc07_svm/map:" in proc.stdout


def test_caption_tool_writes_captions_and_attention_pngs(tiny_run, tmp_path):
  from PIL import Image

  from vlrep.tools import caption

  rng = np.random.default_rng(0)
  paths = []
  for i, size in enumerate([(50, 40), (32, 64)]):
    path = tmp_path / f"img{i}.png"
    Image.fromarray(rng.integers(0, 255, size + (3,), dtype=np.uint8)).save(path)
    paths.append(str(path))
  out = caption.caption_files(tiny_run, paths, "latest", "greedy", max_len=8, attention_dir=str(tmp_path / "att"))
  for p in paths:
    entry = out[p]
    assert isinstance(entry["caption"], str)
    assert len(entry["attention_pngs"]) == len(entry["tokens"])
    for png in entry["attention_pngs"]:
      assert Image.open(png).size == (224, 224)  # 32px input upscaled 7x for viewing
  not_image = tmp_path / "notes.png"
  not_image.write_text("not an image")
  with pytest.raises(ValueError, match="not a readable image"):
    caption.caption_files(tiny_run, [str(not_image)], "latest")
  with pytest.raises(FileNotFoundError, match="No such image"):
    caption.caption_files(tiny_run, [str(tmp_path / "missing.jpg")], "latest")


def test_grounding_tool_scores_each_word_group_with_own_and_other_images(tiny_run):
  """The tool's own-image NLL, token-weighted over groups, is the method's forward loss on the same captions; the
  other-image NLL differs (a trained head's image changes its predictions); piece groups cover scenes' words."""
  import jax
  import jax.numpy as jnp

  from vlrep import run_setup, runs
  from vlrep.data import pipeline
  from vlrep.tools import grounding

  result = grounding.image_gain(tiny_run, split="val", limit=8)
  assert {"colour", "shape", "other"} <= set(result)
  run = runs.load_run(tiny_run, "latest")
  _, eval_inputs = run_setup.build(run.config)
  builder = pipeline.get_builder("synthetic_scenes", run.config.data.data_dir, "tiny")
  examples = records.first_examples(builder, "val", 8)
  batch = next(pipeline.eval_batches(builder, examples, "decode|normalize", ("image", "captions"), 100))
  real = batch["_mask"].astype(bool)
  captions = np.array(batch["captions"], dtype=object).reshape(len(real), -1)[real]
  total_nll, total_tokens = 0.0, 0
  for column in captions.T:
    tokens = np.stack([eval_inputs.tokenizer.encode(c.decode(), run.config.method.max_len)[0] for c in column])
    inputs = {"image": jnp.asarray(batch["image"][real]), "tokens": jnp.asarray(tokens)}
    _, metrics, _ = eval_inputs.method.loss(run.variables, inputs, jax.random.PRNGKey(0), train=False)
    n = int((tokens[:, 1:] != 0).sum())
    total_nll += float(metrics["forward_loss"]) * n
    total_tokens += n
  assert sum(r["tokens"] for r in result.values()) == total_tokens
  mean_matched = sum(r["matched"] * r["tokens"] for r in result.values()) / total_tokens
  np.testing.assert_allclose(mean_matched, total_nll / total_tokens, rtol=1e-4)
  assert any(abs(r["gain"]) > 1e-4 for r in result.values())
  with pytest.raises(ValueError, match="backward"):
    grounding.image_gain(tiny_run, split="val", limit=8, direction="sideways")


def test_captioning_needs_a_forward_model():
  from vlrep import methods
  from vlrep.evaluators import captioning

  method = methods.build(load_tiny_config("task=masked_lm").method, 50)
  with pytest.raises(ValueError, match="forward captioning head"):
    captioning.captioner_for(method, ConfigDict({"decoding": "beam"}))


def test_sweep_tabulates_and_plots(tmp_path):
  from vlrep.tools import sweep

  for frac, value in ((10, 50.0), (100, 66.5)):
    os.makedirs(tmp_path / f"fraction{frac}")
    (tmp_path / f"fraction{frac}" / "summary.json").write_text(json.dumps({"probe/map": value, "preempted": False}))
  md, png = sweep.sweep(
    "configs/virtex.py:runlocal", "fraction=10 20 100", str(tmp_path), ["probe/map"], collect_only=True
  )
  table = open(md).read()
  assert "| fraction | probe/map |" in table
  assert "| 10 | 50.00 |" in table and "| 100 | 66.50 |" in table and "| 20 | — |" in table
  assert os.path.getsize(png) > 1000
  assert [v[1] for v in sweep.variants("c.py:runlocal", sweep.parse_vary("a=1 2;b=x"))] == [
    "c.py:runlocal,a=1,b=x",
    "c.py:runlocal,a=2,b=x",
  ]


def test_sweep_over_seeds_runs_each_seed_and_tabulates_means(tmp_path, monkeypatch):
  from vlrep.tools import sweep

  calls = []

  def fake_run(cfg, workdir, overrides, eval_config, dry_run=False):
    # Each fake run's metric is known: 30 + seed for tfm, 20 + seed for att_fc (seed 2 of att_fc has none).
    calls.append((os.path.basename(workdir), cfg, overrides))
    seed = int(next((o.split("=")[1] for o in overrides if o.startswith("seed=")), 0))
    summary = {"preempted": False}
    if not ("att_fc" in cfg and seed == 2):
      summary["probe/map"] = (30.0 if "tfm" in cfg else 20.0) + seed
    os.makedirs(workdir)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f)

  monkeypatch.setattr(sweep, "run_variant", fake_run)
  md, png = sweep.sweep(
    "configs/icmlm.py:runlocal",
    "variant=tfm att_fc",
    str(tmp_path),
    ["probe/map"],
    overrides=["init_from=/r/tp{suffix}", "log_every_steps=7"],
    seeds=["0", "1", "2"],
  )
  assert calls[:3] == [
    ("varianttfm", "configs/icmlm.py:runlocal,variant=tfm", ["init_from=/r/tp", "log_every_steps=7"]),
    ("varianttfm_s1", "configs/icmlm.py:runlocal,variant=tfm", ["init_from=/r/tp_s1", "log_every_steps=7", "seed=1"]),
    ("varianttfm_s2", "configs/icmlm.py:runlocal,variant=tfm", ["init_from=/r/tp_s2", "log_every_steps=7", "seed=2"]),
  ]
  assert len(calls) == 6
  table = open(md).read()
  assert "seeds 0, 1, 2: mean ± std (each seed)" in table
  assert "| tfm | 31.00 ± 1.00 (30.00 / 31.00 / 32.00) |" in table  # sample std
  assert "| att_fc | 20.50 ± 0.71 (20.00 / 21.00 / —) |" in table  # the missing seed is shown and left out of the mean
  assert os.path.getsize(png) > 1000
  # Finished runs are not started again; with an eval config, only those whose summary lacks a requested metric
  # are evaluated (att_fc's seed 2 has no probe/map), and only evaluated.
  calls.clear()
  evaluated = []
  monkeypatch.setattr(sweep, "evaluate_run", lambda eval_config, workdir: evaluated.append(os.path.basename(workdir)))
  sweep.sweep("configs/icmlm.py:runlocal", "variant=tfm att_fc", str(tmp_path), ["probe/map"], seeds=["0", "1", "2"])
  sweep.sweep("configs/icmlm.py:runlocal", "variant=tfm", str(tmp_path), ["probe/map"], "e.py", seeds=["0", "1"])
  assert calls == [] and evaluated == []
  sweep.sweep("configs/icmlm.py:runlocal", "variant=att_fc", str(tmp_path), ["probe/map"], "e.py", seeds=["0", "2"])
  assert calls == [] and evaluated == ["variantatt_fc_s2"]
  with pytest.raises(ValueError, match="distinct"):
    sweep.sweep("c.py", "a=1", str(tmp_path), ["m"], seeds=["1", "1"])
  with pytest.raises(ValueError, match="integers"):
    sweep.sweep("c.py", "a=1", str(tmp_path), ["m"], seeds=["x"])
  with pytest.raises(ValueError, match="--seeds, not --overrides"):
    sweep.sweep("c.py", "a=1", str(tmp_path), ["m"], overrides=["seed=3"], seeds=["0", "1"])


def test_inspection_notebook_runs_top_to_bottom(tiny_run):
  import nbclient
  import nbformat

  nb = nbformat.read(os.path.join(ROOT, "colab", "inspect.ipynb"), as_version=4)
  os.environ["VLREP_NOTEBOOK_WORKDIR"] = tiny_run
  try:
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  finally:
    del os.environ["VLREP_NOTEBOOK_WORKDIR"]
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "step 6" in text and "neighbours sharing a class" in text
  figures = [
    o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})
  ]
  assert len(figures) == 3


def test_finetune_starts_from_the_pretrained_backbone(tiny_run, tmp_path):
  from vlrep import runs

  proc = run_main(
    tmp_path / "ft",
    f"--config.init_from={tiny_run}",
    "--config.optim.lr_groups=(('.*', 0.0),)",
    config="tests/tiny_finetune.py",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Backbone initialised from" in proc.stderr
  summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
  assert 0 <= summary["val/top1"] <= summary["val/top5"] <= 100
  # With LR 0 the fine-tuned backbone is exactly the pretrained one (and the new classifier exists).
  src, ft = runs.load_run(tiny_run), runs.load_run(str(tmp_path / "ft"), "latest")
  jax.tree.map(np.testing.assert_array_equal, ft.params["backbone"], src.params["backbone"])
  assert ft.params["classifier"]["kernel"].shape == (64, 10)
  # A config whose backbone differs takes the architecture of the run it starts from, and says so.
  other = run_main(
    tmp_path / "ft_other",
    f"--config.init_from={tiny_run}",
    "--config.method.backbone.depth=18",
    "--config.total_steps=1",
    config="tests/tiny_finetune.py",
  )
  assert other.returncode == 0, other.stderr[-3000:]
  assert "the backbone takes the architecture of" in other.stderr and "depth=10 (config: 18)" in other.stderr
  assert runs.read_config(str(tmp_path / "ft_other")).method.backbone.depth == 10


def test_negative_or_fractional_every_steps_is_refused_before_any_evaluator_is_built():
  from vlrep import evaluators

  # type 'nope' would fail in build(): the every_steps check must come first and name the evaluator.
  for every in (-1, 2.5):
    with pytest.raises(ValueError, match=r"evals\.probe\.every_steps="):
      evaluators.build_all(ConfigDict({"probe": {"type": "nope", "every_steps": every}}), {})
  with pytest.raises(ValueError, match="Unknown evaluator type"):
    evaluators.build_all(ConfigDict({"probe": {"type": "nope", "every_steps": 0}}), {})


def test_virtex_fraction_ablation_scales_the_steps_as_the_paper():
  """VirTex A.1: the data-efficiency runs train for iterations proportional to their share of the images."""
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import virtex

  full, tenth = virtex.get_config(), virtex.get_config("fraction=10")
  assert (full.total_steps, full.data.split) == (500_000, "train")
  assert (tenth.total_steps, tenth.data.split) == (50_000, "train[:10%]")
  assert virtex.get_config("fraction=50,steps=7").total_steps == 7  # an explicit budget wins
  assert virtex.get_config("runlocal,fraction=20").total_steps == virtex.get_config("runlocal").total_steps // 5
  with pytest.raises(ValueError, match="percentage"):
    virtex.get_config("fraction=0")


def test_supervised_presence_reference_trains_multilabel_and_is_probed(tmp_path):
  """configs/finetune.py:runlocal,labels=presence: the runlocal backbone trained on which shapes are present
  (sigmoid cross-entropy, checked by hand), probed like the pretraining methods."""
  from vlrep.methods import classifier

  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import finetune
  import virtex

  c = finetune.get_config("runlocal,labels=presence")
  ref = virtex.get_config("runlocal")
  assert c.method.multilabel and c.method.backbone.to_dict() == ref.method.backbone.to_dict()
  assert c.total_steps == ref.total_steps and c.optim.name == ref.optim.name and c.batch_size == ref.batch_size
  assert c.data.pp.endswith("tags(num_tags=10, out='label')") and list(c.evals) == ["probe"]
  assert c.evals.probe.val_split == "probe_val" and c.best_metric == "probe/map_val"
  with pytest.raises(ValueError, match="use it with runlocal"):
    finetune.get_config("labels=presence")
  with pytest.raises(ValueError, match="Unknown labels"):
    finetune.get_config("runlocal,labels=colour")
  # The loss is the mean sigmoid cross-entropy over classes and images.
  m = classifier.Method(
    ConfigDict({"num_classes": 3, "multilabel": True, "dtype": "float32", "backbone": {"depth": 10, "width": 4}})
  )
  batch = {"image": np.zeros((2, 16, 16, 3), np.float32), "label": np.array([[1, 0, 1], [0, 0, 1]], np.uint8)}
  variables = m.init(jax.random.PRNGKey(0), batch)
  loss, metrics, _ = m.loss(variables, batch, None, True)
  logits, _ = m.model.apply(variables, batch["image"], True, mutable=["batch_stats"])[0]
  z, y = np.asarray(logits, np.float64), batch["label"].astype(np.float64)
  expected = np.mean(np.log1p(np.exp(-np.abs(z))) + np.maximum(z, 0) - z * y)
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  assert float(metrics["exact_match"]) == np.mean(np.all((z > 0) == (y > 0.5), axis=1))
  with pytest.raises(ValueError, match="multi-hot"):
    m.loss(variables, {**batch, "label": np.array([0, 2])}, None, True)
  # End to end on the tiny dataset: trains and reports the probe on both probe splits.
  data_dir = os.environ["VLREP_TEST_DATA_DIR"]
  proc = run_main(
    tmp_path / "sup",
    "--config.total_steps=3",
    "--config.batch_size=8",
    f"--config.data.data_dir={data_dir}",
    "--config.data.config_name=tiny",
    "--config.method.backbone.width=4",
    "--config.method.backbone.bn_group_size=4",
    f"--config.evals.probe.data_dir={data_dir}",
    "--config.evals.probe.config_name=tiny",
    "--config.evals.probe.batch_size=16",
    "--config.evals.probe.random_init=False",
    "--config.checkpoint.async_save=False",
    config="configs/finetune.py:runlocal,labels=presence",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "sup" / "summary.json").read_text())
  assert 0 < summary["probe/map"] <= 100 and 0 < summary["probe/map_val"] <= 100


def test_sweep_dry_run_resolves_every_variant_and_trains_nothing(tmp_path, capsys):
  from vlrep.tools import sweep

  assert (
    sweep.sweep("tests/tiny_virtex.py", "steps=3 4", str(tmp_path), ["probe/map"], seeds=["0", "1"], dry_run=True)
    is None
  )
  printed = capsys.readouterr().out
  assert printed.count("Would run: python -m vlrep.main --config=tests/tiny_virtex.py:steps=") == 4
  assert not any(tmp_path.iterdir())  # nothing trained, no table written
  with pytest.raises(ValueError, match="has no key 'optim.no_such_key'"):
    sweep.sweep(
      "tests/tiny_virtex.py", "steps=3", str(tmp_path), ["m"], overrides=["optim.no_such_key=1"], dry_run=True
    )
  with pytest.raises(ValueError, match="Unknown|unknown|steps=x|invalid"):
    sweep.sweep("tests/tiny_virtex.py", "steps=x", str(tmp_path), ["m"], dry_run=True)


def test_map_cv_is_scored_on_the_training_split_alone():
  x, y = _multilabel(1, signal=2.0)
  first = voc07_svm.fit_and_score(x[:250], y[:250], x[250:], y[250:])
  # Other test images and labels: the test mAP changes, the cross-validated score cannot.
  shuffled = voc07_svm.fit_and_score(x[:250], y[:250], x[250:][::-1], np.roll(y[250:], 7, axis=0))
  assert shuffled["map_cv"] == first["map_cv"] and shuffled["map"] != first["map"]
  noise = np.random.default_rng(2).normal(size=x.shape)
  assert voc07_svm.fit_and_score(noise[:250], y[:250], noise[250:], y[250:])["map_cv"] < first["map_cv"] - 20


def _recipe_configs():
  """Every method's recipe and runlocal, with the arguments that change their evaluators."""
  specs = [("virtex", ""), ("loctex", ""), ("mct", ""), ("icmlm", "variant=tp"), ("icmlm", "variant=tfm")]
  specs += [("finetune", ""), ("vlbert", "stage=pretrain,data=captions"), ("vlbert", "stage=finetune,task=vqa")]
  for name, arg in specs:
    for local in ("", "runlocal"):
      args = ",".join(a for a in (arg, local) if a)
      yield f"{name}:{args}", _load_config(name, args)


def _load_config(name, arg):
  spec = importlib.util.spec_from_file_location(f"configs_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_no_recipe_keeps_its_best_checkpoint_by_a_test_split():
  for name, c in _recipe_configs():
    rule = evaluators.selection_rule(c.get("evals", {}), c.get("best_metric", ""), c.get("select_on_test", False))
    assert "TEST" not in rule, (name, rule)
  virtex = _load_config("virtex", "")
  assert evaluators.selection_rule(virtex.evals, virtex.best_metric) == "probe/map_cv: held out from probe's test split"
  # VirTex appendix A.4's rule (the best checkpoint by VOC07 test mAP) only when asked for, and then said.
  with pytest.raises(ValueError, match="selection on the test split"):
    evaluators.selection_rule(virtex.evals, "probe/map")
  said = evaluators.selection_rule(virtex.evals, "probe/map", select_on_test=True)
  assert "TEST split (voc2007 test)" in said, said
  # Evaluations switched off (`--config.evals={}`, a documented command): nothing is chosen, and that is said.
  assert evaluators.selection_rule({}, "probe/map").startswith("none: best_metric 'probe/map' names no evaluator")
  assert evaluators.selection_rule(virtex.evals, "") == "none: the last checkpoint"
