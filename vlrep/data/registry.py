"""The preprocessing-op registry: `name(args)` op factories, the `|`-separated string parser, and the per-example
seed splitting every random op uses. A leaf of the data layer: op libraries (ops, traces, vl_ops, region_files)
register into it, and nothing here imports them.

Randomness is stateless: every example carries a seed `_rng` derived from its position in the global input
stream, and each random op splits it (`next_rng`). The same example index therefore always gets the same
augmentation, which makes runs resumable to the exact batch and independent of tf.data's parallelism.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from vlrep.data.op_strings import op_calls

Example = dict[str, Any]
Op = Callable[[Example], Example]

_REGISTRY: dict[str, Callable[..., Op]] = {}


def register(fn):
  """Registers a TensorFlow op factory: get_NAME(*args) -> fn(example) -> example, run inside tf.data."""
  _REGISTRY[fn.__name__.removeprefix("get_")] = fn
  return fn


def register_host(fn):
  """Registers a host op factory: get_NAME(*args, context) -> HostOp, run on numpy batches after tf.data.

  Ops that need Python (SentencePiece) run here rather than in a tf.numpy_function: Python callbacks inside
  tf.data contend for the GIL and can deadlock when the iterator is torn down.
  """
  fn.host = True
  return register(fn)


class HostOp(NamedTuple):
  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  fn: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class Preprocess(NamedTuple):
  """A parsed preprocessing string: per-example TF ops, then per-batch host ops."""

  example_fn: Op
  batch_fn: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
  host_inputs: tuple[str, ...]
  host_outputs: tuple[str, ...]


def known_ops() -> list[str]:
  return sorted(_REGISTRY)


def op_arguments(pp: str, *names: str) -> dict[str, Any] | None:
  """The arguments of the first op in `pp` named one of `names`, bound to its factory's signature with the
  defaults filled in (e.g. `{'max_regions': 36, 'key': 'objects'}` for `regions_from_objects(36)`), plus
  `'_op'`: the op's name. None when `pp` has none of them. Tools read a recipe's shapes (crop size, regions per
  image, text length) with this, never with a regex over the string, which may hold a user's path."""
  for name, args, kwargs in op_calls(pp):
    if name in names:
      if name not in _REGISTRY:
        raise ValueError(f"Unknown preprocessing op {name!r} in {pp!r}. Known ops: {', '.join(known_ops())}")
      signature = inspect.signature(_REGISTRY[name])
      bound = signature.bind_partial(*args, **kwargs)
      bound.apply_defaults()
      return {**{k: v for k, v in bound.arguments.items() if k != "context"}, "_op": name}
  return None


def parse(pp: str, context: dict | None = None) -> Preprocess:
  """Parses a `|`-separated op string. `context` carries objects such as the tokenizer. Host ops (e.g.
  `tokenize`) must come after every TF op."""
  context = context or {}
  tf_ops, host_ops = [], []
  for name, args, kwargs in op_calls(pp):
    if name not in _REGISTRY:
      raise ValueError(f"Unknown preprocessing op {name!r} in {pp!r}. Known ops: {', '.join(known_ops())}")
    factory = _REGISTRY[name]
    if getattr(factory, "host", False):
      host_ops.append(factory(*args, context=context, **kwargs))
    elif host_ops:
      raise ValueError(f"Op {name!r} follows a host op in {pp!r}; host ops (tokenize) must come last.")
    else:
      tf_ops.append(factory(*args, **kwargs))

  # Graph code throughout (the ops use tf.cond and tf.while_loop, never Python control flow on tensors), so
  # AutoGraph's source rewrite is skipped: it cost about a second per pipeline built.
  @tf.autograph.experimental.do_not_convert
  def example_fn(example: Example) -> Example:
    for op in tf_ops:
      example = op(example)
    return example

  def batch_fn(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for op in host_ops:
      batch = op.fn(batch)
    return batch

  host_outputs = tuple(o for op in host_ops for o in op.outputs)
  # What tf.data must deliver: each host op's inputs that no earlier host op makes (an op may read and rewrite a
  # field, e.g. pair_mask).
  host_inputs, made = [], set()
  for op in host_ops:
    host_inputs += [i for i in op.inputs if i not in made and i not in host_inputs]
    made.update(op.outputs)
  host_inputs = tuple(host_inputs)
  return Preprocess(example_fn, batch_fn, host_inputs, host_outputs)


def next_rng(example: Example) -> tf.Tensor:
  """Splits the example's seed; returns a fresh seed for this op and stores the other."""
  seeds = tf.random.experimental.stateless_split(example["_rng"], num=2)
  example["_rng"] = seeds[0]
  return seeds[1]
