r"""VOC07 linear-SVM probe of a checkpoint's frozen backbone (VirTex appendix A.1; ICMLM's variant).

  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py --workdir=DIR              # VOC2007, VirTex
  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:variant=icmlm --workdir=DIR  # 2x2-pooled, 8192-d
  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:runlocal --workdir=/tmp/virtex_local

Arguments: runlocal (synthetic_scenes' probe splits: SVMs on probe_trainval, map_val on probe_val, map on
probe_test), variant=virtex|icmlm, solver=jax|sklearn, ap=sklearn|11point (the official VirTex evaluation's
scikit-learn AP, or the VOC2007 devkit's 11-point AP), labels=shape|color
(runlocal only: the classes are synthetic_scenes' 10 shapes, the probe everything else reports, or its 8 colours,
written as `<name>_color/...`: what a backbone learned about colour, which captions name as often as shape).
VOC2007 is prepared from local files with `python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=...`.
"""

import numpy as np
from ml_collections import ConfigDict

from vlrep.config_utils import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, runlocal=False, variant="virtex", solver="jax", labels="shape", ap="sklearn")
  if arg.labels not in ("shape", "color"):
    raise ValueError(f"Unknown labels={arg.labels!r}; expected 'shape' or 'color'.")
  if arg.labels != "shape" and not arg.runlocal:
    raise ValueError("labels=color is synthetic_scenes' colour probe: use it with runlocal.")
  probe = dict(
    type="voc07_svm",
    dataset="voc2007",
    data_dir="",
    config_name="",
    train_split="trainval",
    test_split="test",
    # Shorter side to 256, centre 224 crop, ImageNet mean/std.
    pp="decode|resize_small(256)|central_crop(224)|normalize|voc_labels(20)",
    batch_size=256,
    feature="pre_logits",
    pooling="gap",
    l2_normalize=True,
    costs=(0.01, 0.1, 1.0, 10.0),
    folds=3,
    solver=arg.solver,
    ap=arg.ap,  # 'sklearn': the official VirTex evaluation's AP; '11point': the VOC2007 devkit's
  )
  if arg.variant == "icmlm":
    # ICMLM (appendix): the last feature map average-pooled to 2x2 (8192-d for ResNet-50), l2-normalised; the paper
    # samples 40 costs log-uniformly in [1e-5, 1e5] and picks one with Optuna: here 40 log-spaced costs over the
    # same range, picked by the same 3-fold cross-validation as the VirTex protocol.
    probe.update(feature="grid", pooling="2x2", costs=tuple(float(c) for c in np.logspace(-5, 5, 40)))
  elif arg.variant != "virtex":
    raise ValueError(f"Unknown variant {arg.variant!r}; expected 'virtex' or 'icmlm'.")
  if arg.runlocal:
    probe.update(
      dataset="synthetic_scenes",
      config_name="default",
      data_dir="~/.cache/vlrep/tensorflow_datasets",
      train_split="probe_trainval",
      val_split="probe_val",
      test_split="probe_test",
      pp="decode|normalize|" + ("voc_labels(10)" if arg.labels == "shape" else "voc_labels(8, field='color')"),
      batch_size=200,
    )
  name = "voc07_svm" if arg.variant == "virtex" else "voc07_svm_icmlm"
  return ConfigDict({"evals": {name + ("_color" if arg.labels == "color" else ""): probe}})
