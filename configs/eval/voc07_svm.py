r"""VOC07 linear-SVM probe of a checkpoint's frozen backbone (VirTex appendix A.1; ICMLM's variant).

  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py --workdir=DIR              # VOC2007, VirTex
  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:variant=icmlm --workdir=DIR  # 2x2-pooled, 8192-d
  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:runlocal --workdir=/tmp/virtex_local
  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:data=/data/labelled_tfds --workdir=RUN

Arguments: runlocal (synthetic_scenes' probe splits: SVMs on probe_trainval, map_val on probe_val, map on
probe_test), variant=virtex|icmlm, solver=jax|sklearn, ap=sklearn|11point (the official VirTex evaluation's
scikit-learn AP, or the VOC2007 devkit's 11-point AP), labels=shape|color
(runlocal only: the classes are synthetic_scenes' 10 shapes, the probe everything else reports, or its 8 colours,
written as `<name>_color/...`: what a backbone learned about colour, which captions name as often as shape).
data=DIR (your own classes, prepared into DIR with `vlrep.data.prepare --dataset=image_folder`,
docs/own_classes.md: an SVM per class, the class against the rest, fit on the train split, each cost chosen by
cross-validation on it; `map_val` on the val split, `map` on the test split; images resized to `size` px, default
224, as resize_small + centre crop).
VOC2007 is prepared from local files with `python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=...`.
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg
from vlrep.data.builders import image_folder

common = config_module(__file__, "../common.py")  # the blocks every recipe shares


def get_config(arg=None):
  arg = parse_arg(arg, runlocal=False, variant="virtex", solver="jax", labels="shape", ap="sklearn", data="", size=224)
  if arg.labels not in ("shape", "color"):
    raise ValueError(f"Unknown labels={arg.labels!r}; expected 'shape' or 'color'.")
  if arg.labels != "shape" and not arg.runlocal:
    raise ValueError("labels=color is synthetic_scenes' colour probe: use it with runlocal.")
  # 'sklearn': the official VirTex evaluation's AP; '11point': the VOC2007 devkit's.
  probe = common.voc07_svm_eval(arg.variant, solver=arg.solver, ap=arg.ap)
  probe.setdefault("pooling", "gap")  # the features' global average (the icmlm variant's: 2x2)
  if arg.data:
    if arg.runlocal or arg.labels != "shape":
      raise ValueError("data=DIR evaluates on your own classes: without runlocal or labels=.")
    probe.update(
      image_folder.eval_settings(arg.data, arg.size),
      train_split="train",
      val_split="val",
      test_split="test",
      label_key="label",
    )
  if arg.runlocal:
    probe.update(common.voc07_svm_local("voc_labels(10)" if arg.labels == "shape" else "voc_labels(8, field='color')"))
  name = "voc07_svm" if arg.variant == "virtex" else "voc07_svm_icmlm"
  return ConfigDict({"evals": {name + ("_color" if arg.labels == "color" else ""): probe}})
