r"""Detection and instance-segmentation transfer: the run's backbone fine-tuned end to end in torchvision's Mask
R-CNN (or Faster R-CNN) with FPN, scored by pycocotools (box and mask AP, AP50, AP75). Needs the `detection` extra
(torch, torchvision, pycocotools): pip install -e .[detection].

  python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/tmp/virtex_local
  python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init --workdir=/tmp/virtex_local
  python -m vlrep.evaluate --config=configs/eval/detection.py:coco=/data/coco --workdir=DIR

Arguments: runlocal (synthetic_scenes at 64 px: train on the first `train_limit` training scenes, score on
probe_test; `split=probe_val` scores the validation split, where the schedule was chosen: 150 iterations separate
pretrained from random initialisation twice as well as 300 there, docs/results/detection.md), random_init (the
same architecture from vlrep's initialiser instead of the run's weights: the baseline a pretraining effect is
measured against; written as `detection_random_init/...`), seeds ('+'-separated, e.g. 0+1+2: mean, std and
each), parallel (seeds fine-tuned at once, each in its own process: parallel=2 on a 2-core CPU runs two one-thread
workers, about twice as fast as one after the other), iterations (0: the form's: runlocal 150),
detector=mask_rcnn|faster_rcnn, norm=trained|frozen (the backbone's BatchNorm; frozen cripples random init),
split, train_limit, test_limit (first N scenes; 0 = all), threads (torch CPU threads; 0 = torch's default).
coco=DIR (the papers' form): COCO 2017 in DIR (annotations/instances_train2017.json, train2017/, and val2017
likewise), Mask R-CNN R50-FPN 1x as VirTex Table 6 runs it in Detectron2 (800-1333 px, 90k iterations of 16
images, lr 0.02 dropped at 60k and 80k, trained BatchNorm, 1,000 warm-up iterations); any other COCO-format set
through the same files' names, e.g. VOC converted.
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg
from vlrep.pytorch import detection_spec  # the worker's settings, defaults and checks (torch-free)

common = config_module(__file__, "../common.py")  # the blocks every recipe shares


def runlocal_detector() -> dict:
  """The worker's spec at 64 px. torchvision's defaults assume 800-px images: anchors 32-512, RoIAlign's level
  mapping at scale 224 (every 64-px box would go to the finest level), 2,000 proposals and 1,024-wide heads (far
  too much for a CPU). Here the anchors span the shapes' 8-40 px boxes, a 32-px box maps to level 4 (stride 16 with
  the small stem), and proposals and heads are a tenth of the defaults."""
  return detection_spec.settings(
    fpn_channels=64,
    anchor_sizes=(8, 16, 32, 64, 128),
    min_size=64,
    max_size=64,
    rpn_pre_nms_top_n_train=300,
    rpn_post_nms_top_n_train=100,
    rpn_pre_nms_top_n_test=300,
    rpn_post_nms_top_n_test=100,
    rpn_batch_size_per_image=128,
    box_batch_size_per_image=64,
    box_detections_per_img=20,
    box_head_width=256,
    mask_head_width=64,
    roi_canonical_scale=32,
    roi_canonical_level=4,
    roi_sampling_ratio=1,  # half the CPU time of torchvision's 2 for RoIAlign's backward pass, at 7x7 bins of 64 px
    # Chosen on probe_val for separating backbones, not for the highest AP: longer schedules let random
    # initialisation catch up (docs/results/detection.md, "The schedule, chosen on probe_val").
    iterations=150,
    warmup_iterations=50,
    log_every=25,
  )


def coco_detector() -> dict:
  """Mask R-CNN R50-FPN 1x (Detectron2's schedule; the detector sizes, batch and learning rate are the defaults:
  torchvision's, which are Detectron2's)."""
  return detection_spec.settings(
    iterations=90000,
    warmup_iterations=1000,
    lr_drops=(60000 / 90000, 80000 / 90000),
    log_every=100,
    eval_batch_size=8,
  )


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    random_init=False,
    coco="",
    seeds="0",
    parallel=1,
    iterations=0,
    detector="mask_rcnn",
    norm="trained",
    split="probe_test",
    train_limit=2000,
    test_limit=300,
    threads=0,
  )
  if arg.runlocal == bool(arg.coco):
    raise ValueError("Give either runlocal (synthetic_scenes) or coco=DIR (COCO 2017 in DIR).")
  if arg.runlocal:
    detector = runlocal_detector()
    data = dict(
      common.synthetic_scenes(),
      train_split="train",
      test_split=arg.split,
      train_limit=arg.train_limit,
      test_limit=arg.test_limit,
    )
  else:
    detector = coco_detector()
    data = dict(
      train_annotations=f"{arg.coco}/annotations/instances_train2017.json",
      train_images=f"{arg.coco}/train2017",
      test_annotations=f"{arg.coco}/annotations/instances_val2017.json",
      test_images=f"{arg.coco}/val2017",
    )
  detector.update(detector=arg.detector, norm=arg.norm, threads=arg.threads)
  if arg.iterations:
    detector["iterations"] = arg.iterations
  detector = detection_spec.settings(**detector)  # the command line's values checked too
  seeds = tuple(int(s) for s in str(arg.seeds).split("+"))
  evaluation = dict(
    type="detection",
    every_steps=0,
    seeds=seeds,
    parallel=arg.parallel,
    random_init=arg.random_init,
    detector=detector,
    **data,
  )
  name = "detection_random_init" if arg.random_init else "detection"
  return ConfigDict({"evals": {name: evaluation}})
