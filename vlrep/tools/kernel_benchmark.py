"""Times the `backbone.pallas_conv1x1` kernels against XLA's plain path, one ResNet-50 1x1 convolution at a time,
for several tile settings: which shapes the kernels win and which tiles to make the defaults.

  python -m vlrep.tools.kernel_benchmark --batch=256 --output=/tmp/kernels.json      # on a GPU
  python -m vlrep.tools.kernel_benchmark --shapes=tiny --batch=8 --group=8 --windows=1   # on CPU: interpreted, a check

Each case is one 1x1 convolution of a ResNet-50 bottleneck at 224x224 input in bf16 with BatchNorm groups of
`--group` images: its forward, its output's per-group sums (a BatchNorm's statistics) and, for conv3, the previous
BatchNorm's apply + ReLU on its input, then the backward of all of it (what one training step runs for it). The
plain path is what the backbone runs with the switch off: XLA's convolution with the elementwise and reduction
passes around it. Times are the median of `--windows` windows of `--iters` calls (the fastest and slowest beside
it), every variant of a case timed round-robin, as `vlrep.tools.benchmark` does for whole steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from vlrep.models import pallas_conv
from vlrep.tools import device_turns

# (name, positions per side, input channels, output channels, BatchNorm + ReLU prologue): ResNet-50's 1x1
# convolutions at 224x224 (each stage's first block reads the previous stage's width; strides apply before).
RESNET50_CASES = (
  ("layer1 conv1", 56, 256, 64, False),
  ("layer1 conv3", 56, 64, 256, True),
  ("layer2 conv1", 28, 512, 128, False),
  ("layer2 conv3", 28, 128, 512, True),
  ("layer3 conv1", 14, 1024, 256, False),
  ("layer3 conv3", 14, 256, 1024, True),
  ("layer4 conv1", 7, 2048, 512, False),
  ("layer4 conv3", 7, 512, 2048, True),
)
TINY_CASES = (("tiny conv1", 4, 32, 16, False), ("tiny conv3", 4, 16, 32, True))
# Tile settings tried (bm, bk, bn, num_warps, num_stages): the default first. bm is capped by the rows of one
# BatchNorm group (choose_tiles), so stage 4 (49 positions x 32 images) runs 32-row tiles whatever is asked.
TILE_SETTINGS = (
  pallas_conv.Tiles(),
  pallas_conv.Tiles(bm=128, bk=32, bn=128, num_warps=4, num_stages=4),
  pallas_conv.Tiles(bm=64, bk=64, bn=128, num_warps=4, num_stages=3),
  pallas_conv.Tiles(bm=128, bk=64, bn=64, num_warps=4, num_stages=3),
  pallas_conv.Tiles(bm=128, bk=64, bn=256, num_warps=8, num_stages=3),
  pallas_conv.Tiles(bm=64, bk=32, bn=64, num_warps=4, num_stages=3),
)


def _define_flags() -> None:
  flags.DEFINE_enum("shapes", "resnet50", ["resnet50", "tiny"], "ResNet-50's 1x1 convolutions, or two tiny ones.")
  flags.DEFINE_integer("batch", 256, "Images per step.")
  flags.DEFINE_integer("group", 32, "Images per BatchNorm group (0: the whole batch).")
  flags.DEFINE_integer("iters", 20, "Calls per timed window.")
  flags.DEFINE_integer("windows", 3, "Timed windows; the median is reported.")
  flags.DEFINE_string("output", "", "Write the results as JSON here.")
  flags.DEFINE_string("turn_dir", "", "Share the device with other benchmarks (vlrep.tools.device_turns).")
  flags.DEFINE_integer("turn_parties", 1, "Processes sharing --turn_dir.")
  flags.DEFINE_float("turn_deadline", 0.0, "Unix time at which optional parties still compiling are killed.")
  flags.DEFINE_bool("turn_optional", False, "This process may be killed if still compiling at --turn_deadline.")


FLAGS = flags.FLAGS


def case_inputs(batch: int, hw: int, cin: int, cout: int, group: int, seed: int = 0):
  """bf16 input rows, kernel, per-group prologue scale/shift and the cotangents a loss would send back."""
  rng = np.random.default_rng(seed)
  rows = batch * hw * hw
  groups = batch // group if group else 1
  return dict(
    x=jnp.asarray(rng.normal(size=(rows, cin)), jnp.bfloat16),
    w=jnp.asarray(rng.normal(size=(cin, cout)) / np.sqrt(cin), jnp.bfloat16),
    s=jnp.asarray(1 + 0.1 * rng.normal(size=(groups, cin)), jnp.float32),
    t=jnp.asarray(0.1 * rng.normal(size=(groups, cin)), jnp.float32),
    dy=jnp.asarray(rng.normal(size=(rows, cout)), jnp.bfloat16),
  )


def plain_step(hw: int, rows_per_group: int, prologue: bool):
  """The switch-off path: (BatchNorm-apply + ReLU), XLA's 1x1 convolution, the per-group sums, and the backward."""

  def forward(x, w, s, t):
    rows, cin = x.shape
    groups = rows // rows_per_group
    if prologue:
      x = jnp.maximum(x.astype(jnp.float32).reshape(groups, rows_per_group, cin) * s[:, None] + t[:, None], 0)
      x = x.reshape(rows, cin).astype(w.dtype)
    images = x.reshape(-1, hw, hw, cin)
    y = jax.lax.conv_general_dilated(images, w[None, None], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = y.reshape(rows, -1)
    yf = y.astype(jnp.float32).reshape(groups, rows_per_group, -1)
    return y, yf.sum(1), (yf * yf).sum(1)

  return forward


def kernel_step(rows_per_group: int, prologue: bool, tiles: pallas_conv.Tiles):
  def forward(x, w, s, t):
    return pallas_conv.conv1x1_bn_stats(x, w, rows_per_group, (s, t) if prologue else None, tiles)

  return forward


def training_call(forward):
  """forward + backward of one convolution, as in a step: the cotangents of y and of both sums sent back."""

  def call(x, w, s, t, dy):
    (y, group_sum, group_sumsq), vjp = jax.vjp(forward, x, w, s, t)
    grads = vjp((dy, jnp.ones_like(group_sum) * 1e-3, jnp.ones_like(group_sumsq) * 1e-6))
    return y, grads

  return jax.jit(call)


def build_case(name, hw, cin, cout, prologue, batch, group) -> dict:
  """One case's inputs and its variants compiled and checked against the plain path (nothing timed)."""
  inputs = case_inputs(batch, hw, cin, cout, group)
  rows = inputs["x"].shape[0]
  rows_per_group = (group or batch) * hw * hw
  args = (inputs["x"], inputs["w"], inputs["s"], inputs["t"], inputs["dy"])
  interpret = jax.default_backend() == "cpu"
  variants, errors, reference = {"xla": training_call(plain_step(hw, rows_per_group, prologue))}, {}, None
  for cap in TILE_SETTINGS:
    try:
      tiles = pallas_conv.choose_tiles(rows, cin, cout, rows_per_group, cap, min_block=1 if interpret else 16)
    except ValueError as e:
      errors[str(cap)] = str(e)
      continue
    label = f"pallas bm{tiles.bm} bk{tiles.bk} bn{tiles.bn} w{tiles.num_warps} s{tiles.num_stages}"
    if label not in variants:
      variants[label] = training_call(kernel_step(rows_per_group, prologue, tiles))
  compiled = {}  # label -> (function, largest difference from the plain path relative to its largest value)
  for label, fn in variants.items():
    try:
      out = jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 - a tile setting Triton refuses is reported, the others still run
      errors[label] = f"{type(e).__name__}: {e}"[:1000]
      continue
    if label == "xla":
      reference = out
    relative = jax.tree.map(
      lambda a, b: (
        float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
        / (float(jnp.abs(b.astype(jnp.float32)).max()) + 1e-12)
      ),
      out,
      reference,
    )
    compiled[label] = (fn, max(jax.tree.leaves(relative)))
  return {"name": name, "args": args, "rows": rows, "cin": cin, "cout": cout, "prologue": prologue,
          "compiled": compiled, "errors": errors}


def time_case(built: dict, iters: int, windows: int) -> dict:
  """A built case's variants timed round-robin: `windows` windows of `iters` calls each."""
  compiled, args, errors = built["compiled"], built["args"], built["errors"]
  seconds = {label: [] for label in compiled}
  for _ in range(windows):
    for label, (fn, _) in compiled.items():
      t0 = time.perf_counter()
      for _ in range(iters):
        out = fn(*args)
      jax.block_until_ready(out)
      seconds[label].append((time.perf_counter() - t0) / iters)
  result = {"case": built["name"], **{k: built[k] for k in ("rows", "cin", "cout", "prologue")}, "variants": {}}
  xla_ms = 1e3 * statistics.median(seconds["xla"]) if "xla" in seconds else None
  for label, s in seconds.items():
    ms = 1e3 * statistics.median(s)
    result["variants"][label] = {
      "ms": ms,
      "ms_min": 1e3 * min(s),
      "ms_max": 1e3 * max(s),
      "speedup_vs_xla": xla_ms / ms if xla_ms else None,
      "max_relative_difference_vs_xla": compiled[label][1],
    }
  if errors:
    result["errors"] = errors
  return result


def markdown(results: list[dict]) -> str:
  lines = [
    "| case | rows x cin -> cout | XLA ms | best kernel | its ms | speed-up |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for r in results:
    xla = r["variants"].get("xla", {}).get("ms")
    kernels = {k: v for k, v in r["variants"].items() if k != "xla"}
    best = min(kernels, key=lambda k: kernels[k]["ms"]) if kernels else None
    lines.append(
      f"| {r['case']}{' (prologue)' if r['prologue'] else ''} | {r['rows']} x {r['cin']} -> {r['cout']} | "
      + (f"{xla:.3f}" if xla else "-")
      + (
        f" | {best} | {kernels[best]['ms']:.3f} | {xla / kernels[best]['ms']:.2f}x |"
        if best and xla
        else " | - | - | - |"
      )
    )
  return "\n".join(lines)


def main(argv):
  del argv
  if FLAGS.batch < 1 or FLAGS.group < 0 or (FLAGS.group and FLAGS.batch % FLAGS.group):
    raise app.UsageError(f"--batch={FLAGS.batch} must be a positive multiple of --group={FLAGS.group} (0: one group).")
  if FLAGS.shapes == "resnet50" and jax.devices()[0].platform != "gpu":
    # Interpreted on a CPU, ResNet-50's shapes take hours and time nothing the kernels would do on a GPU.
    raise app.UsageError(
      f"--shapes=resnet50 times the Triton kernels and needs a GPU (this process sees {jax.devices()[0].platform}); "
      "on a CPU check them with --shapes=tiny --batch=8 --group=8 --windows=1."
    )
  cases = RESNET50_CASES if FLAGS.shapes == "resnet50" else TINY_CASES
  turns = device_turns.join(FLAGS.turn_dir, FLAGS.turn_parties, FLAGS.turn_deadline or time.time() + 3600, FLAGS.turn_optional)
  built = [build_case(*case, FLAGS.batch, FLAGS.group) for case in cases]
  with device_turns.turn(turns):  # with other benchmarks: every case compiled first, then timed alone
    results = [time_case(b, FLAGS.iters, FLAGS.windows) for b in built]
  device = jax.devices()[0]
  out = {
    "device": device.device_kind,
    "platform": device.platform,
    "jax": jax.__version__,
    "batch": FLAGS.batch,
    "group": FLAGS.group,
    "tile_settings": [dataclasses.asdict(t) for t in TILE_SETTINGS],
    "cases": results,
  }
  print(json.dumps(out, indent=2))
  print(markdown(results))
  if FLAGS.output:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
    with open(FLAGS.output, "w") as f:
      json.dump(out, f, indent=2)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
