"""Rematerialisation (`config.remat`, a model's `remat` field): which of a block's forward values its backward pass
keeps, the rest being computed again from the block's input. One block is one ResNet residual block or one
transformer layer (VirTex's decoder layers, the text encoders', BERT's, ViLBERT's visual and co-attention layers).

  'none'  no rematerialisation: the backward pass keeps every value it needs (the default; fastest, most memory)
  'dots'  each block keeps its matmul and convolution outputs (jax.checkpoint_policies.dots_saveable) and computes
          again the cheap rest: normalisations, activations, softmax, dropout masks, residual sums
  'full'  each block keeps only its input (jax.checkpoint_policies.nothing_saveable) and runs again whole in the
          backward pass: about one more forward pass of compute for the least memory

The maths is the same under every policy (gradients agree to float32 rounding; tests/test_remat.py) and so is the
parameter tree: a block keeps its name and its parameters' paths, so checkpoints load whatever the policy.
"""

from __future__ import annotations

import flax.linen as nn
import jax

# name -> the jax.checkpoint policy of each block (None: the block is not wrapped at all).
POLICIES = {
  "none": None,
  "dots": jax.checkpoint_policies.dots_saveable,
  "full": jax.checkpoint_policies.nothing_saveable,
}


def check(name: str) -> str:
  """`name` when it is a policy's; a ValueError listing the choices otherwise."""
  if not isinstance(name, str) or name not in POLICIES:
    raise ValueError(f"Unknown remat policy {name!r}; choose one of {', '.join(map(repr, POLICIES))}.")
  return name


def wrap(block: type[nn.Module], name: str, static_argnums: tuple[int, ...]) -> type[nn.Module]:
  """The module class `block`, rematerialised under policy `name` (`block` itself for 'none').

  `static_argnums`: the positions in `block.__call__(self, ...)` (self is 0) of its Python-valued arguments, the
  `train` / `deterministic` flags, which callers must pass positionally. The wrapped class keeps the parameters'
  names; its mutable collections (BatchNorm's batch_stats, sown intermediates) and rngs (dropout) are lifted through
  the checkpoint, so they update and draw as without it."""
  policy = POLICIES[check(name)]
  if policy is None:
    return block
  return nn.remat(block, policy=policy, static_argnums=static_argnums)
