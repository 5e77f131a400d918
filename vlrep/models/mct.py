"""MCT's towers (Yuan et al., CVPR 2021): a ResNet image encoder and a BERT-style text encoder, each with two
2-layer MLP heads — a small intra-modal one (128-d, MoCo-v2's) and a wide inter-modal one (1024-d, the common
image-caption space). The momentum (key) encoders are the same module applied with momentum parameters.

The text tower is either trained from scratch (`TextEncoder`, the paper's 'scratch' variant) or a pretrained BERT
(`vlrep.models.bert.BertEncoder`, Hugging Face's tree, so its checkpoint drops in), fine-tuned with the tower's LR
and, as BERT fine-tuning does, with dropout while training (`method.bert_dropout`, 0.1 as BERT-base's own)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from vlrep.models import backbones, special_tokens
from vlrep.models import bert as bert_lib
from vlrep.models.loctex import TextEncoder


class MLPHead(nn.Module):
  """Linear -> ReLU -> linear (MoCo-v2's projection head); `batchnorm` adds BatchNorm before the ReLU (SimCLR's
  and MoCo-v3's heads), which removes the component every input shares (see MCTModel.head_batchnorm)."""

  hidden: int
  out: int
  dtype: Any = jnp.float32
  batchnorm: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(self.hidden, dtype=self.dtype, param_dtype=jnp.float32, name="fc1")(x)
    if self.batchnorm:
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype, name="bn1")(x)
    x = nn.relu(x)
    return nn.Dense(self.out, dtype=self.dtype, param_dtype=jnp.float32, name="fc2")(x).astype(jnp.float32)


class MCTModel(nn.Module):
  vocab_size: int
  backbone: dict
  text: dict  # TextEncoder fields: hidden, num_layers, num_heads, max_len, dropout (unused with `bert`)
  bert: bert_lib.BertConfig | None = None  # a pretrained BERT's config: the text tower is that BERT
  head_hidden: int = 2048
  intra_dim: int = 128
  inter_dim: int = 1024
  # Heads ('intra', 'inter') with BatchNorm in the hidden layer. The paper's heads have none. Pooled backbone
  # features share a large common component; under the inter-modal hinge summed over the whole queue, a head
  # without normalisation grows that component until every embedding is the same.
  head_batchnorm: tuple = ()
  # 'cls': BERT's pooled output (the first token's final state); 'mean': the mean of the non-padding tokens'
  # final states. A post-LN encoder trained from scratch starts with nearly the same first-token state for every
  # caption (tests/test_mct.py checks it at init), and runlocal's budget does not train it out of that.
  text_pool: str = "cls"
  dtype: Any = jnp.float32
  remat: str = "none"  # rematerialisation policy of the blocks (vlrep.models.remat.POLICIES); no parameter changes

  def setup(self):
    self.visual = backbones.from_config(self.backbone, dtype=self.dtype, remat=self.remat, name="backbone")
    if self.bert is not None:
      self.textual = bert_lib.BertEncoder(self.bert, dtype=self.dtype, remat=self.remat, name="textual")
      text_width = self.bert.hidden_size
    else:
      self.textual = TextEncoder(self.vocab_size, **self.text, dtype=self.dtype, remat=self.remat, name="textual")
      text_width = self.text["hidden"]
    self.text_pooler = nn.Dense(text_width, dtype=self.dtype, param_dtype=jnp.float32, name="text_pooler")
    for kind in self.head_batchnorm:
      if kind not in ("intra", "inter"):
        raise ValueError(f"Unknown head_batchnorm entry {kind!r}; expected 'intra' and/or 'inter'.")
    head = lambda out, kind, name: MLPHead(self.head_hidden, out, self.dtype, kind in self.head_batchnorm, name=name)
    self.image_intra = head(self.intra_dim, "intra", "image_intra")
    self.image_inter = head(self.inter_dim, "inter", "image_inter")
    self.text_intra = head(self.intra_dim, "intra", "text_intra")
    self.text_inter = head(self.inter_dim, "inter", "text_inter")

  def encode_image(self, images, train: bool = False):
    return self.visual(images, train)

  def embed_images(self, images, train: bool = False) -> dict:
    """{'intra' [B, 128], 'inter' [B, 1024]}, not yet l2-normalised."""
    _, aux = self.visual(images, train)
    pooled = aux["pre_logits"].astype(self.dtype)
    return {"intra": self.image_intra(pooled, train), "inter": self.image_inter(pooled, train)}

  def embed_texts(self, tokens, train: bool = False) -> dict:
    # BERT's pooled output: the first token's ([SOS] / [CLS]) final state (or the tokens' mean) through dense and
    # tanh. A pretrained BERT's 'cls' pooling is its own pretrained pooler.
    if self.bert is not None:
      states, aux = self.textual(tokens, mask=tokens != special_tokens.PAD_ID, deterministic=not train)
    else:
      states, aux = self.textual(tokens, train), None
    if self.text_pool == "cls" and aux is not None:
      pooled = aux["pooled"]
    elif self.text_pool == "cls":
      pooled = jnp.tanh(self.text_pooler(states[:, 0]))
    elif self.text_pool == "mean":
      keep = (tokens != special_tokens.PAD_ID)[..., None].astype(states.dtype)
      pooled = jnp.tanh(self.text_pooler(jnp.sum(states * keep, 1) / jnp.maximum(jnp.sum(keep, 1), 1.0)))
    else:
      raise ValueError(f"Unknown text_pool {self.text_pool!r}; expected 'cls' or 'mean'.")
    return {"intra": self.text_intra(pooled, train), "inter": self.text_inter(pooled, train)}

  def __call__(self, images, tokens, train: bool = False):
    return self.embed_images(images, train), self.embed_texts(tokens, train)
