"""MCT's towers (Yuan et al., CVPR 2021): a ResNet image encoder and a BERT-style text encoder, each with two
2-layer MLP heads — a small intra-modal one (128-d, MoCo-v2's) and a wide inter-modal one (1024-d, the common
image-caption space). The momentum (key) encoders are the same module applied with momentum parameters."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from vlrep.models import resnet
from vlrep.models.loctex import TextEncoder


class MLPHead(nn.Module):
  """Linear -> ReLU -> linear (MoCo-v2's projection head)."""

  hidden: int
  out: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.hidden, dtype=self.dtype, param_dtype=jnp.float32, name="fc1")(x)
    x = nn.relu(x)
    return nn.Dense(self.out, dtype=self.dtype, param_dtype=jnp.float32, name="fc2")(x).astype(jnp.float32)


class MCTModel(nn.Module):
  vocab_size: int
  backbone: dict
  text: dict  # TextEncoder fields: hidden, num_layers, num_heads, max_len, dropout
  head_hidden: int = 2048
  intra_dim: int = 128
  inter_dim: int = 1024
  dtype: Any = jnp.float32

  def setup(self):
    self.visual = resnet.ResNet(**self.backbone, dtype=self.dtype, name="backbone")
    self.textual = TextEncoder(self.vocab_size, **self.text, dtype=self.dtype, name="textual")
    self.text_pooler = nn.Dense(self.text["hidden"], dtype=self.dtype, param_dtype=jnp.float32, name="text_pooler")
    head = lambda out, name: MLPHead(self.head_hidden, out, self.dtype, name=name)  # noqa: E731
    self.image_intra = head(self.intra_dim, "image_intra")
    self.image_inter = head(self.inter_dim, "image_inter")
    self.text_intra = head(self.intra_dim, "text_intra")
    self.text_inter = head(self.inter_dim, "text_inter")

  def encode_image(self, images, train: bool = False):
    return self.visual(images, train)

  def embed_images(self, images, train: bool = False) -> dict:
    """{'intra' [B, 128], 'inter' [B, 1024]}, not yet l2-normalised."""
    _, aux = self.visual(images, train)
    pooled = aux["pre_logits"].astype(self.dtype)
    return {"intra": self.image_intra(pooled), "inter": self.image_inter(pooled)}

  def embed_texts(self, tokens, train: bool = False) -> dict:
    # BERT's pooled output: the first token's ([SOS]) final state through a dense layer and tanh.
    pooled = jnp.tanh(self.text_pooler(self.textual(tokens, train)[:, 0]))
    return {"intra": self.text_intra(pooled), "inter": self.text_inter(pooled)}

  def __call__(self, images, tokens, train: bool = False):
    return self.embed_images(images, train), self.embed_texts(tokens, train)
