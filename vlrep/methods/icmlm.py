"""ICMLM (Bulent Sariyildiz, Perez, Larlus, ECCV 2020): visual features from image-conditioned masked language
modeling over a frozen pretrained BERT, and the tag-prediction (TP) family.

Variants (config `method.variant`):
  tp         tag prediction alone, eq. (2): cross-entropy against the multi-hot tags normalised to sum 1
             (TP_Postag, TP_Cluster or TP_Label, by the config's tag source)
  tfm        ICMLM_tfm: masked token predicted from BERT's token features contextualised among the visual grid
  att_fc     ICMLM_att-fc: masked token predicted from the visual grid alone, pooled by text-driven attention
  text_only  the tfm head without the image (the text-only baseline for masked-token accuracy)
ICMLM variants minimise l_mlm + lambda l_tp (eq. 8; `tp_weight`, 0.1 for ResNet-50). Each step masks one concept
token per caption, sampled uniformly among the caption's concept tokens; a caption with none is left out of l_mlm
and counted (`train/captions_without_concept` per batch). BERT is applied with its parameters held in the model
state, never in the optimizer: they stay bit-identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vlrep import methods
from vlrep.models import bert as bert_lib
from vlrep.models.icmlm import VARIANTS, ICMLMModel


def normalized_tag_loss(logits, tags):
  """Eq. (2): -sum_k y_k log softmax(logits)_k with y normalised to sum 1; images without tags are skipped."""
  per_image, has = tag_loss_per_image(logits, tags)
  return _weighted_mean(per_image, has)


def tag_loss_per_image(logits, tags):
  """Eq. (2) per image: (loss [B], has tags [B] float32); `normalized_tag_loss` is their weighted mean."""
  tags = tags.astype(jnp.float32)
  count = tags.sum(-1)
  per_image = -jnp.sum(tags * jax.nn.log_softmax(logits), -1) / jnp.maximum(count, 1.0)
  return per_image, (count > 0).astype(jnp.float32)


def _weighted_mean(values, weights):
  return jnp.sum(values * weights) / jnp.maximum(weights.sum(), 1.0)


def choose_masked_concepts(tokens, concept_mask, rng):
  """One concept token per caption, uniformly among its concept tokens: (positions [B], has_concept [B])."""
  is_concept = concept_mask[tokens]
  scores = jnp.where(is_concept, jax.random.uniform(rng, tokens.shape), -1.0)
  return jnp.argmax(scores, axis=1), jnp.any(is_concept, axis=1)


def top_k_hits(logits, targets, k: int):
  top = jax.lax.top_k(logits, k)[1]
  return jnp.any(top == targets[:, None], axis=1)


class Method:
  """ICMLM and TP behind vlrep's method contract (init / loss / features, plus `pretrained_variables`)."""

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int, concepts=None):
    if config.variant not in VARIANTS:
      raise ValueError(f"Unknown ICMLM variant {config.variant!r}; known: {VARIANTS}")
    self.config = config
    self.variant = config.variant
    self.uses_text = self.variant != "tp"
    # num_tags: > 0 a fixed label set (TP_Label), -1 the run's concept set (TP_Postag, TP_Cluster), 0 no l_tp.
    self.num_tags = int(config.num_tags)
    if self.num_tags == -1:
      if concepts is None:
        raise ValueError("method.num_tags=-1 takes the tags from the concept set, but the config has no concepts.")
      self.num_tags = len(concepts)
    if self.variant == "tp" and not self.num_tags:
      raise ValueError("method.num_tags must be > 0 for tag prediction (set by the config from its tag source).")
    self.bert_config, self._bert, self._mlm_head = bert_lib.BertConfig(), None, None
    if self.uses_text:  # tag prediction alone never reads BERT
      self.bert_config, self._bert, self._mlm_head, folder = bert_lib.load_pretrained(config.bert_path)
    self.bert = bert_lib.BertEncoder(self.bert_config)
    if self.uses_text:
      if vocab_size != self.bert_config.vocab_size:
        raise ValueError(
          f"The tokenizer has {vocab_size} tokens but BERT ({folder}) has {self.bert_config.vocab_size}: "
          "ICMLM needs tokenizer.kind='wordpiece' with the same folder as method.bert_path."
        )
      ids = np.asarray(getattr(concepts, "token_ids", []), np.int64)
      if concepts is None or getattr(concepts, "kind", "") != "postag" or not len(ids):
        raise ValueError("ICMLM masks concept words: it needs a non-empty postag concept set (config.concepts).")
      mask = np.zeros((vocab_size,), bool)
      mask[ids] = True
      self.concept_mask = jnp.asarray(mask)
      with open(f"{folder}/vocab.txt", encoding="utf-8") as f:
        self.mask_id = next(i for i, line in enumerate(f) if line.rstrip("\n") == "[MASK]")
    self.fields = ("image", "tokens", "tags") if self.num_tags else ("image", "tokens")
    if self.variant == "tp":
      self.fields = ("image", "tags")
    self.model = ICMLMModel(
      variant=self.variant,
      backbone=dict(config.backbone),
      bert=self.bert_config,
      num_tags=self.num_tags,
      tp_head=config.tp_head,
      tp_hidden=config.tp_hidden,
      tfm_layers=config.tfm_layers,
      tfm_heads=config.tfm_heads,
      tfm_mlp_dim=config.tfm_mlp_dim,
      att_dim=config.att_dim,
      att_heads=config.att_heads,
      fc_layers=config.fc_layers,
      dropout=config.dropout,
      dtype=jnp.dtype(config.dtype),
      # config.remat's policy (vlrep.methods.method_config adds it to the method's block): no value changes.
      remat=config.get("remat", "none"),
    )

  # -- contract -----------------------------------------------------------------------------------------
  def init(self, rng, batch) -> dict:
    params_rng, dropout_rng, bert_rng = jax.random.split(rng, 3)
    b = batch["image"].shape[0]
    t = batch["tokens"].shape[1] if "tokens" in batch else 2
    dw, vocab = self.bert_config.hidden_size, self.bert_config.vocab_size
    variables = self.model.init(
      {"params": params_rng, "dropout": dropout_rng},
      batch["image"],
      jnp.zeros((b, t, dw)),
      jnp.ones((b, t), bool),
      jnp.zeros((b,), jnp.int32),
      jnp.zeros((vocab, dw)),
      train=False,
    )
    variables = dict(variables)
    if self.uses_text:
      # Placeholder of the right shapes; the loop puts the checkpoint's values in (`pretrained_variables`).
      variables["bert"] = self.bert.init(bert_rng, jnp.zeros((1, 2), jnp.int32))["params"]
    return variables

  def pretrained_variables(self, pretrained: dict) -> dict:
    """Values the loop writes into a fresh state: the frozen BERT, and the checkpoint's token classifier as the
    initialisation of `mlm_head` when the checkpoint has one (MiniLM does not: then it trains from scratch)."""
    out = {}
    if self.uses_text:
      out["model_state"] = {"bert": self._bert}
      if self._mlm_head is not None and self.variant in ("tfm", "text_only"):
        out["params"] = {"mlm_head": self._mlm_head}
    return out

  def loss(self, variables, batch, rng, train: bool = True):
    return methods.loss_of_parts(self, variables, batch, rng, train)

  def prepare(self, batch, rng):
    """The draw over the whole batch, before it is split: each caption's masked concept token (its position, and
    whether the caption has a concept token at all)."""
    if self.variant == "tp":
      return batch
    mask_rng, _ = jax.random.split(rng)
    positions, has_concept = choose_masked_concepts(batch["tokens"], self.concept_mask, mask_rng)
    return {**batch, "masked_position": positions, "has_concept": has_concept}

  def per_example(self, variables, batch, rng, train: bool = True):
    """Per caption: the masked token's negative log-likelihood (`mlm_nll`), whether it is the top prediction
    (`mlm_top1`, 0/1) and the image's share of its attention (`visual_mass`, tfm and att-fc); per image: eq. (2)'s
    tag loss (`tp_loss`)."""
    _, dropout_rng = jax.random.split(rng)
    if self.variant == "tp":
      out, state = self._apply(variables, batch["image"], None, None, dropout_rng, train)
    else:
      tokens, positions = batch["tokens"], batch["masked_position"]
      # tfm keeps its attention weights for the `visual_attention` metric (dropped from the returned state).
      extra = ("intermediates",) if self.variant == "tfm" else ()
      out, state = self._apply(variables, batch["image"], tokens, positions, dropout_rng, train, extra)
    outputs = {}
    if self.variant != "tp":
      logits = out["mlm_logits"]
      targets = jnp.take_along_axis(tokens, positions[:, None], axis=1)[:, 0]
      logp = jax.nn.log_softmax(logits, axis=-1)
      outputs["mlm_nll"] = -jnp.take_along_axis(logp, targets[:, None], axis=1)[:, 0]
      outputs["mlm_top1"] = top_k_hits(logits, targets, 1).astype(jnp.float32)
      # Share of the masked token's attention that goes to the image (tfm) or the largest grid cell's share of
      # the pooling (att-fc): near 0 the tfm has learned to ignore the image, near 1/cells att-fc's pooling is
      # still uniform (the paper's warm-up remark).
      if "attention" in out:  # att-fc
        outputs["visual_mass"] = jnp.max(out["attention"].reshape(out["attention"].shape[0], -1), axis=1)
      elif "intermediates" in state:  # tfm
        outputs["visual_mass"] = self._masked_token_on_image(state, tokens, positions).sum(-1)
    if "tag_logits" in out:
      outputs["tp_loss"], _ = tag_loss_per_image(out["tag_logits"], batch["tags"])
    return outputs, {k: v for k, v in state.items() if k != "intermediates"}

  def combine(self, variables, outputs, batch):
    """l_mlm over the captions with a masked concept (a caption without one, or empty, is left out and counted),
    eq. (2) over the images with tags, and eq. (8)'s sum: means with the whole batch's counts, linear in the
    outputs."""
    del variables
    metrics, loss = {}, 0.0
    if self.variant != "tp":
      empty = self._empty(batch)
      valid = batch["has_concept"] & ~empty
      w = valid.astype(jnp.float32)
      mlm = _weighted_mean(outputs["mlm_nll"], w)
      metrics["mlm_loss"] = mlm
      metrics["mlm_top1"] = _weighted_mean(outputs["mlm_top1"], w)
      metrics["captions_without_concept"] = jnp.sum(~valid & ~empty).astype(jnp.float32)
      if "visual_mass" in outputs:
        metrics["visual_attention"] = _weighted_mean(outputs["visual_mass"], w)
      loss = mlm
    if "tp_loss" in outputs:
      has = (batch["tags"].astype(jnp.float32).sum(-1) > 0).astype(jnp.float32)
      tp = _weighted_mean(outputs["tp_loss"], has)
      metrics["tp_loss"] = tp
      loss = tp if self.variant == "tp" else loss + self.config.tp_weight * tp
    return loss, metrics, {}

  def features(self, variables, images) -> dict:
    """Backbone features for evaluators: pooled 'pre_logits' and the final 'grid'."""
    v = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
    grid, aux = self.model.apply(v, images, False, method=ICMLMModel.encode_image)
    return {"pre_logits": aux["pre_logits"], "grid": grid.astype(jnp.float32)}

  # -- evaluation and visualisation ---------------------------------------------------------------------
  def predict_masked(self, variables, images, tokens, positions) -> jax.Array:
    """Logits over BERT's vocabulary for the token at `positions` of `tokens` (replaced by [MASK] here)."""
    out, _ = self._apply(variables, images, tokens, positions, jax.random.PRNGKey(0), False)
    return out["mlm_logits"]

  def attention_map(self, variables, images, tokens, positions) -> jax.Array:
    """[B, h, w] attention over the grid for the masked token: att-fc's p_att, or for tfm the last layer's
    attention of the masked token on the visual tokens (mean over heads, renormalised)."""
    out, state = self._apply(variables, images, tokens, positions, jax.random.PRNGKey(0), False, ("intermediates",))
    if "attention" in out:
      return out["attention"]
    if self.variant != "tfm":
      raise ValueError(f"Variant {self.variant!r} has no attention over the image.")
    grid, _ = self.model.apply(
      {"params": variables["params"], "batch_stats": variables["batch_stats"]},
      images,
      False,
      method=ICMLMModel.encode_image,
    )
    gh, gw = grid.shape[1:3]
    rows = self._masked_token_on_image(state, tokens, positions)
    return (rows / jnp.maximum(rows.sum(-1, keepdims=True), 1e-9)).reshape(-1, gh, gw)

  # -- helpers ------------------------------------------------------------------------------------------
  @staticmethod
  def _empty(batch):
    n = batch["image"].shape[0]
    return batch["stat_empty"] if "stat_empty" in batch else jnp.zeros((n,), bool)

  def _masked_token_on_image(self, state, tokens, positions):
    """[B, cells]: the last tfm layer's attention (mean over heads) of the masked token on the visual tokens,
    which come first in the sequence."""
    weights = state["intermediates"][f"tfm_{self.config.tfm_layers - 1}"]["self_attention_weights"][0]  # [B,H,S,S]
    n_visual = weights.shape[-1] - tokens.shape[1]
    rows = jnp.take_along_axis(weights.mean(1), (positions + n_visual)[:, None, None], axis=1)[:, 0]
    return rows[:, :n_visual]

  def _apply(self, variables, images, tokens, positions, dropout_rng, train, extra_mutable=()):
    v = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
    dw, vocab = self.bert_config.hidden_size, self.bert_config.vocab_size
    if tokens is None:
      b = images.shape[0]
      words, token_mask = jnp.zeros((b, 2, dw)), jnp.ones((b, 2), bool)
      positions, embeddings = jnp.zeros((b,), jnp.int32), jnp.zeros((vocab, dw))
    else:
      tokens = jnp.asarray(tokens)
      frozen = jax.lax.stop_gradient(variables["bert"])
      masked = tokens.at[jnp.arange(tokens.shape[0]), positions].set(self.mask_id)
      token_mask = masked != 0
      words = self.bert.apply({"params": frozen}, masked, token_mask)[0]
      embeddings = frozen["embeddings"]["word_embeddings"]["embedding"]
    out, state = self.model.apply(
      v,
      images,
      words,
      token_mask,
      positions,
      embeddings,
      train=train,
      rngs={"dropout": dropout_rng},
      mutable=["batch_stats", *extra_mutable],
    )
    return out, state
