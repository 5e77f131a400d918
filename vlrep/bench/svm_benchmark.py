r"""The VOC07 SVM probe with both solvers side by side, in one run: time, speed ratio and mAP agreement.

  python -m vlrep.bench.svm_benchmark --config=configs/virtex.py:runlocal   # VOC07-size + random-init scenes
  python -m vlrep.bench.svm_benchmark --workdir=/tmp/virtex_local      # synthetic_scenes features of a checkpoint

Two feature sets:
  voc07_size       5011 trainval / 4952 test images x 2048-d, 20 classes, drawn to look like pooled ResNet-50
                   features (non-negative, correlated through a low-rank factor, l2-normalised) with label
                   signal set so that the probe lands in a realistic mAP range.
  synthetic_scenes the probe_trainval / probe_test splits through a backbone: the checkpoint of --workdir, or the
                   random initialisation of --config's backbone when no --workdir is given.
The JAX time includes compilation (what one evaluation in a training run costs).
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags, logging

from vlrep import defaults, runs
from vlrep.data import pipeline
from vlrep.evaluators import EvalInputs, voc07_svm
from vlrep.models import backbones

flags.DEFINE_string("workdir", None, "Checkpoint whose backbone gives the synthetic_scenes features.")
flags.DEFINE_string(
  "config", None, "Config whose backbone (random init) is used without --workdir, e.g. configs/virtex.py:runlocal."
)
flags.DEFINE_list("sets", ["voc07_size", "synthetic_scenes"], "Feature sets to benchmark.")
flags.DEFINE_float("signal", 0.2, "Strength of the label signal in the voc07_size features.")
flags.DEFINE_float("voc07_size_scale", 1.0, "voc07_size at this fraction of VOC07's images and feature width.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_bool("chance", False, "Only print the chance-level mAP (random scores) of the runlocal probe_test.")
flags.DEFINE_string("data_dir", defaults.DATA_DIR, "Where synthetic_scenes is (--chance).")
flags.DEFINE_string("config_name", "default", "synthetic_scenes' builder config (--chance).")
FLAGS = flags.FLAGS


def voc07_size_features(signal: float = 0.2, seed: int = 0, scale: float = 1.0):
  """Synthetic features with VOC07's sizes (times `scale`) and label statistics (about 1.5 objects of 20 classes
  per image)."""
  rng = np.random.default_rng(seed)
  n_train, n_test, dim, classes = int(5011 * scale), int(4952 * scale), max(int(2048 * scale), 64), 20
  n = n_train + n_test
  labels = (rng.random((n, classes)) < 0.075).astype(np.float64)
  difficult = (rng.random((n, classes)) < 0.1) & (labels > 0)
  factors = rng.normal(size=(n, 64)) @ (rng.normal(size=(64, dim)) / 8)
  class_means = rng.normal(size=(classes, dim)) * (rng.random((classes, dim)) < 0.2) * signal
  x = np.maximum(0.0, factors + 0.8 * rng.normal(size=(n, dim)) + labels @ class_means + 0.2)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  y = np.where(labels > 0, np.where(difficult, 0, 1), -1).astype(np.int32)
  return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def scenes_features(config_path: str, workdir: str | None):
  """probe_trainval / probe_test features of synthetic_scenes through a checkpoint's or a random backbone."""
  import importlib.util

  import jax

  if workdir:
    run = runs.load_run(workdir)
    probe = run.config.evals.probe
  else:
    if not config_path:
      raise app.UsageError("--sets=synthetic_scenes needs --workdir (a run's backbone) or --config (a random one).")
    path, _, arg = config_path.partition(":")
    spec = importlib.util.spec_from_file_location("cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg or None)

    net = backbones.from_config(config.method.backbone)
    variables = net.init(jax.random.PRNGKey(0), np.zeros((1, 64, 64, 3), np.float32), False)
    params = {"backbone": variables["params"]}
    run = runs.Run(config, params, {"batch_stats": {"backbone": variables["batch_stats"]}}, 0, "random init", {})
    probe = config.evals.probe
  ev = voc07_svm.Evaluator(probe, EvalInputs())
  fn = runs.backbone_fn(run)
  features = lambda batch: fn(batch, ev.feature_key)
  train_x, train_y = ev._features(probe.train_split, features)
  test_x, test_y = ev._features(probe.test_split, features)
  return train_x, train_y, test_x, test_y


def compare(name: str, train_x, train_y, test_x, test_y) -> dict:
  out = {"set": name, "train": list(train_x.shape), "test": list(test_x.shape)}
  # jax twice: the first call compiles (what the first probe of a process costs), the second does not (every
  # later probe in a training run: the shapes do not change).
  for solver in ("sklearn", "jax", "jax_warm"):
    t0 = time.perf_counter()
    result = voc07_svm.fit_and_score(train_x, train_y, test_x, test_y, solver=solver.removesuffix("_warm"))
    out[f"{solver}_seconds"] = time.perf_counter() - t0
    out[f"{solver}_map"] = result["map"]
    out[f"{solver}_costs"] = result["costs"]
  out["speedup"] = out["sklearn_seconds"] / out["jax_seconds"]
  out["speedup_warm"] = out["sklearn_seconds"] / out["jax_warm_seconds"]
  out["map_difference"] = out["jax_map"] - out["sklearn_map"]
  print(
    f"{name}: {train_x.shape[0]} x {train_x.shape[1]} train, {test_x.shape[0]} test | "
    f"sklearn {out['sklearn_seconds']:.1f}s mAP {out['sklearn_map']:.2f} | "
    f"jax {out['jax_seconds']:.1f}s (with compilation; {out['jax_warm_seconds']:.1f}s without) "
    f"mAP {out['jax_map']:.2f} | speed-up {out['speedup']:.1f}x ({out['speedup_warm']:.1f}x), "
    f"mAP difference {out['map_difference']:+.2f}",
    flush=True,
  )
  return out


def chance_map(labels: np.ndarray, draws: int = 50, seed: int = 0) -> float:
  """Mean AP (the probe's: scikit-learn's) of random scores: the probe's chance level for these labels ({1, 0, -1})."""
  rng = np.random.default_rng(seed)
  aps = []
  for c in range(labels.shape[1]):
    y = labels[labels[:, c] != 0, c]
    aps.append(np.mean([voc07_svm.average_precision(rng.random(len(y)), y) for _ in range(draws)]))
  return float(np.mean(aps) * 100)


def main(argv):
  del argv
  import os

  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if FLAGS.chance:
    b = pipeline.get_builder("synthetic_scenes", FLAGS.data_dir, FLAGS.config_name)
    batches = pipeline.eval_batches(b, "probe_test", "voc_labels(10)", ("labels",), 500)
    labels = np.concatenate([x["labels"][x["_mask"].astype(bool)] for x in batches])
    print(f"probe_test chance mAP (random scores): {chance_map(labels):.2f}")
    return
  results = []
  for name in FLAGS.sets:
    if name == "voc07_size":
      results.append(compare(name, *voc07_size_features(FLAGS.signal, scale=FLAGS.voc07_size_scale)))
    elif name == "synthetic_scenes":
      results.append(compare(name, *scenes_features(FLAGS.config, FLAGS.workdir)))
    else:
      raise app.UsageError(f"Unknown feature set {name!r}; known: voc07_size, synthetic_scenes")
  logging.info("%s", results)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  app.run(main)
