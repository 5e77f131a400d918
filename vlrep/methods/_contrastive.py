"""Image-text contrastive losses, shared by the methods that use them (CLIP, SigLIP, LocTex's L_C).

  info_nce       InfoNCE under cosine similarity / temperature, over the batch or groups of it (LocTex's per-GPU
                 negatives), image -> text or symmetric; CLIP's loss is its symmetric form (`clip_loss`).
  sigmoid_loss   SigLIP's per-pair loss: -1/B sum_i sum_j log sigmoid(z_ij (t x_i.y_j + b)), z_ij = 1 on the
                 diagonal and -1 elsewhere; `sigmoid_loss_chunked` computes the same sum a block of the B x B
                 similarities at a time.

Embeddings are l2-normalised here (again where the caller already did: normalising is idempotent).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from vlrep.sharding import DATA

# CLIP's bound on the learned logit scale: exp(scale) <= 100 (a temperature of at least 0.01).
MAX_LOGIT_SCALE = math.log(100.0)


def l2_normalize(x: jnp.ndarray, eps: float = 1e-12) -> jnp.ndarray:
  x = x.astype(jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def info_nce(
  image: jnp.ndarray,
  text: jnp.ndarray,
  temperature: float,
  groups: int = 1,
  symmetric: bool = False,
  weights: jnp.ndarray | None = None,
) -> jnp.ndarray:
  """Mean InfoNCE of image i against caption i, with the other captions of its group (of `groups` equal,
  contiguous parts of the batch) as negatives; cosine similarity / temperature. `symmetric` averages in the
  caption -> image direction. `weights` [B] (0 or 1) drop rows from the mean (they remain negatives)."""
  b = image.shape[0]
  if b % groups:
    raise ValueError(f"Batch {b} does not split into {groups} contrastive groups.")
  img = l2_normalize(image).reshape(groups, b // groups, -1)
  txt = l2_normalize(text).reshape(groups, b // groups, -1)
  logits = jnp.einsum("gid,gjd->gij", img, txt) / temperature
  diag = jnp.diagonal(logits, axis1=1, axis2=2)
  per_row = jax.nn.logsumexp(logits, axis=2) - diag
  if symmetric:
    per_row = 0.5 * (per_row + jax.nn.logsumexp(logits, axis=1) - diag)
  w = jnp.ones((b,), jnp.float32) if weights is None else weights.astype(jnp.float32)
  return jnp.sum(per_row.reshape(b) * w) / jnp.maximum(jnp.sum(w), 1.0)


def clipped_logit_scale(logit_scale: jnp.ndarray) -> jnp.ndarray:
  """exp(min(logit_scale, log 100)): CLIP clips its learned scale at 100 "to prevent scaling the logits by more
  than 100". The clip is in the forward pass (no gradient above the bound), the same as clamping the parameter
  after each update where the parameter has no weight decay (CLIP's: gains, biases and the scale have none)."""
  return jnp.exp(jnp.minimum(jnp.asarray(logit_scale, jnp.float32), MAX_LOGIT_SCALE))


def clip_loss(image: jnp.ndarray, text: jnp.ndarray, logit_scale: jnp.ndarray) -> jnp.ndarray:
  """CLIP's loss: the mean of the image -> text and text -> image cross-entropies over the global batch, logits
  = cosine similarity x exp(logit_scale) (clipped at 100). `info_nce`, symmetric, at temperature 1 / scale."""
  return info_nce(image, text, 1.0 / clipped_logit_scale(logit_scale), symmetric=True)


def _pair_loss_sum(img, txt, t, b, diagonal_offset=None):
  """sum_ij -log sigmoid(z_ij (t img_i.txt_j + b)) over one block; z_ij = 1 where j == i + diagonal_offset (a
  traced scalar, or None: the block holds no positive pair)."""
  logits = t * (img @ txt.T) + b
  if diagonal_offset is None:
    z = -jnp.ones_like(logits)
  else:
    rows, cols = jnp.arange(img.shape[0])[:, None], jnp.arange(txt.shape[0])[None, :]
    z = jnp.where(cols == rows + diagonal_offset, 1.0, -1.0)
  return -jnp.sum(jax.nn.log_sigmoid(z * logits))


def sigmoid_loss(image: jnp.ndarray, text: jnp.ndarray, t: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
  """SigLIP's loss, the whole B x B matrix at once: -1/B sum_i sum_j log sigmoid(z_ij (t x_i.y_j + b)), x and y
  the l2-normalised embeddings, t the temperature (exp of the learned t'), b the learned bias."""
  img, txt = l2_normalize(image), l2_normalize(text)
  return _pair_loss_sum(img, txt, t, b, 0) / image.shape[0]


def sigmoid_loss_chunked(
  image: jnp.ndarray, text: jnp.ndarray, t: jnp.ndarray, b: jnp.ndarray, chunks: int = 1
) -> jnp.ndarray:
  """`sigmoid_loss`, computed so that no device holds the B x B similarities.

  Under a mesh with a `data` axis of n > 1 devices (`jax.set_mesh`, read at trace time with
  `jax.sharding.get_abstract_mesh()`), the batch is split along it as SigLIP does: each device scores its
  images against its own texts, passes its texts to the next device (`ppermute` in `shard_map`) and scores the
  ones it receives, n - 1 times; each device holds one (B/n) x (B/n) block at a time. Without such a mesh (the
  method is traced with no mesh in scope, or on one device), the texts are taken `chunks` blocks at a time in a
  scan, B x (B/chunks) similarities per step, and XLA places them where the images are. The chunk count comes
  from the config rather than the device count because a method never sees the devices; both forms are the same
  sum (tested against `sigmoid_loss` on 8 devices). Each block is rematerialised in the backward pass, so the
  gradient does not keep all blocks either."""
  mesh = jax.sharding.get_abstract_mesh()
  n = 0 if mesh.empty or DATA not in mesh.axis_names else mesh.shape[DATA]
  img, txt = l2_normalize(image), l2_normalize(text)
  t, b = jnp.asarray(t, jnp.float32), jnp.asarray(b, jnp.float32)
  batch = image.shape[0]
  if n > 1 and batch % n == 0:
    return _ring_sum(img, txt, t, b, n) / batch
  if chunks <= 1:
    return _pair_loss_sum(img, txt, t, b, 0) / batch
  if batch % chunks:
    raise ValueError(f"The batch of {batch} does not split into {chunks} sigmoid-loss chunks (method.loss_chunks).")
  size = batch // chunks
  block = jax.checkpoint(_pair_loss_sum)

  def step(total, k_and_txt):
    k, txt_k = k_and_txt
    return total + block(img, txt_k, t, b, -k * size), None

  blocks = txt.reshape(chunks, size, -1)
  total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (jnp.arange(chunks), blocks))
  return total / batch


def _ring_sum(img, txt, t, b, n):
  """The pair-loss sum over the B x B matrix, images and texts split along `data` (n devices), texts passed
  round the ring: at step k a device holds the texts of device (i - k) mod n, so only step 0 has positives."""
  ring = [(i, (i + 1) % n) for i in range(n)]
  block = jax.checkpoint(_pair_loss_sum, static_argnums=(4,))

  @functools.partial(jax.shard_map, in_specs=(P(DATA), P(DATA), P(), P()), out_specs=P())
  def per_device(img, txt, t, b):
    own = block(img, txt, t, b, 0)

    def step(carry, _):
      total, txt = carry
      txt = jax.lax.ppermute(txt, DATA, ring)
      return (total + block(img, txt, t, b, None), txt), None

    (total, _), _ = jax.lax.scan(step, (own, txt), None, length=n - 1)
    return jax.lax.psum(total, DATA)

  return per_device(img, txt, t, b)
