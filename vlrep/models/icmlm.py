"""ICMLM's trainable modules (Bulent Sariyildiz et al., ECCV 2020), around a frozen BERT applied by the method.

  backbone   the CNN phi (ResNet), the only part transfer evaluation keeps
  tp         tag prediction: 2-layer MLP on the pooled grid ('mlp', the paper's ResNet-50 choice) or 4 conv
             layers + global average pooling + linear ('cnn', its VGG16 choice)
  tfm        ICMLM_tfm: the grid projected to BERT's width (plus a learned grid position embedding), concatenated
             with BERT's token features, a post-LN transformer encoder; the masked token's output goes to BERT's
             token classifier (`mlm_head`, initialised from the checkpoint's when it has one)
  att, fc    ICMLM_att-fc, eqs. (3)-(6): per head, LayerNorm+ReLU projections of grid and tokens to d_z, scaled
             dot-product scores, log-sum-exp over the caption's tokens; heads averaged by a learned linear layer;
             softmax over the grid pools it; fc layers (linear, LayerNorm, ReLU) map to BERT's width, scored by dot
             product against BERT's (frozen) word embeddings
The variant 'text_only' is tfm without the image: the same frozen BERT, transformer layer and token classifier
trained on captions alone, the baseline that says how much the image adds to masked-token prediction.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from vlrep.models import backbones
from vlrep.models import remat as remat_lib
from vlrep.models.bert import BertConfig, BertMLMHead
from vlrep.models.transformer import decoder_layer

VARIANTS = ("tp", "tfm", "att_fc", "text_only")


class TagHead(nn.Module):
  num_tags: int
  kind: str = "mlp"
  hidden: int = 2048
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, grid):
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=jnp.float32, name=name)
    if self.kind == "mlp":
      x = jnp.mean(grid, axis=(1, 2))
      x = nn.relu(dense(self.hidden, "fc1")(x))
    elif self.kind == "cnn":
      x = grid
      for i in range(4):
        x = nn.Conv(self.hidden, (3, 3), dtype=self.dtype, param_dtype=jnp.float32, name=f"conv{i + 1}")(x)
        x = nn.relu(nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name=f"norm{i + 1}")(x))
      x = jnp.mean(x, axis=(1, 2))
    else:
      raise ValueError(f"Unknown tp head {self.kind!r}; known: mlp, cnn.")
    return dense(self.num_tags, "out")(x).astype(jnp.float32)


class AttentionPooling(nn.Module):
  """Eqs. (3)-(5): grid [B, N, dx], tokens [B, T, dw] (mask [B, T]) -> (pooled [B, dx], p_att [B, N])."""

  dim: int
  num_heads: int = 1
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, grid, tokens, token_mask):
    proj = lambda x, name: nn.relu(
      nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name=f"{name}_norm")(
        nn.DenseGeneral((self.num_heads, self.dim), dtype=self.dtype, param_dtype=jnp.float32, name=name)(x)
      )
    )
    x, w = proj(grid, "sigma_x"), proj(tokens, "sigma_w")  # [B, N, H, dz], [B, T, H, dz]
    scores = jnp.einsum("bnhd,bthd->bhnt", x, w).astype(jnp.float32) / jnp.sqrt(float(self.dim))
    scores = jnp.where(token_mask[:, None, None, :], scores, -jnp.inf)
    per_head = jax.nn.logsumexp(scores, axis=-1)  # [B, H, N]: soft maximum over the caption's tokens
    s = nn.Dense(1, param_dtype=jnp.float32, name="sigma_h")(jnp.moveaxis(per_head, 1, -1))[..., 0]  # [B, N]
    p_att = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bn,bnd->bd", p_att, grid.astype(jnp.float32)), p_att


class ICMLMModel(nn.Module):
  variant: str
  backbone: dict
  bert: BertConfig
  num_tags: int = 0
  tp_head: str = "mlp"
  tp_hidden: int = 2048
  tfm_layers: int = 1
  tfm_heads: int = 8
  tfm_mlp_dim: int = 3072
  att_dim: int = 768
  att_heads: int = 1
  fc_layers: int = 1
  dropout: float = 0.1
  dtype: Any = jnp.float32
  remat: str = "none"  # rematerialisation policy of the blocks (vlrep.models.remat.POLICIES); no parameter changes

  def setup(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"Unknown ICMLM variant {self.variant!r}; known: {VARIANTS}")
    self.visual = backbones.from_config(self.backbone, self.dtype, remat=remat_lib.check(self.remat))
    if self.num_tags:
      self.tp = TagHead(self.num_tags, self.tp_head, self.tp_hidden, self.dtype, name="tp")
    dw = self.bert.hidden_size
    if self.variant in ("tfm", "text_only"):
      if self.variant == "tfm":
        self.visual_proj = nn.Dense(dw, dtype=self.dtype, param_dtype=jnp.float32, name="visual_proj")
        self.grid_pos = self.param("grid_pos", nn.initializers.normal(0.02), (256, dw))
      self.tfm = [
        decoder_layer(self.remat)(
          self.tfm_heads, self.tfm_mlp_dim, self.dropout, cross_attention=False, dtype=self.dtype, name=f"tfm_{i}"
        )
        for i in range(self.tfm_layers)
      ]
      self.mlm_head = BertMLMHead(self.bert, self.dtype, name="mlm_head")
    if self.variant == "att_fc":
      self.att = AttentionPooling(self.att_dim, self.att_heads, self.dtype, name="att")
      self.fc = [nn.Dense(dw, dtype=self.dtype, param_dtype=jnp.float32, name=f"fc_{i}") for i in range(self.fc_layers)]
      self.fc_norms = [
        nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name=f"fc_norm_{i}") for i in range(self.fc_layers)
      ]

  def encode_image(self, images, train: bool = False):
    return self.visual(images, train)

  def __call__(self, images, words, token_mask, masked_pos, word_embeddings, train: bool = False):
    """images [B, H, W, 3]; words [B, T, dw] frozen BERT features of the masked caption; masked_pos [B];
    word_embeddings [V, dw]. Returns {'tag_logits', 'mlm_logits', 'attention' [B, h, w] over the grid}."""
    out = {}
    b = images.shape[0]
    if self.variant == "text_only" and self.is_initializing():
      self.visual(images, False)  # the (unused) backbone still exists, so the probe reports random init
    if self.variant != "text_only":
      grid, _ = self.visual(images, train)
      gh, gw = grid.shape[1:3]
      if self.num_tags:
        out["tag_logits"] = self.tp(grid)
      flat = grid.reshape(b, gh * gw, -1)
    if self.variant in ("tfm", "text_only"):
      seq, mask = words.astype(self.dtype), token_mask
      n_visual = 0
      if self.variant == "tfm":
        n_visual = gh * gw
        if n_visual > self.grid_pos.shape[0]:
          raise ValueError(f"A {gh}x{gw} grid exceeds the 256 learned grid positions; use smaller images.")
        visual = self.visual_proj(flat) + self.grid_pos[:n_visual].astype(self.dtype)
        seq = jnp.concatenate([visual, seq], axis=1)
        mask = jnp.concatenate([jnp.ones((b, n_visual), bool), token_mask], axis=1)
      attn_mask = mask[:, None, None, :]
      for layer in self.tfm:
        seq, _ = layer(seq, None, attn_mask, train)
      h = jnp.take_along_axis(seq, (masked_pos + n_visual)[:, None, None], axis=1)[:, 0]
      out["mlm_logits"] = self.mlm_head(h, word_embeddings)
    if self.variant == "att_fc":
      pooled, p_att = self.att(flat, words.astype(self.dtype), token_mask)
      x = pooled.astype(self.dtype)
      for dense, norm in zip(self.fc, self.fc_norms, strict=True):
        x = nn.relu(norm(dense(x)))
      out["mlm_logits"] = x.astype(jnp.float32) @ word_embeddings.astype(jnp.float32).T
      out["attention"] = p_att.reshape(b, gh, gw)
    return out
