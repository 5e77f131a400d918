"""Shared helpers for builders of real datasets read from local copies.

A manual_dir may come from someone else (a dataset shared as a folder, shards downloaded from the web), so what
the builders read from it is bounded and checked before it is read (`LIMITS`, set by `vlrep.data.prepare`'s flags):

  - every file and shard member read whole (an image, a `KEY.jpg` in a shard) is at most `max_file_bytes`, every
    text (an index line, a shard's `KEY.txt` / `KEY.json`) at most `max_text_bytes`: the size is checked before
    reading (a file's size, a tar member's declared size) and the read itself is capped at the limit + 1 byte, so
    a gzip stream that decompresses to more than it declares is still refused;
  - an image is decoded only if its header declares at most `max_image_pixels` pixels (a decompression bomb: a
    20000 x 20000 PNG of a few kilobytes would take gigabytes);
  - a file a row names (an image, a shard, the index) that resolves outside manual_dir (an absolute path, a
    `../` path, a symlink) is not read unless `allow_outside_manual_dir` is set (`outside_manual_dir`);
  - only regular files are opened (a FIFO named `x.jpg` would block prepare forever).

Each refusal of one file is a counted skip (`skip`) naming the limit; a whole file that cannot be read (an
index) is a UserError (exit status 2).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import stat
import warnings

from absl import logging
from PIL import Image

from vlrep.data import images
from vlrep.errors import UserError

# Counts of skipped inputs per (dataset, reason); `vlrep.data.prepare` prints and saves them.
SKIPPED: collections.Counter = collections.Counter()
# Images stored after a conversion that changes how their pixels are read (vlrep.data.images' notes: EXIF
# orientation, 16-bit range, transparency over white, CMYK, first frame of an animation), per (dataset, note).
CONVERTED: collections.Counter = collections.Counter()
# Files read from outside manual_dir because `allow_outside_manual_dir` allowed it (the prepare report names them).
OUTSIDE: list[str] = []

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one input may make prepare read or hold (vlrep.data.prepare's flags of the same names)."""

  # An image file or shard member: 256 MiB holds any photo (a 150-megapixel camera's JPEG is ~60 MB).
  max_file_bytes: int = 256 * MIB
  # An index line or a shard's KEY.txt / KEY.json: a Localized Narratives row with its traces is ~10-200 kB.
  max_text_bytes: int = 8 * MIB
  # Pixels an image's header may declare: PIL's own hard limit (twice Image.MAX_IMAGE_PIXELS), ~179 megapixels,
  # above any camera's photo. Decoding holds up to ~8 bytes per pixel (the decoded image and its RGB copy).
  max_image_pixels: int = 178_956_970
  allow_outside_manual_dir: bool = False


LIMITS = Limits()


class TooLarge(ValueError):
  """An input over one of LIMITS: `reason` is the skip reason naming the limit."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


class NotRegularFile(OSError):
  """A path that is a folder, a FIFO, a device or a socket: never opened for reading."""


class OutsideManualDir(UserError):
  """Files named by the source resolve outside --manual_dir and --allow_outside_manual_dir was not given."""


def _size(n: int) -> str:
  return f"{n / MIB:g} MiB" if n >= MIB and n % (MIB // 16) == 0 else f"{n:,} bytes"


def file_too_large(limit: int, flag: str = "max_file_bytes") -> str:
  return f"file over {_size(limit)} (--{flag})"


def image_too_large(limit: int) -> str:
  return f"image over {limit:,} pixels (--max_image_pixels; a decompression bomb?)"


def open_regular(path: str):
  """`path` opened for binary reading, if it is a regular file (NotRegularFile otherwise; FileNotFoundError and
  the other OSErrors as open raises them). O_NONBLOCK: a FIFO is opened without waiting for a writer, then
  refused."""
  fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
  try:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      raise NotRegularFile(f"{path} is not a regular file (a folder, a FIFO or a device)")
    return os.fdopen(fd, "rb")
  except BaseException:
    os.close(fd)
    raise


def read_capped(f, limit: int, reason: str) -> bytes:
  """The rest of `f`, refused (TooLarge(reason)) if it holds more than `limit` bytes: at most limit + 1 bytes are
  read, whatever a header or a compressed stream claims."""
  data = f.read(limit + 1)
  if len(data) > limit:
    raise TooLarge(reason)
  return data


def read_file(path: str, limit: int | None = None) -> bytes:
  """A regular file's bytes, refused before reading (TooLarge) when over `limit` (LIMITS.max_file_bytes)."""
  limit = LIMITS.max_file_bytes if limit is None else limit
  reason = file_too_large(limit)
  with open_regular(path) as f:
    if os.fstat(f.fileno()).st_size > limit:
      raise TooLarge(reason)
    return read_capped(f, limit, reason)


def lines(f, limit: int):
  """(line number, the line's bytes without its b"\\n") of the binary file `f`, or (number, None) for a line over
  `limit` bytes (the rest of that line is skipped without being held)."""
  number = 0
  while True:
    raw = f.readline(limit + 1)
    if not raw:
      return
    number += 1
    if len(raw) > limit and not raw.endswith(b"\n"):
      while raw and not raw.endswith(b"\n"):  # the rest of the long line, read in bounded pieces
        raw = f.readline(MIB)
      yield number, None
      continue
    yield number, raw.removesuffix(b"\n")


def decode_image(data: bytes) -> Image.Image:
  """The decoded image in `data`. Its header's size is checked before any pixel is decoded: more than
  LIMITS.max_image_pixels is TooLarge (PIL's own warning above Image.MAX_IMAGE_PIXELS is silenced: the limit is
  ours, and PIL's DecompressionBombError is counted under our reason too)."""
  limit = LIMITS.max_image_pixels
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)
      im = Image.open(io.BytesIO(data))
  except Image.DecompressionBombError as e:
    raise TooLarge(image_too_large(limit)) from e
  width, height = im.size
  if width * height > limit:
    im.close()
    raise TooLarge(image_too_large(limit))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    im.load()
  return im


def viewer_jpeg(data: bytes, dataset: str, what: str) -> tuple[bytes, tuple[int, int]] | None:
  """(JPEG bytes of the image in `data` as a viewer shows it (vlrep.data.images: EXIF orientation, 16-bit range,
  transparency over white, CMYK, first frame), its (width, height)), or None (a counted skip) when it is over
  LIMITS or does not decode. Each conversion is counted in CONVERTED."""
  try:
    with decode_image(data) as im:
      jpeg, size, notes = images.viewer_jpeg(im, data)
  except Exception as e:  # PIL raises many types for corrupt files
    skip(dataset, image_skip_reason(e), what)
    return None
  for note in notes:
    CONVERTED[(dataset, note)] += 1
  return jpeg, size


def converted(dataset: str) -> dict[str, int]:
  """CONVERTED's counts of `dataset`: {note: images}."""
  return {note: n for (name, note), n in sorted(CONVERTED.items()) if name == dataset}


def image_skip_reason(e: Exception) -> str:
  """The skip reason of an image that could not be read or decoded."""
  if isinstance(e, TooLarge):
    return e.reason
  if isinstance(e, FileNotFoundError):
    return "missing image file"
  if isinstance(e, NotRegularFile):
    return "image path not a regular file (a folder, FIFO or device)"
  return f"undecodable image ({type(e).__name__})"


def outside(root: str, path: str) -> str | None:
  """Where `path` really is (symlinks resolved) if that is outside `root` (itself resolved), else None."""
  real_root, real = os.path.realpath(root), os.path.realpath(path)
  return None if os.path.commonpath([real_root, real]) == real_root else real


def refuse_outside(root: str, found: list[tuple[str, str]], what: str) -> None:
  """OutsideManualDir naming `found` ([(name as given, where it resolves)]) unless LIMITS allows reading outside
  manual_dir, in which case they are recorded in OUTSIDE for the prepare report."""
  if not found:
    return
  if LIMITS.allow_outside_manual_dir:
    OUTSIDE.extend(name for name, _ in found)
    return
  listed = "; ".join(f"{name!r} -> {real}" for name, real in found[:5])
  more = f" and {len(found) - 5} more" if len(found) > 5 else ""
  raise OutsideManualDir(
    f"{root}: {len(found)} file{'s' if len(found) > 1 else ''} named by {what} resolve{'s' if len(found) == 1 else ''}"
    f" outside --manual_dir (an absolute path, a '../' path or a symlink): {listed}{more}. vlrep reads only inside "
    "--manual_dir: move or copy the files in, or give --allow_outside_manual_dir if you meant them (e.g. images "
    "symlinked in on purpose)."
  )


def check_inside(root: str, path: str) -> None:
  """refuse_outside for one file an official-format builder is about to read: they check each image as they read
  it, and the first one outside manual_dir stops prepare (TFDS removes its unfinished output)."""
  real = outside(root, path)
  if real is not None:
    refuse_outside(root, [(os.path.relpath(path, root), real)], "the dataset's annotations")


def read_image_file(path: str, dataset: str, root: str | None = None) -> bytes | None:
  """The image file's bytes, or None (counted): missing, not a regular file, over LIMITS.max_file_bytes. `root`:
  the manual_dir it must lie in (check_inside)."""
  if root is not None:
    check_inside(root, path)
  try:
    return read_file(path)
  except (OSError, TooLarge) as e:
    reason = image_skip_reason(e)
  SKIPPED[(dataset, reason)] += 1
  logging.warning("%s: skipping %s: %s", dataset, path, reason)
  return None


def skip(dataset: str, reason: str, what: str) -> None:
  SKIPPED[(dataset, reason)] += 1
  logging.warning("%s: skipping %s: %s", dataset, what, reason)
