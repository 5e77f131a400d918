r"""Imports a published checkpoint as a vlrep run directory: the second door for weights (vlrep.interop.export is
the first).

  python -m vlrep.interop.import_run --format=virtex --checkpoint=bicaptioning_R_50_L1_H2048.pth \
      --vocab=coco_10k.model --workdir=/runs/virtex_zoo
  python -m vlrep.interop.import_run --format=torchvision --checkpoint=resnet50-0676ba61.pth --workdir=/runs/in1k_r50
  python -m vlrep.interop.import_run --format=auto --checkpoint=FILE --workdir=RUN       # the format that fits the keys
  python -m vlrep.interop.import_run --format=auto --checkpoint=clip-vit-base-patch32/ --workdir=RUN  # config.json's

and then, as with any trained run:

  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py --workdir=/runs/in1k_r50
  python -m vlrep.tools.caption --workdir=/runs/virtex_zoo photo.jpg
  python -m vlrep.main --config=configs/finetune.py --config.init_from=/runs/in1k_r50 --workdir=/runs/inat_ft
  python -m vlrep.interop.export --workdir=/runs/virtex_zoo --format=virtex --out=bicaptioning.pth

A format is a module `vlrep.interop.formats.<format>` (see vlrep/interop/keymaps.py for the contract), found with
`vlrep.modules.get("interop.formats", ...)`; --format=auto picks the one whose `score` of the file's keys is highest
(the file is read once and handed to the format); a Hugging Face folder's format is its config.json's model_type
(FOLDER_MODEL_TYPES: 'clip', 'siglip', 'visual_bert'), an .npz's big_vision's (read without pickles). The run
directory is what training writes: a 'best' and a latest checkpoint (step 0) whose metadata holds the run's config
and an `import` note (source, format, what was dropped and why), plus summary.json. Everything is checked before
anything is written; an existing --workdir is replaced only with --overwrite.

The run's config is built by the format from the checkpoint: the model as published (its method with the
checkpoint's architecture, its tokenizer, the preprocessing it evaluates with), no recipe file read, so an
installed vlrep imports from any folder. `--config=FILE[:ARG]` (a path as the user names it) starts it from a
recipe's full config instead (its data, optimizer and evaluations kept; the method and tokenizer the
checkpoint's).

An imported run computes in float32 (`method.dtype`), as its source's code does, whatever the base config says (the
recipes' bfloat16 is a training speed choice: it moves a VisualBERT's outputs by up to 2.5e-2 relative);
`--dtype=bfloat16` asks for bfloat16 compute instead (parameters stay float32 either way).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil

import numpy as np
from absl import app, flags, logging
from ml_collections import ConfigDict

from vlrep import checkpoint as ckpt_lib
from vlrep import run_summary, safe_files
from vlrep.errors import BadFile, UserError, exit_2_on_user_error
from vlrep.interop import keymaps
from vlrep.interop.formats import big_vision, hf_clip
from vlrep.interop.formats import torchvision as tv

# --format=auto on a folder: config.json's model_type -> the format that reads it.
FOLDER_MODEL_TYPES = {"clip": "hf_clip", "siglip": "hf_siglip", "visual_bert": "visual_bert"}
# The compute dtypes an imported run's `method.dtype` may take; the first is the default (the sources' own).
DTYPES = ("float32", "bfloat16")


class NoSuchFile(UserError, FileNotFoundError):
  """A file named on the command line (checkpoint, vocabulary, config) does not exist."""


class WorkdirExists(UserError, FileExistsError):
  """--workdir holds something that only --overwrite replaces (or is a file)."""


def load_config(spec: str) -> ConfigDict:
  """`path/to/config.py[:ARG]` -> get_config(ARG); the path as the user names it (relative to the working
  directory)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise NoSuchFile(f"No config file {os.path.abspath(path)!r}; pass --config=PATH[:ARG].")
  name = "vlrep_import_config_" + os.path.splitext(os.path.basename(path))[0]
  module_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def resolve_format(fmt: str, checkpoint: str):
  """(the format module, the file's contents or None): the named format, or for 'auto' the best-scoring one (the
  file read once here, its contents handed on; an error naming the closest format and how the file differs from
  it when none fits)."""
  if fmt != "auto":
    if fmt not in keymaps.import_formats():
      known = ", ".join(keymaps.import_formats())
      raise UserError(f"Unknown import format {fmt!r}; known formats: {known} (or 'auto').")
    return keymaps.format_module(fmt), None
  if os.path.isdir(checkpoint):
    return keymaps.format_module(folder_format(checkpoint)), None
  if checkpoint.endswith(".npz"):  # numpy's archive (big_vision's parameters), read without pickles
    contents = big_vision.read_npz(checkpoint)
    score, missing, unexpected = big_vision.score(set(contents))
    if score < 0.5 or missing:
      raise BadFile(str(keymaps.no_format_error(checkpoint, set(contents), "big_vision", score, missing, unexpected)))
    logging.info("--format=auto: big_vision (score %.2f).", score)
    return big_vision, contents
  contents = tv.read_contents(checkpoint)
  keys = set(tv.read_state_dict(checkpoint, contents))
  name, score, missing, unexpected = keymaps.closest_format(keys)
  if score < 0.5 or missing:
    raise BadFile(str(keymaps.no_format_error(checkpoint, keys, name, score, missing, unexpected)))
  logging.info("--format=auto: %s (score %.2f).", name, score)
  return keymaps.format_module(name), contents


def folder_format(folder: str) -> str:
  """The format of a Hugging Face folder, by its config.json's model_type (FOLDER_MODEL_TYPES)."""
  kind = hf_clip.model_type(folder)
  if kind not in FOLDER_MODEL_TYPES:
    known = ", ".join(f"{t!r} (--format={f})" for t, f in FOLDER_MODEL_TYPES.items())
    said = f"its config.json's model_type is {kind!r}" if kind else "it has no config.json"
    raise UserError(
      f"--format=auto: {folder} is a folder, and {said}; the folders vlrep reads have model_type {known}."
    )
  logging.info("--format=auto: %s (config.json's model_type %r).", FOLDER_MODEL_TYPES[kind], kind)
  return FOLDER_MODEL_TYPES[kind]


def check_workdir(workdir: str, overwrite: bool) -> str:
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if os.path.isfile(workdir):
    raise WorkdirExists(f"--workdir={workdir} is a file, not a run directory.")
  if os.path.isdir(workdir) and os.listdir(workdir) and not overwrite:
    raise WorkdirExists(
      f"--workdir={workdir} already exists and is not empty; pass --overwrite to replace it, or choose another."
    )
  return workdir


def read(module, checkpoint: str, vocab: str | None, workdir: str, config: ConfigDict | None, contents=None, **options):
  """module.read(...) with the keyword arguments its signature accepts (the base config, the run directory and the
  file's contents already read are offered to every format; options the format does not take are an error)."""
  params = inspect.signature(module.read).parameters
  takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
  offered = (("config", config), ("workdir", workdir), ("contents", contents))
  kwargs = {k: v for k, v in offered if (takes_any or k in params) and (k != "contents" or v is not None)}
  unknown = [k for k in options if not takes_any and k not in params]
  if unknown:
    name = module.__name__.rsplit(".", 1)[-1]
    raise UserError(f"--{', --'.join(unknown)} do(es) not apply to --format={name}.")
  return module.read(checkpoint, vocab, **kwargs, **options)


def set_dtype(imported: keymaps.ImportedRun, dtype: str) -> None:
  """The run computes in `dtype` (its config's `method.dtype`), said in its note."""
  imported.config.method.dtype = dtype
  imported.note["dtype"] = dtype if dtype == DTYPES[0] else f"{dtype} (--dtype; the source computes in float32)"


def _jsonable(x):
  return json.loads(json.dumps(x, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def write_run(workdir: str, imported: keymaps.ImportedRun, overwrite: bool) -> None:
  """Writes the run as training does (vlrep.checkpoint.Checkpointer: best and latest checkpoints of step 0, the
  config in their metadata), into a fresh sibling directory first (safe_files.atomic_dir) and renamed into place
  when complete."""
  parent = os.path.dirname(workdir)
  safe_files.make_dirs(parent)
  with safe_files.atomic_dir(workdir) as tmp:  # a fresh folder beside WORKDIR: nothing planted there is followed
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0700 -> what os.makedirs would have made
    for rel, src in imported.files.items():
      safe_files.make_dirs(os.path.dirname(os.path.join(tmp, rel)), root=tmp)
      with safe_files.open_atomic(os.path.join(tmp, rel), "wb", root=tmp) as out, open(src, "rb") as f:
        shutil.copyfileobj(f, out)
    to_np = lambda t: {k: to_np(v) if isinstance(v, dict) else np.asarray(v) for k, v in t.items()}
    params, model_state = to_np(imported.params), to_np(imported.model_state)
    state = {"step": np.int32(0), "params": params, "model_state": model_state}
    meta = {
      "signature": ckpt_lib.signature(params),
      "config": imported.config.to_dict(),
      "summary": {},
      "import": _jsonable(imported.note),
    }
    ck = ckpt_lib.Checkpointer(tmp, keep=1, async_save=False)
    ck.save(0, state, meta)
    ck.save(0, state, meta, best=True)
    ck.wait()
    ck.close()
    note = imported.note
    run_summary.write_summary(tmp, {"import/format": note.get("format", ""), "import/source": note.get("source", "")})
    if os.path.lexists(workdir) and not overwrite and (not os.path.isdir(workdir) or os.listdir(workdir)):
      raise WorkdirExists(f"--workdir={workdir} appeared while importing; nothing was replaced.")


def import_run(
  fmt: str,
  checkpoint: str,
  workdir: str,
  vocab: str | None = None,
  config: str | None = None,
  overwrite: bool = False,
  dtype: str = DTYPES[0],
  **options,
) -> keymaps.ImportedRun:
  """Reads CHECKPOINT in format FMT ('auto': the best-scoring format) and writes the run to WORKDIR; returns what
  was imported. `config`: a recipe's config file[:arg] to start the run's config from (default: the format builds
  it from the checkpoint);
  `dtype`: the run's compute dtype (one of DTYPES; float32, the sources' own, by default)."""
  if dtype not in DTYPES:
    raise UserError(f"--dtype={dtype!r}: an imported run computes in one of {', '.join(DTYPES)}.")
  workdir = check_workdir(workdir, overwrite)
  if not os.path.exists(checkpoint):
    raise NoSuchFile(f"No checkpoint {checkpoint}.")
  if vocab and not os.path.exists(vocab):
    raise NoSuchFile(f"No vocabulary file {vocab}.")
  module, contents = resolve_format(fmt, checkpoint)
  base = load_config(config) if config else None
  imported = read(module, checkpoint, vocab, workdir, base, contents, **options)
  set_dtype(imported, dtype)
  write_run(workdir, imported, overwrite)
  logging.info("Imported %s (%s) into %s.", checkpoint, imported.note.get("format"), workdir)
  return imported


def define_flags():
  """Command-line flags (defined only when run as a command, so importing the module defines none)."""
  flags.DEFINE_string("format", "auto", f"One of {', '.join(keymaps.import_formats())}, or 'auto' (the one that fits).")
  flags.DEFINE_string("checkpoint", None, "The published checkpoint (file, or folder for folder formats).")
  flags.DEFINE_string("vocab", None, "The model's vocabulary (VirTex: the official coco_10k.model).")
  flags.DEFINE_string("workdir", None, "The run directory to write.")
  flags.DEFINE_bool("overwrite", False, "Replace an existing --workdir.")
  flags.DEFINE_string("config", None, "A recipe's config file[:arg] to start from (default: the format builds it).")
  flags.DEFINE_string("task", None, "VirTex: captioning or masked_lm for a forward-only head (default: file name).")
  flags.DEFINE_integer("heads", 0, "VirTex: attention heads of the textual head (default H / 64, as the zoo).")
  flags.DEFINE_bool("backbone_only", False, "VirTex: import the visual backbone alone.")
  flags.DEFINE_bool(
    "quick_gelu",
    None,
    "open_clip: the towers use QuickGELU (default: from the file: OpenAI's, or 'quickgelu' in its name).",
  )
  flags.DEFINE_enum(
    "dtype", DTYPES[0], DTYPES, "The run's compute dtype (method.dtype); float32 computes as the source's code does."
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  options = {}
  if f.task:
    options["task"] = f.task
  if f.heads:
    options["heads"] = f.heads
  if f.backbone_only:
    options["backbone_only"] = True
  if f.quick_gelu is not None:
    options["quick_gelu"] = f.quick_gelu
  imported = import_run(f.format, f.checkpoint, f.workdir, f.vocab, f.config, f.overwrite, f.dtype, **options)
  note = imported.note
  where = os.path.abspath(f.workdir)
  print(f"Imported {f.checkpoint} ({note.get('format')}) into {where}; it computes in {f.dtype}.", flush=True)
  for key, why in note.get("dropped", {}).items():
    print(f"  dropped {key}: {why}", flush=True)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["checkpoint", "workdir"])
  app.run(exit_2_on_user_error(main))
