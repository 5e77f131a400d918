"""The official VirTex training step (kdexd/virtex), timed: the code a user would otherwise run.

Its model, optimizer, LR schedule and mixed precision are built by its own factories from its own config file
(default: `configs/width_ablations/bicaptioning_R_50_L1_H2048.yaml`, the R-50 L1 H2048 bicaptioning model; its
`_BASE_` sets AMP, cudnn.benchmark, SGD + LookAhead, one param group per parameter, clipping at norm 10), and the
step is its training loop's body (`scripts/pretrain_virtex.py`: zero_grad, forward under `amp.autocast`,
`scaler.scale(loss).backward()`, unscale, `clip_grad_norm_`, `scaler.step`, `scaler.update`, `scheduler.step`).
Inputs are random tensors of its batch's shapes already on the device (images, caption and reversed-caption tokens
of the full caption length), so its data stack is not needed. The whole batch runs on one device (the paper's
runs split 256 images over 8 GPUs with per-GPU BatchNorm: 32 images per BatchNorm there, 256 here).

Its code is not part of vlrep: give a checkout with `--virtex_src` (`git clone https://github.com/kdexd/virtex`).
It needs torch, torchvision, sentencepiece, fvcore (its config) and loguru; albumentations and cv2 (its data
transforms, imported by its factories module) are replaced by empty stand-ins when missing, since nothing here
reads data.

  python -m vlrep.bench.official_virtex --virtex_src=/tmp/virtex --batch_size=256 --steps=20 --windows=3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import types

import torch

from vlrep.bench import device_turns
from vlrep.bench.torch_reference import time_windows

DEFAULT_CONFIG = "configs/width_ablations/bicaptioning_R_50_L1_H2048.yaml"


def _stand_in(name: str) -> types.ModuleType:
  """An importable empty module whose every attribute is a do-nothing class: enough for class definitions and
  module-level `Compose([...])` calls in code that is imported but never run."""
  module = types.ModuleType(name)

  def attribute(attr: str):
    if attr.startswith("__"):  # module protocol (__file__, __path__, ...): absent, as in a plain module
      raise AttributeError(attr)
    return type(attr, (), {"__init__": lambda self, *a, **k: None})

  module.__getattr__ = attribute
  return module


def import_official(virtex_src: str):
  """The official `virtex` package from a checkout: (Config, factories module)."""
  if not os.path.isfile(os.path.join(virtex_src, "virtex", "factories.py")):
    raise SystemExit(f"--virtex_src={virtex_src!r} is not a checkout of kdexd/virtex (no virtex/factories.py).")
  for name in ("albumentations", "cv2"):  # data transforms only
    if importlib.util.find_spec(name) is None:
      sys.modules[name] = _stand_in(name)
  sys.path.insert(0, os.path.abspath(virtex_src))
  from virtex import factories  # noqa: PLC0415 - the official code comes from a path given at run time
  from virtex.config import Config  # noqa: PLC0415

  return Config, factories


def synthetic_batch(batch_size: int, image_size: int, caption_length: int, vocab_size: int, sos: int, eos: int, device):
  gen = torch.Generator(device=device).manual_seed(0)
  images = torch.randn(batch_size, 3, image_size, image_size, device=device, generator=gen)
  tokens = torch.randint(4, vocab_size, (batch_size, caption_length), device=device, generator=gen)
  tokens[:, 0], tokens[:, -1] = sos, eos
  lengths = torch.full((batch_size,), caption_length, device=device, dtype=torch.long)
  return {"image": images, "caption_tokens": tokens, "noitpac_tokens": tokens.flip(1), "caption_lengths": lengths}


def benchmark(
  virtex_src: str,
  config_file: str = DEFAULT_CONFIG,
  batch_size: int = 256,
  steps: int = 20,
  windows: int = 3,
  turns: device_turns.Turns | None = None,
) -> dict:
  Config, factories = import_official(virtex_src)
  path = config_file if os.path.isabs(config_file) else os.path.join(virtex_src, config_file)
  _C = Config(path, [])
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  amp = _C.AMP and device.type == "cuda"
  # As the official script's common_setup does.
  torch.manual_seed(_C.RANDOM_SEED)
  torch.backends.cudnn.deterministic = _C.CUDNN_DETERMINISTIC
  torch.backends.cudnn.benchmark = _C.CUDNN_BENCHMARK
  model = factories.PretrainingModelFactory.from_config(_C).to(device)
  model.train()
  optimizer = factories.OptimizerFactory.from_config(_C, model.named_parameters())
  scheduler = factories.LRSchedulerFactory.from_config(_C, optimizer)
  scaler = torch.amp.GradScaler("cuda", enabled=amp)
  batch = synthetic_batch(
    batch_size,
    _C.DATA.IMAGE_CROP_SIZE,
    _C.DATA.MAX_CAPTION_LENGTH,
    _C.DATA.VOCAB_SIZE,
    _C.DATA.SOS_INDEX,
    _C.DATA.EOS_INDEX,
    device,
  )

  def step():  # scripts/pretrain_virtex.py's loop body
    optimizer.zero_grad()
    with torch.autocast(device.type, enabled=amp):
      loss = model(batch)["loss"]
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), _C.OPTIM.CLIP_GRAD_NORM)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return loss.detach()

  def run(n):
    for _ in range(n):
      loss = step()
    if device.type == "cuda":
      torch.cuda.synchronize()
    return loss

  warmup_s, seconds, turn, loss = time_windows(run, steps, windows, turns)
  step_s = statistics.median(seconds)
  commit = os.path.join(virtex_src, "COMMIT")
  return {
    "framework": f"torch {torch.__version__}",
    "code": "kdexd/virtex" + (f" @ {open(commit).read().strip()}" if os.path.exists(commit) else ""),
    "config_file": config_file,
    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    "batch_size": batch_size,
    "amp": amp,
    "cudnn_benchmark": _C.CUDNN_BENCHMARK,
    "textual": _C.MODEL.TEXTUAL.NAME,
    "param_groups": len(optimizer.param_groups),
    "step_seconds": step_s,
    "window_step_seconds": seconds,
    "images_per_second": batch_size / step_s,
    "images_per_second_min": batch_size / max(seconds),
    "images_per_second_max": batch_size / min(seconds),
    "warmup_seconds": warmup_s,
    "turn": turn,
    "final_loss": float(loss),
    "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--virtex_src", required=True, help="a checkout of kdexd/virtex")
  p.add_argument("--config_file", default=DEFAULT_CONFIG, help="its config, relative to --virtex_src or absolute")
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--steps", type=int, default=20, help="steps per timed window")
  p.add_argument("--windows", type=int, default=3)
  p.add_argument("--output", default=None, help="optional JSON file for the results")
  p.add_argument("--turn_dir", default="", help="share the device with other benchmarks (vlrep.bench.device_turns)")
  p.add_argument("--turn_parties", type=int, default=1, help="processes sharing --turn_dir")
  p.add_argument("--turn_deadline", type=float, default=0.0, help="Unix time after which the ready ones go on")
  a = p.parse_args(argv)
  turns = device_turns.join(a.turn_dir, a.turn_parties, a.turn_deadline or time.time() + 3600, optional=True)
  result = benchmark(a.virtex_src, a.config_file, a.batch_size, a.steps, a.windows, turns)
  print(json.dumps(result, indent=2), flush=True)
  if a.output:
    with open(a.output, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
