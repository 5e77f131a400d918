"""Supervised image classification with a ResNet: end-to-end fine-tuning for transfer (VirTex appendix A.3,
iNaturalist-style), with the backbone initialised from a pretrained run (`config.init_from`).

Config `method`: name='classifier', num_classes, backbone {depth, width, bn_group_size, stem, stem_stride}, dtype,
label_smoothing, head_init_std, multilabel (False: one class per image, softmax cross-entropy on an integer
'label'; True: several classes per image, sigmoid cross-entropy on a multi-hot 'label' [B, num_classes], e.g.
synthetic_scenes' shape presence: the supervised upper reference of the runlocal probe).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from vlrep import methods
from vlrep.models import backbones


class ClassifierModel(nn.Module):
  num_classes: int
  backbone: dict
  head_init_std: float = 0.01
  dtype: jnp.dtype = jnp.float32
  remat: str = "none"  # the backbone's rematerialisation policy (vlrep.models.remat.POLICIES); no parameter changes

  @nn.compact
  def __call__(self, images, train: bool = False):
    _, aux = backbones.from_config(self.backbone, dtype=self.dtype, remat=self.remat, name="backbone")(images, train)
    logits = nn.Dense(
      self.num_classes,
      kernel_init=nn.initializers.normal(self.head_init_std),
      param_dtype=jnp.float32,
      name="classifier",
    )(aux["pre_logits"])
    return logits, aux


class Method:
  """A ResNet classifier behind vlrep's method contract, its loss split for microbatches
  (`methods.SplitsItsLoss`)."""

  fields = ("image", "label")

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int = 0):
    del vocab_size
    if not config.get("num_classes"):
      raise ValueError("method.num_classes must be set for the classifier.")
    self.config = config
    self.model = ClassifierModel(
      config.num_classes,
      dict(config.backbone),
      config.get("head_init_std", 0.01),
      jnp.dtype(config.dtype),
      remat=config.get("remat", "none"),  # config.remat, copied in by methods.method_config
    )

  def init(self, rng, batch) -> dict:
    return self.model.init(rng, batch["image"], False)

  def loss(self, variables, batch, rng, train: bool = True):
    return methods.loss_of_parts(self, variables, batch, rng, train)

  def per_example(self, variables, batch, rng, train: bool = True):
    """Each image's loss (multilabel: each class's) and whether it is right (accuracy; multilabel: every class
    right), as floats."""
    del rng
    (logits, _), new_state = self.model.apply(variables, batch["image"], train, mutable=["batch_stats"])
    if self.config.get("multilabel", False):
      targets = batch["label"].astype(jnp.float32)
      if targets.ndim != 2 or targets.shape[1] != self.config.num_classes:
        raise ValueError(
          f"multilabel needs a multi-hot 'label' [B, {self.config.num_classes}]; got shape {targets.shape}."
        )
      # Per class [B, C]: combine's mean over all of them is the loss's, bit for bit.
      loss = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), targets)
      exact = jnp.all((logits > 0) == (targets > 0.5), axis=-1)
      return {"loss": loss, "exact_match": exact.astype(jnp.float32)}, new_state
    labels = optax.smooth_labels(
      jax.nn.one_hot(batch["label"], self.config.num_classes), self.config.get("label_smoothing", 0.0)
    )
    loss = optax.softmax_cross_entropy(logits.astype(jnp.float32), labels)
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return {"loss": loss, "accuracy": correct}, new_state

  def combine(self, variables, outputs, batch):
    """Means over the batch: linear in the outputs."""
    del variables, batch
    metric = "exact_match" if self.config.get("multilabel", False) else "accuracy"
    return jnp.mean(outputs["loss"]), {metric: jnp.mean(outputs[metric])}, {}

  def features(self, variables, images) -> dict:
    logits, aux = self.model.apply(variables, images, False)
    return {"logits": logits.astype(jnp.float32), "pre_logits": aux["pre_logits"]}
