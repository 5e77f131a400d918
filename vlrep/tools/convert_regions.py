r"""Converts Faster R-CNN region-feature dumps to vlrep's per-image .npz files (vlrep.data.region_files).

  python -m vlrep.tools.convert_regions --format=mmf --src=/data/vqa/features/trainval --dst=/data/vlrep_regions

--format=mmf reads `<image_id>.npy` (N x 2048 features) with `<image_id>_info.npy` (bbox, num_boxes, image_width,
image_height, objects, cls_prob), the layout of MMF's extracted COCO / Conceptual Captions features. Files that
lack an info file or a required key are skipped and counted.
"""

from __future__ import annotations

import os

from absl import app, flags

from vlrep.data import region_files
from vlrep.errors import UserError, exit_2_on_user_error, reading


def define_flags():
  """Command-line flags (defined only when run as a command, so importing the module defines none)."""
  flags.DEFINE_enum("format", "mmf", ["mmf"], "Layout of the source files.")
  flags.DEFINE_string("src", None, "Directory of the source dumps.")
  flags.DEFINE_string("dst", None, "Directory for <image_id>.npz files.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")

  f = flags.FLAGS
  if not os.path.isdir(f.src):
    raise UserError(f"--src={f.src} is not a directory of MMF region-feature dumps.")
  # The dumps are files from outside: a malformed one the converter does not count as skipped (its own checks name
  # the file) still ends as one message, not a traceback.
  with reading(f.src, what="folder of MMF region-feature dumps (<id>.npy + <id>_info.npy)", hint=HINT):
    counts = region_files.convert_mmf(f.src, f.dst)
  print(", ".join(f"{k}: {v}" for k, v in counts.items()))
  if not counts["converted"]:
    raise UserError(f"No region files converted from {f.src} ({', '.join(f'{k}: {v}' for k, v in counts.items())}).")


HINT = "Re-extract or re-download the dumps; the files named above as skipped are damaged or not MMF's layout."


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["src", "dst"])
  app.run(exit_2_on_user_error(main))
