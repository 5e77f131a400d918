"""Speed switches that do not pay on an accelerator (docs/speed.md), so vlrep has no code for them. A run's saved
config may still carry their keys: reading such a run drops them, since the plain path computes the same maths with
the same parameters. The two that change what a checkpoint holds are a clear error when on: padded vocabulary
tables wherever the run is read, a flat momentum vector when the run is resumed.

A leaf module: the models (a backbone section), `runs` (a saved config) and the tools read it.
"""

from __future__ import annotations

from absl import logging

_H200 = "measured on an NVIDIA H200 (docs/speed.md, 2026-11-26)"

# Dotted key -> (its 'off' value, why vlrep has no such switch, what it changes in a checkpoint when on: None,
# 'params' or 'opt_state').
REMOVED_SWITCHES = {
  "method.backbone.pallas_conv1x1": (
    False,
    f"its Pallas/Triton 1x1 convolution kernels ran at 0.18-0.93x XLA's plain path, {_H200}",
    None,
  ),
  "method.backbone.fused_bn_act": (False, f"x0.979 on the VirTex step, {_H200}", None),
  "method.backbone.fast_max_pool": (False, f"x0.990 on the VirTex step, {_H200}", None),
  "method.backbone.conv1x1_as_dot": (False, f"x0.749 on the VirTex step, {_H200}", None),
  "method.fused_qkv": (False, f"x0.994 on the VirTex step, {_H200}", None),
  "method.fused_memory_kv": (False, f"x1.003 on the VirTex step, {_H200}", None),
  "method.vocab_multiple": (1, f"x0.995 on the VirTex step, {_H200}", "params"),
  "optim.grad_norm_once": (False, f"x0.992 on the VirTex step, {_H200}", None),
  "optim.lookahead_sync_only": (False, f"x0.974 on the VirTex step, {_H200}", None),
  "optim.flat_update": (False, f"x0.957 on the VirTex step, {_H200}", "opt_state"),
  "rng_impl": ("threefry2x32", f"unsafe_rbg ran at x0.976 on the VirTex step, {_H200}", None),
}


def _is_off(key: str, value) -> bool:
  off = REMOVED_SWITCHES[key][0]
  return value in (off, None, "", 0) if isinstance(off, (bool, int)) else value in (off, None, "")


def drop_removed_switches(section: dict, prefix: str = "", resuming: bool = False) -> dict:
  """`section` (a config, or its sub-section at dotted `prefix`, e.g. 'method.backbone') without the removed
  switches it carries, each at its own level. One that was on and changed the parameters (or, when `resuming`,
  the optimizer state) is a ValueError naming it; one that was on and changed only the speed is dropped with a
  log line."""
  out = dict(section)
  for key, value in section.items():
    full = f"{prefix}.{key}" if prefix else key
    if full in REMOVED_SWITCHES:
      _, why, changed = REMOVED_SWITCHES[full]
      if not _is_off(full, value) and (changed == "params" or (resuming and changed == "opt_state")):
        raise ValueError(
          f"This run was trained with the speed switch {full}={value!r}, which changed what its checkpoint holds "
          f"and was removed ({why}). Retrain without it (git keeps the switch's code)."
        )
      if not _is_off(full, value):
        logging.info(
          "Dropping the removed speed switch %s=%r (%s); the plain path computes the same maths.", full, value, why
        )
      del out[key]
    elif hasattr(value, "items") and any(k.startswith(full + ".") for k in REMOVED_SWITCHES):
      out[key] = drop_removed_switches(value, full, resuming)
  return out
