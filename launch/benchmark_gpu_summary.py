"""One table of what launch/benchmark_gpu.sh measured: `python3 launch/benchmark_gpu_summary.py OUT_DIR`.

Per process: the plain step's images/s (median window, slowest-fastest), MFU, the time to build and compile
everything and the wait for the device's turn; per variant its ratio to the plain step; the PyTorch references.
Failed variants and killed processes with their errors."""

import glob
import json
import os
import sys


def fmt_rate(r):
  return f"{r['images_per_second']:7.0f} ({r['images_per_second_min']:.0f}-{r['images_per_second_max']:.0f})"


def official_file(name, d):
  print(f"\n## {name}: {d['code']} {d['config_file']} on {d['device']} ({d['framework']}, AMP {d['amp']})")
  print(f"official step {fmt_rate(d)} img/s  loss {d['final_loss']:.3f}  warm-up {d['warmup_seconds']:.0f} s")


def step_file(name, d):
  mfu = f"{100 * d['mfu']:.1f}%" if d.get("mfu") else "-"
  turn = d.get("turn", {})
  print(f"\n## {name}: {d['device']} jax {d.get('jax')} {d.get('xla_flags', '')}")
  print(
    f"baseline {fmt_rate(d)} img/s  MFU {mfu}  {d['model_tflops_per_step']:.2f} TFLOP/step  "
    f"loss {d['final_loss']:.3f}  build {d.get('build_seconds', 0):.0f} s  "
    f"turn wait {turn.get('waited_s', 0):.0f} s (ready {turn.get('ready')}, killed {turn.get('killed')})"
  )
  for v, r in sorted(d.get("variants", {}).items(), key=lambda kv: -kv[1].get("speedup_vs_baseline", 0)):
    if "error" in r:
      print(f"  {v:22s} ERROR {r['error'][:300]}")
    else:
      mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
      print(f"  {v:22s} {fmt_rate(r)}  x{r['speedup_vs_baseline']:.3f}  MFU {mfu}  loss {r['final_loss']:.3f}")
  for mode, r in d.get("torch_reference", {}).items():
    if "error" in r:
      print(f"  torch {mode:16s} ERROR {r['error']}")
    else:
      print(
        f"  torch {mode:16s} {fmt_rate(r)}  warm-up {r['warmup_seconds']:.0f} s  "
        f"vlrep/torch x{d['speedup_vs_torch'][mode]:.3f}"
      )


def main(out):
  for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(path)[:-5]
    with open(path) as f:
      d = json.load(f)
    (official_file if "code" in d else step_file)(name, d)
  expected = {"virtex", "official_virtex", "loctex", "mct", "xla_conv_fusion"}
  missing = sorted(expected - {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(out, "*.json"))})
  if missing:
    print(f"\nno results (not run, failed or killed; see log.txt): {', '.join(missing)}")


if __name__ == "__main__":
  main(sys.argv[1])
