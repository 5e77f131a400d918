"""Top-1 / top-5 of a classifier trained end to end (VirTex A.3 fine-tuning), on its own logits."""

from __future__ import annotations

from vlrep.evaluators._inputs import EvalInputs, Model
from vlrep.evaluators.linear_probe import extract_labeled, topk_accuracy


class Evaluator:
  """Evaluator for classifiers trained end to end: top-1 / top-5 of the model's own 'logits' on a split.

  Config: dataset, data_dir, config_name, split, pp, label_key, batch_size, every_steps.
  """

  feature_key = "logits"

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.builder = inputs.builder(config)
    self.inputs = inputs

  def evaluate(self, model: Model) -> dict[str, float]:
    c = self.config
    features_fn = model.extractor(self.feature_key)
    logits, labels = extract_labeled(
      self.inputs, self.builder, c.split, c.pp, c.get("label_key", "label"), c.batch_size, features_fn
    )
    return {"top1": topk_accuracy(logits, labels, 1), "top5": topk_accuracy(logits, labels, min(5, logits.shape[1]))}
