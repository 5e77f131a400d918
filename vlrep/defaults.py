"""Every default value the package and the configs share, in one place: where datasets are generated and read,
where JAX keeps its compiled programs, and the evaluation protocols' settings that configs start from. A leaf (no
JAX, TensorFlow or evaluator code), so a config can be read on a machine that has only JAX and a config never
imports an evaluator for its settings."""

# Where the embedded datasets (synthetic_scenes) are generated and where the runlocal configs read them.
DATA_DIR = "~/.cache/vlrep/tensorflow_datasets"
# JAX's persistent compilation cache (`vlrep.main --compilation_cache`).
COMPILATION_CACHE_DIR = "~/.cache/vlrep/jax_compilation_cache"
# Seconds a preempted process has to save its checkpoint and leave (`checkpoint.exit_deadline_secs`).
EXIT_DEADLINE_SECS = 20.0
# How training data is read (the `data` block of a config; the reader's values where a config leaves one out).
# min_field_fraction: the share of the examples that must carry each field the method trains on; prefetch: batches
# tf.data prepares ahead; cache_image_size > 0: every image decoded once into memory at that shorter side;
# in_memory: this host's encoded records held in memory; device_prefetch: batches put on the devices ahead.
DATA_READING = dict(min_field_fraction=0.5, prefetch=2, cache_image_size=0, in_memory=False, device_prefetch=2)

# ---------------------------------------------------------------------------------------------------------------
# VSE++ retrieval (vlrep.evaluators.vsepp)
# ---------------------------------------------------------------------------------------------------------------
# The protocol's settings on COCO (train2017 pairs, 1K test folds of val2017); configs start from this.
VSEPP_COCO = dict(
  type="vsepp",
  dataset="coco_captions2017",
  data_dir="",
  config_name="",
  train_split="train",
  test_split="val",
  pp="decode|resize_small(256)|central_crop(224)|normalize",
  captions_key="captions",
  num_captions=5,
  max_len=40,
  feature="pre_logits",
  batch_size=250,
  train_batch_size=128,
  embed_dim=1024,
  word_dim=300,
  epochs=30,
  lr_update_epochs=15,
  lr=2e-4,
  lr_decay=0.1,
  margin=0.2,
  max_violation=True,
  sum_loss_epochs=0,
  grad_clip=2.0,
  seed=0,
  train_limit=0,
  test_limit=5000,
  fold_size=1000,
  every_steps=0,
)
# synthetic_scenes on a 2-core CPU: 2000 training images (10000 pairs), a 256-d space, 5 + 5 epochs, the first
# 500 val images ranked together.
VSEPP_RUNLOCAL = dict(
  dataset="synthetic_scenes",
  config_name="default",
  data_dir=DATA_DIR,
  pp="decode|normalize",
  batch_size=100,
  embed_dim=256,
  word_dim=128,
  epochs=10,
  lr_update_epochs=5,
  # Hardest negatives from a GRU at init train poorly in 10 short epochs: the sum over all negatives for the first
  # 5 epochs gives a clearly higher recall on runlocal features than hardest negatives from the start.
  sum_loss_epochs=5,
  train_limit=2000,
  test_limit=500,
  fold_size=0,
)


# ---------------------------------------------------------------------------------------------------------------
# MCT's tagging probe (vlrep.evaluators.tagging)
# ---------------------------------------------------------------------------------------------------------------
# The paper's protocol adapted to COCO (its table 5 is on Stock, which is not public): the 80 instance categories
# as tags, train2017 -> val2017.
TAGGING_COCO = dict(
  type="tagging",
  dataset="coco_captions2017",
  data_dir="",
  config_name="",
  train_split="train",
  test_split="val",
  pp="decode|resize_small(256)|central_crop(224)|normalize|tags(num_tags=80)",
  tags_key="tags",
  feature="pre_logits",
  batch_size=250,
  tag_dim=4096,
  hidden=2048,
  epochs=30,
  lr=1e-3,
  train_batch_size=256,
  ks=(5, 10, 15, 20),
  seed=0,
  train_limit=0,
  test_limit=0,
  every_steps=0,
)
# synthetic_scenes: its 10 shapes and 10 colours as tags (MCT runlocal's tags), 2000 / 500 images.
TAGGING_RUNLOCAL = dict(
  dataset="synthetic_scenes",
  config_name="default",
  data_dir=DATA_DIR,
  pp="decode|normalize|tags(fields=(('objects', 'label', 0), ('objects', 'color', 10)), num_tags=20)",
  batch_size=100,
  hidden=512,
  epochs=30,
  ks=(3, 5, 10),
  train_limit=2000,
  test_limit=500,
)


# ---------------------------------------------------------------------------------------------------------------
# VisualBERT / ViLBERT (vlrep.methods.vlbert): the model settings every configs/vlbert.py run and an imported
# VisualBERT (vlrep.interop.formats.visual_bert) start from.
# ---------------------------------------------------------------------------------------------------------------
VLBERT_MODEL = dict(
  # ViLBERT's pooled output joins its pooled text and image: 'mul' (their product; ViLBERT's and MMF's
  # fusion_method default) or 'sum'.
  fusion="mul",
  # Dropout while training, in both streams and before the task head: MMF's (and BERT's) 0.1; < 0 takes the
  # checkpoint's config.json rates.
  bert_dropout=0.1,
  mask_rate=0.15,
  region_mask_rate=0.15,
  region_classes=1601,  # Visual Genome's classes in the paper's detector
  # ViLBERT's masked-region target: 'distribution' (KL to the region files' cls_prob, the study's), 'classes'
  # (each box's class label), 'feature' (MSE to the feature: grid cells) -- see vlrep.methods.vlbert.
  region_target="classes",
  region_weight=1.0,
  # ViLBERT's visual stream and co-attention (the paper's sizes); vlrep.methods.vlbert reads them for either arch.
  v_layers=6,
  v_hidden=1024,
  v_heads=8,
  v_intermediate=1024,
  bi_hidden=1024,
  bi_heads=8,
)
# The visual side: the frozen extractor's backbone (ResNet-50) and how regions are cut from its grid.
VLBERT_VISUAL = dict(
  backbone=dict(depth=50, width=64, bn_group_size=0),
  init_from="",  # required without region files: the run whose backbone extracts the regions
  allow_random_init=False,  # True: a random frozen extractor on purpose (runlocal), else an error
  seed=0,
  roi_size=7,
  crop_size=32,
)
