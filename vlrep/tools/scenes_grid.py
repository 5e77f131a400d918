"""Writes a PNG grid of synthetic_scenes samples with their first caption (README's picture).

python -m vlrep.tools.scenes_grid --out=docs/synthetic_scenes.png
"""

import numpy as np
from absl import app, flags
from PIL import Image, ImageDraw

from vlrep.data.builders import scenes

flags.DEFINE_string("out", "docs/synthetic_scenes.png", "Output PNG.")
flags.DEFINE_integer("seed", 0, "Seed.")
FLAGS = flags.FLAGS


def grid(seed: int = 0, cols: int = 4, scale: int = 3) -> Image.Image:
  rng = np.random.default_rng(seed)
  tiles = []
  for k in range(cols * 2):
    s = scenes.generate_scene(rng, 64, "main" if k < cols else "sketch")
    img = Image.fromarray(s["image"]).resize((64 * scale, 64 * scale), Image.NEAREST)
    tile = Image.new("RGB", (64 * scale, 64 * scale + 44), "white")
    tile.paste(img, (0, 0))
    words, lines = s["captions"][1].split(), [""]
    for w in words:
      lines[-1] = (lines[-1] + " " + w).strip() if len(lines[-1]) + len(w) < 30 else lines[-1]
      if w not in lines[-1].split():
        lines.append(w)
    ImageDraw.Draw(tile).text((3, 64 * scale + 2), "\n".join(lines[:3]), fill="black")
    tiles.append(tile)
  w, h = tiles[0].size
  out = Image.new("RGB", (w * cols, h * 2), "white")
  for k, t in enumerate(tiles):
    out.paste(t, ((k % cols) * w, (k // cols) * h))
  return out


def main(argv):
  del argv
  import os

  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  grid(FLAGS.seed).save(FLAGS.out)
  print(FLAGS.out)


if __name__ == "__main__":
  app.run(main)
