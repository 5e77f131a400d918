"""An own-data folder (`image_text`, captions.jsonl) made of real photographs: scikit-image's sample images
(skimage.data, shipped with the package) and crops and mirrors of them, so the images have the sizes, aspect
ratios and modes a user's photos have (RGB and grayscale JPEGs, RGB and RGBA PNGs, from 60 px strips to a
1411 x 1411 scan), with 1 to 7 captions per image, tags on every image and Localized-Narratives-style narrations
(timed words and mouse traces, as LN's JSONL has them) on most images.

`write_folder(root)` writes the folder; `prepare_folder(root)` also prepares it with `vlrep.data.prepare`
(`python -m vlrep.data.prepare --dataset=image_text --manual_dir=ROOT/photos --data_dir=ROOT/tfds`) and returns
the data_dir. `python tests/real_photos.py ROOT` does both from a shell (for trying the README's commands on it).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from PIL import Image
from skimage import data as skdata

from vlrep.data import prepare

# name -> (skimage.data function, what the photo shows, its tags). The subjects are the captions' nouns.
PHOTOS = {
  "astronaut": ("astronaut", "an astronaut in a white suit holding a helmet", ["astronaut", "person", "flag"]),
  "coffee": ("coffee", "a cup of coffee on a saucer with a spoon", ["coffee", "cup", "spoon"]),
  "chelsea": ("chelsea", "a ginger cat looking to the right", ["cat", "animal"]),
  "rocket": ("rocket", "a rocket on its launch pad under a blue sky", ["rocket", "sky"]),
  "hubble": ("hubble_deep_field", "many small galaxies on a black sky", ["galaxy", "space", "sky"]),
  "cells": ("immunohistochemistry", "stained cells seen through a microscope", ["cells", "microscope"]),
  "colorwheel": ("colorwheel", "a wheel of colours on a white background", ["colours", "circle"]),
  "coins": ("coins", "rows of old coins on a dark table", ["coins", "table"]),
  "camera": ("camera", "a man with a camera on a tripod in a field", ["person", "camera", "field"]),
  "page": ("page", "a page of printed text", ["text", "page"]),
  "logo": ("logo", "a logo with a snake on a transparent background", ["logo", "snake"]),
  "retina": ("retina", "the retina of an eye with red blood vessels", ["eye", "vessels"]),
  "clock": ("clock", "a clock on a wall seen from the side", ["clock", "wall"]),
  "text": ("text", "printed letters on a grey card", ["text", "letters"]),
  "brick": ("brick", "a brick wall in grey light", ["wall", "brick"]),
  "moon": ("moon", "the surface of the moon with craters", ["moon", "craters"]),
}

# Each photo's first caption is "a photo of SUBJECT"; the others follow these templates in order.
TEMPLATES = (
  "there is {s} in this picture",
  "a close view of {s}",
  "on the left of the image {s}",
  "{s} on the right side of the frame",
  "a picture that shows {s}",
  "in this image we can see {s}",
)


def _crops_and_mirrors(arrays: dict) -> dict:
  """Derived images of other sizes and aspect ratios: crops (tall, wide, small), mirrors, a downscale."""
  a = arrays
  return {
    "chelsea_left_tall": ("chelsea", a["chelsea"][:, :150]),  # 300 x 150: portrait
    "coffee_mirrored": ("coffee", a["coffee"][:, ::-1]),
    "astronaut_face": ("astronaut", a["astronaut"][20:220, 140:260]),  # 200 x 120
    "rocket_strip": ("rocket", a["rocket"][150:210]),  # 60 x 640: a very wide strip, shorter side 60
    "rocket_tall": ("rocket", a["rocket"][:, 250:400]),  # 427 x 150
    "hubble_corner": ("hubble", a["hubble"][:333, :500]),
    "retina_small": ("retina", np.asarray(Image.fromarray(a["retina"]).resize((301, 301)))),
    "cells_mirrored": ("cells", a["cells"][::-1]),
    "camera_crop": ("camera", a["camera"][100:400, 50:250]),  # grayscale, 300 x 200
    "coins_wide": ("coins", a["coins"][100:200]),  # grayscale, 100 x 384
    "colorwheel_half": ("colorwheel", a["colorwheel"][:185]),
    "chelsea_mirrored": ("chelsea", a["chelsea"][:, ::-1]),
    "brick_square": ("brick", a["brick"][:97, :97]),
    "coffee_tall": ("coffee", a["coffee"][:, 200:420]),  # 400 x 220
    "astronaut_mirrored_png": ("astronaut", a["astronaut"][::2, ::-2]),  # 256 x 256
    "moon_strip": ("moon", a["moon"][200:280]),  # grayscale, 80 x 512
  }


def _file_name(name: str, array: np.ndarray, index: int) -> str:
  """PNG for the RGBA logo, the mirrored astronaut and every third image; JPEG otherwise."""
  png = array.ndim == 3 and array.shape[2] == 4 or name.endswith("_png") or index % 3 == 2
  return f"{name}.png" if png else f"{name}.jpg"


def _narration(caption: str, seed: int) -> dict:
  """Localized Narratives' fields for `caption`: each word spoken for 0.3-0.6 s with a short pause, and the mouse
  wandering over the image meanwhile, sampled every 0.05 s in segments (LN's 'traces': lists of {x, y, t}, x and y
  in [0, 1]; a few points just off the image, as LN's own data has)."""
  rng = np.random.default_rng(seed)
  words, t = [], 0.2
  for word in caption.split():
    length = float(rng.uniform(0.3, 0.6))
    words.append({"utterance": word, "start_time": round(t, 3), "end_time": round(t + length, 3)})
    t += length + float(rng.uniform(0.0, 0.2))
  times = np.arange(0.0, t + 0.3, 0.05)
  xy = np.cumsum(rng.normal(0, 0.03, (len(times), 2)), 0) + rng.uniform(0.3, 0.7, 2)
  xy = np.clip(xy, -0.01, 1.01)
  points = [
    {"x": round(float(x), 4), "y": round(float(y), 4), "t": round(float(s), 3)}
    for (x, y), s in zip(xy, times, strict=True)
  ]
  cuts = sorted(rng.choice(np.arange(5, len(points) - 5), 2, replace=False))
  segments = [points[: cuts[0]], points[cuts[0] : cuts[1]], points[cuts[1] :]]
  return {"timed_caption": words, "traces": segments}


def write_folder(root: str) -> dict:
  """Writes ROOT/photos: the images and captions.jsonl. Returns {relative image path: (height, width, number of
  captions)}."""
  os.makedirs(os.path.join(root, "photos", "images"), exist_ok=True)
  arrays = {name: getattr(skdata, fn)() for name, (fn, _, _) in PHOTOS.items()}
  images = {name: (name, array) for name, array in arrays.items()}
  images.update(_crops_and_mirrors(arrays))
  rows, written = [], {}
  for index, (name, (source, array)) in enumerate(images.items()):
    path = os.path.join("images", _file_name(name, array, index))
    image = Image.fromarray(np.ascontiguousarray(array))
    image.save(os.path.join(root, "photos", path), **({"quality": 90} if path.endswith(".jpg") else {}))
    _, subject, tags = PHOTOS[source]
    count = 1 + (index * 3) % 7  # 1 to 7 captions, every count present
    captions = [f"a photo of {subject}"] + [t.format(s=subject) for t in TEMPLATES][: count - 1]
    for k, caption in enumerate(captions):
      row = {"image": path, "caption": caption, "tags": tags}
      if k == 0 and index % 4 != 3:  # three images in four narrated (LN narrates its images once)
        row.update(_narration(caption, seed=index))
      rows.append(row)
    written[path] = (array.shape[0], array.shape[1], count)
  with open(os.path.join(root, "photos", "captions.jsonl"), "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n")
  return written


def prepare_folder(root: str) -> tuple[str, dict, dict]:
  """write_folder(root), prepared into ROOT/tfds: (data_dir, the prepare report, write_folder's answer)."""
  written = write_folder(root)
  report = prepare.prepare("image_text", os.path.join(root, "photos"), os.path.join(root, "tfds"))
  return os.path.join(root, "tfds"), report, written


if __name__ == "__main__":
  data_dir, report, written = prepare_folder(sys.argv[1])
  print(json.dumps({"data_dir": data_dir, "images": len(written), "report": report}, indent=1, default=str))
