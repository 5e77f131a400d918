"""A labelled image folder of real photographs (scikit-image's sample images) for tests of your own classes: mixed
sizes and aspect ratios, crops and mirrors, JPEG and PNG, a grayscale class and an RGBA logo, one class folder
per class as a user would lay them out (tests/test_own_labelled.py)."""

from __future__ import annotations

import os

import numpy as np
import skimage.data
from PIL import Image


def _variants(photo: np.ndarray) -> list[np.ndarray]:
  """The photo, mirrored and cropped three ways (centre, left part, top part): 5 images of different shapes."""
  h, w = photo.shape[:2]
  return [
    photo,
    photo[:, ::-1],
    photo[h // 6 : h - h // 6, w // 5 : w - w // 5],
    photo[:, : w * 3 // 5],
    photo[: h * 2 // 3, w // 8 :],
  ]


def _shrunk(pixels: np.ndarray, longest: int) -> Image.Image:
  """The pixels as a PIL image, its longer side `longest` (keeping the aspect ratio): a small file, quick to read."""
  image = Image.fromarray(pixels)
  scale = longest / max(image.size)
  return image.resize((max(8, round(image.width * scale)), max(8, round(image.height * scale))), Image.BILINEAR)


# class folder -> the photos it is made of (skimage.data names); each gives _variants, sizes cycling in LONGEST.
CLASSES = {
  "tabby_cat": ("chelsea", "cat"),
  "coffee_cup": ("coffee",),
  "rocket": ("rocket",),
  "coins": ("coins",),  # grayscale
  "night_sky": ("hubble_deep_field",),
  "logo": ("logo",),  # RGBA
}
LONGEST = (96, 64, 80, 112, 72)
PER_CLASS = 6  # images written per class


def write_labelled_folder(root: str) -> dict[str, list[str]]:
  """Writes root/<class>/<name>.{jpg,png} for CLASSES; returns {class: [paths under root]}. RGBA and grayscale
  images keep their mode (PNG for RGBA, and every third image PNG)."""
  written = {}
  for label, names in CLASSES.items():
    os.makedirs(os.path.join(root, label), exist_ok=True)
    photos = [getattr(skimage.data, name)() for name in names]
    variants = [v for photo in photos for v in _variants(photo)][:PER_CLASS]
    while len(variants) < PER_CLASS:  # a second mirror of a crop: still a different image
      variants.append(variants[len(variants) - 2][::-1])
    written[label] = []
    for i, pixels in enumerate(variants):
      image = _shrunk(np.ascontiguousarray(pixels), LONGEST[i % len(LONGEST)])
      suffix = ".png" if image.mode == "RGBA" or i % 3 == 2 else ".jpg"
      path = os.path.join(label, f"{label}_{i}{suffix}")
      image.save(os.path.join(root, path))
      written[label].append(path)
  return written
