"""Evaluates a trained checkpoint: `python -m vlrep.evaluate --config=configs/eval/NAME.py --workdir=DIR`.

The eval config lists evaluators in `evals` (the same entries a training config's `evals` holds); the run's own
config (saved in the checkpoint) says how to rebuild the model. Metrics are merged into DIR/summary.json under
`<eval name>/<metric>`, beside the training ones, together with `<eval name>/checkpoint_step`.

Restoring a run and its backbone is `vlrep.runs`' job.
"""

from __future__ import annotations

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from vlrep import evaluators, methods, runs
from vlrep.data import concepts, pipeline, tokenizers


def method_and_tokenizer(run: runs.Run) -> dict:
  """The run's method (whole model) and tokenizer, rebuilt from its config as training built them, with what
  its concept set (ICMLM's, MCT's tags on own data) and what the method's setup gave it (a VQA run's answers):
  what whole-model evaluators and tools need."""
  data = run.config.data
  builder = pipeline.get_builder(data.name, data.data_dir, data.get("config_name"))
  tokenizer = tokenizers.ensure_tokenizer(run.config.tokenizer, builder)
  needs = {**concepts.run_concepts(run.config, builder, tokenizer), **methods.setup(run.config, builder, tokenizer)}
  method = methods.build(run.config.method, tokenizer.vocab_size, **needs)
  return {"method": method, "tokenizer": tokenizer, **needs}


def run_inputs_of(run: runs.Run, with_method: bool = True) -> evaluators.RunInputs:
  """What an evaluator gets of `run` (its method and tokenizer rebuilt when `with_method`), on this process."""
  import jax

  host, num_hosts = jax.process_index(), jax.process_count()
  if not with_method:
    return evaluators.RunInputs(host=host, num_hosts=num_hosts)
  parts = method_and_tokenizer(run)
  method, tokenizer = parts.pop("method"), parts.pop("tokenizer")
  return evaluators.RunInputs(tokenizer=tokenizer, method=method, needs=parts, host=host, num_hosts=num_hosts)


def evaluate(eval_config: ConfigDict, workdir: str, checkpoint: str = "best", names=None) -> dict[str, float]:
  """Runs the eval config's evaluators on a checkpoint; merges `<name>/<metric>` into summary.json."""
  import jax

  run = runs.load_run(workdir, checkpoint)
  logging.info("Evaluating %s (step %d, %s).", run.path, run.step, run.config.method.get("name"))
  evals_cfg = eval_config.evals
  unknown = [n for n in (names or []) if n not in evals_cfg]
  if unknown:
    raise ValueError(f"Unknown evaluations {unknown}; this config defines {sorted(evals_cfg)}.")
  run_inputs = run_inputs_of(run, with_method=any(evaluators.needs_method(cfg) for cfg in evals_cfg.values()))
  features = None  # built on first use: a run without a backbone (VisualBERT on region files) has evaluations too
  results: dict[str, float] = {}
  for name, cfg in evals_cfg.items():
    if names and name not in names:
      continue
    ev = evaluators.build(cfg, run_inputs)
    if ev.feature_key:
      features = features or runs.backbone_fn(run)
      metrics = ev.run(lambda batch, key=ev.feature_key, f=features: f(batch, key))
    else:
      metrics = ev.run(None, variables=jax.device_put(run.variables))
    results.update({f"{name}/{k}": v for k, v in metrics.items()})
    results[f"{name}/checkpoint_step"] = run.step
    logging.info("%s: %s", name, ", ".join(f"{k}={v:.2f}" for k, v in metrics.items()))
  if run_inputs.host == 0:
    runs.write_summary(workdir, results)
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
