"""What the step's levers for batches larger than the device cost: per-device memory of the compiled train step,
with the batch taken in microbatches (`config.microbatches`) and each rematerialisation policy (`config.remat`),
and the step's time on this machine.

  python -m vlrep.bench.memory --methods=virtex@1,virtex,clip,loctex --microbatches=1,2,4,8 \\
      --remat=none,dots,full --devices=8 --out=/tmp/memory.json
  python -m vlrep.bench.memory --time --methods=clip --settings=1:none,2:none,4:none,1:dots,1:full,4:full \\
      --steps=2 --windows=7 --out=/tmp/step_time_clip.json

Memory: the loop's own step (`vlrep.train_step.make_train_step`, jitted with the loop's shardings and the donated
state) is lowered on abstract inputs (`jax.ShapeDtypeStruct`s carrying their shardings; the state from
`jax.eval_shape`) and compiled; nothing runs, so no memory is taken and any batch compiles on a CPU.
`compiled.memory_analysis()` gives, per device, the arguments (the state's shard and the batch's), the outputs
(the new state, aliased to the donated arguments, and the metrics) and the temporaries (activations, gradients,
the optimizer's work); `compiled.cost_analysis()['flops']` the FLOPs of a device's program, whose ratio to the
one-shot step's is each lever's compute cost. `--devices=N` simulates N devices on the CPU
(`--xla_force_host_platform_device_count`, set here before JAX starts its backends) so that each device's program
is the one an N-device run compiles; `NAME@N` gives one method its own device count. A setting the loop would
refuse (`train_step.step_errors`: a microbatch splitting BatchNorm groups, a batch not dividing) is listed as
refused, not measured. XLA's CPU pipeline would merge a rematerialised block's recomputation with its forward pass
(`KEEP_REMAT`): the command keeps jax.checkpoint's barriers, as accelerators' pipelines do.

Methods are NAME (configs/NAME.py, at its recipe: batch, backbone, image size) or a config file's path, with
`:ARG` for the config's argument (`clip:loss=sigmoid`, `tests/tiny_clip.py`) and `@N` for its device count.

Time (`--time`): each method's config at `--time_arg` (default runlocal) and `--time_batch_size`, on one device,
every microbatch x remat setting compiled in one process and timed side by side (`vlrep.bench.benchmark`: windows
of `--steps` steps round-robin over the settings); each setting's median window, its spread and its ratio to the
one-shot step. CPU times say little in absolute terms; their ratios are what this measures.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import app, flags
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public API removes a jaxpr's dead code
from jax.sharding import NamedSharding

from vlrep import config_utils, methods, optim, sharding, train_step
from vlrep.bench import benchmark

GIB = 2**30
# Simulated CPU devices: set in XLA_FLAGS before JAX starts its backends (`cpu_flags`).
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# XLA's CPU pipeline expands the optimization barriers that keep a rematerialised block's recomputation apart
# (jax.checkpoint's prevent_cse) before its common-subexpression pass, which then merges the recomputation with the
# forward pass: the backward pass reads the forward's values again, so remat changes neither memory nor time there
# (a 16-layer MLP's gradient: 512 MiB of temporaries under every policy; 272 MiB under 'full' with this flag).
# Keeping the barriers compiles what an accelerator's pipeline keeps; steps without remat have no barriers to keep.
KEEP_REMAT = "--xla_disable_hlo_passes=cse_barrier_expander"
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def _define_flags() -> None:
  """Defined when run as a program only, so importing this module (tests, other tools) defines no flags."""
  flags.DEFINE_list("methods", ["virtex@1", "virtex", "clip", "loctex"], "NAME[:ARG][@DEVICES] or PATH.py[:ARG][@N].")
  flags.DEFINE_list("microbatches", ["1", "2", "4", "8"], "Microbatch counts (config.microbatches).")
  flags.DEFINE_list("remat", ["none", "dots", "full"], "Rematerialisation policies (config.remat).")
  flags.DEFINE_list("settings", [], "N:POLICY pairs (microbatches:remat) instead of the grid of the two flags above.")
  flags.DEFINE_integer("devices", 8, "Devices simulated on the CPU (a method's @N overrides).")
  flags.DEFINE_string("platform", "cpu", "Whose devices compile the step (the CPU's can be simulated).")
  flags.DEFINE_integer("image_size", 0, "Image side (default: the config's inception_crop, else 224).")
  flags.DEFINE_integer("num_tags", 80, "Tag vocabulary size for methods with tags (MCT).")
  flags.DEFINE_string("out", None, "JSON file for the results.")
  flags.DEFINE_bool("resume", False, "Keep the rows --out already holds; measure only the settings it lacks.")
  flags.DEFINE_bool("time", False, "Time the settings on one device instead (see the module docstring).")
  flags.DEFINE_string("time_arg", "runlocal", "--time: the configs' argument (their CPU-sized variant).")
  flags.DEFINE_integer("time_batch_size", 128, "--time: global batch (128: 4 microbatches of 32, runlocal's BN group).")
  flags.DEFINE_integer("time_image_size", 64, "--time: image side (runlocal's synthetic scenes are 64 px).")
  flags.DEFINE_integer("steps", 3, "--time: steps per timed window.")
  flags.DEFINE_integer("windows", 5, "--time: timed windows per setting (round-robin over the settings).")


FLAGS = flags.FLAGS


def parse_method(spec: str, default_devices: int) -> tuple[str, str, str | None, int]:
  """'NAME[:ARG][@N]' -> (label, config file, ARG or None, devices)."""
  m = re.fullmatch(r"([^:@]+)(?::([^@]*))?(?:@(\d+))?", spec.strip())
  if not m:
    raise ValueError(f"--methods entry {spec!r}: NAME[:ARG][@DEVICES] or PATH.py[:ARG][@DEVICES].")
  name, arg, devices = m.group(1), m.group(2), int(m.group(3) or default_devices)
  path = name if name.endswith(".py") else os.path.join(CONFIGS, f"{name}.py")
  if not os.path.exists(path):
    raise ValueError(f"--methods entry {spec!r}: no config file {path}.")
  label = os.path.splitext(os.path.basename(name))[0] + (f":{arg}" if arg else "")
  return label, path, arg or None, devices


def load_config(path: str, arg: str | None, **overrides) -> ml_collections.ConfigDict:
  config = config_utils.config_module(path, os.path.basename(path)).get_config(arg)
  for key, value in overrides.items():
    config[key] = value
  return config


def vocab_size_of(config) -> int:
  return int(config.tokenizer.vocab_size) if config.get("tokenizer") else 0


def max_len_of(config) -> int:
  return int(config.method.get("max_len") or config.method.text.max_len)


def _bytes_per_device(tree, shardings) -> int:
  """Bytes of one device's shards of `tree` (abstract arrays) under `shardings` (the first device's share)."""
  total = 0
  leaves = jax.tree.leaves(shardings, is_leaf=lambda v: isinstance(v, NamedSharding))
  for x, s in zip(jax.tree.leaves(tree), leaves, strict=True):
    total += int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
  return total


def compile_step(config, devices: int, platform: str = "cpu", image_size: int = 0, num_tags: int = 80):
  """(compiled step, {'state_bytes', 'batch_bytes'} per device): the loop's step for `config` on the first
  `devices` devices of `platform`, compiled on abstract inputs."""
  available = jax.devices(platform)
  if len(available) < devices:
    raise ValueError(
      f"{devices} devices asked, {len(available)} {platform} devices exist (on a CPU: --devices, or XLA_FLAGS="
      f"{_DEVICE_FLAG}=N before JAX starts)."
    )
  mesh = jax.make_mesh(
    (devices,), (sharding.DATA,), axis_types=(jax.sharding.AxisType.Auto,), devices=available[:devices]
  )
  vocab_size = vocab_size_of(config)
  method = methods.build(methods.method_config(config), vocab_size)
  image_size = image_size or benchmark.config_image_size(config)
  shapes = benchmark.batch_shapes(method, config.batch_size, image_size, vocab_size, max_len_of(config), num_tags)
  batch_sh = sharding.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sh) for k, (shape, dtype) in shapes.items()}
  key = jax.random.PRNGKey(0)
  tx, schedules = optim.build(config.optim, jax.eval_shape(method.init, key, batch)["params"], 1000, 10)
  init = functools.partial(train_step.init_train_state, method, tx)
  abstract = jax.eval_shape(init, key, batch)
  state_sh = sharding.state_shardings(mesh, abstract, config.sharding.params, rules=config.sharding.get("rules", ()))
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)
  step = train_step.make_train_step(
    method, tx, schedules, key, optim.frozen_rules(config.optim), config.get("microbatches", 1), batch_sh
  )
  jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=(0,))
  compiled = jitted.lower(state, batch).compile()
  parts = {
    "model_flops": step_flops(step, state, batch) / devices,
    "state_bytes": _bytes_per_device(abstract, state_sh),
    "params_bytes": _bytes_per_device(abstract["params"], state_sh["params"]),
    "batch_bytes": _bytes_per_device(batch, {k: batch_sh for k in batch}),
  }
  return compiled, parts


def step_flops(step, state, batch) -> float:
  """Model FLOPs of one step (matrix products and convolutions, `benchmark.jaxpr_flops`; a scan's body times its
  length) of the step's jaxpr with its dead code removed, as XLA removes it (the gradient cache's first forward
  pass where `combine` is linear in the outputs). XLA's own `cost_analysis` counts a while loop's body once, so it
  misses all but one microbatch."""
  closed = jax.make_jaxpr(step)(state, batch)
  jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  return benchmark.jaxpr_flops(jaxpr)


def measure(config, devices: int, platform: str = "cpu", image_size: int = 0, num_tags: int = 80) -> dict:
  """Per-device bytes of the compiled step (argument, output, alias, temp; `temp_plus_argument`, the figure the
  table compares, and `peak`, argument + output - alias + temp) and its FLOPs; {'refused': why} for a setting
  the loop refuses."""
  errors = train_step.step_errors(config, devices)
  if errors:
    return {"refused": " ".join(errors)}
  t0 = time.time()
  try:
    compiled, parts = compile_step(config, devices, platform, image_size, num_tags)
  except Exception as e:  # noqa: BLE001 - a method not yet split for microbatches is reported in its row
    return {"error": f"{type(e).__name__}: {e}"[:500]}
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out = {
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "xla_flops": float(cost.get("flops", 0.0)) if cost else 0.0,
    "compile_seconds": time.time() - t0,
    **parts,
  }
  out["temp_plus_argument"] = out["temp_bytes"] + out["argument_bytes"]
  out["peak"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
  return out


def memory_table(label, path, arg, devices, settings, platform="cpu", image_size=0, num_tags=80, done=()) -> list[dict]:
  """Rows of one method: each (microbatches, remat) setting at the config's own batch, with ratios to the one-shot
  step (microbatches=1, remat='none'; `with_ratios`). `done`: rows measured before (a resumed run), kept instead
  of measured again."""
  rows = []
  for n, remat in settings:
    before = [r for r in done if _key(r) == (label, devices, n, remat)]
    if before:
      rows.append(before[0])
      continue
    config = load_config(path, arg, microbatches=n, remat=remat)
    row = {"method": label, "devices": devices, "batch_size": int(config.batch_size), "microbatches": n}
    row["remat"] = remat
    row["per_device_microbatch"] = config.batch_size / (devices * n)
    row.update(measure(config, devices, platform, image_size, num_tags))
    rows.append(row)
    print(f"{label}@{devices} microbatches={n} remat={remat}: {_summary(row)}", file=sys.stderr, flush=True)
  return with_ratios(rows)


def _key(row: dict) -> tuple:
  return row["method"], row["devices"], row["microbatches"], row["remat"]


def with_ratios(rows: list[dict]) -> list[dict]:
  """`rows` with each measured row's `vs_one_shot` (temp + argument) and `flops_vs_one_shot` (model FLOPs) against
  its method's one-shot row at the same device count."""
  base = {
    (r["method"], r["devices"]): r
    for r in rows
    if r["microbatches"] == 1 and r["remat"] == "none" and "temp_bytes" in r
  }
  for r in rows:
    b = base.get((r["method"], r["devices"]))
    if b and "temp_bytes" in r:
      r["vs_one_shot"] = r["temp_plus_argument"] / b["temp_plus_argument"]
      r["flops_vs_one_shot"] = r["model_flops"] / b["model_flops"] if b["model_flops"] else None
  return rows


def _summary(row: dict) -> str:
  if "temp_bytes" not in row:
    return row.get("refused") or row.get("error")
  return (
    f"temp {row['temp_bytes'] / GIB:.2f} GiB + argument {row['argument_bytes'] / GIB:.2f} GiB, "
    f"{row['model_flops'] / 1e12:.3f} model TFLOP per device, compiled in {row['compile_seconds']:.0f} s"
  )


def memory_markdown(rows: list[dict]) -> str:
  lines = [
    "| method | devices | batch (per device per microbatch) | microbatches | remat | argument GiB (state) | temp GiB "
    "| temp + argument GiB | vs one-shot | FLOPs vs one-shot |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in rows:
    head = f"| {r['method']} | {r['devices']} | {r['batch_size']} ({r['per_device_microbatch']:g}) "
    head += f"| {r['microbatches']} | {r['remat']} "
    if "temp_bytes" not in r:
      why = r.get("refused") or r.get("error")
      lines.append(head + f"| {'refused' if 'refused' in r else 'failed'}: {why} | | | | |")
      continue
    flops = r.get("flops_vs_one_shot")
    lines.append(
      head + f"| {r['argument_bytes'] / GIB:.2f} ({r['state_bytes'] / GIB:.2f}) | {r['temp_bytes'] / GIB:.2f} "
      f"| {r['temp_plus_argument'] / GIB:.2f} | {100 * r.get('vs_one_shot', float('nan')):.0f}% "
      f"| {'-' if flops is None else f'{flops:.2f}'} |"
    )
  return "\n".join(lines) + "\n"


def time_table(label, path, arg, settings, batch_size, image_size, steps, windows, num_tags=80) -> dict:
  """One method's (microbatches, remat) settings timed side by side on one device (`benchmark.benchmark`'s
  variants), with the one-shot step (1, 'none') as the baseline."""
  config = load_config(path, arg, batch_size=batch_size)
  config.sharding.num_devices = 1
  settings = [(1, "none"), *(s for s in settings if s != (1, "none"))]
  variants = tuple((f"mb{n}_{r}", f"microbatches={n},remat={r}") for n, r in settings if (n, r) != (1, "none"))
  result = benchmark.benchmark(config, steps, image_size, vocab_size_of(config), "device", num_tags, windows, variants)
  rows = []
  for n, r in settings:
    v = result if (n, r) == (1, "none") else result["variants"][f"mb{n}_{r}"]
    row = {"method": label, "batch_size": batch_size, "microbatches": n, "remat": r}
    if "error" in v:
      row["error"] = v["error"]
    else:
      s = v["window_step_seconds"]
      row.update(
        step_seconds=v["step_seconds"],
        window_step_seconds=s,
        fastest=min(s),
        slowest=max(s),
        vs_one_shot=v["step_seconds"] / result["step_seconds"],
        final_loss=v["final_loss"],
      )
    rows.append(row)
  return {"device": result["device"], "rows": rows}


def time_markdown(rows: list[dict]) -> str:
  lines = [
    "| method | batch | microbatches | remat | step s, median (fastest-slowest) | vs one-shot |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for r in rows:
    head = f"| {r['method']} | {r['batch_size']} | {r['microbatches']} | {r['remat']} "
    if "error" in r:
      lines.append(head + f"| failed: {r['error'][:200]} | |")
    else:
      lines.append(
        head + f"| {r['step_seconds']:.3f} ({r['fastest']:.3f}-{r['slowest']:.3f}) | {r['vs_one_shot']:.2f} |"
      )
  return "\n".join(lines) + "\n"


def grid(microbatches, remats, settings=()) -> list[tuple[int, str]]:
  """(microbatches, remat) pairs: `settings` ('N:POLICY') when given, else every policy x every count."""
  if settings:
    return [(int(n), r) for n, _, r in (s.partition(":") for s in settings)]
  return [(int(n), r) for r in remats for n in microbatches]


def main(argv):
  del argv
  settings = grid(FLAGS.microbatches, FLAGS.remat, FLAGS.settings)
  specs = [parse_method(s, FLAGS.devices) for s in FLAGS.methods]
  result = {"jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "argv": sys.argv}
  if FLAGS.time:
    rows = []
    for label, path, arg, _ in specs:
      arg = ",".join(filter(None, (FLAGS.time_arg, arg)))
      timed = time_table(
        label,
        path,
        arg,
        settings,
        FLAGS.time_batch_size,
        FLAGS.time_image_size,
        FLAGS.steps,
        FLAGS.windows,
        FLAGS.num_tags,
      )
      rows += timed["rows"]
      result["device"] = timed["device"]
    table = time_markdown(rows)
    result.update(steps=FLAGS.steps, windows=FLAGS.windows)
  else:
    done = []
    if FLAGS.resume and FLAGS.out and os.path.exists(FLAGS.out):
      with open(FLAGS.out) as f:
        done = json.load(f)["rows"]
    rows = []
    for label, path, arg, devices in specs:
      rows += memory_table(label, path, arg, devices, settings, FLAGS.platform, FLAGS.image_size, FLAGS.num_tags, done)
      if FLAGS.out:  # what is measured so far survives a stopped run
        kept = [r for r in done if _key(r) not in {_key(x) for x in rows}]
        _write(FLAGS.out, {**result, "rows": with_ratios(kept + rows)})
    rows = with_ratios([r for r in done if _key(r) not in {_key(x) for x in rows}] + rows)
    order = list(train_step.REMAT_POLICIES)
    rows.sort(key=lambda r: (r["method"], r["devices"], order.index(r["remat"]), r["microbatches"]))
    table = memory_markdown(rows)
    result["device"] = jax.devices(FLAGS.platform)[0].device_kind
  result.update(rows=rows, markdown=table)
  if FLAGS.out:
    _write(FLAGS.out, result)
  print(table, flush=True)


def _write(path: str, result: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)


def cpu_flags(argv: list[str]) -> None:
  """Sets XLA_FLAGS before JAX starts its backends: the simulated devices (--xla_force_host_platform_device_count
  for the largest device count the command asks for; not when it times, on one device, nor where XLA_FLAGS sets
  it already) and `KEEP_REMAT`."""
  flags_now = os.environ.get("XLA_FLAGS", "")
  extra = []
  if _DEVICE_FLAG not in flags_now and "--time" not in argv:
    counts = [8]
    for a in argv:
      if a.startswith("--devices="):
        counts[0] = int(a.split("=", 1)[1])
      if a.startswith("--methods="):
        counts += [int(n) for n in re.findall(r"@(\d+)", a)]
    extra.append(f"{_DEVICE_FLAG}={max(counts)}")
  if "--xla_disable_hlo_passes" not in flags_now:
    extra.append(KEEP_REMAT)
  os.environ["XLA_FLAGS"] = " ".join([flags_now, *extra]).strip()


if __name__ == "__main__":
  cpu_flags(sys.argv)
  _define_flags()
  app.run(main)
