"""Evaluators, built from `config.evals` = {name: {type: ..., every_steps: ..., ...}}.

An evaluator type is a module here (vlrep.evaluators.<type>, listed in KNOWN) whose `Evaluator(config, run)` (run:
`RunInputs`, what it may use of the run, and its `batches`) has `.config`, `.feature_key` (which of the method's
`features` it needs) and `.run(features_fn)` ->
{metric: value}; the loop prefixes metrics with the evaluator's name (e.g. 'probe/map').
"""

from __future__ import annotations

import importlib

from vlrep.errors import UserError
from vlrep.evaluators.run_inputs import Model, RunInputs  # noqa: F401  (the contract's types)

KNOWN = (
  "voc07_svm",
  "linear_probe",
  "accuracy",
  "captioning",
  "localization",
  "retrieval",
  "vsepp",
  "tagging",
  "masked_tokens",
  "vl_task",
  "held_out_loss",
)


def _module(evaluator_type: str):
  if "." not in evaluator_type and evaluator_type not in KNOWN:
    raise UserError(f"Unknown evaluator type {evaluator_type!r}. Known evaluators: {', '.join(KNOWN)}")
  return importlib.import_module(evaluator_type if "." in evaluator_type else f"vlrep.evaluators.{evaluator_type}")


def build(config, run: RunInputs):
  """The evaluator of `config.type`: the `Evaluator` class of the module vlrep.evaluators.<type> (or of the module
  at that dotted path: an evaluator of your own), given what it may use of the run (`RunInputs`)."""
  return _module(config.type).Evaluator(config, run)


def needs_method(config) -> bool:
  """Whether the evaluator uses the run's method and tokenizer (its class's `needs_method`): vlrep.evaluate then
  rebuilds them."""
  return getattr(_module(config.type).Evaluator, "needs_method", False)


def selection_rule(evals_config, best_metric: str, select_on_test: bool = False) -> str:
  """What a run keeps its best checkpoint by, in words (summary.json's `best_checkpoint_selected_on`).

  A `best_metric` that scores an evaluator's test split (its module's TEST_METRICS, e.g. the VOC07 probe's 'map')
  is refused unless `select_on_test` is set: a checkpoint chosen on the split that is then reported is not a
  held-out result. VirTex's appendix A.4 does exactly that; its recipe sets `select_on_test` to reproduce it."""
  if not best_metric:
    return "none: the last checkpoint"
  name, _, metric = best_metric.partition("/")
  if name not in evals_config:  # e.g. `--config.evals={}`: nothing is evaluated, so nothing is chosen
    return f"none: best_metric {best_metric!r} names no evaluator of this config; the last checkpoint"
  cfg = evals_config[name]
  if metric in getattr(_module(cfg.type), "TEST_METRICS", ()):
    split = f"{cfg.get('dataset', '?')} {cfg.get('test_split', '?')}"
    if not select_on_test:
      raise UserError(
        f"best_metric {best_metric!r} is the score on {name}'s test split ({split}): choosing the checkpoint by it "
        "is selection on the test split. Select on a held-out score (e.g. probe/map_cv, the probe's cross-"
        "validation on its training split, or probe/map_val with a val_split), or set select_on_test=True to "
        "do it knowingly (VirTex appendix A.4's procedure); the summary then says so."
      )
    return f"{best_metric}: the TEST split ({split}), chosen knowingly (select_on_test=True)"
  return f"{best_metric}: held out from {name}'s test split"


def build_all(evals_config, run: RunInputs) -> dict:
  for name, cfg in evals_config.items():
    every = cfg.get("every_steps", 0)
    if not isinstance(every, int) or every < 0:
      # (A negative value would pass `step % every == 0` at every step and evaluate after each one.)
      raise UserError(
        f"evals.{name}.every_steps={every!r}: use a step count > 0, or 0 to evaluate only after the last step."
      )
  return {name: build(cfg, run) for name, cfg in evals_config.items()}
