"""A text transformer in big_vision's layout (`Embed_0`, `pos_embedding`, `Transformer` = vit.Encoder), pooled to
one vector per text: the text towers of CLIP as open_clip and OpenAI build it (a causal mask, the end-of-text
token's state, the final LayerNorm) and of SigLIP as big_vision builds it (no mask, the last position's state), so
imported checkpoints compute what they computed. The projection to the joint space is the CLIP model's
(vlrep.models.clip), not this tower's.

Pooling (`pool`):
  'argmax'       the state at the highest token id: CLIP's end-of-text token (49407, the vocabulary's last)
  'eos'          the state at the first `eos_id` (Hugging Face CLIP with a configured end-of-text id)
  'last'         the state at the last position (SigLIP: texts padded to the full length)
  'last_nonpad'  the state at the last token that is not `pad_id` (vlrep's own tokenizers)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from vlrep.models import remat as remat_lib
from vlrep.models import vit

POOLS = ("argmax", "eos", "last", "last_nonpad")


class TextTransformer(nn.Module):
  vocab_size: int
  width: int = 512
  depth: int = 12
  num_heads: int = 8
  mlp_dim: int | None = None  # 4 * width when None
  max_len: int = 77
  causal: bool = True
  pool: str = "argmax"
  eos_id: int = -1
  pad_id: int = 0
  mlp_act: str = "gelu"
  ln_eps: float = 1e-5
  dropout: float = 0.0
  dtype: Any = jnp.float32
  remat: str = "none"

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    """tokens [B, L] (L <= max_len) -> (pooled [B, width] after the final LayerNorm, states [B, L, width])."""
    if self.pool not in POOLS:
      raise ValueError(f"Unknown text pooling {self.pool!r}; known: {POOLS}.")
    length = tokens.shape[1]
    if length > self.max_len:
      raise ValueError(f"Texts of {length} tokens are longer than the tower's {self.max_len} positions.")
    x = nn.Embed(
      self.vocab_size,
      self.width,
      embedding_init=nn.initializers.normal(stddev=0.02),
      param_dtype=jnp.float32,
      dtype=self.dtype,
      name="Embed_0",
    )(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.01), (1, self.max_len, self.width), jnp.float32)
    x = x + pos[:, :length].astype(x.dtype)
    mask = nn.make_causal_mask(tokens) if self.causal else None
    x = vit.Encoder(
      self.depth,
      self.num_heads,
      self.mlp_dim,
      self.dropout,
      self.mlp_act,
      self.ln_eps,
      self.dtype,
      remat_lib.check(self.remat),
      name="Transformer",
    )(x, mask, deterministic=not train)
    if self.pool == "argmax":
      index = jnp.argmax(tokens, axis=1)
    elif self.pool == "eos":
      index = jnp.argmax(tokens == self.eos_id, axis=1)
    elif self.pool == "last":
      index = jnp.full((tokens.shape[0],), length - 1)
    else:
      index = jnp.maximum(jnp.sum(tokens != self.pad_id, axis=1) - 1, 0)
    pooled = jnp.take_along_axis(x, index[:, None, None], axis=1)[:, 0]
    return pooled.astype(jnp.float32), x
