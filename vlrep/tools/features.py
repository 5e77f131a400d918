r"""A run's backbone features of image files: pooled ([N, C]) and grid ([N, h, w, C], rows, columns, channels).

  python -m vlrep.tools.features --workdir=RUN IMAGES... --out=FILE
  python -m vlrep.tools.features --workdir=/tmp/vlrep_virtex_local photo1.jpg photo2.png --out=/tmp/features.safetensors
  python -m vlrep.tools.features --workdir=/runs/in1k_r50 photo.jpg --resize=256 --size=224 --out=/tmp/pooled.npy

or from Python, the same computation (this command calls it):

  import vlrep
  out = vlrep.load("/runs/in1k_r50").encode_images(["photo1.jpg", "photo2.png"])  # {'pooled', 'grid'}

Any vlrep run with a visual backbone: a trained one, an imported one (vlrep.interop.import_run) or a shared folder
(vlrep.interop.export --format=vlrep). The backbone is the one every transfer evaluation uses (`vlrep.runs.backbone_fn`:
BatchNorm in inference mode, float32); 'pooled' is its `pre_logits` (the grid's spatial mean), 'grid' its final
feature map.

Preprocessing (`--transform`): 'resize_crop' (default) resizes the shorter side to --resize and takes the centre
--size x --size crop, with torchvision's sizes and offsets (transforms.Resize(R) + CenterCrop(S)); 'squash'
resizes to --size x --size whatever the aspect ratio; 'virtex_official' is the official VirTex evaluation's (256,
bilinear, centre crop 224). Bicubic resampling (PIL's), then ImageNet mean/std
normalisation, as the models were trained. --size defaults to the crop size of the run's training
preprocessing (its config's data.pp, e.g. inception_crop(224) -> 224; when it names none, its dataset's fixed image
size, e.g. synthetic_scenes' 64; else 224), --resize to --size.
The command prints what it used, and the output records it.

Output, chosen by --out's extension, one row per image in the order given:
  .safetensors  tensors 'pooled' and 'grid' (--features picks), float32; metadata 'paths' (JSON list, the row
                order), 'preprocessing' (JSON), 'run' and 'step'. Read it with safetensors.numpy.load_file and
                safetensors.safe_open(...).metadata().
  .npy          one array (--features=pooled, the default for .npy, or grid), and FILE.json beside it with the paths,
                preprocessing, run and step.
An existing --out is replaced only with --overwrite. Bad inputs (a missing or unreadable image, a directory that
is not a run, a run without a visual backbone, another extension) are errors naming what was wrong: exit status 2.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags
from safetensors.numpy import save_file

from vlrep import inference, safe_files
from vlrep.errors import UserError, exit_2_on_user_error

TRANSFORMS = inference.TRANSFORMS
FEATURES = {"pooled": "pre_logits", "grid": "grid"}  # name in the output -> runs.backbone_fn's key
EXTENSIONS = (".safetensors", ".npy")


def extract(
  workdir: str,
  images,
  checkpoint: str = "best",
  features=("pooled", "grid"),
  size: int = 0,
  resize: int = 0,
  transform: str = "resize_crop",
  batch_size: int = 32,
) -> dict:
  """The run's backbone features of image files: {'pooled': [N, C], 'grid': [N, h, w, C] (those in `features`),
  float32 numpy, one row per path in order; 'paths'; 'preprocessing' (what was done to each image); 'run' (the
  checkpoint's path) and 'step'}. `size`, `resize`, `transform`: as the command's flags (0: from the run's config).
  `vlrep.load(workdir).encode_images` computes them."""
  unknown = [f for f in features if f not in FEATURES]
  if unknown or not features:
    raise UserError(f"--features={','.join(features)}: choose from {', '.join(FEATURES)}.")
  paths = inference.check_images(images)
  model = inference.load(workdir, checkpoint, batch_size)
  if "backbone" not in model.run.params:
    raise UserError(
      f"The run {workdir} has no visual backbone (its parameters: {sorted(model.run.params)}); features need one."
    )
  with inference.saved_config_errors(model.run):
    prep = inference.preprocessing(model.run.config, transform, size, resize)
  result = model.encode_images(paths, tuple(features), preprocessing=prep)
  return {**result, "paths": paths, "preprocessing": prep, "run": model.run.path, "step": model.run.step}


def check_out(out: str, names, overwrite: bool = False) -> list[str]:
  """The files that writing features `names` to OUT makes (OUT, and OUT.json for .npy); a clear error for another
  extension, a .npy for several arrays or an existing file without `overwrite` (checked before any compute)."""
  ext = os.path.splitext(out)[1]
  if ext not in EXTENSIONS:
    raise UserError(f"--out={out}: the extension chooses the format, one of {', '.join(EXTENSIONS)}.")
  if ext == ".npy" and len(names) != 1:
    raise UserError(f"--out={out}: a .npy file holds one array; pass --features=pooled or grid, or write .safetensors.")
  files = [out] if ext == ".safetensors" else [out, out + ".json"]
  existing = [f for f in files if os.path.exists(f)]
  if existing and not overwrite:
    raise UserError(f"{existing[0]} exists; pass --overwrite to replace it, or choose another --out.")
  return files


def write(result: dict, out: str, overwrite: bool = False) -> list[str]:
  """Writes `extract`'s result to OUT (.safetensors: every feature in it; .npy: its one feature, and OUT.json with
  the paths and preprocessing); returns the files written. Each file is written beside and renamed into place."""
  ext = os.path.splitext(out)[1]
  names = [name for name in FEATURES if name in result]
  files = check_out(out, names, overwrite)
  meta = {"paths": result["paths"], "preprocessing": result["preprocessing"], "run": result["run"]}
  meta["step"] = result["step"]
  safe_files.make_dirs(os.path.dirname(os.path.abspath(out)))
  if ext == ".safetensors":
    arrays = {name: np.ascontiguousarray(result[name]) for name in names}
    with safe_files.atomic_path(out, suffix=ext) as tmp:
      save_file(arrays, tmp, metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    return files
  with safe_files.atomic_path(out, suffix=ext) as tmp:  # numpy adds .npy to a name without it
    np.save(tmp, np.ascontiguousarray(result[names[0]]))
  safe_files.write_json(out + ".json", {"array": names[0], "shape": list(result[names[0]].shape), **meta})
  return files


def define_flags():
  """Command-line flags (defined only when run as a command, so importing the module defines none)."""
  flags.DEFINE_string("workdir", None, "The run directory (trained, or imported with vlrep.interop.import_run).")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  flags.DEFINE_string("out", None, "The output file: .safetensors (pooled and grid) or .npy (one array).")
  flags.DEFINE_list("features", [], "pooled, grid or both (default: both for .safetensors, pooled for .npy).")
  flags.DEFINE_enum("transform", "resize_crop", TRANSFORMS, "resize_crop: shorter side, centre crop; squash.")
  flags.DEFINE_integer("size", 0, "The side of the image the backbone sees (0: the run's training image size).")
  flags.DEFINE_integer("resize", 0, "resize_crop: the shorter side before the crop (0: --size).")
  flags.DEFINE_integer("batch_size", 32, "Images per backbone call.")
  flags.DEFINE_bool("overwrite", False, "Replace an existing --out.")


def main(argv):
  f = flags.FLAGS
  features = f.features or (["pooled"] if f.out.endswith(".npy") else list(FEATURES))
  check_out(f.out, features, f.overwrite)
  result = extract(f.workdir, argv[1:], f.checkpoint, features, f.size, f.resize, f.transform, f.batch_size)
  files = write(result, f.out, f.overwrite)
  shapes = ", ".join(f"{name} {list(result[name].shape)}" for name in FEATURES if name in result)
  print(f"Preprocessing: {inference.describe(result['preprocessing'])}.", flush=True)
  print(f"{len(result['paths'])} images, {shapes} (float32) from {result['run']}: {', '.join(files)}", flush=True)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir", "out"])
  app.run(exit_2_on_user_error(main))
