"""VSE++ retrieval on a frozen backbone (Faghri et al., BMVC 2018; the protocol of MCT's tables 4, 6 and 7).

The backbone only gives features: images are embedded once (`feature`, 'pre_logits' by default, BatchNorm in
inference mode), and a fresh joint-embedding model is trained on the training split's image-caption pairs:
  image   a linear layer to `embed_dim` on the frozen feature, l2-normalised
  caption word embeddings (`word_dim`) -> a 1-layer GRU (`embed_dim` units) -> its state after the last token,
          l2-normalised; captions are the run's tokenizer's ids (VSE++ builds a word vocabulary, a detail)
  loss    VSE++'s hinge loss with the hardest negative of the mini-batch in both directions (`max_violation`;
          False sums over all negatives, VSE0), margin 0.2; pairs of the same image are never negatives of
          each other. `sum_loss_epochs` > 0 sums over all negatives for those first epochs (VSE-infinity's
          warm-up; 0 in the paper's protocol): on weak features the hardest-negative loss alone can settle
          where every score is equal (loss = 2 x batch x margin) and never leave
  optim   Adam, LR 2e-4 for `lr_update_epochs` (15) epochs, then x0.1 until `epochs` (30); gradients clipped
          to norm 2; one epoch is one pass over all (image, caption) pairs, batch 128
Then the test split is ranked as in `retrieval`: i2t/t2i R@1/5/10, median ranks and rsum, over folds of
`fold_size` images (COCO 1K) or the whole split (0, COCO 5K). Works for any method with a ResNet backbone.

Config: dataset, data_dir, config_name, train_split, test_split, pp (must give 'image'), captions_key,
num_captions, max_len, feature, batch_size (extraction), train_batch_size, embed_dim, word_dim, epochs,
lr_update_epochs, lr, lr_decay, margin, max_violation, sum_loss_epochs, grad_clip, seed, train_limit, test_limit,
fold_size, every_steps, random_init. Empty or missing captions are skipped; `train_pairs` counts the pairs trained on.
Images may have different numbers of captions; num_captions 0 reads every caption of each image (your own data).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from vlrep.data import records
from vlrep.evaluators._inputs import EvalInputs, Model, caption_width, with_fixed_captions
from vlrep.evaluators.retrieval import folded_metrics


def l2_normalize(x):
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-12))


class JointEmbedding(nn.Module):
  """VSE++'s two encoders: a linear image projection and a GRU caption encoder into one `embed_dim` space."""

  vocab_size: int
  embed_dim: int = 1024
  word_dim: int = 300

  def setup(self):
    self.image_fc = nn.Dense(self.embed_dim, kernel_init=nn.initializers.xavier_uniform(), name="image_fc")
    self.words = nn.Embed(
      self.vocab_size, self.word_dim, embedding_init=nn.initializers.uniform(0.2), name="words"
    )  # uniform(0.2) is U[0, 0.2); shifted to VSE++'s U[-0.1, 0.1] in embed_texts
    self.gru = nn.RNN(nn.GRUCell(self.embed_dim), return_carry=True, name="gru")

  def embed_images(self, features):
    return l2_normalize(self.image_fc(features))

  def embed_texts(self, tokens):
    lengths = jnp.maximum(jnp.sum(tokens != 0, -1), 1)  # [PAD] is id 0 in both tokenizers
    carry, _ = self.gru(self.words(tokens) - 0.1, seq_lengths=lengths)
    return l2_normalize(carry)

  def __call__(self, features, tokens):
    return self.embed_images(features), self.embed_texts(tokens)


def contrastive_loss(images, texts, image_ids, margin: float, max_violation: bool):
  """VSE++'s loss on a batch of pairs (row i: image i with caption i), l2-normalised [B, D] each:
  sum_i [margin - s(i,i) + s(i,c')]_+ + [margin - s(i,i) + s(i',i)]_+ with c', i' the hardest negatives
  (max_violation) or summed over all negatives. Pairs whose images are the same are not negatives."""
  scores = images @ texts.T  # [B images, B captions]
  diagonal = jnp.diag(scores)
  negative = image_ids[:, None] != image_ids[None, :]
  cost_caption = jnp.where(negative, jax.nn.relu(margin + scores - diagonal[:, None]), 0.0)  # image i vs caption j
  cost_image = jnp.where(negative, jax.nn.relu(margin + scores - diagonal[None, :]), 0.0)  # caption j vs image i
  if max_violation:
    return jnp.sum(jnp.max(cost_caption, 1)) + jnp.sum(jnp.max(cost_image, 0))
  return jnp.sum(cost_caption) + jnp.sum(cost_image)


def train_joint_embedding(
  image_features: np.ndarray, pair_image: np.ndarray, pair_tokens: np.ndarray, vocab_size: int, config
) -> tuple[JointEmbedding, dict, float]:
  """Trains VSE++ on pairs (pair_image[p] indexes image_features, pair_tokens[p] its caption).
  Returns (model, params, the last epoch's mean loss)."""
  c = config
  model = JointEmbedding(vocab_size, c.get("embed_dim", 1024), c.get("word_dim", 300))
  bs = min(c.get("train_batch_size", 128), len(pair_image))
  steps_per_epoch = max(1, len(pair_image) // bs)  # the last partial batch is dropped, as VSE++'s loader does
  epochs = c.get("epochs", 30)
  decay_step = c.get("lr_update_epochs", 15) * steps_per_epoch
  schedule = optax.piecewise_constant_schedule(c.get("lr", 2e-4), {decay_step: c.get("lr_decay", 0.1)})
  tx = optax.chain(optax.clip_by_global_norm(c.get("grad_clip", 2.0)), optax.adam(schedule))
  rng = np.random.default_rng(c.get("seed", 0))
  params = model.init(
    jax.random.PRNGKey(c.get("seed", 0)), jnp.asarray(image_features[:1]), jnp.asarray(pair_tokens[:1])
  )["params"]
  opt_state = tx.init(params)
  feats = jnp.asarray(image_features)
  margin, max_violation = c.get("margin", 0.2), c.get("max_violation", True)
  warmup = c.get("sum_loss_epochs", 0)  # VSE-infinity's warm-up: all negatives before the hardest one

  @functools.partial(jax.jit, static_argnums=4)
  def step(params, opt_state, idx, tokens, hardest):
    def loss_fn(p):
      im, tx_emb = model.apply({"params": p}, feats[idx], tokens)
      return contrastive_loss(im, tx_emb, idx, margin, hardest)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  epoch_loss = float("nan")
  for epoch in range(epochs):
    order = rng.permutation(len(pair_image))
    losses = []
    for s in range(steps_per_epoch):
      sel = order[s * bs : (s + 1) * bs]
      params, opt_state, loss = step(
        params,
        opt_state,
        jnp.asarray(pair_image[sel]),
        jnp.asarray(pair_tokens[sel]),
        hardest=max_violation and epoch >= warmup,
      )
      losses.append(loss)
    epoch_loss = float(np.mean(jax.device_get(losses)))
    if not np.isfinite(epoch_loss):
      raise FloatingPointError(f"VSE++ training diverged in epoch {epoch + 1} (loss {epoch_loss}).")
    logging.log_every_n_seconds(logging.INFO, "VSE++ epoch %d/%d: loss %.3f", 30, epoch + 1, epochs, epoch_loss)
  return model, params, epoch_loss


class Evaluator:
  """Evaluator: VSE++ trained on frozen backbone features; reports retrieval recalls on the test split."""

  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.feature_key = config.get("feature", "pre_logits")
    self.tokenizer = inputs.tokenizer
    if self.tokenizer is None:
      raise ValueError("The vsepp evaluator needs the run's tokenizer (config.tokenizer) to encode captions.")
    self.builder = inputs.builder(config)
    self.inputs = inputs
    if config.batch_size % jax.device_count():
      raise ValueError(f"vsepp batch_size {config.batch_size} is not divisible by the {jax.device_count()} devices.")

  def _extract(self, split: str, limit: int, features_fn: Callable):
    """(features [N, D], tokens [N, C, L], has_caption [N, C]) of the first `limit` images of a split."""
    c = self.config
    split = records.first_examples(self.builder, split, limit)
    width = caption_width(self.builder, split, c.captions_key, c.num_captions)
    pp = with_fixed_captions(c.pp, c.captions_key, width)
    feats, tokens, has = [], [], []
    for local in self.inputs.batches(self.builder, split, pp, ("image", c.captions_key), c.batch_size):
      n = len(local["_mask"])
      caps = np.asarray(local[c.captions_key], dtype=object).reshape(n, width)
      strings = [s.decode("utf-8") if isinstance(s, bytes) else ("" if s == 0 else str(s)) for s in caps.reshape(-1)]
      ids = np.stack([self.tokenizer.encode(s, c.max_len)[0] for s in strings]).reshape(n, width, -1)
      present = np.array([bool(s.strip()) for s in strings]).reshape(n, width)
      # Tokens travel with the images, so every host gets the global batch's captions back.
      f, batch = features_fn({"image": local["image"], "_mask": local["_mask"], "tokens": ids, "present": present})
      m = batch["_mask"].astype(bool)
      feats.append(f[m].reshape(int(m.sum()), -1))
      tokens.append(batch["tokens"][m])
      has.append(batch["present"][m])
    if not feats:
      raise ValueError(f"Split {split!r} of {c.dataset} yielded no images for VSE++.")
    x = np.concatenate(feats).astype(np.float32)
    if not np.isfinite(x).all():
      raise FloatingPointError(f"The backbone gave non-finite features on {split!r}; the checkpoint is broken.")
    return x, np.concatenate(tokens), np.concatenate(has).astype(bool)

  def evaluate(self, model: Model) -> dict[str, float]:
    c = self.config
    features_fn = model.extractor(self.feature_key)
    t0 = time.time()
    train_x, train_tokens, train_has = self._extract(c.train_split, c.get("train_limit", 0), features_fn)
    test_x, test_tokens, test_has = self._extract(c.test_split, c.get("test_limit", 0), features_fn)
    pair_image, pair_caption = np.nonzero(train_has)
    if not len(pair_image):
      raise ValueError(f"{c.dataset}/{c.train_split} has no non-empty captions to train VSE++ on.")
    t1 = time.time()
    model, params, last_loss = train_joint_embedding(
      train_x, pair_image, train_tokens[pair_image, pair_caption], self.tokenizer.vocab_size, c
    )
    t2 = time.time()
    image_emb = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x, method=JointEmbedding.embed_images))(
      params, test_x))  # fmt: skip
    owner, which = np.nonzero(test_has)
    embed_texts = jax.jit(lambda p, t: model.apply({"params": p}, t, method=JointEmbedding.embed_texts))
    text_emb = np.concatenate(
      [np.asarray(embed_texts(params, test_tokens[owner[s : s + 1024], which[s : s + 1024]]))
       for s in range(0, len(owner), 1024)]
    )  # fmt: skip
    out = folded_metrics(image_emb, text_emb, owner, c.get("fold_size", 0))
    out["train_loss"] = last_loss
    out["train_pairs"] = float(len(pair_image))
    logging.info(
      "VSE++ on %d train pairs / %d test images, %d captions: features %.1fs, training %.1fs; i2t R@1 %.1f, "
      "t2i R@1 %.1f (chance %.1f)",
      len(pair_image),
      len(test_x),
      len(owner),
      t1 - t0,
      t2 - t1,
      out["i2t_r1"],
      out["t2i_r1"],
      out["chance_r1"],
    )
    return out
