"""Multimodal contrastive training, MCT (Yuan et al., CVPR 2021): MoCo-v2 within each modality, tag-supervised
positives, and margin ranking between modalities against the other modality's queue (eq. 3-15).

State beyond the parameters lives in the model state, so the loop checkpoints, shards and restores it like
BatchNorm statistics:
  momentum   the key encoders' parameters and BatchNorm statistics (updated in the step, before the keys are
             computed, as MoCo does: k <- m k + (1 - m) q)
  queues     K keys per path (image_intra, text_intra, image_inter, text_inter), the keys' tags and validity
             flags, and the write pointer; enqueued from the global batch in order, sharded along `data`.

Losses per example (means over the examples each applies to):
  J_ii   InfoNCE of the image query against its key and the image queue            all images
  J_tag  J_ii with positives extended to queue entries sharing more than eps tags   images with tags
  J_cc   InfoNCE of the caption query against its key and the caption queue        images with a caption
  J_ic   sum_j [alpha - q_ic.k_ic+ + q_ic.k_j]_+ over the caption (inter) queue     images with a caption
  J_ci   the same, caption query against the image (inter) queue                   images with a caption
So an image with only tags trains on lambda_ii J_ii + lambda_tag J_tag, one with only a caption on
lambda_ii J_ii + lambda_cc J_cc + lambda_ic J_ic + lambda_ci J_ci, and one with neither on J_ii: the paper's subsets.

`text_tower`: 'scratch' (a BERT-style encoder trained from scratch, `config.text`) or 'bert' (the pretrained BERT in
`config.bert_path`, 'minilm' = the packaged MiniLM; the tokenizer must be its WordPiece vocabulary). BERT's weights go
into both the query tower and its momentum copy (`pretrained_variables`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from vlrep import methods
from vlrep.models import bert as bert_lib
from vlrep.models.mct import MCTModel

PATHS = ("image_intra", "text_intra", "image_inter", "text_inter")


def l2_normalize(x, eps: float = 1e-12):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), eps))


def info_nce(q, k_pos, queue, queue_valid, tau: float, extra_positives=None):
  """Per-example -mean_{p in P} log softmax_p over [q.k+, q.queue] / tau (eq. 3, 5, 8). Invalid queue entries
  are no negatives. `extra_positives` [B, K] adds queue entries to P (J_tag); None gives P = {k+}."""
  logits = jnp.concatenate([jnp.sum(q * k_pos, -1, keepdims=True), q @ queue.T], axis=1) / tau
  logits = jnp.where(jnp.concatenate([jnp.ones((q.shape[0], 1), bool), queue_valid[None].repeat(q.shape[0], 0)], 1),
                     logits, -1e9)  # fmt: skip
  logp = jax.nn.log_softmax(logits, axis=1)
  if extra_positives is None:
    return -logp[:, 0], jnp.ones(q.shape[:1])
  pos = jnp.concatenate([jnp.ones((q.shape[0], 1), bool), extra_positives & queue_valid[None]], axis=1)
  count = jnp.sum(pos, 1)
  return -jnp.sum(jnp.where(pos, logp, 0.0), 1) / count, count.astype(jnp.float32)


def margin_ranking(q, k_pos, queue, queue_valid, alpha: float):
  """Per-example sum_j [alpha - q.k+ + q.queue_j]_+ over the valid queue entries (eq. 11, 14)."""
  hinge = jax.nn.relu(alpha - jnp.sum(q * k_pos, -1, keepdims=True) + q @ queue.T)
  return jnp.sum(jnp.where(queue_valid[None], hinge, 0.0), 1)


def enqueue(queue, keys, ptr):
  """Writes the batch's keys at `ptr` (the queue size is a multiple of the batch, so no write wraps)."""
  return jax.lax.dynamic_update_slice_in_dim(queue, keys.astype(queue.dtype), ptr, axis=0)


def _masked_mean(values, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _age_gap(q, queue, ptr, b: int):
  """mean q.(newest b keys) - mean q.(oldest b keys); the queue is written in batches of b at ptr."""
  k = queue.shape[0]
  newest = jax.lax.dynamic_slice_in_dim(queue, (ptr - b) % k, b, axis=0)
  oldest = jax.lax.dynamic_slice_in_dim(queue, ptr, b, axis=0)
  return jnp.mean(q @ newest.T) - jnp.mean(q @ oldest.T)


class Method:
  """MCT behind vlrep's method contract (init / loss / features), plus `embed` for retrieval; its loss split for
  microbatches (`methods.SplitsItsLoss`: queries and keys per example, the J terms, queues and momentum update over
  the global batch)."""

  fields = ("image_q", "image_k", "tokens_q", "tokens_k", "tags")

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int, concepts=None):
    # `concepts`: the tag set of a run on your own data (config.concepts, kind 'tags'); the `concept_tags` op
    # reads it, the model only sees the multi-hot tags it makes.
    del concepts
    self.config = config
    self.text_tower = config.get("text_tower", "scratch")
    self._bert, bert_config = None, None
    if self.text_tower == "bert":
      bert_config, self._bert, _, folder = bert_lib.load_pretrained(config.get("bert_path", ""))
      layers = int(config.get("bert_layers", 0))
      bert_config, self._bert = bert_lib.first_layers(bert_config, self._bert, layers, folder)
      # Fine-tuning dropout, in the query and the momentum tower alike (both run in training mode, as MoCo's
      # key encoder does).
      bert_config = bert_lib.with_dropout(bert_config, config.get("bert_dropout", -1.0))
      if vocab_size != bert_config.vocab_size:
        raise ValueError(
          f"The tokenizer has {vocab_size} tokens but BERT ({folder}) has {bert_config.vocab_size}: set "
          "tokenizer.kind='wordpiece' with the same folder as method.bert_path."
        )
    elif self.text_tower != "scratch":
      raise ValueError(f"Unknown method.text_tower {self.text_tower!r}; expected 'scratch' or 'bert'.")
    self.model = MCTModel(
      vocab_size=vocab_size,
      bert=bert_config,
      backbone=dict(config.backbone),
      text=dict(config.text),
      head_hidden=config.head_hidden,
      head_batchnorm=tuple(config.get("head_batchnorm", ())),
      text_pool=config.get("text_pool", "cls"),
      intra_dim=config.intra_dim,
      inter_dim=config.inter_dim,
      dtype=jnp.dtype(config.dtype),
      remat=config.get("remat", "none"),  # config.remat, copied in by methods.method_config
    )

  # -- contract -----------------------------------------------------------------------------------------
  def init(self, rng, batch) -> dict:
    params_rng, dropout_rng, queue_rng = jax.random.split(rng, 3)
    b, k = batch["image_q"].shape[0], self.config.queue_size
    if k % b:
      raise ValueError(f"method.queue_size {k} must be a multiple of the global batch size {b} (MoCo's rule).")
    variables = self.model.init(
      {"params": params_rng, "dropout": dropout_rng}, batch["image_q"], batch["tokens_q"], train=False
    )
    params, stats = variables["params"], variables.get("batch_stats", {})
    dims = {"image_intra": self.config.intra_dim, "text_intra": self.config.intra_dim}
    dims.update(image_inter=self.config.inter_dim, text_inter=self.config.inter_dim)
    # Random unit keys as initial negatives, as MoCo starts; they carry no tags.
    queues = {
      p: l2_normalize(jax.random.normal(r, (k, dims[p])))
      for p, r in zip(PATHS, jax.random.split(queue_rng, 4), strict=True)
    }
    queues.update(
      tags=jnp.zeros((k, batch["tags"].shape[-1]), jnp.uint8),
      image_valid=jnp.ones((k,), bool),
      text_valid=jnp.ones((k,), bool),
      ptr=jnp.zeros((), jnp.int32),
    )
    copy = lambda t: jax.tree.map(jnp.array, t)
    return {"params": params, "batch_stats": stats, "momentum": {"params": copy(params), "batch_stats": copy(stats)},
            "queues": queues}  # fmt: skip

  def pretrained_variables(self, pretrained: dict) -> dict:
    """With text_tower='bert': BERT's weights for the text tower and for its momentum copy."""
    if self._bert is None:
      return {}
    return {"params": {"textual": self._bert}, "model_state": {"momentum": {"params": {"textual": self._bert}}}}

  def loss(self, variables, batch, rng, train: bool = True):
    return methods.loss_of_parts(self, variables, batch, rng, train)

  def prepare(self, batch, rng):
    """Shuffled BatchNorm's permutation of the global batch: the key images in shuffled order ('image_k_shuffled')
    and the positions that put them back ('unshuffle'). Drawn before a batch is split, so the key encoder's
    BatchNorm groups are the same whatever the microbatch count. The key captions need no shuffle: the text
    encoders use LayerNorm, and the heads' BatchNorm (head_batchnorm) takes its statistics over the whole batch,
    which a permutation leaves unchanged (tested:
    test_text_keys_need_no_shuffle_their_only_batchnorm_sees_the_whole_batch)."""
    _, _, shuffle_rng = jax.random.split(rng, 3)
    perm = jax.random.permutation(shuffle_rng, batch["image_q"].shape[0])
    return {**batch, "image_k_shuffled": jnp.take(batch["image_k"], perm, axis=0), "unshuffle": jnp.argsort(perm)}

  def per_example(self, variables, batch, rng, train: bool = True):
    """The l2-normalised queries (from the encoder being trained) and keys (no gradient, from the momentum
    encoder after this step's update; the image keys in the shuffled order, `combine` puts them back), and both
    encoders' BatchNorm statistics."""
    q_rng, k_rng, _ = jax.random.split(rng, 3)
    (img_q, txt_q), new_stats = self.model.apply(
      {"params": variables["params"], "batch_stats": variables["batch_stats"]},
      batch["image_q"],
      batch["tokens_q"],
      train,
      rngs={"dropout": q_rng},
      mutable=["batch_stats"],
    )
    # Momentum update first, then keys from the updated key encoder, as MoCo does. Shuffled BatchNorm: the key
    # images arrive permuted (`prepare`), so BatchNorm groups of the key encoder never hold a query's own positive
    # in the same positions (MoCo's guard against BN leakage).
    (img_k, txt_k), mom_stats = self.model.apply(
      {"params": self._momentum_params(variables), "batch_stats": variables["momentum"]["batch_stats"]},
      batch["image_k_shuffled"],
      batch["tokens_k"],
      train,
      rngs={"dropout": k_rng},
      mutable=["batch_stats"],
    )
    outputs = {"q_ii": img_q["intra"], "q_ic": img_q["inter"], "q_cc": txt_q["intra"], "q_ci": txt_q["inter"]}
    outputs = {k: l2_normalize(v) for k, v in outputs.items()}
    keys = {"image_intra_shuffled": img_k["intra"], "image_inter_shuffled": img_k["inter"]}
    keys.update(text_intra=txt_k["intra"], text_inter=txt_k["inter"])
    outputs.update({f"k_{k}": jax.lax.stop_gradient(l2_normalize(v)) for k, v in keys.items()})
    state = {"batch_stats": new_stats["batch_stats"], "momentum": {"batch_stats": mom_stats["batch_stats"]}}
    return outputs, state

  def combine(self, variables, outputs, batch):
    """Every J term over the global batch's queries and keys (the image keys put back in order) against the
    queues; the queues with the batch's keys enqueued in order, and the momentum encoder's parameters."""
    c = self.config
    queues = variables["queues"]
    b = outputs["q_ii"].shape[0]
    q = {name: outputs[f"q_{name}"] for name in ("ii", "ic", "cc", "ci")}
    # Keys by queue path: image keys for image queues, the momentum text encoder's for caption queues.
    unshuffle = batch["unshuffle"]
    keys = {"image_intra": outputs["k_image_intra_shuffled"][unshuffle], "text_intra": outputs["k_text_intra"]}
    keys.update(image_inter=outputs["k_image_inter_shuffled"][unshuffle], text_inter=outputs["k_text_inter"])

    tags = batch["tags"].astype(jnp.float32)
    has_tags = jnp.sum(tags, -1) > 0
    has_caption = ~batch["stat_empty"] if "stat_empty" in batch else jnp.ones((b,), bool)
    img_valid, txt_valid = queues["image_valid"], queues["text_valid"]

    j_ii, _ = info_nce(q["ii"], keys["image_intra"], queues["image_intra"], img_valid, c.temperature)
    overlap = tags @ queues["tags"].astype(jnp.float32).T  # [B, K]: shared tags with each queue entry
    j_tag, num_pos = info_nce(
      q["ii"], keys["image_intra"], queues["image_intra"], img_valid, c.temperature, overlap > c.tag_threshold
    )
    j_cc, _ = info_nce(q["cc"], keys["text_intra"], queues["text_intra"], txt_valid, c.temperature)
    # Image query in the common space against the caption keys, and the converse.
    j_ic = margin_ranking(q["ic"], keys["text_inter"], queues["text_inter"], txt_valid, c.margin)
    j_ci = margin_ranking(q["ci"], keys["image_inter"], queues["image_inter"], img_valid, c.margin)

    terms = {
      "j_ii": jnp.mean(j_ii),
      "j_tag": _masked_mean(j_tag, has_tags),
      "j_cc": _masked_mean(j_cc, has_caption),
      "j_ic": _masked_mean(j_ic, has_caption),
      "j_ci": _masked_mean(j_ci, has_caption),
    }
    weights = dict(c.weights)
    loss = sum(weights[name] * terms[name] for name in terms if weights[name])

    # Enqueue this batch's keys (the global batch, in order) and advance the pointer: once per step.
    ptr = queues["ptr"]
    new_queues = {p: enqueue(queues[p], keys[p], ptr) for p in PATHS}
    new_queues.update(
      tags=enqueue(queues["tags"], batch["tags"].astype(jnp.uint8), ptr),
      image_valid=enqueue(queues["image_valid"], jnp.ones((b,), bool), ptr),
      text_valid=enqueue(queues["text_valid"], has_caption, ptr),
      ptr=(ptr + b) % c.queue_size,
    )
    metrics = dict(terms)
    metrics["tag_positives"] = _masked_mean(num_pos, has_tags)
    metrics["positive_similarity"] = jnp.mean(jnp.sum(q["ii"] * keys["image_intra"], -1))
    # Collapse diagnostics: a query's mean similarity to the queue's keys, and the norm of the queue's mean key
    # (1 when every key points the same way, ~1/sqrt(K) for spread-out keys).
    metrics["negative_similarity"] = _masked_mean(
      q["ii"] @ queues["image_intra"].T, jnp.broadcast_to(img_valid, (b, c.queue_size))
    )
    metrics["queue_mean_norm"] = jnp.linalg.norm(jnp.mean(queues["image_intra"], 0))
    # Staleness shortcut: a query's similarity to the newest queued batch minus that to the oldest. Positive and
    # growing when all embeddings drift together, so the freshest key (the positive) wins on recency alone.
    metrics["queue_age_gap"] = _age_gap(q["ii"], queues["image_intra"], ptr, b)
    metrics["inter_age_gap"] = _age_gap(q["ic"], queues["text_inter"], ptr, b)
    # The momentum update once per step (per_example recomputes the same values for its keys).
    new_state = {"momentum": {"params": self._momentum_params(variables)}, "queues": new_queues}
    return loss, metrics, new_state

  def _momentum_params(self, variables):
    """MoCo's key encoder after this step's update: m k + (1 - m) q, no gradient to q."""
    m = self.config.momentum
    return jax.tree.map(
      lambda k, q: m * k + (1 - m) * jax.lax.stop_gradient(q), variables["momentum"]["params"], variables["params"]
    )

  def features(self, variables, images) -> dict:
    """Frozen query-encoder features for evaluators: pooled 'pre_logits' and the final 'grid'."""
    v = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
    grid, aux = self.model.apply(v, images, False, method=MCTModel.encode_image)
    return {"pre_logits": aux["pre_logits"], "grid": grid.astype(jnp.float32)}

  def embed(self, variables, images=None, tokens=None) -> dict:
    """l2-normalised inter-modal (common space) embeddings of images and/or captions, for retrieval."""
    v = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
    out = {}
    if images is not None:
      out["image"] = l2_normalize(self.model.apply(v, images, False, method=MCTModel.embed_images)["inter"])
    if tokens is not None:
      out["text"] = l2_normalize(self.model.apply(v, tokens, False, method=MCTModel.embed_texts)["inter"])
    return out
