"""Evaluation protocols as plain settings: what configs start from. A leaf (no TensorFlow, no evaluator code), so
a config can be read on a machine that has only JAX (the step benchmark on a GPU machine) and the evaluators'
modules stay below the configs. The evaluator modules re-export their protocol (`vsepp.COCO_PROTOCOL`).
"""

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
  data_dir="~/.cache/vlrep/tensorflow_datasets",
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
