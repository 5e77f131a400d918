"""An image file as a viewer shows it, in one place: `prepare` (every builder of your own photos), the features and
caption tools and the evaluators that read image files all decode through `viewer_rgb` / `decode_file`.

What a viewer shows, and so what vlrep stores and feeds a model (8-bit RGB):

  - EXIF orientation applied (PIL.ImageOps.exif_transpose): a phone's portrait JPEG stored 600 x 512 with
    orientation 6 is 512 x 600, upright. EXIF that cannot be read leaves the image as stored (noted).
  - 16-bit grayscale (PIL modes I;16, I;16L, I;16B, I;16N, and mode I read from a PNG, whose samples are at most
    16 bits) scaled by the type's full range, value * 255 / 65535, as image viewers show them (a full-range 16-bit
    photo keeps its look; PIL's own convert clips at 255 and makes it white). 32-bit integer (I) and floating-point
    (F) images, which have no range every viewer agrees on (a scientific TIFF), are scaled by their own range:
    their minimum to 0, their maximum to 255 (non-finite values as the minimum; a constant image keeps its value,
    clipped to 0..255).
  - Transparency (RGBA, LA, PA, RGBa, La, a palette or grayscale/RGB PNG with a transparent colour) composited
    over white, as a browser shows it on a white page: out = alpha * colour + (1 - alpha) * 255.
  - CMYK (a print JPEG; Adobe's inverted CMYK as PIL reads it), YCbCr, palette, 1-bit and the other PIL modes
    converted to RGB by PIL's conversion.
  - Animated images (GIF, APNG, WebP, multi-page TIFF, MPO): the first frame, as a thumbnail shows it.
  - Colour profiles (ICC) are not applied: the pixel values are used as stored.

Each conversion that changes how pixels are read is named in the returned notes (NOTE_*), which prepare counts
in its report (`converted`).
"""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
from PIL import Image, ImageOps

# The image suffixes vlrep reads in every input format (a class folder, a shard member; a row of captions.jsonl,
# captions.csv or labels.csv may name any file and is decoded by content).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".webp", ".gif", ".bmp", ".tif", ".tiff")

NOTE_ORIENTATION = "EXIF orientation applied (rotated or mirrored upright)"
NOTE_BAD_EXIF = "EXIF unreadable (shown as stored, not rotated)"
NOTE_16BIT = "16-bit pixels scaled to 8 bits by the type's range (value * 255 / 65535)"
NOTE_WIDE = "32-bit or float pixels scaled to 8 bits by the image's own min..max"
NOTE_ALPHA = "transparency composited over white"
NOTE_CMYK = "CMYK converted to RGB"
NOTE_ANIMATED = "animated or multi-frame image: the first frame kept"

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def _frames(im: Image.Image) -> int:
  try:
    return int(getattr(im, "n_frames", 1) or 1)
  except Exception:  # noqa: BLE001 -- a damaged multi-frame file may fail to count its frames: one is shown
    return 1


def _range_scaled(im: Image.Image, full_range: bool) -> Image.Image:
  """A one-channel 16/32-bit or float image -> mode L: by the 16-bit type's range, or by its own min..max."""
  a = np.asarray(im)
  a = a.astype(np.float64)  # big-endian I;16B too
  if full_range:
    out = a * (255.0 / 65535.0)
  else:
    finite = np.isfinite(a)
    if not finite.any():
      out = np.zeros_like(a)
    else:
      lo, hi = float(a[finite].min()), float(a[finite].max())
      a = np.where(finite, a, lo)
      out = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.full_like(a, min(max(lo, 0.0), 255.0))
  return Image.fromarray(np.clip(np.round(out), 0, 255).astype(np.uint8), "L")


def _over_white(im: Image.Image) -> Image.Image:
  """An image with transparency -> RGB, composited over white."""
  rgba = np.asarray(im.convert("RGBA"), np.float32)
  alpha = rgba[..., 3:] / 255.0
  out = rgba[..., :3] * alpha + 255.0 * (1.0 - alpha)
  return Image.fromarray(np.clip(np.round(out), 0, 255).astype(np.uint8), "RGB")


def _has_transparency(im: Image.Image) -> bool:
  if im.mode in ALPHA_MODES:
    return True
  return im.mode in ("P", "L", "RGB") and "transparency" in im.info


def viewer_rgb(im: Image.Image) -> tuple[Image.Image, list[str]]:
  """(`im` as a viewer shows it, as a new loaded RGB image, the notes of what was converted); see the module
  docstring. Only the first frame of a multi-frame image is decoded."""
  notes, fmt = [], im.format
  if _frames(im) > 1:
    notes.append(NOTE_ANIMATED)
    im.seek(0)
  try:
    orientation = im.getexif().get(ImageOps.ExifTags.Base.Orientation, 1)
    if orientation not in (1, None):
      im = ImageOps.exif_transpose(im)
      notes.append(NOTE_ORIENTATION)
  except Exception:  # noqa: BLE001 -- malformed EXIF: PIL raises several types; the image is shown as stored
    notes.append(NOTE_BAD_EXIF)
  if im.mode in SIXTEEN_BIT or im.mode == "I" and fmt == "PNG":
    return _range_scaled(im, full_range=True).convert("RGB"), [*notes, NOTE_16BIT]
  if im.mode in ("I", "F"):
    return _range_scaled(im, full_range=False).convert("RGB"), [*notes, NOTE_WIDE]
  if _has_transparency(im):
    return _over_white(im), [*notes, NOTE_ALPHA]
  if im.mode == "CMYK":
    notes.append(NOTE_CMYK)
  return (im.copy() if im.mode == "RGB" else im.convert("RGB")), notes


def open_bounded(data: bytes, max_pixels: int) -> Image.Image:
  """The image in `data` opened, its header read and checked (PIL's DecompressionBombError, more than
  `max_pixels`: ValueError naming the size), nothing decoded."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    im = Image.open(io.BytesIO(data))
  width, height = im.size
  if width * height > max_pixels:
    im.close()
    raise ValueError(f"the image claims {width} x {height} pixels, more than {max_pixels:,}")
  return im


def decode_file(path_or_bytes: str | os.PathLike | bytes, max_pixels: int | None = None) -> tuple[np.ndarray, list]:
  """An image file (a path or its bytes) -> (uint8 [H, W, 3] as a viewer shows it, notes): see viewer_rgb. Raises
  what PIL raises for a file that is not an image, and ValueError for one whose header claims more than
  `max_pixels` (default: PIL's Image.MAX_IMAGE_PIXELS) pixels."""
  if isinstance(path_or_bytes, bytes):
    data = path_or_bytes
  else:
    with open(path_or_bytes, "rb") as f:
      data = f.read()
  limit = max_pixels or Image.MAX_IMAGE_PIXELS or 89_478_485
  with open_bounded(data, limit) as im, warnings.catch_warnings():
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    rgb, notes = viewer_rgb(im)
  return np.asarray(rgb, np.uint8), notes


def keeps_jpeg(im: Image.Image) -> bool:
  """Whether the stored file's bytes already are what a viewer shows, for storage as JPEG: a one-frame RGB or
  grayscale JPEG without an EXIF orientation to apply (TensorFlow's decoder ignores EXIF)."""
  if im.format != "JPEG" or im.mode not in ("RGB", "L") or _frames(im) > 1:
    return False
  try:
    return im.getexif().get(ImageOps.ExifTags.Base.Orientation, 1) in (1, None)
  except Exception:  # noqa: BLE001 -- malformed EXIF: a viewer shows it as stored, as TensorFlow decodes it
    return True


# A re-encoded image (every image but an upright JPEG) is stored at this JPEG quality without chroma subsampling
# (4:4:4): decoded by TensorFlow as training reads it, a photo stays within ~2/255 (mean absolute difference) of
# the pixels a viewer shows; quality 95 with PIL's default 4:2:0 drifts to ~3/255 on detailed photos.
JPEG_QUALITY = 97


def viewer_jpeg(im: Image.Image, data: bytes) -> tuple[bytes, tuple[int, int], list[str]]:
  """(JPEG bytes of what a viewer shows of `im` (opened from `data`), its (width, height), notes): `data` itself
  when it already is that (keeps_jpeg), else viewer_rgb re-encoded (JPEG_QUALITY, 4:4:4)."""
  if keeps_jpeg(im):
    im.load()
    return data, im.size, []
  rgb, notes = viewer_rgb(im)
  out = io.BytesIO()
  rgb.save(out, "JPEG", quality=JPEG_QUALITY, subsampling=0)
  return out.getvalue(), rgb.size, notes
