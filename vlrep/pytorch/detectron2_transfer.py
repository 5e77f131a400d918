r"""The papers' detection transfer through Detectron2: a run's backbone fine-tuned in Faster / Mask R-CNN with the
configs of configs/detectron2/, as kdexd/virtex's scripts/eval_detectron2.py does it.

  python -m vlrep.pytorch.detectron2_transfer --workdir=RUN --config-file=configs/detectron2/FILE.yaml [KEY VALUE ...]
  python -m vlrep.pytorch.detectron2_transfer --workdir=/runs/virtex_r50 \
      --config-file=configs/detectron2/voc_faster_rcnn_R_50_C4_24k.yaml --num-gpus=8
  python -m vlrep.pytorch.detectron2_transfer --workdir=/runs/loctex_r50 \
      --config-file=configs/detectron2/coco_mask_rcnn_R_50_FPN_2x.yaml \
      --dataset=mine_train=coco:/data/mine/train.json:/data/mine/images \
      --dataset=mine_val=coco:/data/mine/val.json:/data/mine/images --train=mine_train --test=mine_val \
      SOLVER.MAX_ITER 2000 SOLVER.STEPS "(1500,)"

What it does, in order:
1. The run's backbone (its best checkpoint, --checkpoint) is handed off by the interop export command
   (`vlrep.interop.export` with --format=backbone --out=OUTPUT_DIR) in a process of its own on the CPU (JAX never
   touches the accelerator Detectron2 trains on; this driver imports neither JAX nor TensorFlow):
   OUTPUT_DIR/backbone.safetensors (torchvision's names) and backbone.json (its architecture), the hand-off vlrep's
   own detection evaluator reads too (vlrep.pytorch.handoff). The Detectron2 weights are built from them here
   (vlrep.pytorch.detectron2_keys renames). `--weights=random` fine-tunes a randomly initialised backbone of the
   run's architecture instead (the baseline; the hand-off still gives the architecture).
2. The config: the YAML, then the KEY VALUE pairs, then what follows from the run and the machine: the ResNet's
   depth and widths from backbone.json (the YAMLs say ResNet-50), MODEL.DEVICE (cuda when there is one), OUTPUT_DIR
   (default RUN/detectron2/<YAML name>, `_random` added for --weights=random), and SyncBN read as BN when the job
   is one process (the same statistics; PyTorch's SyncBatchNorm needs a process group). PreciseBN's pass is capped
   at SOLVER.MAX_ITER iterations, so a short run is not dominated by 200 batches of statistics (the papers'
   schedules are unchanged).
3. vlrep's input convention is checked, not assumed: the exported weights expect RGB, ImageNet mean/std on 0-255 and
   the stride on each bottleneck's 3x3 (INPUT.FORMAT RGB, MODEL.PIXEL_MEAN/STD, MODEL.RESNETS.STRIDE_IN_1X1 False,
   as configs/detectron2/Base-*-vlrep.yaml set them). A config built on Detectron2's stock base files (BGR, Caffe
   means, stride in 1x1) would give silently wrong features: it is refused, naming the keys and their values.
4. LocTex's ROI head (`Res5ROIHeadsExtraNorm`, vlrep.pytorch.detectron2_heads) is registered, so the LocTex configs
   build as they are.
5. Datasets: Detectron2's own names (coco_2017_train, voc_2007_trainval, lvis_v1_val, ...; their files under
   $DETECTRON2_DATASETS, default ./datasets) or any set registered on the command line with
   --dataset=NAME=coco:JSON:IMAGE_DIR, NAME=lvis:JSON:IMAGE_DIR or NAME=voc:VOC_DIR:SPLIT:YEAR; --train / --test
   (comma-separated names) replace DATASETS.TRAIN / TEST. The evaluator follows the dataset (COCO, LVIS, VOC).
   Masks stored as RLE in a command-line set (vlrep.data.instances writes RLE) switch INPUT.MASK_FORMAT to bitmask.
6. Training resumes from OUTPUT_DIR's last Detectron2 checkpoint when there is one (rerun the same command after an
   interruption); the final evaluation's metrics go into RUN/summary.json as `detectron2/<YAML name>/<dataset>/
   <task>/<metric>` (e.g. .../bbox/AP, .../segm/AP50) and, with the per-class APs, into
   OUTPUT_DIR/transfer_results.json. A detector that makes no prediction on a test set scores AP 0 on each of its
   metrics (Detectron2 reports NaN: "No predictions from the model!"), with a warning saying so; a size range (APs,
   APm, APl) the test set has no ground truth of has no AP and stays absent.

It resumes only what it wrote. A run folder may come from someone else, and Detectron2 reads a `.pkl` with plain
pickle.load and a checkpoint with torch.load, which can run code the file names. So:
- The driver records what it writes in OUTPUT_DIR/vlrep_written.json (MANIFEST: the name and sha256 of the hand-off's
  backbone.safetensors and backbone.json and of every checkpoint its trainer saves, rewritten atomically after each
  save). A `last_checkpoint` that names
  anything but a checkpoint of that record (another name, a path, a `.pkl`, a link) or a file whose sha256 differs
  from the record is refused with exit status 2 naming the file, before Detectron2 is imported.
- The record lies in the run folder, so it is no proof by itself: Detectron2 never reads a pickle itself. The
  trainer's checkpointer (`checkpointer_type`) loads only OUTPUT_DIR's backbone.safetensors (vlrep's checked
  safetensors reader: no pickle) and recorded checkpoints, each through vlrep's restricted unpickler
  (vlrep.torch_files: tensors, numpy arrays and plain containers, nothing else imported or called), and a resumed
  checkpoint is read that way before Detectron2 is imported too. The hand-off is exported afresh by every command
  that does not resume (a resumed one loads no backbone, and reads the recorded backbone.json for the architecture).
- Writes never follow links: OUTPUT_DIR and every folder between the run and it must be real folders, and a link (or
  anything but a file or folder) anywhere under OUTPUT_DIR is refused before training, since Detectron2 writes its
  logs, config.yaml, metrics and evaluations there by name; the driver's own files (checkpoints, last_checkpoint,
  the record, transfer_results.json) are written through vlrep.safe_files.
- The YAML (and each _BASE_ it names) is read as plain YAML: Detectron2's merge_from_file would retry one with
  Python tags (`!!python/object/apply:...`) by yaml.unsafe_load, which runs what they name; here it is refused.

Detectron2 is not on the package index. Build it from its source (CPU or CUDA; minutes):
  git clone https://github.com/facebookresearch/detectron2 && cd detectron2
  pip install --no-build-isolation -e .          # FORCE_CUDA=0 on a machine without CUDA
Without it the command exits with status 2 and says so. Every bad input (a run whose backbone Detectron2's ResNet
cannot hold, a dataset that is not registered, a wrong input convention) is an error with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from vlrep import errors, run_summary, safe_files, torch_files
from vlrep.errors import BadFile, UserError
from vlrep.pytorch import detection_spec, detectron2_heads, detectron2_keys, handoff

# Detectron2 (built from its source, INSTALL below) and torch are imported inside the functions that use them: an
# optional dependency, so --help and the early refusals (a missing run, no Detectron2) work without importing it.

logger = logging.getLogger(__name__)
INSTALL = (
  "Detectron2 is not installed (it is not on the package index). Build it from its source, e.g.\n"
  "  git clone https://github.com/facebookresearch/detectron2 && cd detectron2\n"
  "  pip install --no-build-isolation -e .    # FORCE_CUDA=0 on a machine without CUDA\n"
  "(it needs torch; `pip install -e '.[detection]'` in vlrep installs the torch and torchvision pair it runs with)."
)
# What the handed-off weights expect (torchvision's convention): KEY -> value.
INPUT_CONVENTION = {
  "INPUT.FORMAT": "RGB",
  "MODEL.PIXEL_MEAN": [123.675, 116.280, 103.530],
  "MODEL.PIXEL_STD": [58.395, 57.120, 57.375],
  "MODEL.RESNETS.STRIDE_IN_1X1": False,
}
# Detectron2's ResNet: BasicBlocks for 18/34 (res2 width fixed at 64), bottlenecks for 50/101/152.
DETECTRON2_DEPTHS = (18, 34, 50, 101, 152)
NORM_KEYS = ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")
DATASET_KINDS = {"coco": 2, "lvis": 2, "voc": 3}  # kind -> number of ':'-separated fields after it
# What the driver writes into OUTPUT_DIR and may hand to Detectron2: the backbone hand-off (its weights and their
# architecture) and the trainer's checkpoints (PeriodicCheckpointer's model_<iteration, 7 digits>.pth and
# model_final.pth), recorded in MANIFEST.
MANIFEST = "vlrep_written.json"
HANDOFF_FILES = (handoff.HANDOFF_WEIGHTS, handoff.HANDOFF_INFO)
CHECKPOINT_NAME = re.compile(r"model_(\d{7}|final)\.pth\Z")
LAST_CHECKPOINT = "last_checkpoint"
_SMALL_FILE = 1 << 20  # bytes: the record and last_checkpoint are a few hundred


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m vlrep.pytorch.detectron2_transfer",
    description="Fine-tune and evaluate a vlrep run's backbone with Detectron2 (the papers' detection transfer).",
    epilog="Trailing KEY VALUE pairs override the YAML, as Detectron2's tools/train_net.py reads them.",
  )
  p.add_argument("--workdir", required=True, help="The vlrep run whose backbone is transferred.")
  p.add_argument("--config-file", "--config_file", dest="config_file", required=True, help="A Detectron2 YAML.")
  p.add_argument("--checkpoint", default="best", help="best, latest or a step (vlrep.interop.export's --checkpoint).")
  p.add_argument("--weights", choices=("run", "random"), default="run", help="random: the random-init baseline.")
  p.add_argument("--output-dir", "--output_dir", dest="output_dir", default="", help="Default RUN/detectron2/NAME.")
  p.add_argument("--dataset", action="append", default=[], help="NAME=coco:JSON:IMAGES | lvis:.. | voc:DIR:SPLIT:YEAR")
  p.add_argument("--train", default="", help="Comma-separated dataset names for DATASETS.TRAIN.")
  p.add_argument("--test", default="", help="Comma-separated dataset names for DATASETS.TEST.")
  p.add_argument("--num-gpus", "--num_gpus", dest="num_gpus", type=int, default=1, help="GPUs on this machine.")
  p.add_argument("--num-workers", "--num_workers", dest="num_workers", type=int, default=-1, help="Data workers.")
  p.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE pairs")
  args = p.parse_args(argv)
  if len(args.opts) % 2:
    raise UserError(f"The config overrides come in KEY VALUE pairs; got an odd number: {args.opts}.")
  return args


def detectron2_missing() -> ImportError | None:
  """Why Detectron2 (or torch under it) does not import here; None when it does."""
  try:
    import detectron2.engine  # noqa: F401
  except ImportError as e:
    return e
  return None


def require_detectron2() -> None:
  """A UserError that says how to install Detectron2 when it (or torch) does not import."""
  missing = detectron2_missing()
  if missing is not None:
    raise UserError(f"{INSTALL}\n(import failed: {missing})")


def parse_dataset(spec: str) -> tuple[str, str, list[str]]:
  """'NAME=KIND:A:B[:C]' -> (NAME, KIND, [A, B, C]); paths are checked to exist."""
  name, sep, rest = spec.partition("=")
  kind, _, fields = rest.partition(":")
  parts = fields.split(":") if fields else []
  if not sep or not name or kind not in DATASET_KINDS or len(parts) != DATASET_KINDS[kind]:
    raise UserError(
      f"--dataset={spec!r}: expected NAME=coco:JSON:IMAGE_DIR, NAME=lvis:JSON:IMAGE_DIR or NAME=voc:VOC_DIR:SPLIT:YEAR."
    )
  paths = parts[:2] if kind != "voc" else parts[:1]
  for path in paths:
    if not os.path.exists(os.path.expanduser(path)):
      raise UserError(f"--dataset={spec!r}: {path} does not exist.")
  return name, kind, [os.path.expanduser(p) if i < len(paths) else p for i, p in enumerate(parts)]


def backbone_settings(arch: dict) -> dict:
  """The run's backbone (backbone.json's architecture: vlrep.pytorch.resnet.ResNet's arguments) as Detectron2
  MODEL.RESNETS keys, or a UserError for one Detectron2's ResNet cannot hold."""
  depth, width, inner = int(arch["depth"]), int(arch["width"]), int(arch["inner_multiplier"])
  if arch["stem"] != "imagenet":
    raise UserError(
      f"The run's backbone has stem={arch['stem']!r} (3x3, no max-pool); Detectron2's ResNet builds only the ImageNet "
      "stem (7x7 stride 2 and a max-pool). Train with method.backbone.stem='imagenet' (every paper recipe does), or "
      "use vlrep's own detection evaluator (configs/eval/detection.py), which converts any stem."
    )
  if depth not in DETECTRON2_DEPTHS:
    raise UserError(f"The run's ResNet has depth {depth}; Detectron2's ResNet builds depths {DETECTRON2_DEPTHS}.")
  if depth in (18, 34) and width != 64:
    raise UserError(f"Detectron2's ResNet-{depth} has 64 channels in res2; the run's has width {width}.")
  bottleneck = 4 if depth >= 50 else 1
  return {
    "MODEL.RESNETS.DEPTH": depth,
    "MODEL.RESNETS.STEM_OUT_CHANNELS": width,
    "MODEL.RESNETS.RES2_OUT_CHANNELS": width * bottleneck,
    "MODEL.RESNETS.WIDTH_PER_GROUP": width * inner,
  }


def _get(cfg, key: str):
  node = cfg
  for part in key.split("."):
    node = node[part]
  return node


def _set(cfg, key: str, value) -> None:
  *path, last = key.split(".")
  node = cfg
  for part in path:
    node = node[part]
  node[last] = value


def check_input_convention(cfg) -> None:
  """Refuses a config whose input convention differs from the exported weights' (silently wrong features)."""
  wrong = []
  for key, want in INPUT_CONVENTION.items():
    got = _get(cfg, key)
    same = [round(float(v), 3) for v in got] == want if isinstance(want, list) else got == want
    if not same:
      wrong.append(f"{key} is {got!r}; vlrep's weights need {want!r}")
  if wrong:
    fix = " ".join(f"{k} {json.dumps(v) if isinstance(v, list) else v}" for k, v in INPUT_CONVENTION.items())
    raise UserError(
      "The config's input convention does not match vlrep's exported weights (torchvision's: RGB, ImageNet mean/std "
      "on 0-255, the stride on each bottleneck's 3x3); the features would be silently wrong:\n  "
      + "\n  ".join(wrong)
      + f"\nBase the config on configs/detectron2/Base-*-vlrep.yaml, or append: {fix}"
    )


def build_config(args, world_size: int, cuda: bool):
  """The Detectron2 config: YAML, overrides, then what follows from this machine; checked before the run's backbone
  is exported (`set_backbone` then adds what follows from it)."""
  import yaml
  from detectron2.config import get_cfg

  cfg = get_cfg()
  try:  # Detectron2's default (allow_unsafe=True) retries a YAML with Python tags by yaml.unsafe_load: code it names
    cfg.merge_from_file(args.config_file, allow_unsafe=False)
  except yaml.YAMLError as e:
    raise BadFile(
      f"{args.config_file} (or a _BASE_ file it names) is not a plain YAML config ({type(e).__name__}: "
      f"{str(e).splitlines()[0][:200] if str(e) else ''}); a Python tag (!!python/...) would run code. Use plain "
      "YAML values, as configs/detectron2/ does."
    ) from e
  cfg.merge_from_list(list(args.opts))
  if args.train:
    cfg.DATASETS.TRAIN = tuple(args.train.split(","))
  if args.test:
    cfg.DATASETS.TEST = tuple(args.test.split(","))
  cfg.MODEL.DEVICE = "cuda" if cuda else "cpu"
  cfg.OUTPUT_DIR = output_dir(args)
  if args.num_workers >= 0:
    cfg.DATALOADER.NUM_WORKERS = args.num_workers
  if world_size == 1:  # one process: SyncBN's statistics are BN's, and torch's SyncBatchNorm needs a process group
    for key in NORM_KEYS:
      if _get(cfg, key) == "SyncBN":
        _set(cfg, key, "BN")
  cfg.TEST.PRECISE_BN.NUM_ITER = min(cfg.TEST.PRECISE_BN.NUM_ITER, cfg.SOLVER.MAX_ITER)
  check_input_convention(cfg)
  return cfg


def set_backbone(cfg, architecture: dict) -> None:
  """The run's backbone (backbone.json's `architecture`) in the config: `backbone_settings`, over the YAML's and the
  overrides' values."""
  for key, value in backbone_settings(architecture).items():
    _set(cfg, key, value)


def result_name(args) -> str:
  """The YAML's name, `_random` added for the random-init baseline: its output folder and summary key prefix."""
  name = os.path.splitext(os.path.basename(args.config_file))[0]
  return name if args.weights == "run" else f"{name}_random"


def output_dir(args) -> str:
  name = result_name(args)
  return os.path.abspath(os.path.expanduser(args.output_dir or os.path.join(args.workdir, "detectron2", name)))


# ------------------------------------------------------------------------------------------------------------ #
# What the driver wrote: the record (MANIFEST), its checks, and the only reader of pickles for Detectron2.
# ------------------------------------------------------------------------------------------------------------ #


def output_root(args) -> str:
  """The folder the user named that holds every write: the run (OUTPUT_DIR defaults to a folder inside it), or
  --output-dir itself."""
  if args.output_dir:
    return output_dir(args)
  return os.path.abspath(os.path.expanduser(args.workdir))


def check_output_dir(out_dir: str, root: str) -> None:
  """Refuses (UserError naming it) a link between `root` and `out_dir`, or a link, FIFO, socket or device anywhere
  under `out_dir`: Detectron2 writes its log, config.yaml, metrics and evaluations there by name, following links."""
  safe_files.check_inside(out_dir, root)
  folder = out_dir
  while folder != root and os.path.dirname(folder) != folder:
    if os.path.lexists(folder) and not os.path.isdir(folder):
      raise UserError(f"{folder} is a file; the Detectron2 driver writes its output in a folder there.")
    folder = os.path.dirname(folder)
  if not os.path.isdir(out_dir):
    return
  for folder, dirs, files in os.walk(out_dir):  # os.walk does not descend into linked folders; they are listed
    for name in (*dirs, *files):
      path = os.path.join(folder, name)
      if os.path.islink(path) or not (os.path.isfile(path) or os.path.isdir(path)):
        kind = f"a symlink (to {os.readlink(path)!r})" if os.path.islink(path) else "not a file or folder"
        raise safe_files.OutsideWrite(
          f"{path} is {kind}; the Detectron2 driver writes into {out_dir} and follows no links there. Remove it, or "
          "give a fresh --output-dir."
        )


def _small_text(path: str, what: str) -> str:
  """A short text file of OUTPUT_DIR (the record, last_checkpoint): a regular file, not a link, at most 1 MB."""
  if os.path.islink(path) or not os.path.isfile(path):
    raise BadFile(f"{path} is a link or not a file; the Detectron2 driver writes its {what} as a plain file.")
  if os.path.getsize(path) > _SMALL_FILE:
    raise BadFile(f"{path} has {os.path.getsize(path)} bytes: not a {what} the Detectron2 driver wrote.")
  with errors.reading(path, what), open(path, encoding="utf-8") as f:
    return f.read()


def read_manifest(out_dir: str) -> dict[str, str]:
  """{name: sha256} of the files the driver recorded in `out_dir` ({} when there is no record)."""
  path = os.path.join(out_dir, MANIFEST)
  if not os.path.lexists(path):
    return {}
  text = _small_text(path, "record of the files it wrote")
  with errors.reading(path, "record of the files the Detectron2 driver wrote"):
    files = json.loads(text)["files"]
  hex64 = re.compile(r"[0-9a-f]{64}\Z")
  if not isinstance(files, dict) or not all(
    isinstance(k, str) and (k in HANDOFF_FILES or CHECKPOINT_NAME.match(k)) and isinstance(v, str) and hex64.match(v)
    for k, v in files.items()
  ):
    raise BadFile(
      f"{path}: not a record the Detectron2 driver wrote ({{name: sha256}} of {', '.join(HANDOFF_FILES)}, "
      "model_*.pth; an older vlrep's records backbone.pkl). Delete it and OUTPUT_DIR's last_checkpoint to train "
      "afresh from the run's backbone, or give --output-dir."
    )
  return files


def record_written(out_dir: str, name: str, root: str) -> str:
  """Adds `name` (a file the driver just wrote in `out_dir`) with its sha256 to the record; returns the sha256."""
  digest = safe_files.sha256_of(os.path.join(out_dir, name))
  files = {**read_manifest(out_dir), name: digest}
  record = {"written_by": "vlrep.pytorch.detectron2_transfer", "files": dict(sorted(files.items()))}
  safe_files.write_json(os.path.join(out_dir, MANIFEST), record, root=root)
  return digest


def verified_file(out_dir: str, name: str, named_by: str) -> str:
  """The sha256 of OUTPUT_DIR's `name`, refused (UserError naming the file) unless it is a plain file the record
  lists with that very sha256. `named_by`: what asked for it, for the message."""
  path = os.path.join(out_dir, name)
  fresh = "delete it (and OUTPUT_DIR's last_checkpoint) to train afresh from the run's backbone, or give --output-dir"
  if os.path.islink(path) or not os.path.isfile(path):
    raise UserError(f"{path} ({named_by}) is missing, a link or not a file; the driver loads only files it wrote.")
  recorded = read_manifest(out_dir).get(name)
  if recorded is None:
    raise UserError(
      f"{path} ({named_by}) was not written by the Detectron2 driver: {os.path.join(out_dir, MANIFEST)} does not "
      f"list it. A run folder from elsewhere may ship a file that runs code when Detectron2 loads it; {fresh}."
    )
  digest = safe_files.sha256_of(path)
  if digest != recorded:
    raise UserError(
      f"{path} ({named_by}) is not the file the Detectron2 driver wrote: its sha256 is {digest}, the record's "
      f"{recorded}. It changed since (or was replaced); {fresh}."
    )
  return digest


def resume_checkpoint(out_dir: str) -> tuple[str, str] | None:
  """(path, sha256) of the checkpoint OUTPUT_DIR's `last_checkpoint` names, when there is one: only a model_*.pth of
  OUTPUT_DIR that the record lists with its sha256 (anything else is a UserError naming the file); None without
  last_checkpoint."""
  path = os.path.join(out_dir, LAST_CHECKPOINT)
  if not os.path.lexists(path):
    return None
  name = _small_text(path, "last_checkpoint").strip()
  if not CHECKPOINT_NAME.match(name):
    raise UserError(
      f"{path} names {name[:200]!r}; the Detectron2 driver resumes only the checkpoints it writes in that folder "
      "(model_<7 digits>.pth, model_final.pth). A run folder from elsewhere may name a file that runs code when "
      "Detectron2 loads it. Delete last_checkpoint to train afresh, or give --output-dir."
    )
  return os.path.join(out_dir, name), verified_file(out_dir, name, f"named by {path}")


# Checkpoints read (restricted) and checked before the trainer was built, {path: (sha256, object)}: a resumed
# checkpoint is read once per process, whether main or a launched worker checked it.
_READ: dict[str, tuple[str, Any]] = {}


def read_written(path: str) -> Any:
  """A checkpoint the driver wrote (model_*.pth), read through vlrep's restricted unpickler (nothing it names is
  imported or called; a global outside tensors/arrays/containers is an UnsafeFile error naming the file) and checked
  to be what Detectron2 loads: {'model': {name: array}, ...}."""
  with errors.reading(path, "Detectron2 checkpoint"):
    obj = torch_files.load_checkpoint(path)
  model = obj.get("model") if isinstance(obj, dict) else None
  if not isinstance(model, dict) or not all(isinstance(v, np.ndarray) for v in model.values()):
    raise BadFile(f"{path} holds no {{'model': {{name: tensor}}}}: not a file the Detectron2 driver wrote.")
  return obj


def read_handoff(out_dir: str) -> dict:
  """OUTPUT_DIR's backbone.json (the hand-off's architecture and source), refused unless the record lists it with
  its sha256."""
  verified_file(out_dir, handoff.HANDOFF_INFO, "the backbone's architecture")
  return handoff.read_info(out_dir)


def detectron2_weights(out_dir: str) -> dict:
  """What Detectron2 loads as MODEL.WEIGHTS, built from the recorded hand-off: backbone.safetensors (vlrep's
  checked reader) renamed to Detectron2's ResNet keys, as numpy arrays with `matching_heuristics` (Detectron2 adds
  its `backbone.bottom_up.` prefix itself, as for its model zoo's .pkl files)."""
  verified_file(out_dir, handoff.HANDOFF_WEIGHTS, "for Detectron2 to load")
  source = read_handoff(out_dir)["source"]
  model = detectron2_keys.detectron2_state_dict(handoff.read_weights(out_dir))
  return {"model": dict(model), "__author__": f"vlrep ({source})", "matching_heuristics": True}


def check_output(args, keep: bool) -> str | None:
  """Everything about OUTPUT_DIR that can be checked before Detectron2 is imported: no links in or above it, and a
  `last_checkpoint` that names a checkpoint the driver recorded, unchanged, which the restricted unpickler reads
  (kept for this process's trainer when `keep`). Returns the checkpoint to resume, or None."""
  out_dir = output_dir(args)
  check_output_dir(out_dir, output_root(args))
  resume = resume_checkpoint(out_dir)
  if resume is None:
    return None
  path, digest = resume
  if _READ.get(path, ("",))[0] != digest:
    obj = read_written(path)
    if keep:
      _READ[path] = (digest, obj)
  return path


def load_for_detectron2(filename: str, out_dir: str):
  """What Detectron2's checkpointer gets instead of pickle.load / torch.load of `filename`: only OUTPUT_DIR's
  backbone.safetensors (as `detectron2_weights`: numpy arrays, which Detectron2 converts as it does for its model
  zoo's .pkl files) or a checkpoint of the record, with the recorded sha256, read by `read_written` (its arrays as
  torch tensors: the optimizer's state needs them)."""
  import torch

  path = os.path.abspath(filename)
  folder, name = os.path.split(path)
  if folder != os.path.abspath(out_dir) or not (name == handoff.HANDOFF_WEIGHTS or CHECKPOINT_NAME.match(name)):
    raise UserError(
      f"Detectron2 was asked to load {filename}; the driver hands it only the files it wrote in {out_dir} "
      f"({handoff.HANDOFF_WEIGHTS}, model_*.pth)."
    )
  if name == handoff.HANDOFF_WEIGHTS:
    return detectron2_weights(out_dir)
  digest = verified_file(out_dir, name, "for Detectron2 to load")
  cached = _READ.pop(path, None)
  obj = cached[1] if cached is not None and cached[0] == digest else read_written(path)

  def tensors(x):
    if isinstance(x, np.ndarray):
      if x.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
      return torch.from_numpy(x)
    if isinstance(x, dict):  # in place: an OrderedDict keeps its _metadata (module versions for load_state_dict)
      for k in list(x):
        x[k] = tensors(x[k])
      return x
    if isinstance(x, list):
      x[:] = [tensors(v) for v in x]
      return x
    if isinstance(x, tuple):
      return type(x)(tensors(v) for v in x)
    return x

  return tensors(obj)


def checkpointer_type():
  """Detectron2's DetectionCheckpointer, made to read only what the driver wrote (`load_for_detectron2`, never
  pickle.load or torch.load) and to write without following links, recording each checkpoint it saves."""
  import torch
  from detectron2.checkpoint import DetectionCheckpointer

  def _load_file(self, filename):
    return load_for_detectron2(filename, self.save_dir)

  def save(self, name: str, **kwargs) -> None:  # fvcore's Checkpointer.save, written atomically and recorded
    if not self.save_dir or not self.save_to_disk:
      return
    basename = f"{name}.pth"
    if not CHECKPOINT_NAME.match(basename):
      raise ValueError(f"The driver's checkpointer saves model_<iteration>.pth and model_final.pth, not {basename}.")
    data = {"model": self.model.state_dict()}
    data.update({key: obj.state_dict() for key, obj in self.checkpointables.items()})
    data.update(kwargs)
    path = os.path.join(self.save_dir, basename)
    self.logger.info(f"Saving checkpoint to {path}")
    with safe_files.atomic_path(path, ".pth", root=self.save_dir) as tmp:
      torch.save(data, tmp)
    record_written(self.save_dir, basename, self.save_dir)
    self.tag_last_checkpoint(basename)

  def tag_last_checkpoint(self, basename: str) -> None:
    safe_files.write_text(os.path.join(self.save_dir, LAST_CHECKPOINT), basename, root=self.save_dir)

  def get_checkpoint_file(self) -> str:
    resume = resume_checkpoint(self.save_dir)
    return resume[0] if resume else ""

  methods = dict(
    _load_file=_load_file,
    save=save,
    tag_last_checkpoint=tag_last_checkpoint,
    get_checkpoint_file=get_checkpoint_file,
  )
  return type("WrittenOnlyCheckpointer", (DetectionCheckpointer,), methods)


def saved_backbone_arch(workdir: str, checkpoint: str) -> str | None:
  """The backbone `arch` of the config the run saved with the checkpoint --checkpoint names (orbax's JSON `meta`
  item, read as text: JAX stays out of this process), the newest first as vlrep.runs reads them; None when no
  such file reads (the export below then says what is wrong with the run)."""
  best, latest = os.path.join(workdir, "best"), os.path.join(workdir, "checkpoints")

  def steps(folder):
    return sorted((int(p) for p in os.listdir(folder) if p.isdigit()), reverse=True) if os.path.isdir(folder) else []

  if checkpoint.isdigit():
    candidates = [(d, int(checkpoint)) for d in (latest, best)]
  else:
    candidates = [(best, s) for s in steps(best)] if checkpoint == "best" else []
    candidates += [(latest, s) for s in steps(latest)]
  for folder, step in candidates:
    path = os.path.join(folder, str(step), "meta", "metadata")
    try:
      with open(path, encoding="utf-8") as f:
        config = json.load(f)["config"]
    except (OSError, ValueError, KeyError, TypeError):
      continue
    backbone = (config.get("method") or {}).get("backbone") or {}
    return str(backbone.get("arch", "resnet"))
  return None


def export_backbone(workdir: str, checkpoint: str, out_dir: str) -> None:
  """The run's backbone hand-off (backbone.safetensors and backbone.json) into `out_dir` by the interop export
  command (`vlrep.interop.export` with --format=backbone) in a process of its own, on the CPU: JAX stays out of
  this process and leaves the accelerator to torch."""
  cmd = [
    sys.executable,
    "-m",
    "vlrep.interop.export",
    f"--workdir={workdir}",
    f"--checkpoint={checkpoint}",
    "--format=backbone",
    f"--out={out_dir}",
  ]
  print(f"Exporting the backbone: {' '.join(cmd)}", flush=True)
  done = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
  if done.returncode:
    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    raise UserError(f"Exporting {workdir}'s backbone failed (exit {done.returncode}):\n{tail}")


def register(datasets: list[str]) -> None:
  """The LocTex ROI head and the command line's datasets, in Detectron2's registries."""
  from detectron2.data import DatasetCatalog
  from detectron2.data.datasets import register_coco_instances, register_lvis_instances
  from detectron2.data.datasets.pascal_voc import register_pascal_voc

  detectron2_heads.register_loctex_extra_norm()
  for spec_text in datasets:
    name, kind, fields = parse_dataset(spec_text)
    if name in DatasetCatalog.list():
      raise UserError(f"--dataset={spec_text!r}: {name!r} is already a registered dataset; give it another name.")
    if kind == "coco":
      register_coco_instances(name, {}, fields[0], fields[1])
    elif kind == "lvis":
      register_lvis_instances(name, {}, fields[0], fields[1])
    else:
      register_pascal_voc(name, fields[0], fields[1], int(fields[2]))


def uses_rle_masks(datasets: list[str], names) -> bool:
  """Whether any of `names`, registered on the command line from a COCO/LVIS file, stores masks as RLE (dicts, as
  vlrep.data.instances writes them) rather than polygons, Detectron2's default INPUT.MASK_FORMAT."""
  for spec in datasets:
    name, kind, fields = parse_dataset(spec)
    if name not in names or kind == "voc":
      continue
    with errors.reading(fields[0], "COCO/LVIS instances file"), open(fields[0], encoding="utf-8") as f:
      annotations = json.load(f).get("annotations", [])
    if any(isinstance(a.get("segmentation"), dict) for a in annotations):
      return True
  return False


def check_datasets(cfg) -> None:
  from detectron2.data import DatasetCatalog, MetadataCatalog

  known = set(DatasetCatalog.list())
  for name in (*cfg.DATASETS.TRAIN, *cfg.DATASETS.TEST):
    if name not in known:
      raise UserError(
        f"Dataset {name!r} (DATASETS.TRAIN/TEST) is not registered. Register it with --dataset={name}=coco:JSON:IMAGES "
        "(or lvis:..., voc:DIR:SPLIT:YEAR), or use one of Detectron2's names with its files under $DETECTRON2_DATASETS."
      )
  for name in cfg.DATASETS.TEST:
    kind = MetadataCatalog.get(name).get("evaluator_type", None)
    if kind not in ("coco", "lvis", "pascal_voc"):
      raise UserError(f"Dataset {name!r} has evaluator_type {kind!r}; this tool evaluates coco, lvis and pascal_voc.")


def build_evaluator(cfg, dataset_name: str):
  """The evaluator the dataset's kind needs (as kdexd/virtex's DownstreamTrainer.build_evaluator)."""
  from detectron2.data import MetadataCatalog
  from detectron2.evaluation import COCOEvaluator, LVISEvaluator, PascalVOCDetectionEvaluator

  kind = MetadataCatalog.get(dataset_name).evaluator_type
  folder = os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
  if kind == "pascal_voc":
    return PascalVOCDetectionEvaluator(dataset_name)
  if kind == "lvis":
    return LVISEvaluator(dataset_name, cfg, True, folder)
  return COCOEvaluator(dataset_name, output_dir=folder)


# COCOeval's size ranges (area in pixels, bounds inclusive as COCOeval's): an AP over a range without ground truth is
# undefined (Detectron2: NaN), not 0.
SIZE_RANGES = {"APs": (0, 32**2), "APm": (32**2, 96**2), "APl": (96**2, 1e10)}
# The metrics Detectron2's COCO evaluator reports per task (its LVIS evaluator adds APr, APc, APf).
COCO_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def sizes_with_ground_truth(annotations: list[dict]) -> set[str]:
  """The size ranges (SIZE_RANGES' names) a COCO-format test set has ground truth in: its non-crowd objects' areas
  (COCOeval's `area`; the box's when an annotation has none)."""
  areas = [
    float(a["area"]) if "area" in a else float(a["bbox"][2] * a["bbox"][3])
    for a in annotations
    if not a.get("iscrowd", 0)
  ]
  return {name for name, (low, high) in SIZE_RANGES.items() if any(low <= x <= high for x in areas)}


def scored_without_predictions(tasks: dict, expected: Sequence[str], sizes: set[str]) -> tuple[dict, list[str]]:
  """One test set's {task: {metric: value}} with each task the detector made no prediction for scored as AP 0.

  Detectron2 reports such a task (its COCO/LVIS evaluator logs "No predictions from the model!") with every metric
  NaN, or leaves it out; left so, its metrics would vanish from the results as if undefined. No prediction is AP 0
  on every metric, but an AP over a size range without ground truth (not in `sizes`, `sizes_with_ground_truth`) is
  undefined and stays absent. `expected`: the tasks the evaluator scores (bbox, and segm with masks). A test set
  without ground truth (`sizes` empty) has no AP to give: left as it is. Returns (results, the tasks with no
  prediction)."""
  if not sizes:
    return dict(tasks), []
  out, empty = {}, []
  for task in (*tasks, *(t for t in expected if t not in tasks)):
    metrics = dict(tasks.get(task, {}))
    numbers = [v for v in metrics.values() if isinstance(v, (int, float))]
    if all(not math.isfinite(v) for v in numbers):  # every metric NaN, or none at all: no prediction
      empty.append(task)
      metrics = {m: 0.0 for m in (metrics or COCO_METRICS) if m not in SIZE_RANGES or m in sizes}
    out[task] = metrics
  return out, empty


def test_set_sizes(dataset_name: str) -> set[str]:
  """`sizes_with_ground_truth` of a registered COCO/LVIS test set (its metadata's json_file); empty for another kind
  (VOC's evaluator reports no size ranges)."""
  from detectron2.data import MetadataCatalog

  json_file = MetadataCatalog.get(dataset_name).get("json_file", None)
  if not json_file:
    return set()
  with errors.reading(json_file, "COCO/LVIS instances file"), open(json_file, encoding="utf-8") as f:
    return sizes_with_ground_truth(json.load(f).get("annotations", []))


def with_no_predictions_scored(results: dict, test_names: Sequence[str], tasks: Sequence[str], sizes_of) -> dict:
  """Detectron2's test results ({task: {metric}} for one test set, {dataset: {task: {metric}}} for several) with
  `scored_without_predictions` applied to each test set (`sizes_of(dataset)`: its size ranges with ground truth),
  and a warning logged for each task of a test set the detector made no prediction on."""
  by_set = {test_names[0]: dict(results)} if len(test_names) == 1 else {k: dict(v) for k, v in results.items()}
  for name in by_set:
    by_set[name], empty = scored_without_predictions(by_set[name], tasks, sizes_of(name))
    for task in empty:
      logger.warning(
        "The fine-tuned detector made no predictions on %s (%s): its APs are 0 (Detectron2 reports NaN, 'No "
        "predictions from the model!'). Train longer, or lower MODEL.ROI_HEADS.SCORE_THRESH_TEST.",
        name,
        task,
      )
  return by_set[test_names[0]] if len(test_names) == 1 else by_set


def summary_values(name: str, results: dict) -> dict:
  """Detectron2's {dataset: {task: {metric: value}}} (one test dataset: {task: {metric: value}}) as flat summary
  keys; NaN (COCO's AP of a size or class the test set has no instance of) is left out."""
  out = {}

  def walk(prefix, node):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(f"{prefix}/{key}", value)
      elif isinstance(value, (int, float)) and math.isfinite(value):  # NaN: no object of that size/class
        out[f"{prefix}/{key}"] = float(value)

  walk(f"detectron2/{name}", results)
  return out


def train_and_evaluate(args) -> dict:
  """One process's part of the job (Detectron2's `launch` runs it once per GPU)."""
  import torch
  from detectron2.engine import DefaultTrainer, default_setup
  from detectron2.utils import comm

  register(args.dataset)
  cfg = build_config(args, comm.get_world_size(), torch.cuda.is_available())
  check_datasets(cfg)
  if cfg.MODEL.MASK_ON and cfg.INPUT.MASK_FORMAT == "polygon" and uses_rle_masks(args.dataset, cfg.DATASETS.TRAIN):
    print("The training set's masks are RLE: INPUT.MASK_FORMAT bitmask (polygon reads only polygons).", flush=True)
    cfg.INPUT.MASK_FORMAT = "bitmask"
  root, out_dir = output_root(args), cfg.OUTPUT_DIR
  safe_files.make_dirs(out_dir, root=root)
  # Checked again in this process (a launched worker is a fresh one; the single process read it in main already).
  resume = check_output(args, keep=True)
  if resume is None and comm.is_main_process():
    # Every command that does not resume hands the backbone off afresh (--weights=random too: its architecture).
    export_backbone(args.workdir, args.checkpoint, out_dir)
    for name in HANDOFF_FILES:
      record_written(out_dir, name, root)
  comm.synchronize()
  set_backbone(cfg, read_handoff(out_dir)["architecture"])
  # A resumed job loads its checkpoint, never MODEL.WEIGHTS: nothing else is handed to Detectron2.
  weights = os.path.join(out_dir, handoff.HANDOFF_WEIGHTS)
  cfg.MODEL.WEIGHTS = weights if args.weights == "run" and resume is None else ""
  cfg.freeze()
  default_setup(cfg, argparse.Namespace(config_file=args.config_file, eval_only=False))

  def build_hooks(self):  # the checkpointer the hooks save with and resume_or_load reads with: the driver's own
    self.checkpointer = checkpointer_type()(
      self.checkpointer.model, cfg.OUTPUT_DIR, **self.checkpointer.checkpointables
    )
    return DefaultTrainer.build_hooks(self)

  trainer_type = type(
    "TransferTrainer",
    (DefaultTrainer,),
    {"build_evaluator": staticmethod(build_evaluator), "build_hooks": build_hooks},
  )
  trainer = trainer_type(cfg)
  trainer.resume_or_load(resume=True)
  print(
    f"{'Resuming at iteration ' + str(trainer.start_iter) if resume else 'Fine-tuning'} "
    f"({args.weights} weights) to {cfg.SOLVER.MAX_ITER} iterations; output in {cfg.OUTPUT_DIR}",
    flush=True,
  )
  trainer.train()
  # Detectron2's evaluation hook evaluates the final model after training (whatever TEST.EVAL_PERIOD) and keeps the
  # results on the trainer; train() returns them only when TEST.EXPECTED_RESULTS is set.
  results = getattr(trainer, "_last_eval_results", None)
  if not results:
    results = DefaultTrainer.test(cfg, trainer.model, [build_evaluator(cfg, n) for n in cfg.DATASETS.TEST])
  if comm.is_main_process():
    tasks = ("bbox", "segm") if cfg.MODEL.MASK_ON else ("bbox",)
    results = with_no_predictions_scored(dict(results), list(cfg.DATASETS.TEST), tasks, test_set_sizes)
    values = summary_values(result_name(args), results)
    path = os.path.join(cfg.OUTPUT_DIR, "transfer_results.json")
    safe_files.write_json(path, values, root=cfg.OUTPUT_DIR, indent=2, sort_keys=True)
    # The per-class APs (AP-<class>: 80 for COCO, 1,203 for LVIS) stay in transfer_results.json.
    run_summary.write_summary(args.workdir, {k: v for k, v in values.items() if "/AP-" not in k})
    for key, value in values.items():
      print(f"{key} = {value:.2f}", flush=True)
  return results


def main(argv: Sequence[str] | None = None) -> int:
  try:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isdir(os.path.expanduser(args.workdir)):
      raise UserError(f"--workdir={args.workdir}: no such run directory.")
    if not os.path.isfile(args.config_file):
      raise UserError(f"--config-file={args.config_file}: no such file.")
    # Before Detectron2 is needed: a backbone its ResNet cannot be (a ViT), and what the run folder's OUTPUT_DIR
    # would make it load or write through.
    arch = saved_backbone_arch(os.path.expanduser(args.workdir), args.checkpoint)
    if arch is not None:
      detection_spec.refuse_backbone(arch, f"--workdir={args.workdir}")
    check_output(args, keep=args.num_gpus <= 1)
    require_detectron2()
    from detectron2.engine import launch

    for spec in args.dataset:
      parse_dataset(spec)
    if args.num_gpus > 1:
      launch(train_and_evaluate, args.num_gpus, dist_url="auto", args=(args,))
    else:
      train_and_evaluate(args)
  except UserError as e:
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
