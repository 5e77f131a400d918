"""Evaluates a trained checkpoint: `python -m vlrep.evaluate --config=configs/eval/NAME.py --workdir=DIR`.

The eval config lists evaluators in `evals` (the same entries a training config's `evals` holds); the run's own
config (saved in the checkpoint) says how to rebuild the model. Metrics are merged into DIR/summary.json under
`<eval name>/<metric>`, beside the training ones, together with `<eval name>/checkpoint_step`.

Restoring a run and its backbone is `vlrep.runs`' job.
"""

from __future__ import annotations

import functools

import jax
from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from vlrep import evaluators, inference, run_setup, run_summary, runs
from vlrep.errors import UserError, exit_2_on_user_error


def evaluate(eval_config: ConfigDict, workdir: str, checkpoint: str = "best", names=None) -> dict[str, float]:
  """Runs the eval config's evaluators on a checkpoint; merges `<name>/<metric>` into summary.json."""
  evals_cfg = eval_config.evals
  unknown = [n for n in (names or []) if n not in evals_cfg]
  if unknown:
    raise UserError(f"Unknown evaluations {unknown}; this config defines {sorted(evals_cfg)}.")
  run = inference.load_run(workdir, checkpoint)
  run_summary.read_summary(workdir)  # a damaged summary.json is refused before the evaluations, not after them
  with inference.saved_config_errors(run):
    logging.info("Evaluating %s (step %d, %s).", run.path, run.step, run.config.method.get("name"))
  if "backbone" in run.params:
    inference.check_backbone(run)
  if any(evaluators.needs_method(cfg) for cfg in evals_cfg.values()):
    with inference.saved_config_errors(run):
      # the method and tokenizer, rebuilt as training built them (its own vocabulary copy where it has one)
      eval_inputs = run_setup.build_inputs(run.config, run.workdir)
  else:
    eval_inputs = evaluators.EvalInputs(host=jax.process_index(), num_hosts=jax.process_count())
  model = evaluators.Model(
    jax.device_put(run.variables), backbone_features(run), functools.cache(lambda: runs.backbone_of(run))
  )
  results: dict[str, float] = {}
  for name, cfg in evals_cfg.items():
    if names and name not in names:
      continue
    try:
      evaluator = evaluators.build(cfg, eval_inputs)
    except UserError:
      raise
    except ValueError as e:  # an evaluation the run cannot take (no tokenizer, no captioning head): said, not a bug
      raise UserError(f"--config's evaluation {name!r} does not apply to the run {run.path}: {e}") from e
    metrics = evaluator.evaluate(model)
    results.update({f"{name}/{k}": v for k, v in metrics.items()})
    results[f"{name}/checkpoint_step"] = run.step
    logging.info("%s: %s", name, ", ".join(f"{k}={v:.2f}" for k, v in metrics.items()))
  if eval_inputs.host == 0:
    run_summary.write_summary(workdir, results)
  return results


def backbone_features(run: runs.Run):
  """`features(local_batch, key)` of the run's backbone, built on first use: a run without a backbone (VisualBERT
  on region files) has whole-model evaluations too."""
  extract = functools.cache(lambda: runs.backbone_fn(run))
  return lambda local_batch, key: extract()(local_batch, key)


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
  app.run(exit_2_on_user_error(main))
