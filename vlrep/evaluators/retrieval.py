"""Cross-modal retrieval with a method's own towers (MCT's inter-modal embeddings), no fine-tuning.

For N test images with up to C captions each, both embedded in the common space (`method.embed`):
  i2t_r{1,5,10}   % of images whose best-ranked correct caption is among the top K of all captions
  t2i_r{1,5,10}   % of captions whose image is among the top K of all images
  i2t_medr, t2i_medr   median rank (1 = first)
  rsum            the sum of the six recalls
  chance_r1, chance_r10   100 K / N: a random ranking's t2i recall (i2t's is about the same for small K)
With `fold_size` > 0 the images are split into consecutive folds of that size (COCO's 1K protocol: 5 folds of
the 5K test images) and the metrics are averaged; 0 ranks against the whole split (COCO 5K).

Config: dataset, data_dir, config_name, split, pp (must give 'image'; captions come from `captions_key`),
captions_key, num_captions (C: the first C captions of each image; fewer are padded and ignored; 0 = every caption
of each image, as many as it has: your own data), max_len, batch_size, limit (first N images; 0 = all), fold_size,
every_steps. Images may have different numbers of captions (COCO 5 to 7): each caption's ground truth is its own
image, and an image is found at K (i2t) when any of its captions ranks in the top K, as COCO's protocol counts.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from vlrep.data import records
from vlrep.evaluators._inputs import EvalInputs, Model, caption_width, with_fixed_captions

RECALL_AT = (1, 5, 10)


def retrieval_metrics(image_emb: np.ndarray, text_emb: np.ndarray, text_image: np.ndarray) -> dict[str, float]:
  """image_emb [N, D], text_emb [M, D] (l2-normalised), text_image [M] the index of each caption's image."""
  sim = image_emb @ text_emb.T  # [N, M]
  n = len(image_emb)
  # i2t: rank of the best correct caption for each image.
  order = np.argsort(-sim, axis=1)
  correct = text_image[order] == np.arange(n)[:, None]
  i2t_rank = correct.argmax(axis=1) + 1
  # t2i: rank of each caption's image.
  img_order = np.argsort(-sim.T, axis=1)
  t2i_rank = (img_order == text_image[:, None]).argmax(axis=1) + 1
  out = {}
  for k in RECALL_AT:
    out[f"i2t_r{k}"] = 100.0 * np.mean(i2t_rank <= k)
    out[f"t2i_r{k}"] = 100.0 * np.mean(t2i_rank <= k)
  out["i2t_medr"] = float(np.median(i2t_rank))
  out["t2i_medr"] = float(np.median(t2i_rank))
  out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALL_AT)
  for k in (1, 10):
    out[f"chance_r{k}"] = 100.0 * min(k, n) / n
  return out


def folded_metrics(image_emb, text_emb, text_image, fold_size: int) -> dict[str, float]:
  n = len(image_emb)
  if not fold_size or fold_size >= n:
    return retrieval_metrics(image_emb, text_emb, text_image)
  folds = []
  for start in range(0, n - fold_size + 1, fold_size):
    sel = (text_image >= start) & (text_image < start + fold_size)
    folds.append(retrieval_metrics(image_emb[start : start + fold_size], text_emb[sel], text_image[sel] - start))
  return {k: float(np.mean([f[k] for f in folds])) for k in folds[0]}


class Evaluator:
  needs_method = True  # vlrep.evaluate rebuilds the run's method and tokenizer for it

  def __init__(self, config, inputs: EvalInputs):
    self.config = config
    self.method = inputs.method
    if not hasattr(self.method, "embed"):
      raise ValueError(
        f"The retrieval evaluator needs a method with image and caption towers (MCT); this run's is "
        f"{type(self.method).__name__}."
      )
    self.tokenizer = inputs.tokenizer
    if self.tokenizer is None:
      raise ValueError("The retrieval evaluator needs the run's tokenizer (config.tokenizer) to encode captions.")
    self.builder = inputs.builder(config)
    self.inputs = inputs
    self.embed_images = jax.jit(lambda v, x: self.method.embed(v, images=x)["image"])
    self.embed_texts = jax.jit(lambda v, t: self.method.embed(v, tokens=t)["text"])

  def evaluate(self, model: Model) -> dict[str, float]:
    from jax.experimental import multihost_utils

    c = self.config
    split = records.first_examples(self.builder, c.split, c.get("limit", 0))
    t0 = time.time()
    width = caption_width(self.builder, split, c.captions_key, c.num_captions)
    pp = with_fixed_captions(c.pp, c.captions_key, width)
    images, texts, owners, real_images = [], [], [], []
    for batch in self.inputs.batches(self.builder, split, pp, ("image", c.captions_key), c.batch_size):
      images.append(np.asarray(self.embed_images(model.variables, batch["image"])))
      real_images.append(batch["_mask"].astype(bool))
      caps = np.asarray(batch[c.captions_key], dtype=object).reshape(len(batch["_mask"]), width)
      strings = [s.decode("utf-8") if isinstance(s, bytes) else ("" if s == 0 else str(s)) for s in caps.reshape(-1)]
      tokens = np.stack([self.tokenizer.encode(s, c.max_len)[0] for s in strings])
      texts.append(np.asarray(self.embed_texts(model.variables, tokens)).reshape(len(caps), width, -1))
      owners.append(np.array([[bool(s.strip()) for s in strings]]).reshape(len(caps), width))
    # Every host's shard, in host order, then only real images and non-empty captions.
    gather = lambda x: np.asarray(multihost_utils.process_allgather(np.concatenate(x))).reshape(
      (-1,) + np.concatenate(x).shape[1:]
    )
    image_emb, text_emb, has_text, real = gather(images), gather(texts), gather(owners), gather(real_images)
    image_emb, text_emb, has_text = image_emb[real], text_emb[real], has_text[real]
    text_image = np.repeat(np.arange(len(image_emb)), width).reshape(len(image_emb), width)
    out = folded_metrics(image_emb, text_emb[has_text], text_image[has_text], c.get("fold_size", 0))
    logging.info(
      "Retrieval on %d images, %d captions (%.1fs): i2t R@1 %.1f, t2i R@1 %.1f (chance %.1f)",
      len(image_emb),
      int(has_text.sum()),
      time.time() - t0,
      out["i2t_r1"],
      out["t2i_r1"],
      out["chance_r1"],
    )
    return out
