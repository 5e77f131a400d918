"""LocTex's model: a ResNet without pooling, a transformer text encoder, and linear projections.

Contrastive branch: global average pooling of the last stage (visual) or of the tokens (textual), then a
linear map to `embed_dim` each. Localization branch, per supervised scale s (1 = last stage, 2 = the stage
before, 4 = the one before that): linear maps of the spatial features and of the token features to
`embed_dim`, whose products are the image-caption attention logits [B, T, R_s * R_s] (softmax over space).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from vlrep.models import backbones, special_tokens, transformer

SCALE_TO_STAGE = {1: "stage4", 2: "stage3", 4: "stage2"}
# A ViT has one feature map (its patch grid, `stage4`), no earlier stages of finer resolution: scale 1 only.
VIT_SCALES = (1,)


def check_scales(backbone: dict, scales) -> None:
  """A clear error for trace-attention scales the backbone has no feature map for: scales 2 and 4 read a ResNet's
  stage3 and stage2 (strides 16 and 8), which a ViT has not (one grid, at its patch size)."""
  if backbones.arch_of(backbone) == "vit" and set(scales) - set(VIT_SCALES):
    raise ValueError(
      f"LocTex's trace attention at scales {sorted(set(scales) - set(VIT_SCALES))} reads a ResNet's earlier stages "
      f"(2x: stage3, 4x: stage2), which a ViT has not: a ViT supports scales {list(VIT_SCALES)} only (its patch "
      "grid; a finer grid needs smaller patches). Use scales=1 (configs/loctex.py:scales=1) with a ViT backbone."
    )


class TextEncoder(nn.Module):
  """Post-LN transformer encoder with GELU (VirTex's layers without cross-attention) -> the final states
  [B, T, hidden]: bidirectional (LocTex), or `causal` (CLIP's text tower, pooled at [EOS]). `remat`: each layer's
  rematerialisation (vlrep.models.remat; transformer.TransformerTextualHead says what each policy keeps)."""

  vocab_size: int
  hidden: int = 1024
  num_layers: int = 4
  num_heads: int = 16
  mlp_dim: int | None = None
  max_len: int = 60
  dropout: float = 0.1
  dtype: Any = jnp.float32
  causal: bool = False
  remat: str = "none"

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    keep = tokens != special_tokens.PAD_ID
    mask = keep[:, None, None, :]
    if self.causal:
      t = tokens.shape[1]
      mask = mask & jnp.tril(jnp.ones((t, t), bool))[None, None]
    x = transformer.WordAndPositionEmbedding(
      self.vocab_size, self.hidden, self.max_len, self.dropout, self.dtype, name="embedding"
    )(tokens, train)
    layer_cls = transformer.decoder_layer(self.remat)
    for layer in range(self.num_layers):
      x, _ = layer_cls(
        self.num_heads, self.mlp_dim or 4 * self.hidden, self.dropout, False, self.dtype, name=f"layer{layer}"
      )(x, None, mask, train)
    return x


class LocTexModel(nn.Module):
  vocab_size: int
  backbone: dict
  text: dict  # TextEncoder fields: hidden, num_layers, num_heads, max_len, dropout
  embed_dim: int = 1024
  scales: tuple[int, ...] = (1, 2)
  dtype: Any = jnp.float32
  remat: str = "none"  # rematerialisation policy of the blocks (vlrep.models.remat.POLICIES); no parameter changes

  def __post_init__(self):
    check_scales(self.backbone, self.scales)  # when the model is built: before any data is read or step compiled
    super().__post_init__()

  def setup(self):
    dense = lambda name: nn.Dense(self.embed_dim, dtype=self.dtype, param_dtype=jnp.float32, name=name)
    self.visual = backbones.from_config(self.backbone, dtype=self.dtype, remat=self.remat, name="backbone")
    self.textual = TextEncoder(self.vocab_size, **self.text, dtype=self.dtype, remat=self.remat, name="textual")
    self.visual_contrastive = dense("visual_contrastive")
    self.text_contrastive = dense("text_contrastive")
    for s in self.scales:
      if s not in SCALE_TO_STAGE:
        raise ValueError(f"Unknown localization scale {s}; known: {sorted(SCALE_TO_STAGE)}")
    self.visual_localization = {s: dense(f"visual_localization_{s}x") for s in self.scales}
    self.text_localization = {s: dense(f"text_localization_{s}x") for s in self.scales}

  def encode_image(self, images, train: bool = False):
    return self.visual(images, train)

  def embed_images(self, images):
    """L_C's image embeddings [B, D] (inference BatchNorm): the image side of caption retrieval."""
    _, aux = self.visual(images, False)
    return self.visual_contrastive(aux["pre_logits"].astype(self.dtype)).astype(jnp.float32)

  def embed_texts(self, tokens):
    """L_C's caption embeddings [B, D]: the text side of caption retrieval."""
    return self._text_embedding(self.textual(tokens, False), tokens)

  def _text_embedding(self, words, tokens):
    keep = (tokens != special_tokens.PAD_ID).astype(jnp.float32)[..., None]
    text_pooled = jnp.sum(words.astype(jnp.float32) * keep, 1) / jnp.maximum(jnp.sum(keep, 1), 1.0)
    return self.text_contrastive(text_pooled.astype(self.dtype)).astype(jnp.float32)

  def __call__(self, images, tokens, train: bool = False) -> tuple[dict, dict]:
    """Returns ({'image_embedding', 'text_embedding' [B, D], 'attention_logits_<s>x' [B, T, R_s^2]}, aux)."""
    grid, aux = self.visual(images, train)
    words = self.textual(tokens, train)
    out = {
      "image_embedding": self.visual_contrastive(aux["pre_logits"].astype(self.dtype)).astype(jnp.float32),
      "text_embedding": self._text_embedding(words, tokens),
    }
    for s in self.scales:
      out[f"attention_logits_{s}x"] = self._attention_logits(
        self.visual_localization[s], self.text_localization[s], aux[SCALE_TO_STAGE[s]], words
      )
    return out, aux

  def contrastive_attention(self, images, tokens):
    """Attention logits [B, T, R^2] of the contrastive projections applied per location and per token (a
    linear map commutes with average pooling): how a model trained without L_L localizes (inference BN)."""
    _, aux = self.visual(images, False)
    words = self.textual(tokens, False)
    return self._attention_logits(self.visual_contrastive, self.text_contrastive, aux["stage4"], words)

  @staticmethod
  def _attention_logits(visual_proj, text_proj, grid, words):
    b, h, w, c = grid.shape
    v = visual_proj(grid.reshape(b, h * w, c))
    t = text_proj(words)
    return jnp.einsum("btd,bnd->btn", t, v).astype(jnp.float32)
