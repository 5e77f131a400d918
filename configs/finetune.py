r"""End-to-end fine-tuning of a pretrained backbone for image classification (VirTex appendix A.3, iNaturalist).

  python -m vlrep.main --config=configs/finetune.py --config.init_from=/runs/virtex_r50 --workdir=/runs/inat_ft
  python -m vlrep.main --config=configs/finetune.py:runlocal --config.init_from=/tmp/virtex_local \
      --workdir=/tmp/ft_local

The recipe (torchvision's, as in VirTex): iNaturalist 2018 train -> val (a prepared TFDS dataset with 'image'
and 'label'), ResNet-50 + linear layer, 100 epochs, SGD momentum 0.9, weight decay 1e-4, batch 256, LR 0.025
(0.1 from random init: leave init_from empty and pass lr=0.1) multiplied by 0.1 at epochs 70 and 90;
random-resized crop + flip for training, resize 256 / centre 224 for evaluation. The backbone (weights and
BatchNorm statistics) comes from `init_from`'s best checkpoint; the loop checks the shapes match.
Arguments: runlocal (synthetic_scenes, class of the largest object), dataset, num_classes, lr, epochs,
labels=largest|presence (runlocal only). `runlocal,labels=presence` is the supervised upper reference of the
runlocal probe tables: the runlocal backbone trained from random init on the probe's own labels (which of the 10
shapes are present; sigmoid cross-entropy) at the pretraining methods' runlocal budget, then probed like them:

  python -m vlrep.tools.sweep --config=configs/finetune.py:runlocal,labels=presence --vary="steps=400" \
      --seeds=0,1,2 --root=/tmp/supervised --metrics=probe/map,probe/map_val,probe/map_random_init
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg, sibling_config

common = config_module(__file__, "common.py")  # the blocks every recipe shares


def get_config(arg=None):
  arg = parse_arg(
    arg, runlocal=False, dataset="i_naturalist2018", num_classes=8142, lr=0.025, epochs=100.0, labels="largest", steps=0
  )
  if arg.labels not in ("largest", "presence"):
    raise ValueError(f"Unknown labels={arg.labels!r}; expected 'largest' or 'presence'.")
  if arg.labels != "largest" and not arg.runlocal:
    raise ValueError("labels=presence is synthetic_scenes' multi-label reference: use it with runlocal.")
  c = ConfigDict()
  common.run_defaults(c, checkpoint_every=5000)
  c.init_from = ""  # a vlrep run directory whose backbone initialises this one
  c.method = dict(
    name="classifier",
    num_classes=arg.num_classes,
    backbone=dict(depth=50, width=64, bn_group_size=32),
    dtype="bfloat16",
    label_smoothing=0.0,
    head_init_std=0.01,
  )
  c.data = common.train_data(
    arg.dataset, "decode|inception_crop(224, area=(0.08, 1.0))|flip_lr_swap_words(keys=())|normalize"
  )
  c.batch_size = 256
  c.update(common.duration(epochs=arg.epochs))
  c.optim = common.optim(((".*", arg.lr),), schedule="step", step_at=(0.7, 0.9), step_factor=0.1)
  c.evals = dict(
    val=dict(
      type="accuracy",
      dataset=arg.dataset,
      data_dir="",
      config_name="",
      split="validation",
      pp="decode|resize_small(256)|central_crop(224)|normalize",
      label_key="label",
      batch_size=256,
      every_steps=5000,
    )
  )
  c.best_metric = "val/top1"
  if arg.runlocal and arg.labels == "presence":
    _runlocal_presence(c, arg)
  elif arg.runlocal:
    c.data.update(
      common.synthetic_scenes("name"),
      pp="decode|inception_crop(64, area=(0.5, 1.0))|flip_lr_swap_words(keys=())|normalize|largest_object_label",
    )
    c.method.update(num_classes=10, dtype="float32", backbone=dict(depth=26, width=16, bn_group_size=32))
    c.batch_size = 64
    c.total_epochs = arg.epochs if arg.epochs != 100.0 else 4.0
    c.optim.lr_groups = ((".*", arg.lr if arg.lr != 0.025 else 0.05),)
    c.checkpoint.every_steps = 200
    c.log_every_steps = 50
    c.evals.val.update(
      common.synthetic_scenes(),
      split="val",
      pp="decode|normalize|largest_object_label",
      batch_size=100,
      every_steps=0,
    )
  return c


def _runlocal_presence(c, arg):
  """The supervised reference: virtex.py:runlocal's backbone, data, optimiser and budget, with shape-presence labels
  in place of captions, probed on the same splits (so its rows sit beside the methods' in one table)."""
  ref = sibling_config(__file__, "virtex", "runlocal")
  c.data.update(
    common.synthetic_scenes("name"),
    pp=ref.data.pp.split("|normalize|")[0] + "|normalize|tags(num_tags=10, out='label')",
  )
  c.method.update(num_classes=10, multilabel=True, dtype="float32", backbone=dict(ref.method.backbone))
  c.batch_size = ref.batch_size
  c.total_epochs = 0.0
  c.total_steps = arg.steps or ref.total_steps
  c.optim = ref.optim
  c.optim.lr_groups = ((".*", dict(ref.optim.lr_groups)["^backbone/"]),)
  c.checkpoint.every_steps = ref.checkpoint.every_steps
  c.log_every_steps = ref.log_every_steps
  c.evals = dict(probe=ref.evals.probe)
  c.best_metric = ref.best_metric
