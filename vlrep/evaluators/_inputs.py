"""What an evaluator gets of the run it evaluates: at construction `EvalInputs` (by name), at each evaluation the
`Model` to evaluate; and the one way evaluators read a split.

Built once by the training loop (and by `vlrep.evaluate`): the run's tokenizer, its method (for whole-model
evaluators: captioning, retrieval, masked tokens, localization, VL tasks), what the method's setup derived from the
data (ICMLM's concepts, a VQA run's answer vocabulary: `needs`), and this process's place among the hosts.

A helper of the evaluators, not an evaluator (hence the leading '_': `vlrep.modules` does not list it); the rest of
vlrep takes both names from the package, `from vlrep.evaluators import EvalInputs, Model`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from vlrep.data import pipeline, records


@dataclasses.dataclass(frozen=True)
class EvalInputs:
  tokenizer: Any = None
  method: Any = None
  needs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  host: int = 0
  num_hosts: int = 1

  @property
  def pp_context(self) -> dict:
    """What preprocessing ops read (the tokenizer, the method's needs), as `pipeline` takes it."""
    return {"tokenizer": self.tokenizer, **self.needs}

  def builder(self, config):
    """The TFDS builder of an evaluator config's `dataset`, `data_dir`, `config_name`."""
    return pipeline.get_builder(config.dataset, config.get("data_dir"), config.get("config_name"))

  def batches(
    self, builder, split: str, pp: str, fields: Sequence[str], batch_size: int
  ) -> Iterator[dict[str, np.ndarray]]:
    """One pass over this host's shard of `split` in batches of `batch_size` (global) / hosts, padded rows
    marked by `_mask`; every host yields as many batches."""
    return pipeline.eval_batches(
      builder, split, pp, fields, batch_size // self.num_hosts, self.host, self.num_hosts, self.pp_context
    )


@dataclasses.dataclass(frozen=True)
class Model:
  """What every evaluator's `evaluate(model)` evaluates: the model's `variables` ({'params': ..., 'batch_stats': ...,
  on device: whole-model evaluators such as captioning apply the method to them) and `features(local_batch, key)
  -> (global features, global batch)` as numpy, the method's `features(variables, images)[key]` extracted sharded
  over the mesh (backbone evaluators: the probe, the SVM). The training loop and `vlrep.evaluate` build it."""

  variables: Mapping[str, Any]
  features: Callable[[Mapping[str, np.ndarray], str], tuple[np.ndarray, dict[str, np.ndarray]]]
  backbone: Callable[[], tuple[Any, Mapping[str, Any]]] | None = None
  """`backbone()` -> (the visual backbone's Flax module, its variables on the host), for evaluators that rebuild it
  elsewhere (detection converts it to PyTorch); `vlrep.evaluate` gives it, the training loop does not."""

  def extractor(self, key: str) -> Callable[[Mapping[str, np.ndarray]], tuple[np.ndarray, dict[str, np.ndarray]]]:
    """`features` of one key: local batch -> (global features, global batch), what a backbone evaluator's
    extraction loop calls."""
    return lambda local_batch: self.features(local_batch, key)


def caption_width(builder, split: str, key: str, num_captions: int) -> int:
  """How many captions per image an evaluator that groups them by image reads: its config's `num_captions` (the
  first C, as COCO's 5-caption protocols), or with 0 every caption of each image (the split's most; your own data
  has any number)."""
  return num_captions or max(1, records.most_texts(builder, split, key))


def with_fixed_captions(pp: str, key: str, width: int) -> str:
  """`pp` then `fixed_captions`: each image's first `width` captions, '' padded, so images with different numbers
  of captions batch (the evaluators skip empty ones)."""
  return f"{pp}|fixed_captions({width}, key={key!r}, out={key!r})"
