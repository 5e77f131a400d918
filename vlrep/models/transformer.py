"""Transformer pieces for textual heads: embeddings, post-LN decoder layers, and VirTex's textual heads.

The decoder follows VirTex (Vaswani et al. with GELU): each layer applies masked self-attention, attention
over image features, and a feed-forward network; each followed by dropout, a residual connection and
LayerNorm (post-LN). Attention weights are returned by name so visualisations can pick them up.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from vlrep.models import remat as remat_lib

# BERT-style initialisation N(0, 0.02), as VirTex uses. Its gain per matrix, 0.02 * sqrt(H), is ~0.9 at the paper's
# H=2048 but ~0.2 at a CPU-sized H=128, where the products of several small matrices between the image and the
# logits stall learning; `init_std` lets small heads keep the paper's gain (docs/results/virtex.md).
INIT_STD = 0.02


def torch_bias_init(fan_in: int):
  """torch.nn.Linear's default bias initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)): the official VirTex head
  re-initialises only weights (`_init_weights`), so its feed-forward, visual projection and output biases keep it."""
  bound = 1.0 / float(fan_in) ** 0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def zero_row_init(base, row: int):
  """`base` with one row set to zero: torch's Embedding(padding_idx=...) as the official head initialises it."""
  return lambda key, shape, dtype=jnp.float32: base(key, shape, dtype).at[row].set(0.0)


class MultiHeadAttention(nn.Module):
  """Multi-head attention returning (output, weights[B, heads, Tq, Tk] averaged-ready)."""

  num_heads: int
  dtype: Any = jnp.float32
  dropout: float = 0.0
  init_std: float = INIT_STD

  @nn.compact
  def __call__(self, q_in, kv_in, mask=None, train: bool = False):
    init = nn.initializers.normal(self.init_std)
    h = q_in.shape[-1]
    if h % self.num_heads:
      raise ValueError(f"Hidden size {h} is not divisible by {self.num_heads} heads.")
    dense = lambda name, bias=True: nn.DenseGeneral(
      (self.num_heads, h // self.num_heads),
      dtype=self.dtype,
      param_dtype=jnp.float32,
      kernel_init=init,
      use_bias=bias,
      name=name,
    )
    # No key bias: it adds q.b to every logit of a query alike, so softmax removes it and its gradient is zero up to
    # rounding, which Adam would scale up into steps of LR size (different on every device count).
    q, k, v = dense("query")(q_in), dense("key", bias=False)(kv_in), dense("value")(kv_in)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
    if mask is not None:
      logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    probs = nn.Dropout(self.dropout)(weights, deterministic=not train)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(self.dtype), v)
    out = nn.DenseGeneral(h, axis=(-2, -1), dtype=self.dtype, param_dtype=jnp.float32, kernel_init=init, name="out")(
      out
    )
    return out, weights


class DecoderLayer(nn.Module):
  """Post-LN transformer layer: self-attention (causal or not), optional cross-attention, GELU MLP."""

  num_heads: int
  mlp_dim: int
  dropout: float = 0.1
  cross_attention: bool = True
  dtype: Any = jnp.float32
  init_std: float = INIT_STD
  ln_eps: float = 1e-8  # the official VirTex layers (torch.nn.TransformerDecoderLayer) use torch's default 1e-5
  # torch.nn.TransformerDecoderLayer (the official VirTex head) also drops out the feed-forward's hidden
  # activations: linear2(dropout(gelu(linear1(x)))).
  mlp_dropout: bool = False
  torch_bias_init: bool = False  # feed-forward biases U(+-1/sqrt(fan_in)), as the official head leaves them

  @nn.compact
  def __call__(self, x, memory, self_mask, train: bool = False):
    init = nn.initializers.normal(self.init_std)
    bias = torch_bias_init if self.torch_bias_init else lambda fan_in: nn.initializers.zeros
    ln = lambda name: nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, param_dtype=jnp.float32, name=name)
    drop = nn.Dropout(self.dropout)
    y, weights = MultiHeadAttention(self.num_heads, self.dtype, self.dropout, self.init_std, name="self_attention")(
      x, x, self_mask, train
    )
    self.sow("intermediates", "self_attention_weights", weights)  # kept only when 'intermediates' is mutable (maps)
    x = ln("ln_self")(x + drop(y, deterministic=not train))
    cross = None
    if self.cross_attention:
      y, cross = MultiHeadAttention(self.num_heads, self.dtype, self.dropout, self.init_std, name="cross_attention")(
        x, memory, None, train
      )
      x = ln("ln_cross")(x + drop(y, deterministic=not train))
    h = x.shape[-1]
    dense = lambda width, fan_in, name: nn.Dense(
      width, dtype=self.dtype, param_dtype=jnp.float32, kernel_init=init, bias_init=bias(fan_in), name=name
    )
    y = nn.gelu(dense(self.mlp_dim, h, "mlp_in")(x), approximate=False)
    if self.mlp_dropout:
      y = drop(y, deterministic=not train)
    y = dense(h, self.mlp_dim, "mlp_out")(y)
    x = ln("ln_mlp")(x + drop(y, deterministic=not train))
    return x, cross


def decoder_layer(remat: str = "none") -> type[DecoderLayer]:
  """DecoderLayer under rematerialisation policy `remat` (vlrep.models.remat); called as layer(x, memory, mask,
  train), `train` positional (static)."""
  return remat_lib.wrap(DecoderLayer, remat, static_argnums=(4,))


class WordAndPositionEmbedding(nn.Module):
  """Token + learned position embeddings, summed, LayerNorm, dropout. `attend` ties the output layer."""

  vocab_size: int
  hidden: int
  max_len: int
  dropout: float = 0.1
  dtype: Any = jnp.float32
  init_std: float = INIT_STD
  zero_row: int | None = None  # a row (the padding token) that starts at zero, as torch's padding_idx
  # The official VirTex embedding multiplies its output by (token != padding id): an official vocabulary's <unk>
  # (its padding id) inside a caption enters the decoder as a zero vector.
  zero_padding_id: int | None = None

  def setup(self):
    init = nn.initializers.normal(self.init_std)
    words_init = init if self.zero_row is None else zero_row_init(init, self.zero_row)
    self.words = nn.Embed(
      self.vocab_size, self.hidden, embedding_init=words_init, param_dtype=jnp.float32, dtype=self.dtype, name="words"
    )
    self.positions = nn.Embed(
      self.max_len, self.hidden, embedding_init=init, param_dtype=jnp.float32, dtype=self.dtype, name="positions"
    )
    self.ln = nn.LayerNorm(epsilon=1e-8, dtype=self.dtype, param_dtype=jnp.float32, name="ln")
    self.drop = nn.Dropout(self.dropout)

  def __call__(self, tokens, train: bool = False):
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"Sequence length {tokens.shape[1]} exceeds the embedding's max_len {self.max_len}.")
    pos = jnp.arange(tokens.shape[1])[None]
    x = self.drop(self.ln(self.words(tokens) + self.positions(pos)), deterministic=not train)
    if self.zero_padding_id is not None:
      x = x * (tokens != self.zero_padding_id)[..., None].astype(x.dtype)
    return x

  def attend(self, x):
    return self.words.attend(x)


class TransformerTextualHead(nn.Module):
  """One or two (forward/backward) transformer decoders over image features, sharing embeddings and output.

  Attributes:
    directions: ('forward',), ('forward', 'backward') for bicaptioning, or ('bidirectional',) for masked LM
      (self-attention without the causal mask).
    decoder_ln_eps: epsilon of the decoder layers' LayerNorms (the official VirTex head builds
      torch.nn.TransformerDecoderLayer, whose LayerNorms use torch's default 1e-5). The embedding's stays 1e-8,
      as the official code's.
    mlp_dropout: dropout on the feed-forward's hidden activations too (torch.nn.TransformerDecoderLayer's).
    official_init: initialise as the official head effectively does: weights N(0, init_std) as always, but the
      feed-forward and output biases U(+-1/sqrt(fan_in)) (torch.nn.Linear's default, which the official
      `_init_weights` leaves alone) and the padding token's embedding row zero. Attention biases are zero in both.
    remat: rematerialisation of each decoder layer (vlrep.models.remat): 'none' keeps every activation for the
      backward pass; 'dots' keeps the layer's matmul outputs (projections, attention scores and mixes, MLP) and
      recomputes its LayerNorms, softmaxes, GELU and dropout; 'full' keeps only the layer's input and runs it again.
      The embedding and the output layer are not rematerialised; parameters are the same under every policy.
  `causal_by_direction` (optional, {direction: [B] bool}): per example, whether a forward/backward decoder keeps its
  causal mask (True) or attends to every non-padding position (False: CapPa's parallel prediction); a direction
  not in it is causal for every example.
  Returns logits[direction] [B, T, V] and aux {'<direction>/cross_attention': [L][B, heads, T, N]}.
  """

  vocab_size: int
  hidden: int = 2048
  num_layers: int = 1
  num_heads: int | None = None  # default hidden // 64, as VirTex and BERT
  mlp_dim: int | None = None  # default 4 * hidden
  max_len: int = 30
  dropout: float = 0.1
  directions: tuple[str, ...] = ("forward", "backward")
  dtype: Any = jnp.float32
  init_std: float = INIT_STD
  decoder_ln_eps: float = 1e-8
  mlp_dropout: bool = False
  official_init: bool = False
  padding_id: int = 0
  zero_padding_embedding: bool = False  # the official embedding's zeroed padding-id positions (see above)
  remat: str = "none"

  @nn.compact
  def __call__(
    self,
    visual,
    tokens_by_direction: dict,
    padding_by_direction: dict,
    train: bool = False,
    causal_by_direction: dict | None = None,
  ):
    embedding = WordAndPositionEmbedding(
      self.vocab_size,
      self.hidden,
      self.max_len,
      self.dropout,
      self.dtype,
      self.init_std,
      zero_row=self.padding_id if self.official_init else None,
      zero_padding_id=self.padding_id if self.zero_padding_embedding else None,
      name="embedding",
    )
    bias_init = torch_bias_init(self.hidden) if self.official_init else nn.initializers.zeros
    output_bias = self.param("output_bias", bias_init, (self.vocab_size,), jnp.float32)
    heads = self.num_heads or max(1, self.hidden // 64)
    layer_cls = decoder_layer(self.remat)
    logits, aux = {}, {}
    for direction in self.directions:
      if direction not in tokens_by_direction:  # e.g. decoding runs the forward model alone
        continue
      tokens = tokens_by_direction[direction]
      t = tokens.shape[1]
      keep = ~padding_by_direction[direction]
      mask = keep[:, None, None, :]
      if direction != "bidirectional":
        causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
        if causal_by_direction is not None and direction in causal_by_direction:
          causal = causal | ~causal_by_direction[direction][:, None, None, None]
        mask = mask & causal
      x = embedding(tokens, train)
      crosses = []
      for layer in range(self.num_layers):
        x, cross = layer_cls(
          heads,
          self.mlp_dim or 4 * self.hidden,
          self.dropout,
          True,
          self.dtype,
          self.init_std,
          self.decoder_ln_eps,
          self.mlp_dropout,
          self.official_init,
          name=f"{direction}_layer{layer}",
        )(x, visual, mask, train)
        crosses.append(cross)
      logits[direction] = embedding.attend(x).astype(jnp.float32) + output_bias
      aux[f"{direction}/cross_attention"] = crosses
    return logits, aux
