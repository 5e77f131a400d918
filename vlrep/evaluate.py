"""Evaluates a trained checkpoint: `python -m vlrep.evaluate --config=configs/eval/NAME.py --workdir=DIR`.

The eval config lists evaluators in `evals` (the same entries a training config's `evals` holds); the run's own
config (saved in the checkpoint) says how to rebuild the model. Metrics are merged into DIR/summary.json under
`<eval name>/<metric>`, beside the training ones, together with `<eval name>/checkpoint_step`.

Also the shared loading code for the tools that work on checkpoints (export, caption, the notebook):
`load_run` restores parameters without needing the training data, `backbone_fn` gives the jitted frozen
backbone every transfer evaluation uses (BatchNorm in inference mode, float32).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags


@dataclasses.dataclass
class Run:
  """A restored checkpoint: its training config, parameters and model state (numpy), step and where."""

  config: ConfigDict
  params: dict
  model_state: dict
  step: int
  path: str
  meta: dict

  @property
  def variables(self) -> dict:
    return {"params": self.params, **self.model_state}


def load_run(workdir: str, checkpoint: str = "best") -> Run:
  """Restores WORKDIR's 'best' or 'latest' checkpoint, or the one of a given step (as a string of digits).

  'best' falls back to 'latest' when the run kept no best checkpoint (no evaluator had a best metric).
  """
  import orbax.checkpoint as ocp

  workdir = os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"No run directory {workdir}.")
  dirs = {"best": os.path.join(workdir, "best"), "latest": os.path.join(workdir, "checkpoints")}

  def steps_in(d):
    return sorted(int(s) for s in os.listdir(d) if s.isdigit()) if os.path.isdir(d) else []

  if checkpoint == "best" and not steps_in(dirs["best"]):
    checkpoint = "latest"
  if checkpoint in dirs:
    directory, steps = dirs[checkpoint], steps_in(dirs[checkpoint])
    if not steps:
      raise FileNotFoundError(f"{workdir} has no checkpoint (looked in {directory}). Train with vlrep.main first.")
    step = steps[-1]
  elif checkpoint.isdigit():
    step = int(checkpoint)
    directory = next((d for d in dirs.values() if step in steps_in(d)), None)
    if directory is None:
      available = sorted(set(steps_in(dirs["best"]) + steps_in(dirs["latest"])))
      raise FileNotFoundError(f"{workdir} has no checkpoint of step {step}; available steps: {available}")
  else:
    raise ValueError(f"--checkpoint must be 'best', 'latest' or a step number, got {checkpoint!r}.")
  import jax

  mngr = ocp.CheckpointManager(directory)
  meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  mngr.close()
  # Onto this process's first device, whatever device count and sharding wrote the checkpoint.
  state_path = os.path.join(directory, str(step), "state")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  checkpointer = ocp.StandardCheckpointer()
  abstract = jax.tree.map(
    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), checkpointer.metadata(state_path).item_metadata
  )
  state = checkpointer.restore(state_path, abstract)
  to_np = lambda tree: {k: to_np(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}  # noqa: E731
  return Run(
    config=ConfigDict(meta["config"]),
    params=to_np(state["params"]),
    model_state=to_np(state.get("model_state", {})),
    step=step,
    path=os.path.join(directory, str(step)),
    meta=meta,
  )


def backbone_of(run: Run) -> tuple[Any, dict]:
  """(ResNet module in float32, its variables) of a run; a clear error when the checkpoint has no backbone."""
  from vlrep.models import resnet

  if "backbone" not in run.params:
    raise ValueError(
      f"The checkpoint {run.path} has no visual backbone (top-level parameters: {sorted(run.params)}); "
      "transfer evaluation and export need a model with a 'backbone' ResNet."
    )
  cfg = dict(run.config.method.get("backbone", {}))
  if cfg.get("arch", "resnet") == "vgg16":
    from vlrep.models import vgg

    module = vgg.VGG16(width=cfg.get("width", 64))
  else:
    module = resnet.ResNet(
      depth=cfg.get("depth", 50),
      width=cfg.get("width", 64),
      inner_multiplier=cfg.get("inner_multiplier", 1),
      bn_group_size=0,
      stem=cfg.get("stem", "imagenet"),
      stem_stride=cfg.get("stem_stride", 2),
    )
  variables = {"params": run.params["backbone"]}
  stats = run.model_state.get("batch_stats", {}).get("backbone")
  if stats is not None:
    variables["batch_stats"] = stats
  return module, variables


def backbone_fn(run: Run, mesh=None):
  """features_fn(local batch) -> {'pre_logits', 'grid', 'stage1'..'stage4'} as evaluators call it.

  Returns a function of (local batch dict with 'image', feature key) -> (global features np, global batch np),
  jitted and sharded over the mesh's data axis like the training loop's extraction.
  """
  import jax

  from vlrep import sharding

  module, variables = backbone_of(run)
  mesh = mesh or sharding.make_mesh()
  batch_sharding = sharding.batch_sharding(mesh)
  variables = jax.device_put(variables, sharding.replicated(mesh))

  def extract(variables, batch, key):
    grid, aux = module.apply(variables, batch["image"], False)
    return {"grid": grid, **aux}[key], batch

  jitted = jax.jit(extract, static_argnums=2, out_shardings=sharding.replicated(mesh))

  def features(local_batch, key):
    f, b = jitted(variables, sharding.global_batch(local_batch, batch_sharding), key)
    return np.asarray(f), {k: np.asarray(v) for k, v in b.items()}

  return features


def method_and_tokenizer(run: Run) -> dict:
  """The run's method (whole model) and tokenizer, rebuilt from its config: what captioning and the
  localization metric need."""
  from vlrep import methods
  from vlrep.data import pipeline, tokenizers

  data = run.config.data
  builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"))
  tokenizer = tokenizers.ensure_tokenizer(run.config.tokenizer, builder)
  concepts = None
  if run.config.get("concepts"):  # ICMLM: the concept set the run was trained with (cached next to the data)
    from vlrep.data import concepts as concepts_lib

    concepts = concepts_lib.ensure_concepts(
      run.config.concepts, builder, tokenizer, run.config.method.get("bert_path", "")
    )
  answer_vocab = None
  if run.config.get("answers"):  # VQA runs: the answer vocabulary they were trained with (rebuilt from the data)
    from vlrep.data import vl_ops

    answer_vocab = vl_ops.answer_vocab(run.config.answers, builder)
  method = methods.build(run.config.method, tokenizer.vocab_size, concepts=concepts, answer_vocab=answer_vocab)
  return {"method": method, "tokenizer": tokenizer, "concepts": concepts, "answer_vocab": answer_vocab}


def evaluate(eval_config: ConfigDict, workdir: str, checkpoint: str = "best", names=None) -> dict[str, float]:
  """Runs the eval config's evaluators on a checkpoint; merges `<name>/<metric>` into summary.json."""
  import jax

  from vlrep import evaluators
  from vlrep.train import write_summary

  run = load_run(workdir, checkpoint)
  logging.info("Evaluating %s (step %d, %s).", run.path, run.step, run.config.method.get("name"))
  evals_cfg = eval_config.evals
  unknown = [n for n in (names or []) if n not in evals_cfg]
  if unknown:
    raise ValueError(f"Unknown evaluations {unknown}; this config defines {sorted(evals_cfg)}.")
  context = {"run": run}
  # Whole-model evaluators (captioning, localization, retrieval) need the method; they and vsepp the tokenizer.
  if any(cfg.type in ("captioning", "localization", "retrieval", "vsepp", "vl_task") for cfg in evals_cfg.values()):
    context.update(method_and_tokenizer(run))
  host, num_hosts = jax.process_index(), jax.process_count()
  features = backbone_fn(run)
  results: dict[str, float] = {}
  for name, cfg in evals_cfg.items():
    if names and name not in names:
      continue
    ev = evaluators.build(cfg, context, host, num_hosts)
    if ev.feature_key:
      metrics = ev.run(lambda batch, key=ev.feature_key: features(batch, key))
    else:
      metrics = ev.run(None, variables=jax.device_put(run.variables))
    results.update({f"{name}/{k}": v for k, v in metrics.items()})
    results[f"{name}/checkpoint_step"] = run.step
    logging.info("%s: %s", name, ", ".join(f"{k}={v:.2f}" for k, v in metrics.items()))
  if host == 0:
    write_summary(workdir, results)
  return results


def define_flags():
  """Command-line flags (defined only when run as a command, so importing the module defines none)."""
  flags.DEFINE_string("workdir", None, "The training run's directory (its checkpoints and summary.json).")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  flags.DEFINE_list("only", [], "Run only these evaluations of the config (default: all).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  import tensorflow as tf

  tf.config.set_visible_devices([], "GPU")
  results = evaluate(flags.FLAGS.config, flags.FLAGS.workdir, flags.FLAGS.checkpoint, flags.FLAGS.only)
  print("\n".join(f"{k}: {v:.2f}" for k, v in sorted(results.items())), flush=True)


if __name__ == "__main__":
  define_flags()
  config_flags.DEFINE_config_file("config", None, "Eval config: configs/eval/NAME.py[:ARG].", lock_config=True)
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
