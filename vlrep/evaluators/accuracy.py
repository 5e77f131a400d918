"""Top-1 / top-5 of a classifier trained end to end (VirTex A.3 fine-tuning), on its own logits."""

from __future__ import annotations

from collections.abc import Callable

from vlrep.data import pipeline
from vlrep.evaluators.linear_probe import extract_labeled, topk_accuracy


class Accuracy:
  """Evaluator for classifiers trained end to end: top-1 / top-5 of the model's own 'logits' on a split.

  Config: dataset, data_dir, config_name, split, pp, label_key, batch_size, every_steps.
  """

  feature_key = "logits"

  def __init__(self, config, context: dict, host: int = 0, num_hosts: int = 1):
    self.config = config
    self.builder = pipeline.get_builder(config.dataset, config.get("data_dir"), config.get("config_name"))
    self.context, self.host, self.num_hosts = context, host, num_hosts

  def run(self, features_fn: Callable) -> dict[str, float]:
    c = self.config
    logits, labels = extract_labeled(
      self.builder,
      c.split,
      c.pp,
      c.get("label_key", "label"),
      c.batch_size,
      features_fn,
      self.host,
      self.num_hosts,
      self.context,
    )
    return {"top1": topk_accuracy(logits, labels, 1), "top5": topk_accuracy(logits, labels, min(5, logits.shape[1]))}


Evaluator = Accuracy  # what vlrep.evaluators.build instantiates for type "accuracy"
