"""What the config files share, written once: run-level defaults and the evaluator blocks several recipes use.

Plain functions returning dicts (or setting a config's run-level keys), as big_vision's
configs/proj/image_text/common.py. A config file puts its configs/ folder on sys.path and imports this as
`common`: config files are loaded by path (config_flags, `vlrep.tools.sweep`) from any working directory, and
configs/ is no package.

A function's keyword arguments override its defaults or add keys, so each recipe states only where it differs.
"""

import numpy as np

from vlrep import defaults
from vlrep.models import vit

# The official VirTex VOC07 protocol's SVM costs, chosen per class by cross-validation.
SVM_COSTS = (0.01, 0.1, 1.0, 10.0)
# ICMLM's (appendix F.2): the paper samples 40 costs log-uniformly in [1e-5, 1e5] and picks one with Optuna; here
# 40 log-spaced costs over the same range, picked by the same 3-fold cross-validation as the VirTex protocol.
ICMLM_SVM_COSTS = tuple(float(c) for c in np.logspace(-5, 5, 40))


# runlocal's ViT ('vit_local'): patch 8 at 64 px (an 8x8 grid, as the runlocal ResNet's 2x scale), 128 wide, 4 blocks
# of 2 heads, MLP 512. Backbone forward + backward at batch 64 on the 2-core CPU: 0.32 s a step, against 1.33 s for
# ViT-Ti/8 (192 wide, 12 blocks), 0.69 s for Ti/8 at depth 6 and 0.10 s for runlocal's ResNet-10 w16: the Ti is 4x
# too slow for three methods at three seeds on that machine.
LOCAL_VIT = "vit_local"
LOCAL_VIT_SECTION = dict(arch="vit", width=128, depth=4, mlp_dim=512, num_heads=2, patch_size=8, pool_type="gap")
# runlocal's ViT backbone LR under AdamW, to be chosen on VirTex's probe_val among {1e-3, 3e-3} at 3 seeds: only
# the 1e-3 arm has run (docs/results/virtex.md), so 1e-3 is a default, not a choice yet. CLIP's and LocTex's
# runlocal reuse it for their ViT backbones. The ResNet's 1e-2 is a BatchNorm network's.
LOCAL_VIT_LR = 1e-3


def is_vit(backbone: str) -> bool:
  """Whether a `backbone=` argument names a ViT ('vit_local' or big_vision's vit_<variant><patch>)."""
  return backbone.lower().startswith("vit_")


def backbone_choice(backbone: str, resnets) -> None:
  """Refuses a `backbone=` argument that is neither one of `resnets` (the recipe's ResNet names) nor a ViT name,
  naming the choices (a malformed ViT name is refused by vit.config_for, naming its variants and patches)."""
  if backbone not in resnets and not is_vit(backbone):
    raise ValueError(
      f"Unknown backbone={backbone!r}; known: {', '.join(resnets)}, {LOCAL_VIT} (runlocal's ViT) or a ViT "
      f"vit_<variant><patch> (variant one of {', '.join(vit.VARIANTS)}, patch one of {vit.PATCH_SIZES}: vit_b16, "
      "vit_ti8, ...)."
    )


def vit_backbone(backbone: str, **overrides) -> dict:
  """The backbone config section of a ViT name: 'vit_local' (LOCAL_VIT_SECTION) or big_vision's variants
  (`vit.config_for`: 'vit_b16', 'vit_ti8', ...), global-average pooled unless `overrides` say otherwise. A ViT has
  no BatchNorm, so none of the ResNet sections' BN-group settings."""
  if backbone == LOCAL_VIT:
    return dict(LOCAL_VIT_SECTION, **overrides)
  return vit.config_for(backbone, **overrides)


# CapPa's optimizer (Tschannen et al. 2023; big_vision configs/proj/cappa/pretrain.py) for a ViT in the recipes whose
# paper trains a BatchNorm ResNet with SGD: peak LR 1e-3, gradient clipping at norm 1.0, weight decay 1e-4 applied as
# big_vision applies it (p -= 1e-4 * schedule * p, not scaled by the LR). optax's AdamW scales it by the LR, so
# 1e-4 / 1e-3 = 0.1 here decays as much at the peak.
VIT_LR = 1e-3
VIT_WEIGHT_DECAY = 1e-4 / VIT_LR


def vit_optim(lr_groups: tuple, **settings) -> dict:
  """CapPa's optimizer block for a ViT (VIT_LR, VIT_WEIGHT_DECAY): AdamW (the paper's Adafactor variant keeps full
  second moments with beta2 0.999, as AdamW does), gradient clipping at 1.0, cosine decay, no LookAhead; no decay on
  biases, LayerNorm gains, the class token and the position embeddings."""
  return optim(
    lr_groups,
    **dict(
      dict(
        name="adamw",
        weight_decay=VIT_WEIGHT_DECAY,
        b1=0.9,
        b2=0.999,
        grad_clip_norm=1.0,
        no_decay=r"(^|/)(bias|output_bias|scale|pos_embedding|cls)$",
      ),
      **settings,
    ),
  )


def run_defaults(c, checkpoint_every: int = 2000) -> None:
  """The run-level settings of every training recipe: seed 0, parameters replicated on every device, the whole
  batch in one pass (microbatches=1: set N to take it in N parts, one update equal to the whole batch's) with no
  rematerialisation (remat='none'; 'dots' or 'full' trade compute for memory, vlrep.train_step.REMAT_POLICIES),
  checkpoints every `checkpoint_every` steps (the latest 2 kept, written in the background; 20 s to finish one on
  SIGTERM), metrics logged every 100 steps."""
  c.seed = 0
  c.microbatches = 1
  c.remat = "none"
  c.sharding = dict(params="replicate", num_devices=0)
  c.checkpoint = dict(
    every_steps=checkpoint_every, keep=2, async_save=True, exit_deadline_secs=defaults.EXIT_DEADLINE_SECS
  )
  c.log_every_steps = 100


def duration(steps: int = 0, epochs: float = 0.0, examples: int = 0) -> dict:
  """The training length as config keys: set exactly one of steps / epochs / examples (0 = unset)."""
  return dict(total_steps=steps, total_epochs=float(epochs), total_examples=examples)


def train_data(name: str, pp: str, **settings) -> dict:
  """The training data block: the TFDS dataset `name` (its default config, in TFDS's data_dir), split 'train',
  batches prepared 2 ahead on each host and transferred 2 ahead to the devices; no decoded-image cache
  (cache_image_size > 0 decodes every image once into host memory at that shorter side, docs/speed.md) and no
  in-memory records (in_memory=True holds this host's encoded records in memory; ArrayRecord splits are read from
  disk). Of the examples, at least `min_field_fraction` must carry each field the method needs (`requires`, set
  for your own data: LocTex's narrations, MCT's tags), or the run stops before training with the counts."""
  return dict(
    dict(
      name=name,
      config_name="",
      data_dir="",
      split="train",
      **defaults.DATA_READING,
      pp=pp,
    ),
    **settings,
  )


def synthetic_scenes(key: str = "dataset") -> dict:
  """synthetic_scenes' fields in a block: `key` is 'dataset' in an evaluator's, 'name' in the training data's."""
  return {key: "synthetic_scenes", "config_name": "default", "data_dir": defaults.DATA_DIR}


def bpe_tokenizer(corpus_key: str = "captions") -> dict:
  """A 10K-piece BPE vocabulary, built from the training split's `corpus_key` texts when the run has none."""
  return dict(path="", vocab_size=10000, corpus_split="train", corpus_key=corpus_key, build_if_missing=True)


def optim(lr_groups: tuple, **settings) -> dict:
  """The optimizer block: SGD with momentum 0.9 and weight decay 1e-4 on every parameter, no gradient clipping,
  no LookAhead, no warmup; `lr_groups` ((regex, peak LR), ...) in order, the first match wins. b1, b2 and eps are
  the Adam family's (name='adamw', 'radam')."""
  return dict(
    dict(
      name="sgd",
      momentum=0.9,
      nesterov=False,
      weight_decay=1e-4,
      grad_clip_norm=0.0,
      lookahead_steps=0,
      lookahead_alpha=0.5,
      warmup_steps=0,
      warmup_epochs=0.0,
      warmup_examples=0,
      lr_groups=lr_groups,
      no_decay="",
      b1=0.9,
      b2=0.999,
      eps=1e-8,
    ),
    **settings,
  )


def voc07_svm_eval(variant: str = "virtex", **settings) -> dict:
  """VOC07 linear SVMs on frozen features (VirTex appendix A.1): shorter side to 256, centre 224 crop, ImageNet
  mean/std; the pooled features l2-normalised; per-class SVMs fit on trainval, the cost chosen by 3-fold
  cross-validation, mAP on test. variant='icmlm' is ICMLM's (appendix F.2): the last feature map
  average-pooled to 2x2 and flattened (8192-d for ResNet-50), with ICMLM_SVM_COSTS."""
  probe = dict(
    type="voc07_svm",
    dataset="voc2007",
    data_dir="",
    config_name="",
    train_split="trainval",
    test_split="test",
    pp="decode|resize_small(256)|central_crop(224)|normalize|voc_labels(20)",
    batch_size=256,
    feature="pre_logits",
    l2_normalize=True,
    costs=SVM_COSTS,
    folds=3,
  )
  if variant == "icmlm":
    probe.update(feature="grid", pooling="2x2", costs=ICMLM_SVM_COSTS)
  elif variant != "virtex":
    raise ValueError(f"Unknown variant {variant!r}; expected 'virtex' or 'icmlm'.")
  return dict(probe, **settings)


def probe_eval(variant: str = "virtex", **settings) -> dict:
  """A recipe's 'probe': the VOC07 SVMs every 10K steps during training, and once on the random initialisation
  (the baseline its gain is read against)."""
  return voc07_svm_eval(variant, **dict(dict(every_steps=10_000, random_init=True), **settings))


def voc07_svm_local(labels: str = "voc_labels(10)") -> dict:
  """The VOC07 SVMs on synthetic_scenes' probe splits (64 px, no resize): fit on probe_trainval, probe/map_val
  (probe_val) to choose on, probe/map (probe_test) only reported; `labels` the op making the classes (the 10
  shapes)."""
  return dict(
    synthetic_scenes(),
    train_split="probe_trainval",
    val_split="probe_val",
    test_split="probe_test",
    pp=f"decode|normalize|{labels}",
    batch_size=200,
  )


def select_by_probe(c) -> None:
  """The best checkpoint is the one with the best cross-validated probe score on VOC07 trainval, held out from the
  reported test mAP (`select_on_test=True` with best_metric='probe/map' selects on the test split instead, and the
  summary says so)."""
  c.best_metric = "probe/map_cv"
  c.select_on_test = False


def local_probe(c) -> None:
  """runlocal's probe: on synthetic_scenes' probe splits at the end of training, and the best checkpoint chosen on
  probe_val (probe/map, on probe_test, is only reported)."""
  c.evals.probe.update(voc07_svm_local(), every_steps=0)
  c.best_metric = "probe/map_val"


def captioning_eval(**settings) -> dict:
  """Captioning metrics of the forward model on COCO val2017: beam search (5 beams) to 30 tokens, scored against
  every reference caption; 3 examples printed."""
  return dict(
    dict(
      type="captioning",
      dataset="coco_captions2017",
      data_dir="",
      config_name="",
      split="val",
      pp="decode|resize(224)|normalize",
      references="captions",
      decoding="beam",
      beam_size=5,
      top_p=0.9,
      max_len=30,
      batch_size=64,
      limit=0,
      examples=3,
      seed=0,
    ),
    **settings,
  )


def captioning_local() -> dict:
  """Captioning on synthetic_scenes' val split: 64 px images as they are, captions of up to 39 tokens."""
  return dict(synthetic_scenes(), pp="decode|normalize", max_len=39, batch_size=100)


def retrieval_eval(**settings) -> dict:
  """Image-caption retrieval with the run's own towers, no training: COCO 1K (5 folds of the first 5000 val2017
  images, 5 captions each)."""
  return dict(
    dict(
      type="retrieval",
      dataset="coco_captions2017",
      data_dir="",
      config_name="",
      split="val",
      pp="decode|resize_small(256)|central_crop(224)|normalize",
      captions_key="captions",
      num_captions=5,
      max_len=40,
      batch_size=250,
      limit=5000,
      fold_size=1000,
    ),
    **settings,
  )


def retrieval_local() -> dict:
  """Retrieval on synthetic_scenes: its first 500 val images ranked together (VSE++'s runlocal test images)."""
  return dict(synthetic_scenes(), pp="decode|normalize", batch_size=100, limit=500, fold_size=0)


def localization_eval(sizes: tuple, split: str = "val", limit: int = 500) -> dict:
  """Word localization on synthetic_scenes (pointing game and IoU of object words) at grid sides `sizes`: the
  ground truth is the visible instances of the class each object word names."""
  return dict(
    type="localization",
    **synthetic_scenes(),
    split=split,
    pp=(
      f"decode|normalize|trace_words(64, sizes={sizes})|oracle_word_masks(sizes={sizes}, match_traces=False)"
      f"|tokenize_words(60, sizes={sizes}, random_window=False)"
    ),
    grid_sizes=sizes,
    batch_size=100,
    limit=limit,
  )
