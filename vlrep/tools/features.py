r"""A run's backbone features of image files: pooled ([N, C]) and grid ([N, h, w, C], rows, columns, channels).

  python -m vlrep.tools.features --workdir=RUN IMAGES... --out=FILE
  python -m vlrep.tools.features --workdir=/tmp/vlrep_virtex_local photo1.jpg photo2.png --out=/tmp/features.safetensors
  python -m vlrep.tools.features --workdir=/runs/in1k_r50 photo.jpg --resize=256 --size=224 --out=/tmp/pooled.npy

or from Python, the same in one call:

  from vlrep.tools import features
  out = features.extract("/runs/in1k_r50", ["photo1.jpg", "photo2.png"])  # {'pooled', 'grid', 'paths', ...}

Any vlrep run with a visual backbone: a trained one or an imported one (vlrep.interop.import_run). The backbone is the
one
every transfer evaluation uses (`vlrep.runs.load_run` + `runs.backbone_fn`: BatchNorm in inference mode, float32);
'pooled' is its `pre_logits` (the grid's spatial mean), 'grid' its final feature map.

Preprocessing (`--transform`): 'resize_crop' (default) resizes the shorter side to --resize and takes the centre
--size x --size crop, with torchvision's sizes and offsets (transforms.Resize(R) + CenterCrop(S)); 'squash'
resizes to --size x --size whatever the aspect ratio. Bicubic resampling (PIL's), then ImageNet mean/std
normalisation, as the models were trained. --size defaults to the crop size of the run's training
preprocessing (its config's data.pp, e.g. inception_crop(224) -> 224; 224 when it names none), --resize to --size.
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

import contextlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from PIL import Image
from safetensors.numpy import save_file

from vlrep import runs, safe_files, visualize
from vlrep.data import registry
from vlrep.errors import BadFile, UserError, exit_2_on_user_error

TRANSFORMS = ("resize_crop", "squash")
FEATURES = {"pooled": "pre_logits", "grid": "grid"}  # name in the output -> runs.backbone_fn's key
EXTENSIONS = (".safetensors", ".npy")


def training_size(config) -> int:
  """The crop size of the run's training preprocessing (e.g. inception_crop(224, ...) -> 224); 224 if none."""
  pp = config.get("data", {}).get("pp", "")
  crop = registry.op_arguments(pp, "inception_crop", "central_crop", "resize") if pp else None
  return int(crop["size"]) if crop else 224


def preprocessing(config, transform: str = "resize_crop", size: int = 0, resize: int = 0) -> dict:
  """What `load_image` does to each image, every value filled in (recorded with the features)."""
  if transform not in TRANSFORMS:
    raise UserError(f"--transform={transform!r}: one of {', '.join(TRANSFORMS)}.")
  size_from = "given" if size else "the run's training crop size"
  size = size or training_size(config)
  out = {"transform": transform, "size": size, "size_from": size_from}
  if transform == "resize_crop":
    resize = resize or size
    if resize < size:
      raise UserError(f"--resize={resize} is smaller than the --size={size} crop it is cropped to.")
    out["resize_shorter_side"] = resize
  elif resize:
    raise UserError("--resize applies to --transform=resize_crop; 'squash' resizes to --size x --size.")
  out.update(resampling="bicubic", normalization="ImageNet mean/std")
  return out


def describe(prep: dict) -> str:
  how = (
    f"shorter side resized to {prep['resize_shorter_side']}, centre crop {prep['size']}x{prep['size']}"
    if prep["transform"] == "resize_crop"
    else f"squashed to {prep['size']}x{prep['size']}"
  )
  return f"{how} ({prep['resampling']}; size: {prep['size_from']}), {prep['normalization']}"


def load_image(path: str, prep: dict) -> np.ndarray:
  """An image file -> uint8 [size, size, 3], as `prep` (from `preprocessing`) says."""
  size = prep["size"]
  img = Image.fromarray(visualize.read_rgb(path))
  if prep["transform"] == "squash":
    return np.asarray(img.resize((size, size), Image.BICUBIC), np.uint8)
  # The sizes and offsets as torchvision.transforms.Resize(int) and CenterCrop compute them (the longer side
  # truncated, the offsets rounded), so that features match a torchvision pipeline's pixel for pixel.
  w, h = img.size
  short = prep["resize_shorter_side"]
  w, h = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
  img = img.resize((w, h), Image.BICUBIC)
  left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
  return np.asarray(img.crop((left, top, left + size, top + size)), np.uint8)


def check_images(paths) -> list[str]:
  """The paths as a list, each an existing file whose header an image reader recognises (before any compute)."""
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not paths:
    raise UserError("Give at least one image file.")
  paths = [os.fspath(p) for p in paths]
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise UserError(f"No such image file(s): {missing[:10]}{' ...' if len(missing) > 10 else ''}")
  visualize.check_images(paths)
  return paths


def load_run(workdir: str, checkpoint: str = "best") -> runs.Run:
  """runs.load_run for the tools and vlrep.evaluate: every way a folder fails to be a restorable run (missing, no
  checkpoint, damaged or crafted checkpoint files) one UserError naming it, not a traceback."""
  try:
    return runs.load_run(workdir, checkpoint)
  except FileNotFoundError as e:  # no such folder, or no checkpoint in it (runs.NotARun)
    raise UserError(f"--workdir={workdir} is not a vlrep run directory with a restorable checkpoint: {e}") from e
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 -- orbax and tensorstore raise many types for damaged or crafted files
    raise BadFile(
      f"--workdir={workdir} is not a vlrep run directory with a restorable checkpoint: {type(e).__name__}: {e}. "
      "Its checkpoint files are damaged or not vlrep's: copy the run folder again from where it came from."
    ) from e


@contextlib.contextmanager
def saved_config_errors(run: runs.Run):
  """Context for building a run's model (method, tokenizer, backbone) from the config its checkpoint saved: that
  config is a file from outside, so one that does not build (a value of the wrong type, a section that is not one,
  sizes that do not fit the parameters) is one BadFile naming the checkpoint's metadata file, not a traceback."""
  try:
    yield
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 -- Flax, JAX and the methods raise many types for a config that does not build
    detail = (str(e).splitlines() or [""])[0][:300]
    raise BadFile(
      f"{os.path.join(run.path, 'meta', 'metadata')}: the run's saved config does not build its model "
      f"({type(e).__name__}: {detail}). The run folder is damaged or not vlrep's: copy it again from where it came "
      "from."
    ) from e


def check_backbone(run: runs.Run) -> None:
  """The run's backbone, as its saved config describes it, applies to its parameters (traced on a small image,
  nothing computed): a crafted or damaged config is refused before any image is read or evaluation run."""
  with saved_config_errors(run):
    module, variables = runs.backbone_of(run)
    jax.eval_shape(lambda v: module.apply(v, jnp.zeros((1, 64, 64, 3)), False), variables)


def load_backbone_run(workdir: str, checkpoint: str = "best") -> runs.Run:
  """`load_run`, and a UserError for a run without a visual backbone."""
  run = load_run(workdir, checkpoint)
  if "backbone" not in run.params:
    raise UserError(
      f"The run {workdir} has no visual backbone (its parameters: {sorted(run.params)}); features need one."
    )
  return run


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
  checkpoint's path) and 'step'}. `size`, `resize`, `transform`: as the command's flags (0: from the run's config)."""
  unknown = [f for f in features if f not in FEATURES]
  if unknown or not features:
    raise UserError(f"--features={','.join(features)}: choose from {', '.join(FEATURES)}.")
  paths = check_images(images)
  run = load_backbone_run(workdir, checkpoint)
  check_backbone(run)
  with saved_config_errors(run):
    prep = preprocessing(run.config, transform, size, resize)
    backbone = runs.backbone_fn(run)
  # A fixed batch shape (one compile), a multiple of the devices the batch is sharded over; the last batch padded.
  devices = jax.device_count()
  batch = -(-min(batch_size, len(paths)) // devices) * devices
  out = {name: [] for name in features}
  for start in range(0, len(paths), batch):
    chunk = paths[start : start + batch]
    pixels = np.zeros((batch, prep["size"], prep["size"], 3), np.float32)
    pixels[: len(chunk)] = visualize.normalize(np.stack([load_image(p, prep) for p in chunk]))
    for name in features:
      values, _ = backbone({"image": pixels}, FEATURES[name])
      out[name].append(np.asarray(values[: len(chunk)], np.float32))
  result = {name: np.concatenate(parts) for name, parts in out.items()}
  return {**result, "paths": paths, "preprocessing": prep, "run": run.path, "step": run.step}


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
  flags.DEFINE_integer("size", 0, "The side of the image the backbone sees (0: the run's training crop size).")
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
  print(f"Preprocessing: {describe(result['preprocessing'])}.", flush=True)
  print(f"{len(result['paths'])} images, {shapes} (float32) from {result['run']}: {', '.join(files)}", flush=True)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir", "out"])
  app.run(exit_2_on_user_error(main))
