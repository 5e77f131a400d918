"""LocTex (Liu et al., ICCV 2021): contrastive image-caption pretraining plus mouse-trace localization.

  L = contrastive_weight * L_C + localization_weight * sum over scales of L_L(scale)

L_C (eq. 1) is InfoNCE between the pooled, projected image and caption embeddings under cosine similarity
and temperature tau. The paper computes it on each GPU's own sub-batch of 128 ("locally at each GPU"):
`contrastive_group_size=128` splits the batch into groups of 128 consecutive examples whose negatives are each
other, the same maths on any number of devices (and no all-gather when a device holds whole groups);
`contrastive_group_size=0` uses the whole batch as negatives. Both are means over images.

L_L (eq. 3), per example: the L2 distance between the attention maps M (softmax over space of token-region
products) and the rendered traces M^, each normalised to unit L2 norm as one L x R x R vector. Which token rows
enter M's norm is `localization_norm`:
  "caption"  every token of the caption ([SOS], words with or without a trace, [EOS]; not padding): eq. 3 as
             printed, M_k being the whole L x R x R map. The recipe's.
  "traced"   only tokens whose trace is non-empty (the other rows of M are zeroed before normalising).
             runlocal's (docs/results/loctex.md's runs use it).
M^'s norm is the same either way (untraced rows are zero). Examples without any traced token (M^ = 0) are left
out; the loss is the mean over the others. (The paper writes sums over the batch; means keep the two terms'
balance independent of the batch size.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from vlrep import methods
from vlrep.methods._contrastive import info_nce, l2_normalize
from vlrep.models import special_tokens
from vlrep.models.loctex import LocTexModel

LOCALIZATION_NORMS = ("caption", "traced")


def localization_loss_per_example(
  logits: jnp.ndarray, target: jnp.ndarray, rows: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Eq. 3 per example on attention logits [B, T, N] and binary targets [B, T, N]. `rows` [B, T] (0/1) are the
  tokens whose attention enters M's normalisation (the caption's tokens for eq. 3 as printed; tokens with a target
  always do); None: only the tokens with a non-empty target ("traced"). Returns (loss [B], counts [B]: 1.0 where the
  example has at least one supervised token, 0.0 where it has none and its loss does not count)."""
  target = target.astype(jnp.float32)
  supervised = (jnp.sum(target, axis=2) > 0).astype(jnp.float32)  # [B, T]
  kept = supervised if rows is None else jnp.maximum(rows.astype(jnp.float32), supervised)
  attention = jax.nn.softmax(logits.astype(jnp.float32), axis=2) * kept[..., None]

  # Clamped before the square root, so all-zero maps (unsupervised examples) have zero gradients, not NaN.
  def unit(x):
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.square(x), axis=(1, 2), keepdims=True), 1e-24))

  diff = unit(attention) - unit(target)
  per_example = jnp.sqrt(jnp.maximum(jnp.sum(jnp.square(diff), axis=(1, 2)), 1e-24))
  return per_example, (jnp.sum(supervised, axis=1) > 0).astype(jnp.float32)


def localization_loss(
  logits: jnp.ndarray, target: jnp.ndarray, rows: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Eq. 3 over a batch (`localization_loss_per_example`'s arguments): (mean loss over examples with at least one
  supervised token, number of such examples)."""
  return _counted_mean(*localization_loss_per_example(logits, target, rows))


def _counted_mean(per_example, counts):
  """(mean of `per_example` over the examples that count, their number)."""
  count = jnp.sum(counts)
  return jnp.sum(per_example * counts) / jnp.maximum(count, 1.0), count


class Method:
  """LocTex behind vlrep's method contract (init / loss / features), its loss split for microbatches
  (`methods.SplitsItsLoss`)."""

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int):
    if config.contrastive_group_size < 0:
      raise ValueError(f"contrastive_group_size={config.contrastive_group_size}: 0 (the whole batch) or a size.")
    if not (config.contrastive_weight or config.localization_weight):
      raise ValueError("LocTex needs contrastive_weight or localization_weight above 0.")
    # A saved config without the key means "traced", what such a run trained with.
    self.localization_norm = config.get("localization_norm", "traced")
    if self.localization_norm not in LOCALIZATION_NORMS:
      raise ValueError(f"localization_norm={self.localization_norm!r}: one of {LOCALIZATION_NORMS}.")
    self.config = config
    self.scales = tuple(config.scales)
    self.grid_sizes = tuple(config.grid_sizes)
    if len(self.grid_sizes) != len(self.scales):
      raise ValueError(f"grid_sizes {self.grid_sizes} must give one size per scale in {self.scales}.")
    self.fields = ("image", "tokens", *(f"trace_mask_{r}" for r in self.grid_sizes))
    self.model = LocTexModel(
      vocab_size=vocab_size,
      backbone=dict(config.backbone),
      text=dict(config.text),
      embed_dim=config.embed_dim,
      scales=self.scales,
      dtype=jnp.dtype(config.dtype),
      remat=config.get("remat", "none"),  # config.remat, copied in by methods.method_config
    )

  # -- contract -----------------------------------------------------------------------------------------
  def init(self, rng, batch) -> dict:
    params_rng, dropout_rng = jax.random.split(rng)
    return self.model.init({"params": params_rng, "dropout": dropout_rng}, batch["image"], batch["tokens"], False)

  def loss(self, variables, batch, rng, train: bool = True):
    return methods.loss_of_parts(self, variables, batch, rng, train)

  def per_example(self, variables, batch, rng, train: bool = True):
    """The two L_C embeddings (as the model gives them), and per scale each example's localization loss and whether
    it counts (1.0: it has a traced token)."""
    (out, _), new_state = self.model.apply(
      variables, batch["image"], batch["tokens"], train, rngs={"dropout": rng}, mutable=["batch_stats"]
    )
    outputs = {"image_embedding": out["image_embedding"], "text_embedding": out["text_embedding"]}
    rows = (batch["tokens"] != special_tokens.PAD_ID) if self.localization_norm == "caption" else None
    for s, r in zip(self.scales, self.grid_sizes, strict=True):
      logits = out[f"attention_logits_{s}x"]
      if logits.shape[2] != r * r:
        raise ValueError(
          f"Scale {s}x gives a {logits.shape[2]}-cell feature map but grid_sizes says {r}x{r}: set "
          "method.grid_sizes (and trace_words' sizes) to the input size / 32 * scale."
        )
      target = batch[f"trace_mask_{r}"].reshape(logits.shape)
      outputs[f"localization_{s}x"], outputs[f"counts_{s}x"] = localization_loss_per_example(logits, target, rows)
    return outputs, new_state

  def combine(self, variables, outputs, batch):
    """L_C over the global batch's embeddings (groups of consecutive examples in the batch's order) and each
    scale's mean localization loss over the batch's supervised examples."""
    del variables
    cfg = self.config
    valid_caption = ~batch["stat_empty"] if "stat_empty" in batch else None
    img, txt = outputs["image_embedding"], outputs["text_embedding"]
    b, size = img.shape[0], cfg.contrastive_group_size
    if size and b % size:
      raise ValueError(f"The batch of {b} does not split into contrastive groups of {size} (contrastive_group_size).")
    groups = b // size if size else 1
    l_c = info_nce(img, txt, cfg.temperature, groups, cfg.symmetric, valid_caption)
    metrics = {"contrastive_loss": l_c}
    l_l = 0.0
    for s in self.scales:
      loss_s, count = _counted_mean(outputs[f"localization_{s}x"], outputs[f"counts_{s}x"])
      metrics[f"localization_loss_{s}x"] = loss_s
      metrics[f"supervised_examples_{s}x"] = count
      l_l = l_l + loss_s
    metrics["localization_loss"] = l_l
    loss = cfg.contrastive_weight * l_c + cfg.localization_weight * l_l
    return loss, metrics, {}

  def features(self, variables, images) -> dict:
    """Frozen-backbone features for evaluators: pooled 'pre_logits' and the final 'grid'."""
    grid, aux = self.model.apply(variables, images, False, method=LocTexModel.encode_image)
    return {"pre_logits": aux["pre_logits"], "grid": grid.astype(jnp.float32)}

  def embed(self, variables, images=None, tokens=None) -> dict:
    """l2-normalised L_C embeddings of images and/or captions (the retrieval evaluator's towers)."""
    out = {}
    if images is not None:
      out["image"] = l2_normalize(self.model.apply(variables, images, method=LocTexModel.embed_images))
    if tokens is not None:
      out["text"] = l2_normalize(self.model.apply(variables, tokens, method=LocTexModel.embed_texts))
    return out

  def attention(self, variables, images, tokens) -> dict:
    """Softmax attention maps [B, T, R, R] per scale ('<s>x') and of the contrastive projections
    ('contrastive'), with inference BatchNorm: what the localization metric and the figures show."""
    out, _ = self.model.apply(variables, images, tokens, False)
    maps = {f"{s}x": out[f"attention_logits_{s}x"] for s in self.scales}
    maps["contrastive"] = self.model.apply(variables, images, tokens, method=LocTexModel.contrastive_attention)
    result = {}
    for k, logits in maps.items():
      r = int(round(logits.shape[2] ** 0.5))
      result[k] = jax.nn.softmax(logits, axis=2).reshape(*logits.shape[:2], r, r)
    return result
