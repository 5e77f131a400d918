"""Input pipeline speed: images/s per CPU core for decode + augment, vlrep's tf.data beside a PyTorch
DataLoader + PIL baseline doing the same work, in one run.

  python -m vlrep.bench.pipeline_benchmark                     # 1 core and all cores; takes minutes
  python -m vlrep.bench.pipeline_benchmark --cores=1,2 --seconds=15 --output=/tmp/pipeline.json

The work per image, as VirTex's training recipe: decode a COCO-sized JPEG (640x480, quality 90), random
resized crop (area 0.2-1, aspect 3/4-4/3) to 224x224 with antialiased bilinear resizing, random horizontal
flip, ImageNet normalisation to float32, batches of 64.
- `tfdata`: `vlrep.data.pipeline.stream_dataset` with the ops `decode|inception_crop(224, area=(0.2, 1.0))
  |flip_lr_swap_words|normalize`, as training runs them.
- `tfdata_disk`: the same with the JPEGs read by index from an ArrayRecord file (training's default storage).
- `tfdata_cache`: the same from the in-memory cache of decoded images (`data.cache_image_size=256`).
- `torch`: a `torch.utils.data.DataLoader` over a Dataset that decodes with PIL, crops like torchvision's
  RandomResizedCrop (written out: torchvision is not required), flips, and normalises with numpy.
Each measurement runs in its own process pinned to N cores (`os.sched_setaffinity`; DataLoader workers inherit
it), with N worker threads (tf.data) or N worker processes (PyTorch), so "per core" is comparable.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from vlrep.data import pipeline, records, registry

BATCH = 64
CROP = 224


def make_jpegs(count: int, seed: int = 0, size: tuple[int, int] = (640, 480)) -> list[bytes]:
  """COCO-sized photos stand-ins: smooth colour fields with shapes and noise (so JPEG sizes are realistic)."""
  from PIL import Image, ImageDraw

  rng = np.random.default_rng(seed)
  w, h = size
  yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
  out = []
  for _ in range(count):
    base = np.stack([np.sin(xx * rng.uniform(2, 9) + rng.uniform(0, 6)) for _ in range(3)], -1)
    img = ((base * 0.5 + 0.5) * 200 + rng.normal(0, 12, (h, w, 3))).clip(0, 255).astype(np.uint8)
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    for _ in range(12):
      x0, y0 = rng.integers(0, w - 40), rng.integers(0, h - 40)
      box = [x0, y0, x0 + rng.integers(20, 200), y0 + rng.integers(20, 200)]
      draw.ellipse(box, fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    buf = io.BytesIO()
    pil.save(buf, "JPEG", quality=90)
    out.append(buf.getvalue())
  return out


# --------------------------------------------------------------------------------------------------------
# The two implementations, each returning an iterator of batches.
# --------------------------------------------------------------------------------------------------------
def tfdata_batches(jpegs: list[bytes], threads: int, cache: bool, disk: str | None = None):
  import tensorflow as tf

  example_fn = registry.parse(f"decode|inception_crop({CROP}, area=(0.2, 1.0))|flip_lr_swap_words|normalize").example_fn
  if cache:
    lookup = pipeline._cached_lookup_fn(pipeline.decoded_image_cache(jpegs, lambda r: {"image": r}, 256))
  elif disk:  # the JPEGs as records of an ArrayRecord file, read by index as training reads its records
    write_array_record(disk, jpegs)
    _, lookup = records.SplitReader([disk], "benchmark").host_lookup()
  else:
    table = tf.Variable(np.array(jpegs, dtype=object), trainable=False)
    lookup = lambda i: tf.gather(table, i)
  if cache:  # the cached pixels by index; the records themselves are not needed
    read, make = (lambda index: tf.zeros_like(index, tf.string)), (lambda index, _: {"image": lookup(index)})
  else:
    read, make = lookup, (lambda _, record: {"image": record})
  ds = pipeline.stream_dataset(
    len(jpegs), read, make, lambda ex: {"image": example_fn(ex)["image"]}, BATCH, 0, threads=threads
  )
  return ds.as_numpy_iterator()


def write_array_record(path: str, items: list[bytes]) -> None:
  from array_record.python import array_record_module

  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")  # TFDS's choice: random access per record
  for item in items:
    writer.write(item)
  writer.close()


class _PilDataset:
  """Decode + RandomResizedCrop + flip + normalise with PIL and numpy (torchvision's algorithm, written out)."""

  def __init__(self, jpegs):
    self.jpegs = jpegs
    self.mean = np.array([0.485, 0.456, 0.406], np.float32) * 255
    self.inv_std = 1 / (np.array([0.229, 0.224, 0.225], np.float32) * 255)

  def __len__(self):
    return 10**9  # an endless stream, as training's

  def _crop_box(self, w, h, rng):
    for _ in range(10):
      area = w * h * rng.uniform(0.2, 1.0)
      aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
      cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
      if 0 < cw <= w and 0 < ch <= h:
        x0, y0 = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
        return (x0, y0, x0 + cw, y0 + ch)
    side = min(w, h)
    return ((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2)

  def __getitem__(self, index):
    import torch
    from PIL import Image

    rng = np.random.default_rng(index)
    img = Image.open(io.BytesIO(self.jpegs[index % len(self.jpegs)])).convert("RGB")
    img = img.resize((CROP, CROP), Image.BILINEAR, box=self._crop_box(*img.size, rng))
    if rng.random() < 0.5:
      img = img.transpose(Image.FLIP_LEFT_RIGHT)
    x = (np.asarray(img, np.float32) - self.mean) * self.inv_std
    return torch.from_numpy(x.transpose(2, 0, 1).copy())


def torch_batches(jpegs: list[bytes], workers: int):
  import torch

  loader = torch.utils.data.DataLoader(
    _PilDataset(jpegs), batch_size=BATCH, num_workers=workers, persistent_workers=True, prefetch_factor=2
  )
  return iter(loader)


# --------------------------------------------------------------------------------------------------------
# One measurement (in a pinned child process), and the driver.
# --------------------------------------------------------------------------------------------------------
def measure(kind: str, cores: int, seconds: float, num_images: int) -> dict:
  os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
  jpegs = make_jpegs(num_images)
  t0 = time.time()
  if kind == "torch":
    batches = torch_batches(jpegs, cores)
  elif kind == "tfdata_disk":
    with tempfile.TemporaryDirectory() as tmp:
      batches = tfdata_batches(jpegs, cores, cache=False, disk=os.path.join(tmp, "images.array_record"))
      return _time(batches, kind, cores, seconds, t0)
  else:
    batches = tfdata_batches(jpegs, cores, cache=kind == "tfdata_cache")
  return _time(batches, kind, cores, seconds, t0)


def _time(batches, kind: str, cores: int, seconds: float, t0: float) -> dict:
  for _ in range(3):  # warm-up: worker start, graph tracing, (cache) decoding everything once
    next(batches)
  setup_s = time.time() - t0
  t0, n = time.time(), 0
  while time.time() - t0 < seconds:
    b = next(batches)
    n += len(b["image"] if isinstance(b, dict) else b)
  rate = n / (time.time() - t0)
  return {"kind": kind, "cores": cores, "images_per_second": rate, "per_core": rate / cores, "setup_s": setup_s}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cores", default=None, help="comma-separated core counts (default: 1 and all)")
  p.add_argument("--kinds", default="tfdata,tfdata_disk,tfdata_cache,torch")
  p.add_argument("--seconds", type=float, default=15.0, help="timed seconds per measurement")
  p.add_argument("--num_images", type=int, default=256, help="distinct JPEGs in memory (cycled)")
  p.add_argument("--output", default=None)
  p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a._child:
    kind, cores = a._child.split(":")
    print(json.dumps(measure(kind, int(cores), a.seconds, a.num_images)), flush=True)
    return
  available = len(os.sched_getaffinity(0))
  cores = [int(c) for c in a.cores.split(",")] if a.cores else sorted({1, available})
  if max(cores) > available:
    raise SystemExit(f"--cores asks for {max(cores)} cores; this process may use {available}.")
  rows = []
  for c in cores:
    for kind in a.kinds.split(","):
      cmd = [sys.executable, "-m", "vlrep.bench.pipeline_benchmark", f"--_child={kind}:{c}"]
      cmd += [f"--seconds={a.seconds}", f"--num_images={a.num_images}"]
      env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
      out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
      rows.append(json.loads(out.strip().splitlines()[-1]))
      r = rows[-1]
      rate, per_core = r["images_per_second"], r["per_core"]
      print(f"{kind:>13} {c} core(s): {rate:7.1f} images/s, {per_core:6.1f} per core", flush=True)
  by = {(r["kind"], r["cores"]): r["images_per_second"] for r in rows}
  ratios = {
    f"{kind}_vs_torch_{c}cores": by[(kind, c)] / by[("torch", c)]
    for c in cores
    for kind in ("tfdata", "tfdata_disk", "tfdata_cache")
    if (kind, c) in by and ("torch", c) in by
  }
  for k, v in ratios.items():
    print(f"{k}: {v:.2f}x")
  result = {"cpu": _cpu_name(), "rows": rows, "ratios": ratios, "seconds": a.seconds}
  if a.output:
    with open(a.output, "w") as f:
      json.dump(result, f, indent=2)


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return "unknown"


if __name__ == "__main__":
  main()
