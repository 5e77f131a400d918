"""Tiny ViT runs for tests: tests/tiny_virtex.py, tiny_clip.py and tiny_loctex.py with their ResNet replaced by a
two-block ViT (width 32, 2 heads, 8-pixel patches: a 4x4 grid of patches at 32 px).

  python -m vlrep.main --config=tests/tiny_vit.py:virtex --workdir=...   # or :clip, :loctex
"""

import tiny_clip
import tiny_loctex
import tiny_virtex

from vlrep.models import vit

TINY = dict(width=32, depth=2, num_heads=2, mlp_dim=64)
GRID = 32 // 8  # patches per side at tiny runs' 32 px
METHODS = {"virtex": tiny_virtex, "clip": tiny_clip, "loctex": tiny_loctex}


def backbone(**overrides) -> dict:
  """The tiny ViT's backbone config section (class-token pooling unless `overrides` say otherwise)."""
  return vit.config_for("vit_ti8", **{**TINY, "pool_type": "tok", **overrides})


def get_config(arg="virtex"):
  method, _, rest = (arg or "virtex").partition(",")
  if method not in METHODS:
    raise ValueError(f"tests/tiny_vit.py:{arg}: the method is one of {sorted(METHODS)}.")
  if method == "loctex":  # a ViT's trace attention is at scale 1 only (its patch grid)
    rest = ",".join(filter(None, ["scales=1", rest]))
  c = METHODS[method].get_config(rest or None)
  c.method.backbone = backbone()
  if method == "loctex":  # the ResNet's 2x2 grid at 32 px becomes the ViT's 4x4 (8-pixel patches)
    c.method.grid_sizes = (GRID,)
    c.data.pp = c.data.pp.replace("sizes=(2,)", f"sizes=({GRID},)")
    if "localization" in c.evals:
      c.evals.localization.update(
        grid_sizes=(GRID,), pp=c.evals.localization.pp.replace("sizes=(2,)", f"sizes=({GRID},)")
      )
  return c
