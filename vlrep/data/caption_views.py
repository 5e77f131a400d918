"""MCT's caption augmentations (section 3.3): two offline views of each caption (word dropout and swaps), and
pre-computed paraphrases replacing some of them on the host."""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

from vlrep.data.registry import HostOp, next_rng, register, register_host


@register
def get_caption_views(drop: float = 0.1, swap: float = 0.1, key: str = "caption", outs=("caption_q", "caption_k")):
  """Two augmented views of a caption for contrastive text training, offline (no translation models): each
  word dropped with probability `drop` (at least one kept) and each adjacent pair swapped with probability
  `swap`, independently per view. Empty captions stay empty."""

  def view(words, seed):
    seeds = tf.random.experimental.stateless_split(seed, num=2)
    n = tf.shape(words)[0]
    u = tf.random.stateless_uniform([n], seeds[0])
    keep = (u >= drop) | (tf.range(n) == tf.cast(tf.argmax(u), tf.int32))  # the highest draw always stays
    words = tf.boolean_mask(words, keep)
    n = tf.shape(words)[0]
    # Swap pair (i, i+1) for the even i whose draw falls under `swap` (non-overlapping pairs).
    s = tf.random.stateless_uniform([n], seeds[1]) < swap
    idx = tf.range(n)
    even = (idx % 2 == 0) & (idx + 1 < n)
    swap_here = even & s
    swap_prev = tf.concat([[False], swap_here[:-1]], 0)
    src = tf.where(swap_here, idx + 1, tf.where(swap_prev, idx - 1, idx))
    return tf.strings.reduce_join(tf.gather(words, src), separator=" ")

  def op(ex):
    ex = dict(ex)
    words = tf.strings.split(tf.strings.strip(ex[key]))
    seeds = tf.random.experimental.stateless_split(next_rng(ex), num=2)
    for out, seed in zip(outs, tf.unstack(seeds), strict=True):
      ex[out] = tf.cond(tf.size(words) > 0, lambda seed=seed: view(words, seed), lambda: tf.constant(""))
    return ex

  return op


@register
def get_paraphrase_draws(out: str = "paraphrase_u", num: int = 2):
  """`num` uniform draws per example (one per caption view) for the host-side `paraphrases` op: the choice of a
  paraphrase stays a pure function of the example's stream position, so resumed runs repeat it."""

  def op(ex):
    ex = dict(ex)
    ex[out] = tf.random.stateless_uniform([num], next_rng(ex))
    return ex

  return op


@register_host
def get_paraphrases(
  path: str,
  prob: float = 0.5,
  key: str = "caption",
  outs=("caption_q", "caption_k"),
  draws: str = "paraphrase_u",
  context=None,
):
  """Replaces each caption view, with probability `prob`, by one of the caption's pre-computed paraphrases (MCT
  section 3.3 uses back-translation, whose models cannot be fetched here: compute them elsewhere). The file is
  JSON {caption: [paraphrase, ...]}, keyed by the caption text exactly as the dataset stores it. Captions without
  an entry keep their offline views and are counted in `stat_no_paraphrase`. Put `paraphrase_draws` among the
  TF ops, after `caption_views`."""
  del context
  with open(os.path.expanduser(path)) as f:
    table = {k: [p for p in v if p.strip()] for k, v in json.load(f).items()}
  if not any(table.values()):
    raise ValueError(f"{path} holds no paraphrases.")

  def fn(batch):
    batch = dict(batch)
    dec = lambda t: t.decode("utf-8") if isinstance(t, bytes) else str(t)
    captions = [dec(c) for c in np.asarray(batch[key]).reshape(-1)]
    u = np.asarray(batch[draws], np.float64).reshape(len(captions), -1)
    missing = np.zeros(len(captions), bool)
    for v, out in enumerate(outs):
      views = np.array([dec(c) for c in np.asarray(batch[out]).reshape(-1)], dtype=object)
      for i, caption in enumerate(captions):
        options = table.get(caption)
        if not options:
          missing[i] = bool(caption)
          continue
        if u[i, v] < prob:
          views[i] = options[min(int(u[i, v] / prob * len(options)), len(options) - 1)]
      batch[out] = views
    batch["stat_no_paraphrase"] = missing
    return batch

  return HostOp((key, *outs, draws), (*outs, "stat_no_paraphrase"), fn)
