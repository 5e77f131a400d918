"""VirTex (Desai & Johnson): visual backbones from captions, and the paper's pretraining-task ablations.

Tasks (config `method.task`):
  bicaptioning          forward + backward captioning losses summed (eq. 1), the paper's method.
  captioning            forward captioning only.
  token_classification  bag-of-tokens prediction from pooled features (caption structure ignored).
  masked_lm             one bidirectional transformer predicts 15% of the tokens, masked as BERT (80% [MASK],
                        10% a random token, 10% kept).
  cappa                 CapPa (Tschannen et al. 2023): the forward captioner, trained on a share of each batch
                        (`cappa_parallel_fraction`, the paper's 0.75, drawn per example) by parallel prediction:
                        the decoder's input is [MASK] at every position and its self-attention is not causal, so
                        every word is predicted from the image and its position alone; the other examples are
                        teacher-forced under the causal mask. One cross-entropy over every caption token of the
                        batch. Decoded (and scored) autoregressively, as the paper does.

`caption_log_likelihood` scores given captions under the forward captioner (captioning, bicaptioning, cappa).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from vlrep import methods
from vlrep.models import special_tokens
from vlrep.models.virtex import VirTexModel

TASKS = ("bicaptioning", "captioning", "token_classification", "masked_lm", "cappa")
_DIRECTIONS = {
  "bicaptioning": ("forward", "backward"),
  "captioning": ("forward",),
  "masked_lm": ("bidirectional",),
  "cappa": ("forward",),
}
CAPPA_PARALLEL_FRACTION = 0.75  # the paper's share of parallel-prediction examples


def cappa_inputs(tokens, rng, parallel_fraction: float):
  """CapPa's decoder inputs for captions [B, T+1]: (inputs [B, T], padding [B, T], parallel [B] bool).

  Each example is drawn parallel with probability `parallel_fraction`. A parallel row's input is [MASK] at every
  position and it has no padding: its self-attention (not causal) sees all T positions, as the paper's decoder
  sees its whole all-[MASK] input; which of them hold caption words would tell it the caption's length. An
  autoregressive row is the teacher-forced prefix [SOS] c1..cT with its padding, under the causal mask."""
  prefix = tokens[:, :-1]
  parallel = jax.random.bernoulli(rng, parallel_fraction, tokens.shape[:1])
  inputs = jnp.where(parallel[:, None], jnp.asarray(special_tokens.MASK_ID, prefix.dtype), prefix)
  padding = (prefix == special_tokens.PAD_ID) & ~parallel[:, None]
  return inputs, padding, parallel


def reverse_captions(tokens: jnp.ndarray) -> jnp.ndarray:
  """[SOS] c1..cT [EOS] [PAD].. -> [EOS] cT..c1 [SOS] [PAD]..: reverses each caption up to its last non-padding
  token (a padding id inside a caption, an official VirTex vocabulary's [UNK], keeps its mirrored place, as the
  official code's flip of the unpadded caption does)."""
  idx = jnp.arange(tokens.shape[1])[None]
  lengths = jnp.max(jnp.where(tokens != special_tokens.PAD_ID, idx + 1, 0), axis=1, keepdims=True)
  src = jnp.where(idx < lengths, lengths - 1 - idx, idx)
  return jnp.take_along_axis(tokens, src, axis=1)


def mask_tokens(tokens, rng, mask_prob: float, mask_token_prob: float, random_token_prob: float, vocab_size: int):
  """BERT's masking, as VirTex's masked-LM ablation: each non-special token is picked with `mask_prob` (every
  caption at least one); a picked token becomes [MASK] with `mask_token_prob`,
  a uniformly random non-special token with `random_token_prob`, and stays itself otherwise (0.8 / 0.1 / 0.1 in
  BERT and the paper's code). Returns (input tokens, picked mask); the loss is taken at the picked positions."""
  pick_rng, kind_rng, token_rng = jax.random.split(rng, 3)
  special = tokens < special_tokens.NUM_SPECIAL
  scores = jax.random.uniform(pick_rng, tokens.shape)
  is_masked = (scores < mask_prob) & ~special
  # At least one per caption: the lowest-scoring maskable token is already picked unless none is.
  first = jnp.argmin(jnp.where(special, 2.0, scores), axis=1)
  is_masked = is_masked | (jax.nn.one_hot(first, tokens.shape[1]) > 0) & ~special
  kind = jax.random.uniform(kind_rng, tokens.shape)
  random_tokens = jax.random.randint(token_rng, tokens.shape, special_tokens.NUM_SPECIAL, vocab_size, tokens.dtype)
  replaced = jnp.where(kind < mask_token_prob, special_tokens.MASK_ID, tokens)
  replaced = jnp.where(
    (kind >= mask_token_prob) & (kind < mask_token_prob + random_token_prob), random_tokens, replaced
  )
  return jnp.where(is_masked, replaced, tokens), is_masked


def _token_nll(logits, targets):
  """-log p(target) [B, T] under logits [B, T, V], in float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _weighted_mean(values, weights):
  return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1.0)


class Method:
  """VirTex behind vlrep's method contract (init / loss / features)."""

  fields = ("image", "tokens")

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int):
    if config.task not in TASKS:
      raise ValueError(f"Unknown VirTex task {config.task!r}; known: {TASKS}")
    self.parallel_fraction = config.get("cappa_parallel_fraction", CAPPA_PARALLEL_FRACTION)
    if config.task == "cappa" and not 0.0 <= self.parallel_fraction <= 1.0:
      raise ValueError(f"cappa_parallel_fraction={self.parallel_fraction} is a probability: 0..1.")
    self.config = config
    self.vocab_size = vocab_size
    self.model = VirTexModel(
      vocab_size=vocab_size,
      backbone=dict(config.backbone),
      head="linear" if config.task == "token_classification" else "transformer",
      hidden=config.hidden,
      num_layers=config.num_layers,
      max_len=config.max_len,
      dropout=config.dropout,
      directions=_DIRECTIONS.get(config.task, ()),
      dtype=jnp.dtype(config.dtype),
      init_std=config.init_std,
      # Optional (imported runs set them; vlrep.interop.import_run): the head's attention heads and feed-forward width
      # when
      # not hidden // 64 and 4 * hidden, and the decoder LayerNorms' epsilon (vlrep's 1e-8 unless set).
      num_heads=config.get("num_heads") or None,
      mlp_dim=config.get("mlp_dim") or None,
      decoder_ln_eps=config.get("decoder_ln_eps", 1e-8),
      # The official head's training-time behaviour (configs/virtex.py sets both; off by default, so a saved config
      # without them rebuilds the model it trained).
      mlp_dropout=config.get("mlp_dropout", False),
      official_init=config.get("official_init", False),
      # An official vocabulary's <unk> (= its padding id) as the official head treats it (imported VirTex runs).
      official_padding=config.get("official_padding", False),
      remat=config.get("remat", "none"),  # config.remat, copied in by methods.method_config
    )

  # -- contract -----------------------------------------------------------------------------------------
  def init(self, rng, batch) -> dict:
    params_rng, dropout_rng = jax.random.split(rng)
    tokens_in, padding, _ = self._inputs(batch["tokens"], dropout_rng)
    return self.model.init(
      {"params": params_rng, "dropout": dropout_rng}, batch["image"], tokens_in, padding, train=False
    )

  def loss(self, variables, batch, rng, train: bool = True):
    return methods.loss_of_parts(self, variables, batch, rng, train)

  def prepare(self, batch, rng):
    """The draws over the whole batch, before it is split: masked LM's masked tokens, CapPa's parallel rows."""
    mask_rng, _ = jax.random.split(rng)
    task = self.config.task
    if task == "cappa":
      inputs, padding, parallel = cappa_inputs(batch["tokens"], mask_rng, self.parallel_fraction)
      return {**batch, "cappa_inputs": inputs, "cappa_padding": padding, "cappa_parallel": parallel}
    if task == "masked_lm":
      inputs, _, is_masked = self._inputs(batch["tokens"], mask_rng)
      return {**batch, "masked_tokens": inputs["bidirectional"], "is_masked": is_masked}
    return batch

  def per_example(self, variables, batch, rng, train: bool = True):
    """Each caption token's negative log-likelihood and weight (1 where it counts: not padding, a caption that is
    not empty, masked LM's picked tokens), per direction; token classification's loss per image and whether the
    image has targets."""
    _, dropout_rng = jax.random.split(rng)
    tokens = batch["tokens"]
    valid_caption = ~batch["stat_empty"] if "stat_empty" in batch else jnp.ones(tokens.shape[:1], bool)
    task = self.config.task
    causal = None
    if task == "cappa":
      tokens_in, padding = {"forward": batch["cappa_inputs"]}, {"forward": batch["cappa_padding"]}
      causal = {"forward": ~batch["cappa_parallel"]}
    elif task == "masked_lm":
      tokens_in, padding = {"bidirectional": batch["masked_tokens"]}, {"bidirectional": tokens == special_tokens.PAD_ID}
    else:
      tokens_in, padding, _ = self._inputs(tokens, None)
    (logits, _), new_state = self.model.apply(
      variables,
      batch["image"],
      tokens_in,
      padding,
      train=train,
      causal_by_direction=causal,
      rngs={"dropout": dropout_rng},
      mutable=["batch_stats"],
    )
    if task == "token_classification":
      targets = jax.nn.one_hot(tokens, self.vocab_size).max(axis=1).at[:, : special_tokens.NUM_SPECIAL].set(0)
      targets = targets * valid_caption[:, None]
      # Normalised multi-label cross-entropy: the caption's token set shares the target probability mass.
      per_image = -jnp.sum(targets * jax.nn.log_softmax(logits), -1) / jnp.maximum(targets.sum(-1), 1)
      return {"per_image": per_image, "has_targets": (targets.sum(-1) > 0).astype(jnp.float32)}, new_state
    outputs = {}
    if task == "masked_lm":
      weights = batch["is_masked"] & valid_caption[:, None]
      outputs["bidirectional_nll"] = _token_nll(logits["bidirectional"], tokens)
      outputs["bidirectional_weight"] = weights.astype(jnp.float32)
      return outputs, new_state
    seqs = {"forward": tokens, "backward": reverse_captions(tokens)}
    for direction in _DIRECTIONS[task]:
      targets = seqs[direction][:, 1:]
      outputs[f"{direction}_nll"] = _token_nll(logits[direction], targets)
      outputs[f"{direction}_weight"] = ((targets != special_tokens.PAD_ID) & valid_caption[:, None]).astype(jnp.float32)
    return outputs, new_state

  def combine(self, variables, outputs, batch):
    """Means over the whole batch's counted tokens (images, for token classification): linear in the outputs."""
    del variables
    task = self.config.task
    if task == "token_classification":
      loss = jnp.sum(outputs["per_image"] * outputs["has_targets"]) / jnp.maximum(jnp.sum(outputs["has_targets"]), 1)
      return loss, {}, {}
    metrics, loss = {}, 0.0
    for direction in _DIRECTIONS[task]:
      nll, weights = outputs[f"{direction}_nll"], outputs[f"{direction}_weight"]
      d_loss = _weighted_mean(nll, weights)
      if task != "masked_lm":
        metrics[f"{direction}_loss"] = d_loss
      loss = loss + d_loss
      if task == "cappa":
        # Each kind's loss over its own rows' tokens; 0 in a batch that drew none of that kind.
        parallel = batch["cappa_parallel"][:, None]
        metrics["parallel_loss"] = _weighted_mean(nll, weights * parallel)
        metrics["autoregressive_loss"] = _weighted_mean(nll, weights * ~parallel)
        metrics["parallel_share"] = jnp.mean(batch["cappa_parallel"].astype(jnp.float32))
    return loss, metrics, {}

  def features(self, variables, images) -> dict:
    """Frozen-backbone features for evaluators: pooled 'pre_logits' and the final 'grid'."""
    grid, aux = self.model.apply(variables, images, False, method=VirTexModel.encode_image)
    return {"pre_logits": aux["pre_logits"], "grid": grid.astype(jnp.float32)}

  def caption_log_likelihood(self, variables, images, tokens) -> jnp.ndarray:
    """log p(caption | image) [B] float32 of captions [B, T] ([SOS] c1..cn [EOS] [PAD]..): the sum of log
    p(token | image, prefix) over the tokens after [SOS] up to and including the first [EOS], padding excluded,
    teacher-forced under the causal mask with inference BatchNorm and no dropout. The forward captioner scores for
    every captioning task (bicaptioning's backward decoder is not used; CapPa's is its autoregressive mode, the one
    it decodes with). Jittable."""
    task = self.config.task
    if "forward" not in _DIRECTIONS.get(task, ()):
      raise ValueError(
        f"VirTex task {task!r} has no caption likelihood: it needs a forward captioner (tasks "
        f"{', '.join(t for t in TASKS if 'forward' in _DIRECTIONS.get(t, ()))})."
      )
    visual = self.model.apply(variables, images, method=VirTexModel.project_visual)
    logits, _ = self.model.apply(variables, visual, tokens[:, :-1], method=VirTexModel.text_logits)
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    is_eos = targets == special_tokens.EOS_ID
    up_to_eos = (jnp.cumsum(is_eos, axis=1) - is_eos) == 0
    weights = up_to_eos & (targets != special_tokens.PAD_ID)
    return jnp.sum(jnp.where(weights, token_logp, 0.0), axis=1)

  # -- helpers ------------------------------------------------------------------------------------------
  def _inputs(self, tokens, rng):
    """(tokens, padding) per direction: teacher-forced prefixes, or masked captions (+ the mask) for masked LM.
    CapPa's training inputs are drawn in `loss` (cappa_inputs); its init builds the same model from the prefixes."""
    task = self.config.task
    if task == "token_classification":
      return None, None, None
    if task == "masked_lm":
      masked, is_masked = mask_tokens(
        tokens, rng, self.config.mask_prob, self.config.mask_token_prob, self.config.random_token_prob, self.vocab_size
      )
      return ({"bidirectional": masked}, {"bidirectional": tokens == special_tokens.PAD_ID}, is_masked)
    seqs = {"forward": tokens, "backward": reverse_captions(tokens)}
    inputs = {d: seqs[d][:, :-1] for d in _DIRECTIONS[task]}
    return inputs, {d: x == special_tokens.PAD_ID for d, x in inputs.items()}, None
