r"""Exports a run's visual backbone (or a whole VirTex or VisualBERT model) for PyTorch users, in any format whose
module in vlrep/interop/formats/ defines `export` (see vlrep/interop/keymaps.py for the contract; each module's
docstring says what it writes).

  python -m vlrep.interop.export --workdir=DIR --format=torchvision --out=backbone.safetensors   # or backbone.pth
  python -m vlrep.interop.export --workdir=DIR --format=detectron2 --out=backbone.pkl
  python -m vlrep.interop.export --workdir=DIR --format=virtex --out=virtex.pth
  python -m vlrep.interop.export --workdir=DIR --format=visual_bert --out=FOLDER
  python -m vlrep.interop.export --workdir=DIR --format=backbone --out=FOLDER   # backbone.safetensors + backbone.json

torchvision: the backbone with torchvision's ResNet names, no `fc` (`load_state_dict(sd, strict=False)` misses
exactly fc.weight and fc.bias); detectron2: the same weights in Detectron2's names, pickled for MODEL.WEIGHTS;
virtex: the whole model as the official kdexd/virtex code's state dict (strict=True), the official config values
printed; visual_bert: a Hugging Face folder `transformers.VisualBertForPreTraining.from_pretrained` loads (never a
code hook: `auto_map`, `trust_remote_code`, `custom_pipelines`); backbone: the PyTorch hand-off the detection
evaluator and the Detectron2 driver read (vlrep.pytorch.resnet.ResNet's arguments beside the weights).

Every file is written through vlrep.safe_files: a fresh temporary file created exclusively beside --out, then renamed
over it, so a symlink planted at --out or at any temporary name is replaced, never followed, and a symlinked folder
between --out's folder and the file is refused. A run that cannot be exported (a small stem, no backbone, a format
it is not) is refused with one message and exit status 2, as is a missing run or checkpoint.
"""

from __future__ import annotations

from absl import app, flags, logging

from vlrep import runs
from vlrep.errors import UserError, exit_2_on_user_error
from vlrep.interop import keymaps
from vlrep.interop.keymaps import NotExportable


class RunMissing(UserError, FileNotFoundError):
  """No run directory, or no checkpoint of the step asked for, at --workdir."""


def export_format(fmt: str):
  """The format module that exports `fmt`, or a NotExportable listing those that export."""
  known = keymaps.export_formats()
  if fmt not in known:
    raise NotExportable(f"Unknown export format {fmt!r}; known: {', '.join(known)}.")
  return keymaps.format_module(fmt)


def export(workdir: str, fmt: str, out: str, checkpoint: str = "best", overwrite: bool = False) -> dict:
  """Writes WORKDIR's checkpoint (its backbone, or the whole model for virtex and visual_bert) to `out` in format
  `fmt`; returns {'keys', 'parameters', 'step'} and what the format adds ('official_config', 'files', 'notes').
  `overwrite`: replace an existing non-empty --out folder (folder formats; an error otherwise). A run, format or
  --out that cannot give the file is a `NotExportable` (a UserError), before anything is written."""
  module = export_format(fmt)
  if module.OUT_SUFFIXES and not out.endswith(module.OUT_SUFFIXES):
    raise NotExportable(f"--out for {fmt} must end in {' or '.join(module.OUT_SUFFIXES)}, got {out!r}.")
  try:
    run = runs.load_run(workdir, checkpoint)
  except FileNotFoundError as e:  # no run directory, no checkpoint (of that step): the user's path, not a bug
    raise RunMissing(str(e)) from e
  info = module.export(run, out, overwrite)
  logging.info("Wrote %d tensors (%d parameters) of step %d to %s.", info["keys"], info["parameters"], run.step, out)
  return info


def define_flags():
  """Command-line flags (defined only when run as a command, so importing the module defines none)."""
  flags.DEFINE_string("workdir", None, "The training run's directory.")
  formats = keymaps.export_formats()
  descriptions = "; ".join(f"{name}: {keymaps.format_module(name).DESCRIPTION}" for name in formats)
  flags.DEFINE_enum("format", "torchvision", formats, descriptions)
  flags.DEFINE_string("out", None, "Output file (folder formats: output folder).")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  flags.DEFINE_bool("overwrite", False, "Folder formats: replace an existing non-empty --out folder.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  info = export(f.workdir, f.format, f.out, f.checkpoint, f.overwrite)
  print(f"Exported step {info['step']}: {info['keys']} tensors to {f.out}", flush=True)
  for key, value in info.get("official_config", {}).items():
    print(f"  {key}: {value}", flush=True)
  if "files" in info:
    print(f"  files: {', '.join(info['files'])}", flush=True)
  for note in info.get("notes", []):
    print(f"  note: {note}", flush=True)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir", "out"])
  app.run(exit_2_on_user_error(main))
