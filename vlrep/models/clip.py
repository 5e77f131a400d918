"""CLIP's two towers (Radford et al., 2021) on vlrep's pieces, and the learned temperature of its loss.

Image tower: a vlrep backbone (vlrep.models.backbones: a ResNet or a ViT), then either its pooled vector and a
linear projection (`pool='avg'`: a ResNet's global average pool, a ViT's class token, patch mean or MAP head;
`image_projection=False` leaves SigLIP's MAP output unprojected) or CLIP's attention pooling (`pool='attention'`:
the mean of the final grid, with learned position embeddings, is the query of one multi-head attention over the
grid and itself; its output projection gives the embedding).

Text tower for imported CLIP and SigLIP checkpoints (`text.arch='transformer'`): vlrep.models.text_transformer, the
pre-LN towers as open_clip and big_vision build them, projected by `text_projection` (with a bias for SigLIP).

Text tower, from scratch (`bert=None`, vlrep's own): CLIP's layout on vlrep's transformer layers: token and position
embeddings, self-attention layers under a causal mask, and the final state of the caption's [EOS] token (its
last non-padding token) through LayerNorm and a linear projection. The layers are `transformer.DecoderLayer`s
without cross-attention, post-LN (VirTex's) where CLIP's are pre-LN. Or a pretrained BERT (`bert`: its config),
bidirectional, whose [CLS] token's final state is projected.

The loss's learned values live here as parameters, so the optimizer updates them with the towers: CLIP's
`logit_scale` (init log(1/0.07)), or SigLIP's `t_prime` (t = exp(t'), init log 10) and `logit_bias` (init -10).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from vlrep.models import backbones, special_tokens
from vlrep.models import bert as bert_lib
from vlrep.models.loctex import TextEncoder
from vlrep.models.text_transformer import TextTransformer

POOLS = ("avg", "attention")
LOSSES = ("softmax", "sigmoid")


class AttentionPool(nn.Module):
  """CLIP's AttentionPool2d: grid [B, H, W, C] -> [B, out_dim]; C / 64 heads (32 for ResNet-50's 2048 channels)."""

  out_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, grid):
    b, h, w, c = grid.shape
    heads = max(1, c // 64)
    if c % heads:
      raise ValueError(f"Attention pooling: {c} channels do not split into {heads} heads.")
    x = grid.reshape(b, h * w, c).astype(jnp.float32)
    x = jnp.concatenate([jnp.mean(x, axis=1, keepdims=True), x], axis=1)  # [B, 1 + HW, C]
    pos = self.param("position_embedding", nn.initializers.normal(c**-0.5), (1 + h * w, c))
    x = (x + pos).astype(self.dtype)
    init = nn.initializers.normal(c**-0.5)
    dense = lambda name: nn.DenseGeneral(
      (heads, c // heads), dtype=self.dtype, param_dtype=jnp.float32, kernel_init=init, name=name
    )
    q, k, v = dense("query")(x[:, :1]), dense("key")(x), dense("value")(x)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(c // heads)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1).astype(self.dtype), v)
    out = nn.DenseGeneral(
      self.out_dim, axis=(-2, -1), dtype=self.dtype, param_dtype=jnp.float32, kernel_init=init, name="out"
    )(out)
    return out[:, 0].astype(jnp.float32)


def last_token_states(states, tokens):
  """The state of each caption's last non-padding token ([EOS]: the only one a causal mask lets see the whole
  caption; a caption the tokenizer cut keeps its last piece)."""
  last = jnp.maximum(jnp.sum(tokens != special_tokens.PAD_ID, axis=1) - 1, 0)
  return jnp.take_along_axis(states, last[:, None, None], axis=1)[:, 0]


class CLIPModel(nn.Module):
  vocab_size: int
  backbone: dict  # vlrep.models.backbones section: a ResNet, or a ViT (arch='vit') as CLIP's and SigLIP's
  # loctex.TextEncoder fields: hidden, num_layers, num_heads, max_len, dropout (unused with `bert`); or, with
  # arch='transformer', text_transformer.TextTransformer's (open_clip's and big_vision's towers, for imports)
  text: dict
  bert: bert_lib.BertConfig | None = None  # a pretrained BERT's config: the text tower is that BERT
  embed_dim: int = 1024
  pool: str = "avg"
  loss: str = "softmax"
  image_projection: bool = True  # False: the pooled vector is the embedding (SigLIP's MAP head output)
  text_projection_bias: bool = False  # SigLIP's text head has a bias; CLIP's projections have none
  dtype: Any = jnp.float32
  remat: str = "none"  # rematerialisation policy of the blocks (vlrep.models.remat.POLICIES); no parameter changes

  def setup(self):
    if self.pool not in POOLS:
      raise ValueError(f"Unknown image pooling {self.pool!r}; known: {POOLS}")
    if self.loss not in LOSSES:
      raise ValueError(f"Unknown loss {self.loss!r}; known: {LOSSES}")
    self.visual = backbones.from_config(self.backbone, dtype=self.dtype, remat=self.remat, name="backbone")
    if self.pool == "attention":
      self.attention_pool = AttentionPool(self.embed_dim, self.dtype, name="attention_pool")
    elif self.image_projection:
      self.visual_projection = self._projection("visual_projection")
    if self.bert is not None:
      self.textual = bert_lib.BertEncoder(self.bert, dtype=self.dtype, remat=self.remat, name="textual")
    elif self.text.get("arch") == "transformer":
      fields = {k: v for k, v in self.text.items() if k != "arch"}
      self.textual = TextTransformer(self.vocab_size, **fields, dtype=self.dtype, remat=self.remat, name="textual")
    else:
      self.textual = TextEncoder(
        self.vocab_size, **self.text, dtype=self.dtype, causal=True, remat=self.remat, name="textual"
      )
      self.text_ln = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="text_ln")
    self.text_projection = self._projection("text_projection", bias=self.text_projection_bias)
    constant = lambda v: nn.initializers.constant(v)
    if self.loss == "softmax":
      self.logit_scale = self.param("logit_scale", constant(math.log(1 / 0.07)), ())
    else:
      self.t_prime = self.param("t_prime", constant(math.log(10.0)), ())
      self.logit_bias = self.param("logit_bias", constant(-10.0), ())

  def _projection(self, name, bias: bool = False):
    return nn.Dense(self.embed_dim, use_bias=bias, dtype=self.dtype, param_dtype=jnp.float32, name=name)

  def encode_image(self, images, train: bool = False):
    return self.visual(images, train)

  def embed_images(self, images, train: bool = False):
    """Image embeddings [B, D], not yet l2-normalised."""
    grid, aux = self.visual(images, train)
    if self.pool == "attention":
      return self.attention_pool(grid)
    if not self.image_projection:
      return aux["pre_logits"].astype(jnp.float32)
    return self.visual_projection(aux["pre_logits"].astype(self.dtype)).astype(jnp.float32)

  def embed_texts(self, tokens, train: bool = False):
    """Caption embeddings [B, D], not yet l2-normalised."""
    if self.bert is not None:
      states, _ = self.textual(tokens, mask=tokens != special_tokens.PAD_ID, deterministic=not train)
      pooled = states[:, 0]  # [CLS]
    elif self.text.get("arch") == "transformer":
      pooled, _ = self.textual(tokens, train)
    else:
      pooled = self.text_ln(last_token_states(self.textual(tokens, train), tokens))
    return self.text_projection(pooled.astype(self.dtype)).astype(jnp.float32)

  def temperature(self) -> dict:
    """The loss's learned values: {'logit_scale'} or {'t_prime', 'logit_bias'} (raw parameters)."""
    if self.loss == "softmax":
      return {"logit_scale": self.logit_scale}
    return {"t_prime": self.t_prime, "logit_bias": self.logit_bias}

  def __call__(self, images, tokens, train: bool = False) -> dict:
    return {
      "image": self.embed_images(images, train),
      "text": self.embed_texts(tokens, train),
      **self.temperature(),
    }
