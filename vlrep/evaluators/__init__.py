"""Evaluators, built from `config.evals` = {name: {type: ..., every_steps: ..., ...}}.

An evaluator type is a module here (vlrep.evaluators.<type>), or the dotted path of a module elsewhere (an
evaluator of your own, named by your own config; a run folder's saved config names only vlrep's own evaluators,
`vlrep.runs.check_saved_names`), that keeps this contract:

- an `Evaluator` class, built as `Evaluator(config, inputs)` (its config entry, and `inputs`: `EvalInputs`, what it
  may use of the run, with the one way to read a split, `inputs.batches`), whose instances satisfy the `Evaluator`
  protocol below: `config`, and `evaluate(model) -> {metric: value}` for a `Model` (the variables and the sharded
  feature extraction of the checkpoint evaluated). Backbone evaluators (the probe, the SVM) call
  `model.features(batch, key)` with the features key they need; whole-model ones (captioning, localization) apply
  the run's method to `model.variables`. The loop prefixes metrics with the evaluator's name (e.g. 'probe/map');
- optionally, on the class, `needs_method = True`: it uses the run's method and tokenizer, so `vlrep.evaluate`
  rebuilds them for it;
- optionally, at module level, `TEST_METRICS`: the metrics that score the config's test split (`selection_rule`).

`vlrep.modules` looks the type up and lists the types: every module here whose name does not start with '_';
those that do are the evaluators' helpers (metrics, solvers, `EvalInputs`). tests/test_contracts.py checks every
listed module against this contract.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from vlrep import modules
from vlrep.errors import UserError
from vlrep.evaluators._inputs import EvalInputs, Model


@runtime_checkable
class Evaluator(Protocol):
  """What the training loop and `vlrep.evaluate` use of an evaluator (the instance its module's `Evaluator` class
  builds)."""

  config: Any
  """Its entry of `config.evals` (`every_steps`: when the loop runs it)."""

  def evaluate(self, model: Model) -> dict[str, float]:
    """{metric: value} of `model`, the same on every host (each reads its shard of the split)."""


def available() -> tuple[str, ...]:
  """The evaluator types vlrep has: the modules of this package (its helpers' names start with '_')."""
  return modules.available("evaluators")


def _module(evaluator_type: str):
  """The module of an evaluator type: vlrep.evaluators.<type> for a plain name; a dotted path is a module of the
  user's own, imported as named. Only a config the user gives names a dotted path: `vlrep.runs` refuses one in a
  run folder's saved config (a file's names are data, never code to import)."""
  if isinstance(evaluator_type, str) and "." in evaluator_type:
    return modules.own(evaluator_type, "evaluator type")
  return modules.get("evaluators", evaluator_type, "evaluator type")


def build(config, inputs: EvalInputs) -> Evaluator:
  """The evaluator of `config.type`: the `Evaluator` class of the module vlrep.evaluators.<type> (or of the module
  at that dotted path: an evaluator of your own), given what it may use of the run (`EvalInputs`)."""
  return _module(config.type).Evaluator(config, inputs)


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
    split = f"{cfg.get('dataset', '?')} {cfg.get('test_split', cfg.get('split', '?'))}"
    if not select_on_test:
      raise UserError(
        f"best_metric {best_metric!r} is the score on {name}'s test split ({split}): choosing the checkpoint by it "
        "is selection on the test split. Select on a held-out score (e.g. probe/map_cv, the probe's cross-"
        "validation on its training split, or probe/map_val with a val_split), or set select_on_test=True to "
        "do it knowingly (VirTex appendix A.4's procedure); the summary then says so."
      )
    return f"{best_metric}: the TEST split ({split}), chosen knowingly (select_on_test=True)"
  return f"{best_metric}: held out from {name}'s test split"


def build_all(evals_config, inputs: EvalInputs) -> dict[str, Evaluator]:
  for name, cfg in evals_config.items():
    every = cfg.get("every_steps", 0)
    if not isinstance(every, int) or every < 0:
      # (A negative value would pass `step % every == 0` at every step and evaluate after each one.)
      raise UserError(
        f"evals.{name}.every_steps={every!r}: use a step count > 0, or 0 to evaluate only after the last step."
      )
  return {name: build(cfg, inputs) for name, cfg in evals_config.items()}
