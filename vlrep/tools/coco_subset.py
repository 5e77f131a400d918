r"""A seeded subset of a COCO annotation file, for fine-tuning on 10/20/50% of the images (LocTex tables 2, A2).

  python -m vlrep.tools.coco_subset --annotations=instances_train2017.json --percent=10 \
      --out=instances_train2017_10pct.json

Keeps round(percent% of the images) chosen uniformly with --seed, every annotation of those images, and the
categories and other top-level fields unchanged. The same seed gives the same subset, and a smaller percentage
is a subset of a larger one (one permutation, cut at different lengths), so results across sizes are nested.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from vlrep import errors, safe_files


def define_flags():
  flags.DEFINE_string("annotations", None, "COCO instances JSON (e.g. instances_train2017.json).")
  flags.DEFINE_float("percent", None, "Percentage of the images to keep, in (0, 100].")
  flags.DEFINE_string("out", None, "Output JSON.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")


def subset(data: dict, percent: float, seed: int = 0) -> dict:
  if not 0 < percent <= 100:
    raise ValueError(f"percent must be in (0, 100], got {percent}.")
  for key in ("images", "annotations"):
    if key not in data:
      raise ValueError(f"Not a COCO instances file: no {key!r} list (keys: {sorted(data)}).")
  ids = np.array(sorted(img["id"] for img in data["images"]))
  order = np.random.default_rng(seed).permutation(len(ids))
  keep = set(ids[order[: max(1, round(len(ids) * percent / 100))]].tolist())
  out = {k: v for k, v in data.items() if k not in ("images", "annotations")}
  out["images"] = [img for img in data["images"] if img["id"] in keep]
  out["annotations"] = [a for a in data["annotations"] if a["image_id"] in keep]
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  if not os.path.exists(f.annotations):
    raise FileNotFoundError(f"No annotation file {f.annotations}.")
  with errors.reading(f.annotations, what="COCO annotations file (JSON)"):
    with open(f.annotations) as fh:
      data = json.load(fh)
  if not isinstance(data, dict):
    raise errors.BadFile(f"{f.annotations}: not a COCO annotations file (a JSON {type(data).__name__}).")
  out = subset(data, f.percent, f.seed)
  safe_files.write_json(f.out, out, indent=None)  # a fresh temporary file, renamed: no link at --out followed
  print(f"{len(out['images'])}/{len(data['images'])} images, {len(out['annotations'])} annotations -> {f.out}")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["annotations", "percent", "out"])
  app.run(errors.exit_2_on_user_error(main))
