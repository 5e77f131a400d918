"""VisualBERT (one stream) and ViLBERT (two streams with co-attention) over image regions: the models of the
visio-linguistic pretraining study (Singh et al., "Are we pretraining it right?").

Both hold a standard BERT (`vlrep.models.bert.BertEncoder`) under the name `bert`, whose parameter tree is exactly
a Hugging Face BERT's after conversion, so a pretrained checkpoint drops in (`pretrained_variables` of the method).

- VisualBERT: [CLS] text [SEP] (text_b [SEP]) followed by the regions, one sequence through BERT's layers. A
  region's embedding is a projection of its feature plus a projection of its box (x1, y1, x2, y2, area, as
  ViLBERT's spatial embedding), plus a learned "visual segment" vector, then its own LayerNorm (vlrep's default).
  Three knobs make it VisualBERT's and MMF's embeddings exactly (`BertVisioLinguisticEmbeddings`, Hugging Face's
  `VisualBertEmbeddings`): `region_boxes=False` (no box embedding), `region_norm='shared'` (BERT's embedding
  LayerNorm over the whole embedded sequence, no region LayerNorm) and `region_type_embedding='tables'` (the visual
  token-type and visual position embedding tables, each region adding row `region_type_id` of the first and row 0
  of the second; the method starts them from BERT's own tables).
- ViLBERT: the text runs through BERT's layers, the regions (with a leading whole-image [IMG] region whose feature
  is the mean of the regions') through their own `v_layers` transformer layers, and `co-attention` blocks
  exchange the two streams: block k runs before text layer (L - v_layers + k) and visual layer k, as
  ViLBERT's t_biattention_id = [6..11] / v_biattention_id = [0..5] for L = 12, v_layers = 6.

Regions: float [B, N, D] features, boxes [B, N, 4] (ymin, xmin, ymax, xmax in [0, 1], TFDS order), and a bool
mask [B, N] (False = padding, never attended to).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vlrep.errors import UserError
from vlrep.models import backbones
from vlrep.models import bert as bert_lib
from vlrep.models import remat as remat_lib

ARCHS = ("visual_bert", "vilbert")
TEXT_POOLS = ("cls", "mean")
FUSIONS = ("mul", "sum")
REGION_NORMS = ("own", "shared")
REGION_TYPE_EMBEDDINGS = ("segment", "tables")


def _check_sizes(model) -> None:
  """The sizes of a model built from a run's saved config (a run folder may come from elsewhere): positive
  integers, widths that split into their heads, ViLBERT's visual layers no more than the text's; a UserError naming
  the value (exit 2 from a command), not a ZeroDivisionError or a model built at an absurd size."""
  c = model.bert
  sizes = {"bert.hidden_size": c.hidden_size, "bert.num_attention_heads": c.num_attention_heads}
  if model.arch == "vilbert":
    sizes.update(v_layers=model.v_layers, v_hidden=model.v_hidden, v_heads=model.v_heads)
    sizes.update(v_intermediate=model.v_intermediate, bi_hidden=model.bi_hidden, bi_heads=model.bi_heads)
  bad = {k: v for k, v in sizes.items() if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65_536)}
  if bad:
    raise UserError(f"The model's sizes {bad} must be integers from 1 to 65536 (the run's config).")
  pairs = [("bert.hidden_size", "bert.num_attention_heads")]
  if model.arch == "vilbert":
    pairs += [("v_hidden", "v_heads"), ("bi_hidden", "bi_heads")]
  for width, heads in pairs:
    if sizes[width] % sizes[heads]:
      raise UserError(f"{width}={sizes[width]} is not divisible by {heads}={sizes[heads]} (the run's config).")


def box_features(boxes: jax.Array) -> jax.Array:
  """[..., 4] (ymin, xmin, ymax, xmax) -> [..., 5] (x1, y1, x2, y2, area): ViLBERT's 5-d location input."""
  y0, x0, y1, x1 = jnp.moveaxis(boxes.astype(jnp.float32), -1, 0)
  return jnp.stack([x0, y0, x1, y1, (x1 - x0) * (y1 - y0)], axis=-1)


class RegionEmbeddings(nn.Module):
  """A region's embedding: projection of its feature (`feature`), plus a projection of its box (`location`, when
  `boxes`), plus either one learned visual segment vector (`segment`) or, when `tables` = (type vocabulary,
  positions), VisualBERT's visual position and token-type embedding tables (`position_embeddings` row 0 and
  `token_type_embeddings` row `type_id`, added in VisualBERT's order); then its own LayerNorm and dropout when
  `norm`, else the sum is returned for the caller's shared LayerNorm."""

  hidden: int
  eps: float = 1e-12
  dtype: Any = jnp.float32
  dropout: float = 0.0  # after the LayerNorm while training, as BERT's embeddings
  boxes: bool = True
  norm: bool = True
  tables: tuple[int, int] | None = None
  type_id: int = 1

  @nn.compact
  def __call__(self, regions, boxes, deterministic: bool = True):
    x = nn.Dense(self.hidden, dtype=self.dtype, name="feature")(regions)
    if self.boxes:
      x = x + nn.Dense(self.hidden, dtype=self.dtype, name="location")(box_features(boxes))
    if self.tables is None:
      x = x + self.param("segment", nn.initializers.normal(0.02), (self.hidden,)).astype(self.dtype)
    else:
      types, positions = self.tables
      init = nn.initializers.normal(0.02)
      position = nn.Embed(positions, self.hidden, dtype=self.dtype, embedding_init=init, name="position_embeddings")
      token_type = nn.Embed(types, self.hidden, dtype=self.dtype, embedding_init=init, name="token_type_embeddings")
      x = x + position(jnp.zeros((), jnp.int32)) + token_type(jnp.full((), self.type_id, jnp.int32))
    if not self.norm:
      return x
    x = nn.LayerNorm(epsilon=self.eps, dtype=self.dtype, name="LayerNorm")(x)
    return nn.Dropout(self.dropout)(x, deterministic)


def _attend(q, k, v, mask, heads, drop_weights=lambda w: w):
  """Multi-head attention of q [B, Tq, D] over k/v [B, Tk, D] with key mask [B, Tk]; `drop_weights` is the
  attention-weight dropout."""
  b, tq, d = q.shape
  tk = k.shape[1]
  split = lambda y, t: y.reshape(b, t, heads, d // heads)
  q, k, v = split(q, tq), split(k, tk), split(v, tk)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(d // heads)
  scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
  weights = drop_weights(jax.nn.softmax(scores, axis=-1).astype(q.dtype))
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, tq, d)


class CoAttentionBlock(nn.Module):
  """ViLBERT's connection layer: each stream attends to the other (bi_hidden wide), adds & norms, then runs its
  own feed-forward block. While training, dropout on the attention weights and on both residual branches of each
  stream (the rates of the stream's BERT config), as ViLBERT's BertBiAttention / BertBiOutput / BertOutput."""

  text_hidden: int
  visual_hidden: int
  bi_hidden: int
  bi_heads: int
  text_intermediate: int
  visual_intermediate: int
  eps: float = 1e-12
  dtype: Any = jnp.float32
  text_dropout: tuple = (0.0, 0.0)  # (hidden, attention weights) of the text stream
  visual_dropout: tuple = (0.0, 0.0)  # the same for the visual stream

  @nn.compact
  def __call__(self, t, t_mask, v, v_mask, deterministic: bool = True):
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)
    norm = lambda name: nn.LayerNorm(epsilon=self.eps, dtype=self.dtype, name=name)
    drop = lambda rate: lambda y: nn.Dropout(rate)(y, deterministic)
    (t_hidden, t_attn), (v_hidden, v_attn) = self.text_dropout, self.visual_dropout
    bi = self.bi_hidden
    t_ctx = _attend(
      dense(bi, "t_query")(t), dense(bi, "v_key")(v), dense(bi, "v_value")(v), v_mask, self.bi_heads, drop(v_attn)
    )
    v_ctx = _attend(
      dense(bi, "v_query")(v), dense(bi, "t_key")(t), dense(bi, "t_value")(t), t_mask, self.bi_heads, drop(t_attn)
    )
    t = norm("t_attention_LayerNorm")(t + drop(t_hidden)(dense(self.text_hidden, "t_attention_output")(t_ctx)))
    v = norm("v_attention_LayerNorm")(v + drop(v_hidden)(dense(self.visual_hidden, "v_attention_output")(v_ctx)))
    t_h = jax.nn.gelu(dense(self.text_intermediate, "t_intermediate")(t), approximate=False)
    v_h = jax.nn.gelu(dense(self.visual_intermediate, "v_intermediate")(v), approximate=False)
    t = norm("t_output_LayerNorm")(t + drop(t_hidden)(dense(self.text_hidden, "t_output")(t_h)))
    v = norm("v_output_LayerNorm")(v + drop(v_hidden)(dense(self.visual_hidden, "v_output")(v_h)))
    return t, v


class VLBertModel(nn.Module):
  """VisualBERT or ViLBERT with its pretraining heads (MLM; ViLBERT's masked-region head) and a task head.

  Attributes:
    arch: 'visual_bert' or 'vilbert'.
    bert: the text BERT's config (from the checkpoint's config.json).
    v_layers, v_hidden, v_heads, v_intermediate, bi_hidden, bi_heads: ViLBERT's visual stream and co-attention.
    region_classes: > 0 adds the masked-region class head (logits over the classes; the method scores them by KL
      to a detector's distribution or cross-entropy to a box's class: `region_target`); -1 a regression head to
      the region's feature (MSE); 0 none.
    num_labels: > 0 adds the downstream classifier on the pooled output.
    text_pool: what the pooler reads of the text: 'cls' = the [CLS] state (BERT's and the study's), 'mean' = the
      mean over the text's tokens (for a checkpoint whose [CLS] was never trained, as sentence-transformers'
      MiniLM: its [CLS] states of different sentences are all but identical).
    fusion: how ViLBERT joins its pooled text and image ('mul': their product, the default of ViLBERT's and MMF's
      `fusion_method`; 'sum': their sum, the other).
    alignment: adds the image-text alignment head (ViLBERT's multimodal alignment prediction, VisualBERT's
      sentence-image prediction): 2 logits (not aligned, aligned) on the pooled output.
    region_boxes, region_norm, region_type_embedding, region_type_id: VisualBERT's region embeddings (see the
      module docstring; ViLBERT keeps vlrep's, whose box embedding is ViLBERT's own): the box embedding or none;
      'own' LayerNorm over the regions or BERT's embedding LayerNorm 'shared' with the text; a learned 'segment'
      vector or VisualBERT's visual token-type / position 'tables' (the regions' token type: `region_type_id`,
      1 in the authors' and Hugging Face's code, 0 in MMF's).
    remat: rematerialisation (vlrep.models.remat) of each BERT layer, ViLBERT visual layer and co-attention block:
      'dots' keeps their matmul outputs, 'full' only their inputs. The parameter tree is the same.
  """

  arch: str
  bert: bert_lib.BertConfig
  v_layers: int = 6
  v_hidden: int = 1024
  v_heads: int = 8
  v_intermediate: int = 1024
  bi_hidden: int = 1024
  bi_heads: int = 8
  region_classes: int = 0
  region_dim: int = 2048
  num_labels: int = 0
  text_pool: str = "cls"
  fusion: str = "mul"
  alignment: bool = False
  region_boxes: bool = True
  region_norm: str = "own"
  region_type_embedding: str = "segment"
  region_type_id: int = 1
  dtype: Any = jnp.float32
  remat: str = "none"  # rematerialisation policy of the blocks (vlrep.models.remat.POLICIES); no parameter changes

  def setup(self):
    if self.arch not in ARCHS:
      raise ValueError(f"Unknown arch {self.arch!r}; known: {ARCHS}")
    if self.text_pool not in TEXT_POOLS:
      raise ValueError(f"Unknown text_pool {self.text_pool!r}; known: {TEXT_POOLS}")
    if self.fusion not in FUSIONS:
      raise ValueError(f"Unknown fusion {self.fusion!r}; known: {FUSIONS}")
    if self.region_norm not in REGION_NORMS:
      raise ValueError(f"Unknown region_norm {self.region_norm!r}; known: {REGION_NORMS}")
    if self.region_type_embedding not in REGION_TYPE_EMBEDDINGS:
      raise ValueError(f"Unknown region_type_embedding {self.region_type_embedding!r}; known: {REGION_TYPE_EMBEDDINGS}")
    c = self.bert
    _check_sizes(self)
    vlrep_regions = (self.region_boxes, self.region_norm, self.region_type_embedding) == (True, "own", "segment")
    if self.arch == "vilbert" and not vlrep_regions:
      raise ValueError(
        "region_boxes / region_norm / region_type_embedding choose VisualBERT's region embeddings; ViLBERT's regions "
        "keep their box embedding and own LayerNorm (leave them at True / 'own' / 'segment')."
      )
    tables = self.region_type_embedding == "tables"
    if tables and not 0 <= self.region_type_id < c.type_vocab_size:
      raise ValueError(f"region_type_id={self.region_type_id} is not a row of the {c.type_vocab_size} token types.")
    self.text = bert_lib.BertEncoder(c, self.dtype, self.remat, name="bert")
    if self.arch == "visual_bert":
      self.regions_embed = RegionEmbeddings(
        c.hidden_size,
        c.layer_norm_eps,
        self.dtype,
        c.hidden_dropout_prob,
        boxes=self.region_boxes,
        norm=self.region_norm == "own",
        tables=(c.type_vocab_size, c.max_position_embeddings) if tables else None,
        type_id=self.region_type_id,
      )
      pooled_dim = c.hidden_size
    else:
      if not 0 < self.v_layers <= c.num_hidden_layers:
        raise ValueError(f"vilbert needs 1 <= v_layers <= the text layers ({c.num_hidden_layers}), got {self.v_layers}")
      self.regions_embed = RegionEmbeddings(self.v_hidden, c.layer_norm_eps, self.dtype, c.hidden_dropout_prob)
      v_cfg = dataclasses.replace(
        c, hidden_size=self.v_hidden, num_attention_heads=self.v_heads, intermediate_size=self.v_intermediate
      )
      v_layer = bert_lib.bert_layer(self.remat)
      self.v_stream = [v_layer(v_cfg, self.dtype, name=f"v_layer_{i}") for i in range(self.v_layers)]
      # Called as block(t, t_mask, v, v_mask, deterministic): `deterministic` (argument 5 after self) is static.
      co_block = remat_lib.wrap(CoAttentionBlock, self.remat, static_argnums=(5,))
      self.co_attention = [
        co_block(
          c.hidden_size,
          self.v_hidden,
          self.bi_hidden,
          self.bi_heads,
          c.intermediate_size,
          self.v_intermediate,
          c.layer_norm_eps,
          self.dtype,
          text_dropout=(c.hidden_dropout_prob, c.attention_probs_dropout_prob),
          visual_dropout=(v_cfg.hidden_dropout_prob, v_cfg.attention_probs_dropout_prob),
          name=f"co_layer_{i}",
        )
        for i in range(self.v_layers)
      ]
      self.t_pooler = nn.Dense(self.bi_hidden, dtype=self.dtype)
      self.v_pooler = nn.Dense(self.bi_hidden, dtype=self.dtype)
      pooled_dim = self.bi_hidden
    self.mlm_head = bert_lib.BertMLMHead(c, self.dtype)
    if self.region_classes:
      v_width = c.hidden_size if self.arch == "visual_bert" else self.v_hidden
      out = self.region_classes if self.region_classes > 0 else self.region_dim
      self.region_head = [nn.Dense(v_width, dtype=self.dtype), nn.LayerNorm(c.layer_norm_eps), nn.Dense(out)]
    if self.alignment:
      self.align_head = nn.Dense(2, dtype=self.dtype)
    if self.num_labels:
      hidden = nn.Dense(2 * pooled_dim, dtype=self.dtype)
      self.task_head = [hidden, nn.LayerNorm(c.layer_norm_eps), nn.Dense(self.num_labels)]
      self.task_dropout = nn.Dropout(c.hidden_dropout_prob)  # on the pooled output, as MMF's heads

  def encode(self, tokens, type_ids, regions, boxes, region_mask, deterministic: bool = True):
    """-> (text states [B, T, H], region states [B, N', Hv], pooled [B, P], aux).

    ViLBERT's region states include the leading [IMG] region (N' = N + 1). `deterministic=False` (training)
    applies the BERT config's dropout everywhere BERT and ViLBERT put it; it needs a 'dropout' rng."""
    t_mask = tokens != 0
    t = self.text.embeddings(tokens, type_ids, deterministic)
    if self.arch == "visual_bert":
      v = self.regions_embed(regions, boxes, deterministic)
      if self.region_norm == "shared":  # BERT's embedding LayerNorm (and dropout) over the regions too: per position,
        emb = self.text.embeddings  # so the same as VisualBERT's one LayerNorm over the concatenated sequence
        v = emb.dropout(emb.LayerNorm(v.astype(t.dtype)), deterministic)
      x = jnp.concatenate([t, v.astype(t.dtype)], axis=1)
      mask = jnp.concatenate([t_mask, region_mask], axis=1)
      for layer in self.text.layers:
        x = layer(x, mask, deterministic)
      n_text = tokens.shape[1]
      pooled = jnp.tanh(self.text.pooler(self._text_summary(x[:, :n_text], t_mask)))
      return x[:, :n_text], x[:, n_text:], pooled, {}
    # ViLBERT: the [IMG] region is the mean feature over the real regions, boxed as the whole image.
    w = region_mask[..., None].astype(regions.dtype)
    mean = jnp.sum(regions * w, axis=1, keepdims=True) / jnp.maximum(jnp.sum(w, axis=1, keepdims=True), 1.0)
    whole = jnp.broadcast_to(jnp.array([0.0, 0.0, 1.0, 1.0], boxes.dtype), boxes[:, :1].shape)
    v = self.regions_embed(jnp.concatenate([mean, regions], 1), jnp.concatenate([whole, boxes], 1), deterministic)
    v_mask = jnp.concatenate([jnp.ones_like(region_mask[:, :1]), region_mask], axis=1)
    n_text_layers = len(self.text.layers)
    first_co = n_text_layers - self.v_layers
    for i in range(first_co):
      t = self.text.layers[i](t, t_mask, deterministic)
    for k in range(self.v_layers):
      t, v = self.co_attention[k](t, t_mask, v, v_mask, deterministic)
      t = self.text.layers[first_co + k](t, t_mask, deterministic)
      v = self.v_stream[k](v, v_mask, deterministic)
    t_pool = nn.relu(self.t_pooler(self._text_summary(t, t_mask)))
    v_pool = nn.relu(self.v_pooler(v[:, 0]))
    pooled = t_pool * v_pool if self.fusion == "mul" else t_pool + v_pool
    return t, v, pooled, {"t_pooled": t_pool, "v_pooled": v_pool}

  def _text_summary(self, states, mask):
    """[B, T, H] text states -> [B, H]: the [CLS] state, or the mean over the real tokens (text_pool)."""
    if self.text_pool == "cls":
      return states[:, 0]
    w = mask[..., None].astype(states.dtype)
    return jnp.sum(states * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)

  def mlm_logits(self, text_states):
    return self.mlm_head(text_states, self.text.embeddings.word_embeddings.embedding)

  def region_outputs(self, region_states):
    h = self.region_head[0](region_states)
    h = self.region_head[1](jax.nn.gelu(h, approximate=False))
    return self.region_head[2](h).astype(jnp.float32)

  def alignment_logits(self, pooled):
    return self.align_head(pooled).astype(jnp.float32)

  def task_logits(self, pooled, deterministic: bool = True):
    pooled = self.task_dropout(pooled, deterministic)
    h = self.task_head[1](jax.nn.gelu(self.task_head[0](pooled), approximate=False))
    return self.task_head[2](h).astype(jnp.float32)

  def __call__(self, tokens, type_ids, regions, boxes, region_mask):
    """Touches every head (for init)."""
    t, v, pooled, aux = self.encode(tokens, type_ids, regions, boxes, region_mask)
    out = {"mlm_logits": self.mlm_logits(t), "pooled": pooled, **aux}
    if self.region_classes:
      out["region_outputs"] = self.region_outputs(v)
    if self.alignment:
      out["alignment_logits"] = self.alignment_logits(pooled)
    if self.num_labels:
      out["task_logits"] = self.task_logits(pooled)
    return out


def roi_sample(maps: jax.Array, boxes: jax.Array, size: int) -> jax.Array:
  """Bilinear samples of maps [B, H, W, C] on a size x size grid inside each box [B, N, 4] (normalised ymin,
  xmin, ymax, xmax) -> [B, N, size, size, C]. RoIAlign samples bin centres the same way (aligned=True)."""
  b, h, w, c = maps.shape
  frac = (jnp.arange(size, dtype=jnp.float32) + 0.5) / size
  y0, x0, y1, x1 = jnp.moveaxis(boxes.astype(jnp.float32), -1, 0)  # [B, N]
  ys = (y0[..., None] + (y1 - y0)[..., None] * frac) * h - 0.5  # [B, N, S] in pixel-centre coordinates
  xs = (x0[..., None] + (x1 - x0)[..., None] * frac) * w - 0.5

  def corners(coord, limit):
    lo = jnp.floor(coord)
    frac_hi = coord - lo
    lo_i = jnp.clip(lo.astype(jnp.int32), 0, limit - 1)
    hi_i = jnp.clip(lo.astype(jnp.int32) + 1, 0, limit - 1)
    return lo_i, hi_i, frac_hi

  ylo, yhi, fy = corners(ys, h)
  xlo, xhi, fx = corners(xs, w)
  bidx = jnp.arange(b)[:, None, None, None]

  def gather(yi, xi):  # [B, N, S, S, C]
    return maps[bidx, yi[:, :, :, None], xi[:, :, None, :]]

  fy, fx = fy[..., :, None, None], fx[..., None, :, None]
  top = gather(ylo, xlo) * (1 - fx) + gather(ylo, xhi) * fx
  bottom = gather(yhi, xlo) * (1 - fx) + gather(yhi, xhi) * fx
  return top * (1 - fy) + bottom * fy


class RegionFeatures(nn.Module):
  """Region features from a (frozen) vlrep ResNet: 'roi_align' averages bilinear samples of the last stage inside
  each box (RoIAlign + average pooling, as Faster R-CNN's box head input), 'crops' runs the backbone on each box
  cropped and resized to `crop_size` (for small images whose last stage is a few cells), 'grid' takes the last
  stage's cells as regions with their cell boxes (boxes and mask ignored)."""

  backbone: dict
  mode: str = "roi_align"
  roi_size: int = 7
  crop_size: int = 32

  @nn.compact
  def __call__(self, images, boxes, mask):
    net = backbones.from_config(self.backbone, name="backbone")
    if self.mode == "crops":
      b, n = boxes.shape[:2]
      crops = roi_sample(images, boxes, self.crop_size).reshape(b * n, self.crop_size, self.crop_size, -1)
      _, aux = net(crops, train=False)
      return aux["pre_logits"].reshape(b, n, -1), boxes, mask
    grid, _ = net(images, train=False)
    grid = grid.astype(jnp.float32)
    if self.mode == "grid":
      b, h, w, c = grid.shape
      ys, xs = jnp.meshgrid(jnp.arange(h) / h, jnp.arange(w) / w, indexing="ij")
      cells = jnp.stack([ys, xs, ys + 1 / h, xs + 1 / w], -1).reshape(1, h * w, 4)
      return grid.reshape(b, h * w, c), jnp.broadcast_to(cells, (b, h * w, 4)), jnp.ones((b, h * w), bool)
    if self.mode == "roi_align":
      return roi_sample(grid, boxes, self.roi_size).mean(axis=(2, 3)), boxes, mask
    raise ValueError(f"Unknown region mode {self.mode!r}; known: roi_align, crops, grid")
