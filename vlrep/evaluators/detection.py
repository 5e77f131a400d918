"""Detection and instance-segmentation transfer: the run's backbone fine-tuned end to end inside torchvision's
Faster R-CNN or Mask R-CNN with FPN, scored by pycocotools (VirTex Tables 5-7, LocTex Tables 2-3, MCT Tables 2-3
measure backbones this way, with Detectron2).

In this process (JAX): the backbone's variables (or, with `random_init`, fresh ones from vlrep's initialiser for
the same architecture: the baseline a pretraining effect is measured against) become the PyTorch hand-off
(`vlrep.interop.formats.torchvision.write_backbone`: backbone.safetensors in torchvision's names and backbone.json,
the folder `vlrep.interop.export --format=backbone` writes from a run folder) in a temporary folder,
and the data becomes COCO instances (synthetic_scenes' through `vlrep.data.instances`; any other COCO-format set
is read where it is). In a process of its own, `python -m vlrep.pytorch.detection_worker`, PyTorch fine-tunes and scores
the detector (torch and JAX never share a process or contend for one accelerator's memory in it; on a GPU, start
vlrep.evaluate with XLA_PYTHON_CLIENT_PREALLOCATE=false so JAX leaves the memory to it). One worker per seed,
`parallel` of them at once (on a CPU, each with the cores divided among them unless `detector.threads` is set: a
small detector's step gains little from a second thread, so two one-thread workers finish two seeds in about the
time of one).

Metrics (percent): box_ap, box_ap50, box_ap75 and, for Mask R-CNN, mask_ap, mask_ap50, mask_ap75: the mean over
`seeds`, with `<metric>_std` (sample std over seeds, n - 1) when there are several and `<metric>_seed<N>` each;
loss_first, loss_last (the first and last logged training loss, mean over seeds), seconds (all workers).

Config (configs/eval/detection.py fills it): either `dataset` (+ data_dir, config_name; a dataset with visible-
instance maps: synthetic_scenes), `train_split`, `test_split`, `train_limit`, `test_limit` (first N examples;
0 = all), or `train_annotations`, `train_images`, `test_annotations`, `test_images` (COCO instances JSON files and
their image folders: real COCO, VOC converted); `seeds`; `parallel` (workers at once, default 1); `random_init`;
`detector` (the worker's settings: keys of `vlrep.pytorch.detection_spec.SETTINGS`, checked there; the backbone
hand-off, the data and the seed are this evaluator's to set).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from vlrep import safe_files
from vlrep.data import instances
from vlrep.errors import UserError
from vlrep.evaluators._inputs import EvalInputs, Model
from vlrep.interop.formats import torchvision as tv_format
from vlrep.models import resnet, vit
from vlrep.pytorch import detection_spec

AP_METRICS = ("box_ap", "box_ap50", "box_ap75", "mask_ap", "mask_ap50", "mask_ap75")
# The metrics that score the config's test split: a run's best checkpoint is not chosen by them (selection_rule).
TEST_METRICS = AP_METRICS
DATA_FILES = ("train_annotations", "train_images", "test_annotations", "test_images")


def method_section(module) -> dict:
  """The run's backbone as a method config's `backbone` section (what `write_backbone` reads the PyTorch
  architecture from), or a clear error for a backbone that PyTorch's twin cannot build."""
  if not isinstance(module, resnet.ResNet):
    arch = "vit" if isinstance(module, vit.ViT) else type(module).__name__
    detection_spec.refuse_backbone(arch, "The evaluated run")
  names = ("depth", "width", "inner_multiplier", "stem", "stem_stride")
  return {"backbone": {"arch": "resnet", **{k: getattr(module, k) for k in names}}}


def random_variables(module, seed: int, image_size: int) -> dict:
  """Fresh variables of the backbone's architecture from vlrep's own initialiser (the random-init baseline)."""
  images = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
  return jax.device_get(module.init(jax.random.PRNGKey(seed), images, train=False))


class Evaluator:
  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.inputs = inputs
    given = [k for k in DATA_FILES if config.get(k)]
    if given and len(given) != len(DATA_FILES):
      raise UserError(f"Detection data: give all of {DATA_FILES} (COCO instances and image folders); got {given}.")
    self.coco_files = bool(given)
    if self.coco_files:
      for key in DATA_FILES:
        path = os.path.expanduser(config[key])
        if not os.path.exists(path):
          raise UserError(f"Detection data: {key}={path} does not exist.")
    else:
      # A dataset without instance maps is refused here, before anything is read or trained.
      self.builder = instances.instances_builder(config.dataset, config.get("data_dir"), config.get("config_name"))
    if not config.get("seeds"):
      raise UserError("Detection: `seeds` is empty; give at least one seed.")
    if config.get("parallel", 1) < 1:
      raise UserError(f"Detection: parallel={config.parallel}; give 1 or more workers at once.")
    detection_spec.settings(**config.get("detector", {}))  # an unknown or inconsistent setting: refused now

  def _data(self, folder: str) -> dict:
    """The worker's data paths: the config's COCO files, or synthetic instances written into `folder`."""
    c = self.config
    if self.coco_files:
      return {k: os.path.expanduser(c[k]) for k in DATA_FILES}
    paths = {}
    for part in ("train", "test"):
      images = os.path.join(folder, f"{part}_images")
      annotations = os.path.join(folder, f"{part}.json")
      split, limit = c[f"{part}_split"], c.get(f"{part}_limit", 0)
      instances.write_json(instances.coco_instances(self.builder, split, limit, images), annotations)
      paths.update({f"{part}_annotations": annotations, f"{part}_images": images})
    return paths

  def evaluate(self, model: Model) -> dict[str, float]:
    if model.backbone is None:
      raise UserError(
        "The detection evaluator converts the run's backbone to PyTorch: run it after training with "
        "`python -m vlrep.evaluate --config=configs/eval/detection.py[:runlocal] --workdir=RUN`, not as a "
        "training-loop evaluation."
      )
    module, variables = model.backbone()
    section = method_section(module)
    c = self.config
    if self.inputs.host != 0:  # the worker runs once, on the first host; the others report its metrics
      return {}
    parallel = min(c.get("parallel", 1), len(c.seeds))
    detector = c.detector.to_dict()
    if parallel > 1 and not detector.get("threads"):
      detector["threads"] = max(1, (os.cpu_count() or 1) // parallel)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="vlrep_detection_") as folder:
      data = self._data(folder)
      specs = []
      for seed in c.seeds:
        # The hand-off of the run's weights, written once; random_init: fresh ones per seed.
        backbone = os.path.join(folder, f"backbone_random_{seed}" if c.random_init else "backbone")
        if c.random_init:
          source = f"random init (seed {seed})"
          tv_format.write_backbone(
            random_variables(module, int(seed), c.get("init_image_size", 64)), section, backbone, source=source
          )
        elif not os.path.exists(backbone):
          tv_format.write_backbone(variables, section, backbone, source="the evaluated run's backbone")
        spec = {**detector, **data, "backbone": backbone, "seed": int(seed)}
        specs.append(detection_spec.full_spec(spec))
      # Threads only wait on the worker processes; results come back in the seeds' order.
      with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        per_seed = list(pool.map(lambda spec: run_worker(spec, folder, spec["seed"]), specs))
    out = summarize(per_seed, [int(s) for s in c.seeds])
    out["seconds"] = time.time() - t0
    logging.info("Detection (%s): %s", "random init" if c.random_init else "the run's backbone", out)
    return out


def run_worker(spec: dict, folder: str, seed: int) -> dict[str, float]:
  """Runs `python -m vlrep.pytorch.detection_worker` on `spec` (its progress on this process's stderr); its metrics."""
  spec_path, out_path = os.path.join(folder, f"spec_{seed}.json"), os.path.join(folder, f"metrics_{seed}.json")
  safe_files.write_json(spec_path, spec, root=folder)
  command = [sys.executable, "-m", "vlrep.pytorch.detection_worker", f"--spec={spec_path}", f"--out={out_path}"]
  logging.info("Detection worker (seed %d): %s", seed, " ".join(command))
  done = subprocess.run(command, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"The detection worker failed (exit code {done.returncode}; its error is above): {command}")
  with open(out_path) as f:
    return json.load(f)


def summarize(per_seed: list[dict], seeds: list[int]) -> dict[str, float]:
  """Mean over seeds of every metric; with several seeds also `<metric>_std` and `<metric>_seed<N>` of the APs."""
  out = {}
  for key in per_seed[0]:
    if key in ("seconds", "iterations"):
      continue
    values = np.array([m[key] for m in per_seed], np.float64)
    out[key] = float(values.mean())
    if len(per_seed) > 1 and key in AP_METRICS:
      out[f"{key}_std"] = float(values.std(ddof=1))  # sample std, as vlrep.tools.sweep's cells and the tie rule
      out.update({f"{key}_seed{s}": float(v) for s, v in zip(seeds, values, strict=True)})
  out["iterations"] = float(per_seed[0]["iterations"])
  return out
