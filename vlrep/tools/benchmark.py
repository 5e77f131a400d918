"""Times the train step of a config on whatever devices exist: step time, images/s, and model FLOPs
utilisation (FLOPs from XLA's cost analysis of the compiled step, against the device's peak).

  python -m vlrep.tools.benchmark --config=configs/virtex.py --config.batch_size=256 --steps=20
  python -m vlrep.tools.benchmark --config=configs/virtex.py --torch_reference   # + PyTorch, same device, one run

Inputs are random arrays of the config's shapes (the input pipeline is timed separately by
`vlrep.tools.pipeline_benchmark`). `--input=device` reuses one batch already on the device: the step alone.
`--input=host` cycles through 4 distinct batches held in host memory (what the in-memory cache of decoded
images gives the loop) and transfers each step's batch with the loop's device prefetch thread, overlapped with
the running step.
Peak FLOP/s are dense bf16 numbers from vendor specs; unknown devices (CPUs) report no MFU.

`--torch_reference` first runs `vlrep.tools.torch_reference` (the same VirTex model and step in PyTorch) in a
subprocess on the same device, before JAX takes the device's memory, then this step, and reports the ratio.
Only TensorFlow-free modules are imported, so this runs where JAX and PyTorch are installed without TF.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from vlrep import methods, optim, sharding, train_step


def _define_flags() -> None:
  """Defined when run as a program only, so importing this module (tests, other tools) defines no flags."""
  config_flags.DEFINE_config_file("config", None, "Run config.", lock_config=True)
  flags.DEFINE_integer("steps", 20, "Timed steps (after 3 warm-up steps).")
  flags.DEFINE_integer("image_size", 0, "Image size (default: from the config's preprocessing, else 224).")
  flags.DEFINE_integer("vocab_size", 0, "Vocabulary size of the textual head (default: config.tokenizer.vocab_size).")
  flags.DEFINE_string("output", None, "Optional JSON file for the results.")
  flags.DEFINE_integer("num_tags", 80, "Tag vocabulary size for methods with tags (MCT; COCO has 80).")
  flags.DEFINE_enum("input", "device", ["device", "host"], "Where batches come from (see the module docstring).")
  flags.DEFINE_bool(
    "torch_reference", False, "Also time the PyTorch VirTex reference on the same device (VirTex only)."
  )
  flags.DEFINE_bool("torch_compile", True, "torch.compile the PyTorch reference.")


FLAGS = flags.FLAGS

# Dense bf16 peak FLOP/s per device.
PEAK_FLOPS = {
  "H100": 989e12,
  "H200": 989e12,
  "A100": 312e12,
  "L4": 121e12,
  "TPU v4": 275e12,
  "TPU v5 lite": 197e12,
  "TPU v5p": 459e12,
  "TPU v6 lite": 918e12,
}


def peak_flops(device) -> float | None:
  kind = device.device_kind
  for name, flops in PEAK_FLOPS.items():
    if name.lower() in kind.lower():
      return flops
  return None


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
  import re

  m = re.search(r"inception_crop\((\d+)", config.data.pp)
  return FLAGS.image_size or (int(m.group(1)) if m else 224)


def benchmark(
  config, steps: int, image_size: int, vocab_size: int, input_mode: str = "device", num_tags: int = 80
) -> dict:
  mesh = sharding.make_mesh(config.sharding.num_devices or None)
  bs = config.batch_size
  rng = np.random.default_rng(0)
  max_len = config.method.get("max_len") or config.method.text.max_len
  method = methods.build(config.method, vocab_size)
  # A random batch of every field the method reads: images ('image', MCT's 'image_q'/'image_k'), token
  # sequences ('tokens*'), LocTex's rendered traces (about 10% of the cells per token), MCT's tags.
  local = {"stat_empty": np.zeros((bs,), bool)}
  for field in method.fields:
    if field.startswith("image"):
      local[field] = rng.normal(size=(bs, image_size, image_size, 3)).astype(np.float32)
    elif field.startswith("tokens"):
      local[field] = rng.integers(5, vocab_size, size=(bs, max_len)).astype(np.int32)
      local[field][:, 0], local[field][:, -1] = 2, 3
    elif field.startswith("trace_mask_"):
      r = int(field.rsplit("_", 1)[1])
      local[field] = (rng.random((bs, max_len, r, r)) < 0.1).astype(np.uint8)
    elif field == "tags":
      local[field] = (rng.random((bs, num_tags)) < 0.05).astype(np.uint8)
    else:
      raise ValueError(f"The benchmark does not know how to make field {field!r} of {config.method.name}.")
  batch_sh = sharding.batch_sharding(mesh)
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
  state = jax.jit(init, out_shardings=state_sh)(key, batch)
  step = jax.jit(
    train_step.make_train_step(method, tx, schedules, key),
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

  def run(n):
    nonlocal state
    metrics = None
    # Host mode: the loop's device prefetch thread transfers the next batches while a step runs.
    cycle = (host_batches[i % len(host_batches)] for i in range(n))
    batches = sharding.device_prefetch(cycle, batch_sh, 2) if input_mode == "host" else (batch for _ in range(n))
    for next_batch in batches:
      state, metrics = compiled(state, next_batch)
    jax.block_until_ready(metrics)
    return metrics

  run(3)
  t0 = time.time()
  metrics = run(steps)
  step_s = (time.time() - t0) / steps
  device = jax.devices()[0]
  peak = peak_flops(device)
  # Model FLOPs of the whole (global) batch; MFU divides by all devices' peak.
  mfu = flops / step_s / (peak * mesh.devices.size) if peak else None
  return {
    "device": device.device_kind,
    "num_devices": int(mesh.devices.size),
    "batch_size": bs,
    "image_size": image_size,
    "method": config.method.name,
    "input": input_mode,
    "dtype": config.method.dtype,
    "final_loss": float(metrics["train/loss"]),
    "step_seconds": step_s,
    "images_per_second": bs / step_s,
    "model_tflops_per_step": flops / 1e12,
    "xla_cost_analysis_tflops_per_step": xla_flops / 1e12,
    "achieved_tflops_per_second": flops / step_s / 1e12,
    "mfu": mfu,
    "compile_seconds": compile_s,
  }


def torch_reference(config, steps: int, image_size: int, vocab_size: int) -> dict:
  """Times the PyTorch reference in a subprocess (it frees the device's memory before JAX takes it)."""
  import subprocess
  import sys
  import tempfile

  m = config.method
  if m.name != "virtex" or m.task != "bicaptioning" or m.backbone.depth != 50 or m.backbone.width != 64:
    raise ValueError("--torch_reference mirrors VirTex bicaptioning with a ResNet-50 backbone only.")
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    cmd = [sys.executable, "-m", "vlrep.tools.torch_reference", f"--batch_size={config.batch_size}"]
    cmd += [f"--image_size={image_size}", f"--vocab_size={vocab_size}", f"--hidden={m.hidden}"]
    cmd += [f"--layers={m.num_layers}", f"--max_len={m.max_len}", f"--steps={steps}", f"--output={f.name}"]
    cmd += [] if FLAGS.torch_compile else ["--nocompile"]
    subprocess.run(cmd, check=True)
    with open(f.name) as fh:
      return json.load(fh)


def main(argv):
  del argv
  try:  # tf.data must not take accelerator memory; TensorFlow is not needed here at all.
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
  except ImportError:
    pass
  config, image_size = FLAGS.config, _image_size(FLAGS.config)
  vocab_size = FLAGS.vocab_size or config.tokenizer.vocab_size
  reference = torch_reference(config, FLAGS.steps, image_size, vocab_size) if FLAGS.torch_reference else None
  result = benchmark(config, FLAGS.steps, image_size, vocab_size, FLAGS.input, FLAGS.num_tags)
  if reference:
    result["torch_reference"] = reference
    result["speedup_vs_torch"] = result["images_per_second"] / reference["images_per_second"]
  print(json.dumps(result, indent=2), flush=True)
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  _define_flags()
  flags.mark_flags_as_required(["config"])
  app.run(main)
