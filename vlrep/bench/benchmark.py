"""Times the train step of a config on whatever devices exist: step time, images/s, and model FLOPs
utilisation (model FLOPs counted from the jaxpr of the loss's gradient, against the device's datasheet peak and
against its measured bf16 matrix-product peak).

  python -m vlrep.bench.benchmark --config=configs/virtex.py --config.batch_size=256 --steps=20 --windows=3
  python -m vlrep.bench.benchmark --config=configs/virtex.py --torch_reference   # + PyTorch, same device, one run
  python -m vlrep.bench.benchmark --config=configs/virtex.py \
      --variant=f32:method.dtype=float32 --variant=fsdp:sharding.params=fsdp   # A/B in one run
  python -m vlrep.bench.benchmark --config=configs/virtex.py --profile --output_dir=/tmp/bench
  python -m vlrep.bench.benchmark --config=configs/clip.py --config.batch_size=4 --steps=2 --windows=5 \
      --variant=vit_b16:@configs/clip.py:backbone=vit_b16   # another recipe's step beside the config's

Timing: `--windows` windows of `--steps` steps each (after 3 warm-up steps); images/s is the median window, with
the fastest and slowest beside it. `--variant=NAME:KEY=VALUE,KEY=VALUE` adds a variant of the config (an
A/B of a switch against the baseline, in one run); every variant is compiled first, then the windows
run round-robin over the baseline and the variants, so slow drifts of the machine fall on all of them alike, and
each variant's ratio to the baseline is reported. `--variant=NAME:@FILE.py[:ARG]` is another config file (e.g. the
ViT-B/16 recipe beside the ResNet-50 one) at the baseline's batch size. `--profile` traces `--profile_steps` steps
of each (jax.profiler, Perfetto JSON) into --output_dir and writes a table of device time by kernel class
(`profile.md`, `profile.json`).

Inputs are random arrays of the config's shapes (the input pipeline is timed separately by
`vlrep.bench.pipeline_benchmark`). `--input=device` reuses one batch already on the device: the step alone.
`--input=host` cycles through 4 distinct batches held in host memory (what the in-memory cache of decoded
images gives the loop) and transfers each step's batch with the loop's device prefetch thread, overlapped with
the running step.
Peak FLOP/s are dense bf16 numbers from vendor specs; unknown devices (CPUs) report no MFU.

`--torch_reference` first runs `vlrep.bench.torch_reference` (the same VirTex model and step in PyTorch) in a
subprocess on the same device, before JAX takes the device's memory, then this step, and reports the ratio.
Only TensorFlow-free modules are imported, so this runs where JAX and PyTorch are installed without TF.
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import functools
import glob
import gzip
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from vlrep import methods, optim, sharding, train_step
from vlrep.bench import device_turns
from vlrep.data import op_strings


def _define_flags() -> None:
  """Defined when run as a program only, so importing this module (tests, other tools) defines no flags."""
  config_flags.DEFINE_config_file("config", None, "Run config.", lock_config=True)
  flags.DEFINE_integer("steps", 20, "Steps per timed window (after 3 warm-up steps).")
  flags.DEFINE_integer("windows", 3, "Timed windows; images/s is their median.")
  flags.DEFINE_multi_string("variant", [], "NAME:KEY=VALUE[,KEY=VALUE...]: a variant of the config, timed beside it.")
  flags.DEFINE_integer("image_size", 0, "Image size (default: from the config's preprocessing, else 224).")
  flags.DEFINE_integer("vocab_size", 0, "Vocabulary size of the textual head (default: config.tokenizer.vocab_size).")
  flags.DEFINE_string("output", None, "Optional JSON file for the results.")
  flags.DEFINE_string("output_dir", None, "Run folder for the profile (trace, profile.md, profile.json).")
  flags.DEFINE_integer("num_tags", 80, "Tag vocabulary size for methods with tags (MCT; COCO has 80).")
  flags.DEFINE_enum("input", "device", ["device", "host"], "Where batches come from (see the module docstring).")
  flags.DEFINE_bool("profile", False, "Trace --profile_steps steps of each variant and tabulate device time.")
  flags.DEFINE_integer("profile_steps", 5, "Steps traced by --profile.")
  flags.DEFINE_integer(
    "gemm_size",
    -1,
    "Side of the bf16 matrix product that measures the device's peak (0: skip; "
    "-1: 8192 on accelerators, skipped on CPUs).",
  )
  flags.DEFINE_bool(
    "torch_reference", False, "Also time the PyTorch VirTex reference on the same device (VirTex only)."
  )
  flags.DEFINE_list("torch_modes", ["default", "max-autotune"], "torch.compile modes of the reference ('eager': none).")
  flags.DEFINE_bool(
    "offload_states", False, "Keep each variant's train state in host memory except during its own windows."
  )
  flags.DEFINE_integer("compile_threads", 1, "Variants built and compiled at once (threads); executions take turns.")
  flags.DEFINE_list("profile_variants", [], "Variants traced by --profile (default: all, the baseline included).")
  flags.DEFINE_string(
    "turn_dir",
    "",
    "Share the device with other benchmark processes (vlrep.bench.device_turns): all compile at once, time in "
    "turns. The PyTorch references then compile beside this process's variants.",
  )
  flags.DEFINE_integer("turn_parties", 1, "Processes sharing --turn_dir (the references count one each).")
  flags.DEFINE_float("turn_deadline", 0.0, "Unix time at which optional parties still compiling are killed.")
  flags.DEFINE_bool("turn_optional", False, "This process may be killed if still compiling at --turn_deadline.")


FLAGS = flags.FLAGS

# Dense bf16 peak FLOP/s from the vendors' datasheets, by device name; the first entry whose pattern the device's
# name matches wins, so the variants of one chip come before its plain name (JAX names an H100 SXM "NVIDIA H100
# 80GB HBM3", a PCIe card "NVIDIA H100 PCIe", an NVL card "NVIDIA H100 NVL").
PEAK_FLOPS = (
  (r"H100.*PCIe", 756e12),
  (r"H100.*NVL", 835e12),
  (r"H100", 989e12),  # SXM5
  (r"H200.*NVL", 835e12),
  (r"H200", 989e12),  # SXM, and GH200
  (r"A100", 312e12),
  (r"\bL4\b", 121e12),
  (r"TPU v4", 275e12),
  (r"TPU v5 lite|TPU v5e", 197e12),
  (r"TPU v5p|TPU v5$", 459e12),
  (r"TPU v6 lite|TPU v6e", 918e12),
)


def peak_flops_of(device_kind: str) -> float | None:
  """The datasheet's dense bf16 peak of a device name, or None (CPUs and devices not in the table)."""
  for pattern, flops in PEAK_FLOPS:
    if re.search(pattern, device_kind, re.IGNORECASE):
      return flops
  return None


def peak_flops(device) -> float | None:
  return peak_flops_of(device.device_kind)


def measured_gemm_flops(size: int = 8192, repeats: int = 20, windows: int = 3) -> float:
  """The device's measured bf16 matrix-product throughput (FLOP/s): the fastest of `windows` windows of
  `repeats` [size x size] @ [size x size] products with f32 accumulation."""
  key = jax.random.PRNGKey(0)
  a = jax.random.normal(key, (size, size), jnp.bfloat16)
  b = jax.random.normal(jax.random.fold_in(key, 1), (size, size), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  jax.block_until_ready(matmul(a, b))
  best = float("inf")
  for _ in range(windows):
    t0 = time.perf_counter()
    outs = [matmul(a, b) for _ in range(repeats)]
    jax.block_until_ready(outs)
    best = min(best, time.perf_counter() - t0)
  return 2.0 * size**3 * repeats / best


def apply_overrides(config: ml_collections.ConfigDict, overrides: str) -> ml_collections.ConfigDict:
  """A copy of `config` with 'a.b=1,c=rbg' applied; values are Python literals, else strings. Keys must exist."""
  config = ml_collections.ConfigDict(config.to_dict())
  for item in filter(None, (o.strip() for o in overrides.split(","))):
    key, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"Override {item!r} is not KEY=VALUE.")
    *parents, leaf = key.strip().split(".")
    node = config
    for part in parents:
      if part not in node:
        raise ValueError(f"Override {key!r}: the config has no {part!r}.")
      node = node[part]
    if leaf not in node:
      raise ValueError(f"Override {key!r}: the config has no {leaf!r} (known: {', '.join(sorted(node.keys()))}).")
    try:
      value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
      value = text.strip()
    node[leaf] = value
  return config


def variant_config(config: ml_collections.ConfigDict, overrides: str) -> ml_collections.ConfigDict:
  """A variant's config: '@FILE.py[:ARG]' is that config file's get_config(ARG) at the baseline's batch size (a
  whole recipe timed beside the baseline's, per image alike); otherwise `config` with the overrides applied."""
  if not overrides.startswith("@"):
    return apply_overrides(config, overrides)
  path, _, arg = overrides[1:].partition(":")
  spec = importlib.util.spec_from_file_location("benchmark_variant_config", path)
  if spec is None or not os.path.exists(path):
    raise ValueError(f"Variant config {overrides!r}: no config file {path!r}.")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  variant = module.get_config(arg or None)
  variant.batch_size = config.batch_size
  return variant


def parse_variant(spec: str) -> tuple[str, str]:
  """'NAME:KEY=VALUE,...' -> (NAME, 'KEY=VALUE,...'); 'NAME:@FILE.py:ARG' -> (NAME, '@FILE.py:ARG')."""
  name, sep, overrides = spec.partition(":")
  if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
    raise ValueError(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...] with a plain NAME.")
  return name, overrides


def jaxpr_flops(closed_jaxpr) -> float:
  """FLOPs of the matrix products and convolutions in a jaxpr (2 per multiply-add), through nested jaxprs.

  XLA's cost analysis cannot serve as MFU's numerator on GPUs: convolutions and many matrix products become
  cuDNN/cuBLAS custom calls it does not count. Counting the model's own products is the usual definition.
  """
  total = 0.0
  for eqn in closed_jaxpr.jaxpr.eqns if hasattr(closed_jaxpr, "jaxpr") else closed_jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      lhs, rhs = (v.aval.shape for v in eqn.invars)
      (_, rc), (_, rb) = eqn.params["dimension_numbers"]
      free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
      total += 2.0 * np.prod(lhs) * np.prod(free)
    elif name == "conv_general_dilated":
      rhs, out = eqn.invars[1].aval.shape, eqn.outvars[0].aval.shape
      out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
      # A gradient of a strided convolution dilates its input: only 1 / prod(dilation) of the products
      # touch non-zeros, and only those are the model's.
      dilation = np.prod(eqn.params.get("lhs_dilation") or (1,))
      total += 2.0 * np.prod(out) * np.prod(rhs) / out_features / dilation
    multiplier = eqn.params.get("length", 1) if name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
          total += multiplier * jaxpr_flops(sub)
  return total


def model_flops_per_step(method, variables, batch, rng) -> float:
  """Model FLOPs of one step: the loss's forward and backward products, counted from the jaxpr of its
  gradient. For a plain network that is about 3x the forward pass; forward-only parts (MCT's momentum key
  encoders) count once."""

  def loss(params, rest, batch):
    return method.loss({"params": params, **rest}, batch, rng, True)[0]

  rest = {k: v for k, v in variables.items() if k != "params"}
  return jaxpr_flops(jax.make_jaxpr(jax.grad(loss))(variables["params"], rest, batch))


def _image_size(config) -> int:
  """--image_size, else the config's (`config_image_size`)."""
  return FLAGS.image_size or config_image_size(config)


def config_image_size(config) -> int:
  """The size of the config's `inception_crop`, else 224. Read from the op string without building the ops (their
  module imports TensorFlow, which GPU machines may not have)."""
  for name, args, kwargs in op_strings.op_calls(config.data.pp):
    if name == "inception_crop":
      return int(kwargs.get("size", args[0] if args else 224))
  return 224


# Variants compile in threads (`--compile_threads`); what runs on the device (initial state, warm-up steps) runs
# one variant at a time, so their activations never share the device's memory.
_DEVICE_LOCK = threading.Lock()


def batch_shapes(method, batch_size: int, image_size: int, vocab_size: int, max_len: int, num_tags: int = 80) -> dict:
  """{field: (shape, numpy dtype)} of a batch of every field the method reads: images ('image', MCT's
  'image_q'/'image_k'), token sequences ('tokens*'), LocTex's rendered traces ('trace_mask_R'), MCT's tags; and
  'stat_empty'. What `random_batch` fills and what `vlrep.bench.memory` compiles against without data."""
  shapes = {"stat_empty": ((batch_size,), np.dtype(bool))}
  for field in method.fields:
    if field.startswith("image"):
      shapes[field] = ((batch_size, image_size, image_size, 3), np.dtype(np.float32))
    elif field.startswith("tokens"):
      shapes[field] = ((batch_size, max_len), np.dtype(np.int32))
    elif field.startswith("trace_mask_"):
      r = int(field.rsplit("_", 1)[1])
      shapes[field] = ((batch_size, max_len, r, r), np.dtype(np.uint8))
    elif field == "tags":
      shapes[field] = ((batch_size, num_tags), np.dtype(np.uint8))
    else:
      raise ValueError(f"The benchmark does not know how to make field {field!r} of {type(method).__module__}.")
  return shapes


def random_batch(shapes: dict, vocab_size: int, rng: np.random.Generator) -> dict:
  """A random batch of `batch_shapes`' fields: normal images, tokens in [5, vocab) between BOS 2 and EOS 3, about
  10% of the trace cells per token, 5% of the tags."""
  local = {}
  for field, (shape, dtype) in shapes.items():
    if field.startswith("image"):
      local[field] = rng.normal(size=shape).astype(dtype)
    elif field.startswith("tokens"):
      local[field] = rng.integers(5, vocab_size, size=shape).astype(dtype)
      local[field][:, 0], local[field][:, -1] = 2, 3
    elif field.startswith("trace_mask_"):
      local[field] = (rng.random(shape) < 0.1).astype(dtype)
    elif field == "tags":
      local[field] = (rng.random(shape) < 0.05).astype(dtype)
    else:
      local[field] = np.zeros(shape, dtype)
  return local


def prepare(
  config, image_size: int, vocab_size: int, input_mode: str = "device", num_tags: int = 80, offload_state=False
) -> dict:
  """The config's train step compiled on random inputs of its shapes, with its state: what `run_steps` times.
  The step is the loop's, with the config's `microbatches` and `remat` (refused as the loop refuses them,
  `train_step.step_errors`). `offload_state`: the state waits in host memory after the warm-up (`run_steps` brings
  it back)."""
  mesh = sharding.make_mesh(config.sharding.num_devices or None)
  errors = train_step.step_errors(config, int(mesh.devices.size))
  if errors:
    raise ValueError(" ".join(errors))
  bs = config.batch_size
  rng = np.random.default_rng(0)
  max_len = config.method.get("max_len") or config.method.text.max_len
  method = methods.build(methods.method_config(config), vocab_size)
  local = random_batch(batch_shapes(method, bs, image_size, vocab_size, max_len, num_tags), vocab_size, rng)
  batch_sh = sharding.batch_sharding(mesh)
  with _DEVICE_LOCK:
    batch = sharding.global_batch(local, batch_sh)
  # Host mode: 4 distinct host batches (images differ; the rest is shared), transferred every step.
  images = [f for f in local if f.startswith("image")]
  host_batches = [
    dict(local, **{f: rng.normal(size=local[f].shape).astype(np.float32) for f in images}) for _ in range(4)
  ]
  key = jax.random.PRNGKey(0)
  tx, schedules = optim.build(config.optim, jax.eval_shape(method.init, key, batch)["params"], 1000, 10)
  init = functools.partial(train_step.init_train_state, method, tx)
  abstract = jax.eval_shape(init, key, batch)
  state_sh = sharding.state_shardings(mesh, abstract, config.sharding.params, rules=config.sharding.get("rules", ()))
  with _DEVICE_LOCK:
    state = jax.jit(init, out_shardings=state_sh)(key, batch)
  step = jax.jit(
    train_step.make_train_step(method, tx, schedules, key, (), config.get("microbatches", 1), batch_sh),
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, None),
    donate_argnums=(0,),
  )
  t0 = time.time()
  compiled = step.lower(state, batch).compile()
  compile_s = time.time() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost.get("flops", 0.0)) if cost else 0.0
  flops = model_flops_per_step(method, {"params": abstract["params"], **abstract["model_state"]}, batch, key)
  prepared = {
    "compiled": compiled,
    "state": state,
    "state_sharding": state_sh,
    "batch": batch,
    "batch_sharding": batch_sh,
    "host_batches": host_batches,
    "input": input_mode,
    "mesh_size": int(mesh.devices.size),
    "config": config,
    "image_size": image_size,
    "flops": flops,
    "xla_flops": xla_flops,
    "compile_seconds": compile_s,
  }
  with _DEVICE_LOCK:
    run_steps(prepared, 3)  # warm-up
    if offload_state:
      offload(prepared)
  return prepared


def offload(prepared: dict) -> None:
  """Moves a prepared variant's train state to host memory (`onload` brings it back), so that many variants of a
  large step fit the device's memory together; the timed windows never include the transfers."""
  prepared["state"] = jax.device_get(prepared["state"])


def onload(prepared: dict) -> None:
  if not isinstance(jax.tree.leaves(prepared["state"])[0], jax.Array):
    prepared["state"] = jax.block_until_ready(jax.device_put(prepared["state"], prepared["state_sharding"]))


def run_steps(prepared: dict, n: int) -> dict:
  """Runs `n` steps of a prepared step and waits for them; returns the last step's metrics."""
  onload(prepared)
  metrics = None
  # Host mode: the loop's device prefetch thread transfers the next batches while a step runs.
  if prepared["input"] == "host":
    cycle = (prepared["host_batches"][i % len(prepared["host_batches"])] for i in range(n))
    batches = sharding.device_prefetch(cycle, prepared["batch_sharding"], 2)
  else:
    batches = (prepared["batch"] for _ in range(n))
  state = prepared["state"]
  for next_batch in batches:
    state, metrics = prepared["compiled"](state, next_batch)
  jax.block_until_ready(metrics)
  prepared["state"] = state
  return metrics


def time_windows(prepared_by_name: dict, steps: int, windows: int, offload_states: bool = False) -> dict:
  """{name: [seconds per step of each window]}; window w of every variant runs before window w + 1 of any.
  With `offload_states`, each variant's state is on the device only for its own window (moved before the clock
  starts and after it stops)."""
  seconds = {name: [] for name in prepared_by_name}
  for _ in range(windows):
    for name, prepared in prepared_by_name.items():
      onload(prepared)
      t0 = time.perf_counter()
      prepared["last_metrics"] = run_steps(prepared, steps)
      seconds[name].append((time.perf_counter() - t0) / steps)
      if offload_states:
        offload(prepared)
  return seconds


def summarize(prepared: dict, step_seconds: list, peak: float | None, measured_peak: float | None) -> dict:
  """Images/s (median window, and the fastest and slowest) and MFU against both peaks for one variant."""
  config, bs = prepared["config"], prepared["config"].batch_size
  step_s = statistics.median(step_seconds)
  devices = prepared["mesh_size"]
  # Model FLOPs of the whole (global) batch; MFU divides by all devices' peak.
  achieved = prepared["flops"] / step_s
  return {
    "method": config.method.name,
    "batch_size": bs,
    "image_size": prepared["image_size"],
    "input": prepared["input"],
    "dtype": config.method.dtype,
    "final_loss": float(prepared["last_metrics"]["train/loss"]),
    "step_seconds": step_s,
    "window_step_seconds": step_seconds,
    "images_per_second": bs / step_s,
    "images_per_second_min": bs / max(step_seconds),
    "images_per_second_max": bs / min(step_seconds),
    "model_tflops_per_step": prepared["flops"] / 1e12,
    "xla_cost_analysis_tflops_per_step": prepared["xla_flops"] / 1e12,
    "achieved_tflops_per_second": achieved / 1e12,
    "mfu": achieved / (peak * devices) if peak else None,
    "mfu_vs_measured_gemm_peak": achieved / (measured_peak * devices) if measured_peak else None,
    "compile_seconds": prepared["compile_seconds"],
  }


def benchmark(
  config,
  steps: int,
  image_size: int,
  vocab_size: int,
  input_mode: str = "device",
  num_tags: int = 80,
  windows: int = 1,
  variants: tuple[tuple[str, str], ...] = (),
  gemm_size: int = 0,
  profile_dir: str | None = None,
  profile_steps: int = 5,
  compile_threads: int = 1,
  profile_variants: tuple[str, ...] = (),
  turns: device_turns.Turns | None = None,
  offload_states: bool = False,
) -> dict:
  """The baseline config's figures at the top level; each variant's under 'variants' with its ratio to them.

  Variants build and compile `compile_threads` at a time; with `turns`, the timing (and the profile) waits for
  the device's turn (vlrep.bench.device_turns)."""
  configs = {"baseline": config, **{name: variant_config(config, overrides) for name, overrides in variants}}

  def build(item):
    name, c = item
    try:
      return name, prepare(c, image_size, vocab_size, input_mode, num_tags, offload_states), None
    except Exception as e:  # noqa: BLE001 - a variant that does not build or compile is reported, not fatal
      if name == "baseline":
        raise
      # An accelerator's minutes are scarce: the other variants are still timed (e.g. a kernel that Triton's
      # compiler refuses on this device).
      error = f"{type(e).__name__}: {e}"[:2000]
      print(f"Variant {name!r} failed to build or compile and is not timed: {error}", file=sys.stderr, flush=True)
      return name, None, error

  t0 = time.time()
  prepared, failed = {}, {}
  with concurrent.futures.ThreadPoolExecutor(max(1, compile_threads)) as pool:
    for name, p, error in pool.map(build, configs.items()):
      if error:
        failed[name] = error
      else:
        prepared[name] = p
  build_s = time.time() - t0
  print(f"Built and compiled {len(configs)} configs in {build_s:.0f} s.", file=sys.stderr, flush=True)
  device = jax.devices()[0]
  peak = peak_flops(device)
  with device_turns.turn(turns) as turn:
    measured_peak = measured_gemm_flops(gemm_size) if gemm_size else None
    seconds = time_windows(prepared, steps, windows, offload_states)
    if profile_dir:
      traced = [n for n in prepared if not profile_variants or n in profile_variants]
      profiles = {}
      for n in traced:
        profiles[n] = profile(prepared[n], profile_steps, os.path.join(profile_dir, f"trace_{n}"))
        if offload_states:
          offload(prepared[n])
  results = {name: summarize(p, seconds[name], peak, measured_peak) for name, p in prepared.items()}
  result = {
    "device": device.device_kind,
    "platform": device.platform,
    "num_devices": prepared["baseline"]["mesh_size"],
    "jax": jax.__version__,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "datasheet_peak_tflops": peak / 1e12 if peak else None,
    "measured_gemm_peak_tflops": measured_peak / 1e12 if measured_peak else None,
    "steps_per_window": steps,
    "windows": windows,
    "build_seconds": build_s,
    "compile_threads": compile_threads,
    "turn": turn,
    **results.pop("baseline"),
  }
  if variants:
    result["variants"] = {
      name: {
        **r,
        "overrides": dict(variants)[name],
        "speedup_vs_baseline": r["images_per_second"] / result["images_per_second"],
      }
      for name, r in results.items()
    }
    for name, error in failed.items():
      result["variants"][name] = {"overrides": dict(variants)[name], "error": error}
  if profile_dir:
    result["profile"] = profiles
    write_profile_tables(profiles, profile_dir)
  return result


# -- profile ------------------------------------------------------------------------------------------------
# Kernel classes by name, first match wins. cuDNN names its convolution kernels by pass (fprop / dgrad / wgrad);
# cuBLAS's and CUTLASS's matrix products are gemm / nvjet / cutlass; XLA names its own kernels by the fusion's
# kind (loop_*, input_reduce_*, ...) and root operation.
KERNEL_CLASSES = (
  ("convolution dgrad", r"dgrad"),
  ("convolution wgrad", r"wgrad"),
  ("convolution fprop", r"fprop|conv2d|convolve|implicit_gemm|cudnn|convolution|conv_general"),
  ("select-and-scatter", r"select.?and.?scatter"),
  ("RNG", r"rng|threefry|philox|random"),
  ("GEMM", r"gemm|nvjet|cutlass|cublas|matmul|\bdot\b|dot_|gemv"),
  ("reduction", r"reduc"),
  ("copy / transpose", r"copy|transpose|memcpy|memset|concatenate|dynamic.update.slice"),
  ("elementwise", r"fusion|loop|elementwise|multiply|add|subtract|select|convert|broadcast|maximum|exp|tanh"),
)


TOP_KERNELS = 40  # kernels listed by name in the profile, the most time first


def kernel_class(name: str) -> str:
  for cls, pattern in KERNEL_CLASSES:
    if re.search(pattern, name, re.IGNORECASE):
      return cls
  return "other"


def device_kernel_events(trace: dict) -> list[dict]:
  """The trace's kernel events ('X' events with a duration): those of the accelerators' processes
  ('/device:GPU:0', ...); on a CPU, the XLA operations that XLA's CPU threads ran (those nest: a call holds the
  fusions it runs, so CPU shares overlap and serve to check the tool, not to read the CPU's time)."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {
    (e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
  on_device = [e for e in timed if re.match(r"/device:(GPU|TPU)", processes.get(e["pid"], ""))]
  if on_device:
    return on_device
  return [
    e
    for e in timed
    if threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")
    and "::" not in e["name"]
    and not e["name"].startswith("end: ")
  ]


def profile_table(events: list[dict], steps: int) -> dict:
  """Device time per step by kernel class, and the idle time: the span of the kernels minus the time when at
  least one ran. {'classes': {class: {'ms_per_step', 'share', 'kernels_per_step'}}, 'busy_ms_per_step',
  'idle_ms_per_step', 'span_ms_per_step'}; shares are of the summed kernel time."""
  per_class = collections.defaultdict(lambda: [0.0, 0])
  per_kernel = collections.defaultdict(lambda: [0.0, 0])
  intervals = []
  for e in events:
    for table, key in ((per_class, kernel_class(e["name"])), (per_kernel, e["name"])):
      table[key][0] += float(e["dur"])
      table[key][1] += 1
    intervals.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
  busy, end = 0.0, -float("inf")
  for start, stop in sorted(intervals):
    if stop > end:
      busy += stop - max(start, end)
      end = stop
  span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) if intervals else 0.0
  total = sum(v[0] for v in per_class.values()) or 1.0
  us_to_ms = 1e-3 / max(steps, 1)
  return {
    "classes": {
      name: {"ms_per_step": v[0] * us_to_ms, "share": v[0] / total, "kernels_per_step": v[1] / max(steps, 1)}
      for name, v in sorted(per_class.items(), key=lambda kv: -kv[1][0])
    },
    # The kernels that take the most time (XLA names its fusions after their kind and root operation): where
    # inside a class the time goes.
    "top_kernels": [
      {
        "name": name,
        "class": kernel_class(name),
        "ms_per_step": v[0] * us_to_ms,
        "calls_per_step": v[1] / max(steps, 1),
      }
      for name, v in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    ],
    "busy_ms_per_step": busy * us_to_ms,
    "idle_ms_per_step": (span - busy) * us_to_ms,
    "span_ms_per_step": span * us_to_ms,
  }


def profile(prepared: dict, steps: int, trace_dir: str) -> dict:
  """Traces `steps` steps (after they ran once untraced) and tabulates the trace's kernels."""
  run_steps(prepared, steps)
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    run_steps(prepared, steps)
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
  if not paths:
    raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {trace_dir}.")
  with gzip.open(paths[-1]) as f:
    table = profile_table(device_kernel_events(json.load(f)), steps)
  return {"trace": paths[-1], **table}


def profile_markdown(profiles: dict) -> str:
  """One table: kernel classes as rows, variants as columns (ms per step and share of kernel time)."""
  names = list(profiles)
  classes = []
  for p in profiles.values():
    classes += [c for c in p["classes"] if c not in classes]
  lines = ["| kernel class | " + " | ".join(f"{n}: ms/step (share)" for n in names) + " |"]
  lines.append("| --- |" + " --- |" * len(names))
  for c in classes:
    cells = []
    for n in names:
      v = profiles[n]["classes"].get(c)
      cells.append(f"{v['ms_per_step']:.2f} ({100 * v['share']:.1f}%)" if v else "-")
    lines.append(f"| {c} | " + " | ".join(cells) + " |")
  for key, label in (("idle_ms_per_step", "idle gaps"), ("span_ms_per_step", "span of the kernels")):
    lines.append(f"| {label} | " + " | ".join(f"{profiles[n][key]:.2f}" for n in names) + " |")
  for n in names:
    lines += ["", f"{n}: the {TOP_KERNELS} kernels that take the most time", ""]
    lines += ["| kernel | class | ms/step | calls/step |", "| --- | --- | --- | --- |"]
    for k in profiles[n].get("top_kernels", []):
      lines.append(f"| `{k['name'][:90]}` | {k['class']} | {k['ms_per_step']:.3f} | {k['calls_per_step']:g} |")
  return "\n".join(lines) + "\n"


def write_profile_tables(profiles: dict, out_dir: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "profile.json"), "w") as f:
    json.dump(profiles, f, indent=2)
  with open(os.path.join(out_dir, "profile.md"), "w") as f:
    f.write(profile_markdown(profiles))


# -- the PyTorch reference ----------------------------------------------------------------------------------
def torch_reference_command(config, steps, windows, image_size, vocab_size, mode, output) -> list[str]:
  """The `vlrep.bench.torch_reference` command for the config's model, optimizer (SGD, its LRs and decay groups,
  clipping, LookAhead) and BatchNorm groups."""
  m, o = config.method, config.optim
  if m.name != "virtex" or m.task != "bicaptioning" or m.backbone.depth != 50 or m.backbone.width != 64:
    raise ValueError("--torch_reference mirrors VirTex bicaptioning with a ResNet-50 backbone only.")
  if o.name != "sgd":
    raise ValueError(f"--torch_reference mirrors SGD; optim.name is {o.name!r}.")
  lrs = dict(o.lr_groups)
  cmd = [sys.executable, "-m", "vlrep.bench.torch_reference", f"--batch_size={config.batch_size}"]
  cmd += [f"--image_size={image_size}", f"--vocab_size={vocab_size}", f"--hidden={m.hidden}"]
  cmd += [f"--layers={m.num_layers}", f"--max_len={m.max_len}", f"--steps={steps}", f"--windows={windows}"]
  cmd += [f"--backbone_lr={lrs.get('^backbone/', 0.2)}", f"--head_lr={lrs.get('.*', 1e-3)}"]
  cmd += [f"--weight_decay={o.weight_decay}", f"--momentum={o.momentum}", f"--grad_clip_norm={o.grad_clip_norm}"]
  cmd += [f"--lookahead_steps={o.lookahead_steps}", f"--lookahead_alpha={o.lookahead_alpha}"]
  cmd += [f"--bn_group_size={m.backbone.bn_group_size}", f"--compile_mode={mode}", f"--output={output}"]
  return cmd


def start_torch_references(config, steps, windows, image_size, vocab_size, modes, turn_args) -> dict:
  """Starts the references as subprocesses: {mode: (process, output file)}. Without `turn_args` they run one
  after the other before JAX takes the device's memory; with them they compile beside JAX and time in turns."""
  started = {}
  for mode in modes:
    output = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = torch_reference_command(config, steps, windows, image_size, vocab_size, mode, output) + turn_args
    started[mode] = (subprocess.Popen(cmd), output)
    if not turn_args:
      started[mode][0].wait()
  return started


def collect_torch_references(started: dict) -> dict:
  """{mode: the reference's results, or {'error': ...} when it failed or was killed at the turns' deadline}."""
  references = {}
  for mode, (process, output) in started.items():
    code = process.wait()
    if code == 0:
      with open(output) as f:
        references[mode] = json.load(f)
    else:
      killed = " (killed: still compiling at the deadline)" if code == -9 else ""
      references[mode] = {"error": f"exit code {code}{killed}"}
    os.remove(output)
  return references


def main(argv):
  del argv
  try:  # tf.data must not take accelerator memory; TensorFlow is not needed here at all.
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
  except ImportError:
    pass
  config, image_size = FLAGS.config, _image_size(FLAGS.config)
  vocab_size = FLAGS.vocab_size or config.tokenizer.vocab_size
  turns, turn_args = None, []
  if FLAGS.turn_dir:
    # Processes share the device's memory: none may take most of it up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    deadline = FLAGS.turn_deadline or time.time() + 3600
    turns = device_turns.join(FLAGS.turn_dir, FLAGS.turn_parties, deadline, FLAGS.turn_optional)
    turn_args = [f"--turn_dir={FLAGS.turn_dir}", f"--turn_parties={FLAGS.turn_parties}"]
    turn_args += [f"--turn_deadline={turns.deadline}"]
  started = {}
  if FLAGS.torch_reference:
    args = (config, FLAGS.steps, FLAGS.windows, image_size, vocab_size, FLAGS.torch_modes, turn_args)
    started = start_torch_references(*args)
  gemm_size = FLAGS.gemm_size
  if gemm_size < 0:
    gemm_size = 8192 if jax.devices()[0].platform in ("gpu", "tpu") else 0
  if FLAGS.profile and not FLAGS.output_dir:
    raise app.UsageError("--profile writes its trace and tables into --output_dir; give one.")
  result = benchmark(
    config,
    FLAGS.steps,
    image_size,
    vocab_size,
    FLAGS.input,
    FLAGS.num_tags,
    FLAGS.windows,
    tuple(parse_variant(v) for v in FLAGS.variant),
    gemm_size,
    FLAGS.output_dir if FLAGS.profile else None,
    FLAGS.profile_steps,
    FLAGS.compile_threads,
    tuple(FLAGS.profile_variants),
    turns,
    FLAGS.offload_states,
  )
  references = collect_torch_references(started)
  if references:
    result["torch_reference"] = references
    result["speedup_vs_torch"] = {
      m: result["images_per_second"] / r["images_per_second"] for m, r in references.items() if "error" not in r
    }
  print(json.dumps(result, indent=2), flush=True)
  if FLAGS.output:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
    with open(FLAGS.output, "w") as f:
      json.dump(result, f, indent=2)
  if FLAGS.profile:
    print(profile_markdown(result["profile"]), flush=True)


if __name__ == "__main__":
  _define_flags()
  flags.mark_flags_as_required(["config"])
  app.run(main)
