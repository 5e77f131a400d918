"""Pretraining methods: `config.method.name` names a module here (vlrep.methods.<name>), or is the dotted path of a
module elsewhere (a method of your own, outside vlrep, named by your own config; a run folder's saved config names
only vlrep's own methods, `vlrep.runs.check_saved_names`). Either way the module keeps the same contract:

- a `Method` class, built as `Method(config, vocab_size, **needs)` (the config's `method` block, the tokenizer's
  vocabulary size, 0 without one, and what `setup` and the run's concept set returned), whose instances satisfy
  the `Method` protocol below: `fields`, `init`, `loss` and `features` (docs/architecture.md, "Contracts");
- optionally, on the class, `pretrained_variables(pretrained)` (`UsesPretrained`: values the loop writes into the
  fresh state) and `pretrained_runs()` (`NamesPretrainedRuns`: the runs the loop loads and hands to it; without it
  `pretrained` is {});
- optionally, at module level, `setup(config, builder, tokenizer) -> dict` (see `setup` here);
- for `config.microbatches` (`SplitsItsLoss`): `per_example` and `combine`, the loss in two parts, and optionally
  `prepare`; `loss` is then `loss_of_parts` (docs/architecture.md, "Contracts").

A method never reads a checkpoint and knows nothing of devices. `vlrep.modules` looks the name up and lists the
methods: every module here whose name does not start with '_' (those that do are the methods' helpers, e.g.
`_contrastive`'s losses); tests/test_contracts.py checks every listed module against these protocols.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import ml_collections

from vlrep import modules


@runtime_checkable
class Method(Protocol):
  """What the training loop and the evaluators use of a method (the instance its module's `Method` class builds)."""

  fields: Sequence[str]
  """The batch keys `init` and `loss` read: the loop asks the input pipeline for exactly these."""

  def init(self, rng, batch) -> Mapping[str, Any]:
    """The fresh variables ({'params': ..., and any other collection}) for a batch of `fields`."""

  def loss(self, variables, batch, rng, train):
    """(scalar loss, {metric: scalar}, new model state): traced inside the loop's jitted step."""

  def features(self, variables, images) -> Mapping[str, Any]:
    """{key: array} of a batch of images (e.g. 'pre_logits', 'grid'): what backbone evaluators probe."""


@runtime_checkable
class UsesPretrained(Protocol):
  """A method that starts from values it does not initialise itself (a pretrained BERT, another run's weights)."""

  def pretrained_variables(self, pretrained) -> Mapping[str, Any]:
    """The values written into the fresh state ({'params': ..., 'model_state': ...}, numpy trees), given
    `pretrained`: {name: the run loaded at its best checkpoint} for the runs `pretrained_runs` names."""


@runtime_checkable
class NamesPretrainedRuns(Protocol):
  """A method whose pretrained values come from other runs: the loop loads them and hands them over."""

  def pretrained_runs(self) -> Mapping[str, str]:
    """{name: workdir} of the runs `pretrained_variables` receives."""


@runtime_checkable
class SplitsItsLoss(Protocol):
  """A method whose loss splits into work per example and a combination over the global batch: what the train
  step needs to take a batch in microbatches (`config.microbatches`, vlrep.train_step). Its `loss` is
  `loss_of_parts`, so one batch at once computes exactly these parts.

  `per_example` must treat examples independently (BatchNorm groups aside: a microbatch holds whole groups), so
  that running it on each microbatch and concatenating equals running it on the batch; everything that mixes
  examples (a contrastive loss's negatives, a mean's denominator, a queue's update) is `combine`'s. The step
  takes the gradient through both: `combine`'s with respect to the outputs, pulled back through `per_example`
  one microbatch at a time (Gao et al. 2021's gradient cache, exact for any `combine`; when `combine` is linear
  in the outputs XLA drops the first forward pass, and the step costs what one pass costs)."""

  def per_example(self, variables, batch, rng, train):
    """(outputs, new model state): outputs a dict of floating arrays, each with the batch's leading dimension
    (embeddings, per-token losses, weights); the state is BatchNorm's (averaged over microbatches)."""

  def combine(self, variables, outputs, batch):
    """(scalar loss, {metric: scalar}, new model state) from the global batch's `outputs` (in the batch's order)
    and the batch; may read parameters (a learned temperature) and the model state (a queue)."""


def loss_of_parts(method, variables, batch, rng, train: bool):
  """A `SplitsItsLoss` method's `loss`: `prepare` (the draws over the whole batch, when the method has it),
  `per_example` on the whole batch, then `combine`; the two parts' new model states merged. Both `prepare` and
  `per_example` get `rng` (a method splits it, so its masks and its dropout draw apart); the train step's
  microbatched path gives microbatch m's `per_example` `fold_in(rng, m)`, and calls the same parts, so
  `microbatches=1` and N compute one loss (dropout aside: its draws differ)."""
  batch = prepare(method, batch, rng)
  outputs, example_state = method.per_example(variables, batch, rng, train)
  loss, metrics, batch_state = method.combine(variables, outputs, batch)
  return loss, metrics, merge_states(example_state, batch_state)


def prepare(method, batch, rng):
  """The batch with the method's draws over the whole batch added (`method.prepare(batch, rng)`: masks, a
  shuffle), or as it is for a method without them. Done before a batch is split, so the draws are the same
  whatever the microbatch count."""
  return method.prepare(batch, rng) if hasattr(method, "prepare") else batch


def merge_states(a: Mapping, b: Mapping) -> dict:
  """`a` updated by `b`, nested dicts merged key by key (MCT: `per_example` gives the momentum encoder's
  BatchNorm statistics, `combine` its parameters)."""
  out = dict(a)
  for k, v in b.items():
    out[k] = merge_states(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
  return out


def available() -> tuple[str, ...]:
  """The methods vlrep has: the modules of this package (its helpers' names start with '_')."""
  return modules.available("methods")


def _module(name: str):
  """The module of method `name`: vlrep.methods.<name> for a plain name; a dotted path is a module of the user's
  own, imported as named. Only a config the user gives names a dotted path: `vlrep.runs` refuses one in a run
  folder's saved config (a file's names are data, never code to import)."""
  if isinstance(name, str) and "." in name:
    return modules.own(name, "method.name")
  return modules.get("methods", name, "method")


def setup(config: ml_collections.ConfigDict, builder, tokenizer) -> dict:
  """What the run's method needs from its data before it is built: its module's optional
  `setup(config, builder, tokenizer) -> dict` (VQA runs: their answer vocabulary; a config's concept set comes
  from `data.concepts.run_concepts` beside it). The dict is the Method's extra keyword arguments and joins the
  preprocessing ops' context."""
  module = _module(config.method.name)
  return module.setup(config, builder, tokenizer) if hasattr(module, "setup") else {}


def has_setup(name: str) -> bool:
  """Whether the method's module reads its data before it is built (`setup`)."""
  return hasattr(_module(name), "setup")


def method_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The method's block as its models are built: `config.method`, with the run's `remat` policy (a step setting
  at the config's top level, vlrep.train_step.REMAT_POLICIES) added where one is set. Remat changes what the
  backward pass keeps, never a value, so a run rebuilt without it computes the same."""
  remat = config.get("remat", "none")
  if remat == "none":
    return config.method
  return ml_collections.ConfigDict({**config.method.to_dict(), "remat": remat})


def build(config: ml_collections.ConfigDict, vocab_size: int, **needs) -> Method:
  """The method named by `config.name`: the `Method` class of the module vlrep.methods.<name> (or of the module
  at that dotted path), given what `setup` returned."""
  return _module(config.name).Method(config, vocab_size, **needs)


def name_of(method) -> str:
  """What messages call a built method: its module's name for one of vlrep's (`clip`, every class being `Method`),
  its class's name otherwise."""
  module = type(method).__module__
  return module.rsplit(".", 1)[-1] if module.startswith("vlrep.methods.") else type(method).__name__
