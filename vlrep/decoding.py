"""Caption decoding for the forward captioning model: greedy, beam search and nucleus sampling, all jittable.

Each decoder takes `logits_fn(tokens [N, T]) -> logits [N, T, V]` (the textual head with the image features
bound; N is the batch times the beams) and returns token ids [B, T] after [SOS], [EOS] and [PAD] afterwards.
The prefix is recomputed at every position (no key/value cache): captions are short (T <= 40) and the head is
small next to the backbone, so this keeps one code path for every head depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vlrep.data import tokenizers

SOS, EOS, PAD = tokenizers.SOS_ID, tokenizers.EOS_ID, tokenizers.PAD_ID
METHODS = ("greedy", "beam", "nucleus", "virtex_official")
# The official VirTex beam search's "blocked" log-probability of a beam's last token (a constant, not -inf).
OFFICIAL_REPEAT_LOGP = -10000.0


def _init(batch: int, max_len: int) -> jax.Array:
  return jnp.full((batch, max_len + 1), PAD, jnp.int32).at[:, 0].set(SOS)


def _never_special(logits):
  """Positions may emit words or [EOS], never [PAD]/[SOS]/[UNK]/[MASK]."""
  special = jnp.arange(logits.shape[-1]) < tokenizers.NUM_SPECIAL
  return jnp.where(special & (jnp.arange(logits.shape[-1]) != EOS), -jnp.inf, logits)


def greedy(logits_fn, batch: int, max_len: int) -> jax.Array:
  def body(t, carry):
    tokens, done = carry
    logits = _never_special(logits_fn(tokens[:, :-1])[:, t])
    nxt = jnp.where(done, PAD, jnp.argmax(logits, -1).astype(jnp.int32))
    return tokens.at[:, t + 1].set(nxt), done | (nxt == EOS)

  tokens, _ = jax.lax.fori_loop(0, max_len, body, (_init(batch, max_len), jnp.zeros((batch,), bool)))
  return tokens[:, 1:]


def nucleus(logits_fn, batch: int, max_len: int, rng, top_p: float = 0.9, temperature: float = 1.0) -> jax.Array:
  """Samples from the smallest set of tokens whose probability reaches top_p (Holtzman et al.)."""

  def body(t, carry):
    tokens, done = carry
    logits = _never_special(logits_fn(tokens[:, :-1])[:, t]) / temperature
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, -1), -1)
    # The threshold logit: the last one needed to reach top_p (the first is always kept).
    cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_logits, jnp.minimum(cutoff_idx, logits.shape[-1] - 1), axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    nxt = jax.random.categorical(jax.random.fold_in(rng, t), logits).astype(jnp.int32)
    nxt = jnp.where(done, PAD, nxt)
    return tokens.at[:, t + 1].set(nxt), done | (nxt == EOS)

  tokens, _ = jax.lax.fori_loop(0, max_len, body, (_init(batch, max_len), jnp.zeros((batch,), bool)))
  return tokens[:, 1:]


def beam_search(logits_fn, batch: int, max_len: int, beam_size: int = 5, length_penalty: float = 0.0):
  """Beam search over summed log-probabilities; finished beams keep their score and emit [PAD].

  The best beam is chosen by score / length**length_penalty (0: plain log-probability, as VirTex).
  Returns (tokens [B, T], log-probability [B]).
  """
  k = beam_size

  def body(t, carry):
    tokens, scores, done = carry  # [B, k, T+1], [B, k], [B, k]
    logits = _never_special(logits_fn(tokens[:, :, :-1].reshape(batch * k, max_len))[:, t])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1).reshape(batch, k, -1)
    v = logp.shape[-1]
    # A finished beam has exactly one continuation, [PAD], at no cost.
    pad_only = jnp.full((v,), -jnp.inf).at[PAD].set(0.0)
    logp = jnp.where(done[..., None], pad_only, logp)
    cand = (scores[..., None] + logp).reshape(batch, k * v)
    top_scores, top_idx = jax.lax.top_k(cand, k)
    src, word = top_idx // v, (top_idx % v).astype(jnp.int32)
    tokens = jnp.take_along_axis(tokens, src[..., None], axis=1).at[:, :, t + 1].set(word)
    done = jnp.take_along_axis(done, src, axis=1) | (word == EOS)
    return tokens, top_scores, done

  tokens = jnp.broadcast_to(_init(batch, max_len)[:, None], (batch, k, max_len + 1))
  # Identical beams at the start: only the first is live, so the first step picks k different words.
  scores = jnp.tile(jnp.array([0.0] + [-jnp.inf] * (k - 1)), (batch, 1))
  tokens, scores, _ = jax.lax.fori_loop(0, max_len, body, (tokens, scores, jnp.zeros((batch, k), bool)))
  lengths = jnp.sum((tokens[:, :, 1:] != PAD), -1).astype(jnp.float32)
  best = jnp.argmax(scores / jnp.maximum(lengths, 1.0) ** length_penalty, axis=1)
  pick = lambda x: jnp.take_along_axis(x, best.reshape((batch,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
  return pick(tokens)[:, 1:], pick(scores)


def virtex_official(logits_fn, batch: int, max_len: int, beam_size: int = 5, per_node_beam_size: int = 2):
  """kdexd/virtex's evaluation decoding (`AutoRegressiveBeamSearch` driven by `CaptioningModel.decoding_step`), as
  it behaves, so an imported zoo checkpoint's captions and metrics are the published ones:

  - step 1 feeds the head [SOS] alone; every later step feeds the tokens predicted so far *without* [SOS] (the
    first predicted word sits at position 0) and reads the logits at the last of them;
  - every token may be predicted, special ones included (<unk>, [SOS], [MASK]);
  - a beam's last token gets log-probability -10000 (no immediate repeat), then a beam that ended with [EOS]
    can only continue with [EOS] at no cost;
  - each beam proposes its `per_node_beam_size` best continuations (2 officially) and the best `beam_size` of them
    survive, by summed log-probability without length normalisation; the result is the best beam.
  The head sees at most `max_len - 1` tokens (the official MAX_DECODING_STEPS = the caption length).
  `logits_fn` must not mask any key but the future ones (the official decoding step passes the full length).
  Returns (tokens [B, max_len] with [PAD] after the first [EOS], log-probability [B]).
  """
  k, p = beam_size, per_node_beam_size
  width = max(1, max_len - 1)  # the longest input the head sees
  start = jnp.full((batch, width), PAD, jnp.int32).at[:, 0].set(SOS)
  logp0 = jax.nn.log_softmax(logits_fn(start)[:, 0].astype(jnp.float32), -1)
  vocab = logp0.shape[-1]
  scores, first = jax.lax.top_k(logp0, k)  # [B, k]
  preds = jnp.full((batch, k, max_len), PAD, jnp.int32).at[:, :, 0].set(first.astype(jnp.int32))
  words = jnp.arange(vocab)

  def body(t, carry):  # predicts token t (0-based) from tokens 0..t-1
    preds, scores = carry
    last = preds[:, :, t - 1]
    logits = logits_fn(preds[:, :, :width].reshape(batch * k, width))[:, t - 1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1).reshape(batch, k, vocab)
    logp = jnp.where(words == last[..., None], OFFICIAL_REPEAT_LOGP, logp)
    only_eos = jnp.where(words == EOS, 0.0, -jnp.inf)
    logp = jnp.where((last == EOS)[..., None], only_eos, logp)
    top_logp, top_word = jax.lax.top_k(logp, p)  # [B, k, p]
    cand = (top_logp + scores[..., None]).reshape(batch, k * p)
    scores, idx = jax.lax.top_k(cand, k)
    word = jnp.take_along_axis(top_word.reshape(batch, k * p), idx, axis=1).astype(jnp.int32)
    preds = jnp.take_along_axis(preds, (idx // p)[..., None], axis=1).at[:, :, t].set(word)
    return preds, scores

  preds, scores = jax.lax.fori_loop(1, max_len, body, (preds, scores))
  # The official search stops once every beam has ended and repeats [EOS] meanwhile; vlrep pads after [EOS].
  best = preds[:, 0]
  after_eos = (jnp.cumsum(best == EOS, axis=1) - (best == EOS)) > 0
  return jnp.where(after_eos, PAD, best), scores[:, 0]


def decode(logits_fn, batch: int, max_len: int, method: str = "beam", rng=None, **kwargs) -> jax.Array:
  if method == "greedy":
    return greedy(logits_fn, batch, max_len)
  if method == "beam":
    return beam_search(logits_fn, batch, max_len, **kwargs)[0]
  if method == "nucleus":
    return nucleus(logits_fn, batch, max_len, rng if rng is not None else jax.random.PRNGKey(0), **kwargs)
  if method == "virtex_official":
    return virtex_official(logits_fn, batch, max_len, **kwargs)[0]
  raise ValueError(f"Unknown decoding method {method!r}; expected one of {METHODS}.")


def make_captioner(model, max_len: int, method: str = "beam", **kwargs):
  """A jitted (variables, images [B, H, W, 3], rng) -> (tokens [B, T], cross-attention [B, T, N] averaged over
  heads, last layer).

  `model` is a VirTexModel with a forward direction; the attention comes from one teacher-forced pass over the
  decoded caption, so it is exactly what produced each word.
  """

  official = method == "virtex_official"

  @jax.jit
  def caption(variables, images, rng):
    visual = model.apply(variables, images, method=type(model).project_visual)
    b = images.shape[0]

    def text_logits(tokens):
      v = jnp.repeat(visual, tokens.shape[0] // b, axis=0)
      # The official decoding step masks no key (causal attention alone), so an <unk> it predicted is attended.
      padding = jnp.zeros(tokens.shape, bool) if official else None
      return model.apply(variables, v, tokens, "forward", padding, method=type(model).text_logits)

    tokens = decode(lambda t: text_logits(t)[0], b, max_len, method, rng=rng, **kwargs)
    if official:
      # What produced each word: word 1 came from [SOS] alone, word j > 1 from words 1..j-1 (no [SOS]).
      _, first = text_logits(jnp.full((b, 1), SOS, jnp.int32))
      _, rest = text_logits(tokens[:, : max(1, max_len - 1)])
      cross = jnp.concatenate([first[-1], rest[-1]], axis=2)[:, :, :max_len]
    else:
      prefix = jnp.concatenate([jnp.full((b, 1), SOS, jnp.int32), tokens[:, :-1]], axis=1)
      cross = text_logits(prefix)[1][-1]
    return tokens, jnp.mean(cross.astype(jnp.float32), axis=1)

  return caption
