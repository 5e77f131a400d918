"""Attention overlays: a coarse attention map upsampled bicubically onto its image, as a PNG (VirTex fig. 6)."""

from __future__ import annotations

import os
import warnings

import numpy as np
from PIL import Image

from vlrep import errors, safe_files
from vlrep.data import images
from vlrep.data.ops import IMAGENET_MEAN, IMAGENET_STD

# The most pixels an image file may claim: PIL's own bound (Image.MAX_IMAGE_PIXELS, about 89 million; PIL only warns
# up to twice that and decodes), enforced here as a refusal: a PNG of a few KB can claim 100000 x 100000 pixels and
# take tens of GB once decoded.
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
IMAGE_HINT = "Pass a whole JPEG or PNG image file."


def open_image(path: str) -> Image.Image:
  """An image file opened (its header read, nothing decoded); a file that is not an image, or claims more than
  MAX_PIXELS pixels (a decompression bomb), is a BadFile naming it. The caller closes it."""
  with warnings.catch_warnings():
    # PIL warns (DecompressionBombWarning) between 1x and 2x its bound and raises above: both refused below.
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    try:
      img = Image.open(path)
    except Image.DecompressionBombError as e:
      raise errors.BadFile(_too_many_pixels(path, str(e).split(" exceeds")[0])) from e
    except Exception as e:  # noqa: BLE001 -- PIL raises several types for non-images
      raise _unreadable(path, e) from e
  w, h = img.size
  if w * h > MAX_PIXELS:
    img.close()
    raise errors.BadFile(_too_many_pixels(path, f"{w} x {h} = {w * h} pixels"))
  return img


def _unreadable(path: str, e: Exception) -> errors.BadFile:
  if isinstance(e, FileNotFoundError):
    return errors.BadFile(f"No image file {path}.")
  detail = (str(e).splitlines() or [""])[0][:300]
  return errors.BadFile(f"{path} is not a readable image file ({type(e).__name__}: {detail}). {IMAGE_HINT}")


def _too_many_pixels(path: str, size: str) -> str:
  return (
    f"{path}: the image claims {size}, more than the {MAX_PIXELS} pixels vlrep decodes (a small file that claims a "
    "huge image is a decompression bomb). Resize it below that first, if it is a real image you meant."
  )


def check_images(paths: list[str]) -> None:
  """Every path an image file vlrep reads (`open_image`), checked before any model is built; one UserError that
  counts and names the refused ones."""
  refused = []
  for p in paths:
    try:
      open_image(p).close()
    except errors.UserError as e:
      refused.append(str(e))
  if refused:
    raise errors.BadFile(f"{len(refused)} of {len(paths)} image files refused: " + " | ".join(refused[:10]))


def read_rgb(path: str) -> np.ndarray:
  """An image file -> uint8 [H, W, 3] as a viewer shows it (vlrep.data.images.viewer_rgb, as prepare stores own
  photos: EXIF orientation applied, 16-bit by the type's range, transparency over white, the first frame); a file
  that is not an image, is damaged or claims too many pixels is a BadFile naming it."""
  with open_image(path) as img:
    try:
      return np.asarray(images.viewer_rgb(img)[0], np.uint8)
    except Exception as e:  # noqa: BLE001 -- a truncated or damaged file fails on decoding, after its header read
      raise _unreadable(path, e) from e


def load_image(path: str, size: int) -> np.ndarray:
  """An image file -> uint8 [size, size, 3]: shorter side resized to `size`, centre crop (the eval protocol)."""
  img = Image.fromarray(read_rgb(path))
  w, h = img.size
  scale = size / min(w, h)
  img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
  w, h = img.size
  left, top = (w - size) // 2, (h - size) // 2
  return np.asarray(img.crop((left, top, left + size, top + size)), np.uint8)


def load_image_official(path: str, resize: int = 256, crop: int = 224) -> np.ndarray:
  """An image file -> uint8 [crop, crop, 3] as kdexd/virtex's evaluation transform makes it (albumentations'
  SmallestMaxSize(resize): OpenCV INTER_LINEAR, i.e. bilinear at half-pixel centres without antialiasing, rounded
  to uint8; then CenterCrop(crop))."""
  return official_crop(read_rgb(path), resize, crop)


def official_crop(img: np.ndarray, resize: int = 256, crop: int = 224) -> np.ndarray:
  """uint8 [H, W, 3] -> uint8 [crop, crop, 3], `load_image_official`'s transform of decoded pixels."""
  h, w = img.shape[:2]
  scale = resize / min(h, w)
  # albumentations' SmallestMaxSize rounds the new size (py3round: Python's round): 300x451 -> 256x385
  img = resize_bilinear(img, round(h * scale), round(w * scale))
  h, w = img.shape[:2]
  top, left = (h - crop) // 2, (w - crop) // 2
  return img[top : top + crop, left : left + crop]


def resize_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
  """uint8 [H, W, C] -> [out_h, out_w, C]: OpenCV's INTER_LINEAR (source coordinate (i + 0.5) * in / out - 0.5,
  clamped at the borders, no antialiasing), rounded to uint8."""

  def taps(n_out, n_in):
    x = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0, n_in - 1)
    lo = np.floor(x).astype(np.int64)
    return lo, np.minimum(lo + 1, n_in - 1), (x - lo).astype(np.float32)

  y0, y1, fy = taps(out_h, img.shape[0])
  x0, x1, fx = taps(out_w, img.shape[1])
  f = img.astype(np.float32)
  rows = f[y0] * (1 - fy)[:, None, None] + f[y1] * fy[:, None, None]
  out = rows[:, x0] * (1 - fx)[None, :, None] + rows[:, x1] * fx[None, :, None]
  return np.clip(np.round(out), 0, 255).astype(np.uint8)


def normalize(images: np.ndarray, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> np.ndarray:
  """uint8 images -> the float input the models were trained on (ImageNet mean/std unless the run's differ)."""
  return (images.astype(np.float32) / 255.0 - np.array(mean, np.float32)) / np.array(std, np.float32)


def _heat(values: np.ndarray) -> np.ndarray:
  """[H, W] in [0, 1] -> RGB float, a blue-green-yellow-red ramp (no matplotlib needed)."""
  stops = np.array([[0.0, 0.0, 0.5], [0.0, 0.6, 1.0], [0.2, 0.9, 0.2], [1.0, 0.9, 0.0], [0.9, 0.1, 0.0]])
  pos = np.clip(values, 0, 1) * (len(stops) - 1)
  lo = np.floor(pos).astype(int).clip(0, len(stops) - 2)
  frac = (pos - lo)[..., None]
  return stops[lo] * (1 - frac) + stops[lo + 1] * frac


def overlay(image: np.ndarray, attention: np.ndarray, alpha: float = 0.5) -> np.ndarray:
  """uint8 image [H, W, 3] and attention [h, w] -> uint8 overlay; the map is upsampled bicubically."""
  h, w = image.shape[:2]
  att = attention.astype(np.float32)
  att = (att - att.min()) / max(float(att.max() - att.min()), 1e-12)
  up = np.asarray(Image.fromarray(att).resize((w, h), Image.BICUBIC), np.float32).clip(0, 1)
  blended = (1 - alpha) * image.astype(np.float32) / 255.0 + alpha * _heat(up)
  return (blended.clip(0, 1) * 255).round().astype(np.uint8)


def save_token_overlays(
  image: np.ndarray, attention: np.ndarray, words: list[str], out_dir: str, upscale: int = 1
) -> list[str]:
  """One PNG per predicted token: `attention` [T, h*w] (a square grid); returns the written paths."""
  safe_files.make_dirs(out_dir)
  side = int(round(np.sqrt(attention.shape[-1])))
  if side * side != attention.shape[-1]:
    raise ValueError(f"Attention over {attention.shape[-1]} positions is not a square grid.")
  if upscale > 1:
    image = np.asarray(Image.fromarray(image).resize((image.shape[1] * upscale, image.shape[0] * upscale)))
  paths = []
  for t, word in enumerate(words):
    safe = "".join(ch if ch.isalnum() else "_" for ch in word)[:20] or "token"
    path = os.path.join(out_dir, f"{t:02d}_{safe}.png")
    with safe_files.atomic_path(path, suffix=".png") as tmp:
      Image.fromarray(overlay(image, attention[t].reshape(side, side))).save(tmp)
    paths.append(path)
  return paths
