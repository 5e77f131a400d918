"""Evaluators, built from `config.evals` = {name: {type: ..., every_steps: ..., ...}}.

Each has `.config`, `.feature_key` (which of the method's `features` it needs) and `.run(features_fn)` ->
{metric: value}; the loop prefixes metrics with the evaluator's name (e.g. 'probe/map').
"""

from __future__ import annotations

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
)


def build(config, context: dict, host: int = 0, num_hosts: int = 1):
  if config.type == "voc07_svm":
    from vlrep.evaluators.voc07_svm import Voc07Svm

    return Voc07Svm(config, context, host, num_hosts)
  if config.type == "linear_probe":
    from vlrep.evaluators.linear_probe import LinearProbe

    return LinearProbe(config, context, host, num_hosts)
  if config.type == "accuracy":
    from vlrep.evaluators.linear_probe import Accuracy

    return Accuracy(config, context, host, num_hosts)
  if config.type == "captioning":
    from vlrep.evaluators.captioning import Captioning

    return Captioning(config, context, host, num_hosts)
  if config.type == "localization":
    from vlrep.evaluators.localization import Localization

    return Localization(config, context, host, num_hosts)
  if config.type == "retrieval":
    from vlrep.evaluators.retrieval import Retrieval

    return Retrieval(config, context, host, num_hosts)
  if config.type == "vsepp":
    from vlrep.evaluators.vsepp import VsePP

    return VsePP(config, context, host, num_hosts)
  if config.type == "tagging":
    from vlrep.evaluators.tagging import Tagging

    return Tagging(config, context, host, num_hosts)
  if config.type == "masked_tokens":
    from vlrep.evaluators.masked_tokens import MaskedTokens

    return MaskedTokens(config, context, host, num_hosts)
  if config.type == "vl_task":
    from vlrep.evaluators.vl_task import VLTask

    return VLTask(config, context, host, num_hosts)
  raise ValueError(f"Unknown evaluator type {config.type!r}. Known evaluators: {', '.join(KNOWN)}")


def build_all(evals_config, context: dict, host: int = 0, num_hosts: int = 1) -> dict:
  for name, cfg in evals_config.items():
    every = cfg.get("every_steps", 0)
    if not isinstance(every, int) or every < 0:
      # (A negative value would pass `step % every == 0` at every step and evaluate after each one.)
      raise ValueError(
        f"evals.{name}.every_steps={every!r}: use a step count > 0, or 0 to evaluate only after the last step."
      )
  return {name: build(cfg, context, host, num_hosts) for name, cfg in evals_config.items()}
