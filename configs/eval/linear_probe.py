r"""Linear probe on a frozen backbone for any TFDS image-classification dataset (VirTex A.3; MCT's and ICMLM's
variants).

  python -m vlrep.evaluate --config=configs/eval/linear_probe.py --workdir=DIR                       # ImageNet
  python -m vlrep.evaluate --config=configs/eval/linear_probe.py:dataset=i_naturalist2018 --workdir=DIR
  python -m vlrep.evaluate --config=configs/eval/linear_probe.py:variant=mct --workdir=DIR
  python -m vlrep.evaluate --config=configs/eval/linear_probe.py:runlocal --workdir=/tmp/virtex_local
  python -m vlrep.evaluate --config=configs/eval/linear_probe.py:data=/data/labelled_tfds --workdir=RUN

(`:variant=icmlm` is ICMLM's appendix F.2 protocol: logistic regression on pre-extracted features, 25-trial search.)

Arguments: dataset (a prepared TFDS dataset with 'image' and 'label'), num_classes, variant=virtex|mct|icmlm,
mode=features (fast path: features extracted once) | images (augmented images every step, the paper's
protocol; not with icmlm, whose protocol is pre-extracted features), epochs, runlocal (synthetic_scenes: class of
each scene's largest object, 10 classes), data=DIR (your own classes, prepared into DIR with `vlrep.data.prepare
--dataset=image_folder`, docs/own_classes.md: the classifier trains on its train split, the learning rate (and
icmlm's weight decay) is chosen on its val split over `trials` draws, top-1 / top-5 reported on its test split;
images resized to `size` px (default 224) as the evaluation's resize_small + centre crop; variant virtex or
icmlm), size, trials (data=DIR: the search's draws; default 16, icmlm 25).
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg
from vlrep.data.builders import image_folder

common = config_module(__file__, "../common.py")  # the blocks every recipe shares

NUM_CLASSES = {"imagenet2012": 1000, "i_naturalist2018": 8142, "i_naturalist2017": 5089, "places365_small": 365}


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    dataset="imagenet2012",
    num_classes=0,
    variant="virtex",
    mode="features",
    epochs=0,
    data="",
    size=224,
    trials=0,
  )
  probe = dict(
    type="linear_probe",
    dataset=arg.dataset,
    data_dir="",
    config_name="",
    train_split="train",
    test_split="validation",
    label_key="label",
    num_classes=arg.num_classes or NUM_CLASSES.get(arg.dataset, 0),
    pp_train="decode|inception_crop(224, area=(0.08, 1.0))|flip_lr_swap_words(keys=())|normalize",
    pp_eval="decode|resize_small(256)|central_crop(224)|normalize",
    pp_features="",  # the fast path's training features: pp_eval when empty
    feature="pre_logits",
    mode=arg.mode,
    epochs=arg.epochs or 100,
    batch_size=256,
    lr=0.3,
    schedule="cosine",
    milestones=(),
    step_factor=0.2,
    momentum=0.9,
    weight_decay=0.0,
    init_std=0.01,
    seed=0,
  )
  if arg.variant == "mct":
    # MCT (section 4.2): 60 epochs, LR 30 divided by 5 at epochs 30, 40 and 50, no weight decay, batch 256, and
    # "without performing any specific data augmentation": training images get the evaluation's resize and crop.
    probe.update(lr=30.0, schedule="step", step_factor=0.2, epochs=arg.epochs or 60)
  elif arg.variant == "icmlm":
    # ICMLM (appendix F.2): logistic regression on pre-extracted features, the last convolutional layer's output
    # global-average-pooled (2048-d for ResNet-50) of images resized to 224 on the shorter side and centre-cropped to
    # 224, no augmentation; SGD with momentum 0.9, batch 1024, cosine annealing; LR and weight decay chosen over 25
    # trials, LR log-uniform in [0.1, 100] and weight decay uniform in [0, 1e-5] (the paper: Optuna; here 25 random
    # draws trained at once, scored on 1% of the training images held out). The paper gives no epoch count.
    if arg.mode != "features":
      raise ValueError("variant=icmlm trains on pre-extracted features (mode=features).")
    probe.update(
      pp_eval="decode|resize_small(224)|central_crop(224)|normalize",
      pp_train="decode|resize_small(224)|central_crop(224)|normalize",  # (unused: features are extracted once)
      pp_features="",  # the training features are extracted as the evaluation's: no augmentation
      feature="pre_logits",
      batch_size=1024,
      momentum=0.9,
      schedule="cosine",
      lr=0.0,  # searched
      weight_decay=0.0,  # searched
      trials=25,
      lr_range=(0.1, 100.0),
      weight_decay_range=(0.0, 1e-5),
      val_split="",
      holdout_fraction=0.01,
      epochs=arg.epochs or 100,
    )
  elif arg.variant != "virtex":
    raise ValueError(f"Unknown variant {arg.variant!r}; expected 'virtex', 'mct' or 'icmlm'.")
  if arg.runlocal:
    probe.update(
      common.synthetic_scenes(),
      train_split="train",
      test_split="val",
      num_classes=10,
      pp_train="decode|inception_crop(64, area=(0.5, 1.0))|flip_lr_swap_words(keys=())|normalize|largest_object_label",
      pp_eval="decode|normalize|largest_object_label",
      epochs=arg.epochs or 30,
      batch_size=200,
    )
    if arg.variant == "icmlm":
      probe["holdout_fraction"] = 0.1  # 10% of synthetic_scenes' train split scores the trials
  if arg.data:
    probe.update(own_classes(arg, probe))
  if arg.variant == "mct":
    # The milestones sit at the same fractions of the schedule when the epochs change (runlocal, epochs=).
    probe["milestones"] = tuple(round(m * probe["epochs"] / 60) for m in (30, 40, 50))
    probe["pp_train"] = probe["pp_eval"]
  if not probe["num_classes"] and not arg.data:  # your own classes are counted from the prepared dataset
    raise ValueError(f"Set num_classes=N for dataset {arg.dataset!r}.")
  return ConfigDict({"evals": {f"linear_probe_{arg.variant}": probe}})


# data=DIR, variant virtex: the learning rates the search draws from (log-uniform, around VirTex's 0.3), and how
# many (variant icmlm keeps its 25 draws of LR and weight decay).
OWN_LR_RANGE = (0.01, 10.0)
OWN_TRIALS = 16


def own_classes(arg, probe: dict) -> dict:
  """The probe's settings on your own image_folder classes prepared in arg.data: train on train, the LR (icmlm: and
  weight decay) chosen on val by the search (all trials trained at once on pre-extracted features), test reported;
  the number of classes read from the dataset."""
  if arg.runlocal:
    raise ValueError("data=DIR evaluates on your own classes; runlocal on synthetic_scenes: give one of them.")
  if arg.variant == "mct" or arg.mode != "features":
    raise ValueError(
      "data=DIR chooses the learning rate on the val split by a search on pre-extracted features: use "
      "variant=virtex or variant=icmlm, mode=features."
    )
  pp = image_folder.eval_pp(arg.size)
  own = dict(
    image_folder.eval_settings(arg.data, arg.size),
    train_split="train",
    val_split="val",
    test_split="test",
    label_key="label",
    num_classes=0,
    pp_eval=pp,
    pp_train=pp,  # (unused: the features are extracted once)
    pp_features="",
    trials=arg.trials or probe.get("trials") or OWN_TRIALS,
  )
  del own["pp"]
  if arg.variant == "virtex":
    own.update(lr_range=OWN_LR_RANGE, weight_decay_range=(0.0, 0.0))
  return own
