"""VirTex's model: a ResNet visual backbone, a linear visual projection, and a textual head."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from vlrep.models import backbones, special_tokens, transformer


class VirTexModel(nn.Module):
  """Image -> 7x7 grid -> projection to the head width -> textual head.

  `head` is 'transformer' (captioning and masked LM, `directions` choose which) or 'linear' (token
  classification: global-average-pooled features -> vocabulary logits).
  `num_heads` / `mlp_dim` (None: hidden // 64 and 4 * hidden, as every VirTex model) and `decoder_ln_eps` (the
  decoder LayerNorms' epsilon) let a run reproduce a head built otherwise, e.g. an imported official checkpoint.
  `mlp_dropout` and `official_init` (transformer.TransformerTextualHead) make the head train as the official
  code's; with `official_init` the visual projection's weight is N(0, init_std) and its bias torch's uniform one
  (the official `_init_weights`), otherwise LeCun-normal weights and a zero bias. The defaults build vlrep's own
  head, so a saved config without these keys rebuilds the model it trained; configs/virtex.py sets the official
  values.
  `official_padding` treats the padding id as the official head does, for an official vocabulary whose `<unk>` is
  its padding id (0): padding is what follows a caption's last non-padding token (the official code masks by
  caption length) and the padding id's embedding is zero (the official embedding zeroes it), so an `<unk>` inside
  a caption is a zero-embedding position that later positions attend to, not a masked key. Imported VirTex runs set
  it; with vlrep's vocabulary, whose captions hold no padding id, it changes nothing.
  """

  vocab_size: int
  backbone: dict
  head: str = "transformer"
  hidden: int = 2048
  num_layers: int = 1
  max_len: int = 30
  dropout: float = 0.1
  directions: tuple[str, ...] = ("forward", "backward")
  dtype: Any = jnp.float32
  init_std: float = transformer.INIT_STD
  num_heads: int | None = None
  mlp_dim: int | None = None
  decoder_ln_eps: float = 1e-8
  mlp_dropout: bool = False
  official_init: bool = False
  official_padding: bool = False
  remat: str = "none"  # rematerialisation policy of the blocks (vlrep.models.remat.POLICIES); no parameter changes

  def setup(self):
    self.visual = backbones.from_config(self.backbone, dtype=self.dtype, remat=self.remat, name="backbone")
    if self.head == "linear":
      self.classifier = nn.Dense(self.vocab_size, dtype=self.dtype, param_dtype=jnp.float32, name="classifier")
    elif self.head == "transformer":
      init = {}
      if self.official_init:
        init = dict(
          kernel_init=nn.initializers.normal(self.init_std),
          bias_init=transformer.torch_bias_init(self.visual.num_features),
        )
      self.visual_projection = nn.Dense(
        self.hidden, dtype=self.dtype, param_dtype=jnp.float32, name="visual_projection", **init
      )
      self.textual_head = transformer.TransformerTextualHead(
        self.vocab_size,
        self.hidden,
        self.num_layers,
        num_heads=self.num_heads,
        mlp_dim=self.mlp_dim,
        max_len=self.max_len,
        dropout=self.dropout,
        directions=self.directions,
        dtype=self.dtype,
        init_std=self.init_std,
        decoder_ln_eps=self.decoder_ln_eps,
        mlp_dropout=self.mlp_dropout,
        official_init=self.official_init,
        padding_id=special_tokens.PAD_ID,
        zero_padding_embedding=self.official_padding,
        remat=self.remat,
        name="textual_head",
      )
    else:
      raise ValueError(f"Unknown head {self.head!r}; expected 'transformer' or 'linear'.")

  def encode_image(self, images, train: bool = False):
    return self.visual(images, train)

  def project_visual(self, images):
    """Frozen-backbone (inference BatchNorm) image features projected to the head width: [B, H*W, hidden]."""
    grid, _ = self.visual(images, False)
    b, h, w, c = grid.shape
    return self.visual_projection(grid.reshape(b, h * w, c))

  def text_logits(self, visual, tokens, direction: str = "forward", padding=None):
    """Logits [B, T, V] and cross-attention ([L][B, heads, T, N]) of one direction given projected features.
    `padding` [B, T] (True: a masked key) defaults to the padding-id positions."""
    padding = self._padding(tokens, tokens == special_tokens.PAD_ID if padding is None else padding)
    logits, aux = self.textual_head(visual, {direction: tokens}, {direction: padding}, False)
    return logits[direction], aux[f"{direction}/cross_attention"]

  def _padding(self, tokens, padding):
    """The key padding the head uses: with `official_padding`, only positions after the last non-padding token
    (the official caption-length mask) among the given ones."""
    if not self.official_padding:
      return padding
    idx = jnp.arange(tokens.shape[1])[None]
    length = jnp.max(jnp.where(tokens != special_tokens.PAD_ID, idx + 1, 0), axis=1, keepdims=True)
    return padding & (idx >= length)

  def __call__(
    self, images, tokens_by_direction=None, padding_by_direction=None, train: bool = False, causal_by_direction=None
  ):
    """`causal_by_direction`: per-example causal masks of the textual head (TransformerTextualHead; CapPa's)."""
    grid, aux = self.visual(images, train)
    if self.head == "linear":
      return self.classifier(aux["pre_logits"].astype(self.dtype)).astype(jnp.float32), aux
    b, h, w, c = grid.shape
    visual = self.visual_projection(grid.reshape(b, h * w, c))
    if padding_by_direction is not None:
      padding_by_direction = {d: self._padding(tokens_by_direction[d], p) for d, p in padding_by_direction.items()}
    logits, head_aux = self.textual_head(visual, tokens_by_direction, padding_by_direction, train, causal_by_direction)
    aux.update(head_aux)
    return logits, aux
