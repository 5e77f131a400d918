"""Shared helpers for builders of real datasets read from local copies."""

from __future__ import annotations

import collections
import io

from absl import logging
from PIL import Image

# Counts of skipped inputs per (dataset, reason); `vlrep.data.prepare` prints and saves them.
SKIPPED: collections.Counter = collections.Counter()


def readable_image(path: str, dataset: str) -> bool:
  """True if the file fully decodes as an image; otherwise logs, counts a skip and returns False."""
  try:
    with open(path, "rb") as f:
      data = f.read()
    with Image.open(io.BytesIO(data)) as im:
      im.load()
    return True
  except FileNotFoundError:
    reason = "missing image file"
  except Exception as e:  # PIL raises many types for corrupt files
    reason = f"undecodable image ({type(e).__name__})"
  SKIPPED[(dataset, reason)] += 1
  logging.warning("%s: skipping %s: %s", dataset, path, reason)
  return False


def skip(dataset: str, reason: str, what: str) -> None:
  SKIPPED[(dataset, reason)] += 1
  logging.warning("%s: skipping %s: %s", dataset, what, reason)
