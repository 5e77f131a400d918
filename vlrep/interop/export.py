r"""Exports a checkpoint's visual backbone (or a whole VirTex or VisualBERT model) for PyTorch users.

  python -m vlrep.interop.export --workdir=DIR --format=torchvision --out=backbone.safetensors   # or backbone.pth
  python -m vlrep.interop.export --workdir=DIR --format=detectron2 --out=backbone.pkl
  python -m vlrep.interop.export --workdir=DIR --format=virtex --out=virtex.pth
  python -m vlrep.interop.export --workdir=DIR --format=visual_bert --out=FOLDER

torchvision: a ResNet state_dict with torchvision's names (`conv1.weight`, `layer1.0.bn1.running_mean`,
`layer1.0.downsample.0.weight`, ...) and no `fc`; load it with
`torchvision.models.resnet50().load_state_dict(sd, strict=False)` (the missing keys are exactly fc.weight and
fc.bias). Written as safetensors (`.safetensors`, no pickle) or with torch.save (`.pth`, needs torch).

virtex: the whole VirTex model (backbone, visual projection, textual head) as the official kdexd/virtex code's
state dict, {"model": state_dict, "iteration": step} written with torch.save (`.pth`, needs torch): every key its
model has (load_state_dict strict=True), the attention key biases as zeros (vlrep has none: they cancel in softmax)
and the tied copies (output = embedding, the backward head's shared modules) written out. A run imported from an
official checkpoint (vlrep.interop.import_run --format=virtex) gets its vocabulary rows back in the official order, so
import -> export is the identity. The official config values that build the model are printed (MODEL.TEXTUAL.NAME,
DATA.VOCAB_SIZE, the special token indices, ...).

visual_bert: a Hugging Face folder that `transformers.VisualBertForPreTraining.from_pretrained(FOLDER)` loads with no
missing or unexpected keys: config.json (VisualBertConfig: the run's BERT sizes, activation, LayerNorm eps and
visual_embedding_dim), model.safetensors (float32, `visual_bert.*` and `cls.*`, the tied MLM decoder written as
copies) and the run's WordPiece vocab.txt, by the key map the visual_bert importer reads
(vlrep/interop/formats/visual_bert.py: `write_folder`). Exports a run whose model is VisualBERT's: an imported one
(vlrep.interop.import_run --format=visual_bert; import -> export is the identity, bit for bit) or a configs/vlbert.py:
arch=visual_bert run trained with --config.method.region_boxes=False --config.method.region_norm=shared
--config.method.region_type_embedding=tables --config.method.text_pool=cls; any other run is refused, naming those
flags. Notes are printed: a run without a trained alignment head gets `cls.seq_relationship` as zeros, a run
whose regions' token type is 0 (MMF's) needs `visual_token_type_ids` of zeros, a task head is not written. The
folder is written beside --out and renamed into place; an existing non-empty --out needs --overwrite. Code hooks
(`auto_map`, `trust_remote_code`, `custom_pipelines`: keys that make transformers import Python from a folder) are
never written, whatever the run's saved config.json fields hold; dropping one is printed as a note.

detectron2: the same weights renamed as Detectron2's ResNet (layerN -> res{N+1}, bnK -> convK.norm,
downsample.0/1 -> shortcut / shortcut.norm, stem keys under `stem.`), pickled as
{"model": {name: numpy array}, "__author__": ..., "matching_heuristics": True}; `MODEL.WEIGHTS=backbone.pkl`
in the configs of configs/detectron2/ loads it (Detectron2 adds its `backbone.bottom_up.` prefix itself).

Every file is written through vlrep.safe_files: a fresh temporary file created exclusively beside --out, then renamed
over it, so a symlink planted at --out or at any temporary name is replaced, never followed, and a symlinked folder
between --out's folder and the file is refused. A run that cannot be exported (a small stem, no backbone, a format
it is not) is refused with one message and exit status 2, as is a missing run or checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
from collections import OrderedDict
from typing import Any

import numpy as np
from absl import app, flags, logging

from vlrep import runs, safe_files
from vlrep.errors import UserError, exit_2_on_user_error
from vlrep.interop.formats import backbone as backbone_format
from vlrep.interop.formats import torchvision as tv_importer
from vlrep.interop.formats import virtex as virtex_format
from vlrep.interop.formats import visual_bert as visual_bert_format

FORMATS = ("torchvision", "detectron2", "virtex", "visual_bert", "backbone")
# config.json keys that make transformers import and run Python shipped with a folder (AutoModel's `auto_map`,
# `trust_remote_code`, a pipeline's code): an export never writes one, whatever a run's saved fields hold.
CODE_HOOKS = frozenset({"auto_map", "trust_remote_code", "custom_pipelines"})


class NotExportable(UserError):
  """A by-design refusal: the run, the format or --out cannot give the file asked for (the message says why)."""


class RunMissing(UserError, FileNotFoundError):
  """No run directory, or no checkpoint of the step asked for, at --workdir."""


class OutExists(UserError, FileExistsError):
  """--out is a non-empty folder and --overwrite was not given (visual_bert)."""


def torchvision_state_dict(
  backbone_params: dict, backbone_stats: dict | None, counters: dict | None = None
) -> OrderedDict:
  """Flax ResNet variables -> torchvision-named float32 numpy arrays (convs OIHW, BN weight/bias/running_*), by the
  key map `vlrep.interop.formats.torchvision` imports with (import -> export is the identity). `counters`: BatchNorm
  `num_batches_tracked` values an imported run kept (0 otherwise)."""
  if backbone_stats is None:
    raise NotExportable("The backbone has no BatchNorm statistics (batch_stats); it cannot be exported.")
  return OrderedDict(tv_importer.state_dict(backbone_params, backbone_stats, counters).items())


def _imported_counters(run) -> dict:
  """BatchNorm `num_batches_tracked` values an imported run kept (vlrep.interop.import_run), under torchvision's
  names."""
  counters = run.meta.get("import", {}).get("counters", {})
  prefix = run.meta.get("import", {}).get("backbone_prefix", "")
  return {k[len(prefix) :]: v for k, v in counters.items() if k.startswith(prefix)}


def detectron2_state_dict(torchvision_sd: dict) -> OrderedDict:
  """torchvision ResNet names -> Detectron2 ResNet names (what detectron2's convert-torchvision-to-d2 does)."""
  out = OrderedDict()
  for key, value in torchvision_sd.items():
    if key.endswith("num_batches_tracked") or key.startswith("fc."):
      continue
    k = key
    k = re.sub(r"^layer(\d)", lambda m: f"res{int(m.group(1)) + 1}", k)
    k = re.sub(r"\.bn(\d)\.", r".conv\1.norm.", k)
    k = k.replace(".downsample.0.", ".shortcut.").replace(".downsample.1.", ".shortcut.norm.")
    if k.startswith("conv1.") or k.startswith("bn1."):
      k = "stem." + k.replace("bn1.", "conv1.norm.")
    out[k] = value
  return out


def _load(workdir: str, checkpoint: str):
  try:
    return runs.load_run(workdir, checkpoint)
  except FileNotFoundError as e:  # no run directory, no checkpoint (of that step): the user's path, not a bug
    raise RunMissing(str(e)) from e


def _by_design(call, *args):
  """`call(*args)`, a format's own check of a run, whose ValueErrors are refusals that say what the run lacks (a
  VirTex export of a CLIP run, a VisualBERT export of a run with another embedding): one message, exit 2."""
  try:
    return call(*args)
  except UserError:
    raise
  except ValueError as e:
    raise NotExportable(str(e)) from e


def _root_of(out: str) -> str:
  """The folder the user named for --out: every file is written inside it, never through a link in it."""
  return os.path.dirname(os.path.abspath(out))


def export(workdir: str, fmt: str, out: str, checkpoint: str = "best", overwrite: bool = False) -> dict:
  """Writes the backbone of WORKDIR's checkpoint to `out` (the whole model for virtex and visual_bert); returns
  {'keys', 'parameters', 'step'} (and what the format adds: 'official_config', 'notes'). `overwrite`: replace an
  existing non-empty --out folder (visual_bert; it is an error otherwise). A run, format or --out that cannot give
  the file is a `NotExportable` (a UserError), before anything is written."""
  if fmt not in FORMATS:
    raise NotExportable(f"Unknown export format {fmt!r}; expected one of {FORMATS}.")
  if fmt == "torchvision" and not out.endswith((".safetensors", ".pth", ".pt")):
    raise NotExportable(f"--out for torchvision must end in .safetensors or .pth, got {out!r}.")
  if fmt == "detectron2" and not out.endswith(".pkl"):
    raise NotExportable(f"--out for detectron2 must end in .pkl, got {out!r}.")
  if fmt == "virtex" and not out.endswith((".pth", ".pt")):
    raise NotExportable(f"--out for virtex must end in .pth (the official code reads it with torch.load), got {out!r}.")
  run = _load(workdir, checkpoint)
  if fmt == "virtex":
    return _export_virtex(run, out)
  if fmt == "visual_bert":
    return _export_visual_bert(run, out, overwrite)
  if fmt == "backbone":
    return backbone_format.export(run, out, overwrite)
  if run.config.method.get("backbone", {}).get("arch", "resnet") != "resnet":
    raise NotExportable(
      f"{run.path}: export to torchvision/Detectron2 supports ResNet backbones only (this is a VGG16)."
    )
  stem = run.config.method.get("backbone", {}).get("stem", "imagenet")
  if stem != "imagenet":
    # torchvision's and Detectron2's ResNets build the 7x7 stride-2 stem and max-pool in code: a 3x3 stem's weights
    # would load under conv1's name only to fail on its shape, or (strict=False) be silently dropped.
    raise NotExportable(
      f"{run.path}: the backbone uses stem={stem!r} (a 3x3 convolution, no max-pool), which neither torchvision's "
      "nor Detectron2's ResNet has; only stem='imagenet' backbones (every paper recipe) export. Inspect it with "
      "vlrep.evaluate or load its checkpoint in JAX instead."
    )
  _, variables = _by_design(runs.backbone_of, run)
  sd = torchvision_state_dict(variables["params"], variables.get("batch_stats"), _imported_counters(run))
  root = _root_of(out)
  safe_files.make_dirs(root)
  if fmt == "torchvision" and out.endswith(".safetensors"):
    from safetensors.numpy import save_file

    with safe_files.atomic_path(out, ".safetensors", root=root) as tmp:
      save_file(dict(sd), tmp, metadata={"format": "pt", "source": run.path})
  elif fmt == "torchvision":
    torch = _torch("Writing .pth needs PyTorch; install torch or export to .safetensors instead.")
    with safe_files.atomic_path(out, ".pth", root=root) as tmp:
      torch.save(OrderedDict((k, torch.from_numpy(np.array(v))) for k, v in sd.items()), tmp)
  else:
    sd = detectron2_state_dict(sd)
    with safe_files.open_atomic(out, "wb", root=root) as f:
      pickle.dump({"model": dict(sd), "__author__": f"vlrep ({run.path})", "matching_heuristics": True}, f)
  params = sum(
    int(np.prod(v.shape))
    for k, v in sd.items()
    if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))
  )
  logging.info("Wrote %d tensors (%d parameters) of step %d to %s.", len(sd), params, run.step, out)
  return {"keys": len(sd), "parameters": params, "step": run.step}


def _torch(why: str):
  try:
    import torch
  except ImportError as e:
    raise NotExportable(f"{why} (import torch failed: {e})") from e
  return torch


def _export_virtex(run, out: str) -> dict:
  torch = _torch("--format=virtex writes a torch checkpoint: install torch.")
  sd, official = _by_design(virtex_format.state_dict, run)
  root = _root_of(out)
  safe_files.make_dirs(root)
  model = OrderedDict((k, torch.from_numpy(np.array(v))) for k, v in sd.items())
  with safe_files.atomic_path(out, ".pth", root=root) as tmp:
    torch.save({"model": model, "iteration": int(run.step)}, tmp)
  params = sum(
    int(np.prod(v.shape))
    for k, v in sd.items()
    if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))
  )
  logging.info("Wrote %d tensors of step %d to %s; official config: %s", len(sd), run.step, out, official)
  return {"keys": len(sd), "parameters": params, "step": run.step, "official_config": official}


def without_code_hooks(run) -> tuple[Any, list[str]]:
  """The run with the code hooks (CODE_HOOKS) of its saved Hugging Face config.json fields (an imported run's
  `import.hf_config`, which the visual_bert export writes back) removed, and the names removed."""
  note = run.meta.get("import", {})
  fields = note.get("hf_config", {}) if isinstance(note, dict) else {}
  hooks = sorted(k for k in fields if k in CODE_HOOKS) if isinstance(fields, dict) else []
  if not hooks:
    return run, []
  kept = {k: v for k, v in fields.items() if k not in CODE_HOOKS}
  return dataclasses.replace(run, meta={**run.meta, "import": {**note, "hf_config": kept}}), hooks


def _export_visual_bert(run, out: str, overwrite: bool) -> dict:
  folder = os.path.abspath(os.path.expanduser(out)).rstrip(os.sep)
  if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
    raise OutExists(
      f"--out={out} already exists and is not empty; pass --overwrite to replace it, or choose another folder."
    )
  if os.path.lexists(folder) and not os.path.isdir(folder) or os.path.islink(folder):
    raise NotExportable(f"--out={out} is a file or a link; --format=visual_bert writes a folder.")
  safe_files.make_dirs(_root_of(folder))
  run, hooks = without_code_hooks(run)
  info = _by_design(visual_bert_format.write_folder, run, out, overwrite)
  written = os.path.join(folder, "config.json")
  with open(written, encoding="utf-8") as f:  # the file just written: no code hook reached it
    left = sorted(CODE_HOOKS & set(json.load(f)))
  if left:
    raise RuntimeError(f"{written} was written with code hooks {left}; vlrep's export must never write them.")
  if hooks:
    info["notes"] = [
      *info.get("notes", []),
      f"not written: {hooks} (code hooks: transformers would import Python from the folder; an export carries none)",
    ]
  logging.info("Wrote %d tensors of step %d to %s (%s).", info["keys"], run.step, out, ", ".join(info["files"]))
  return info


def define_flags():
  """Command-line flags (defined only when run as a command, so importing the module defines none)."""
  flags.DEFINE_string("workdir", None, "The training run's directory.")
  flags.DEFINE_enum(
    "format",
    "torchvision",
    FORMATS,
    "torchvision (safetensors or .pth), detectron2 (.pkl), virtex (.pth) or visual_bert (a Hugging Face folder).",
  )
  flags.DEFINE_string("out", None, "Output file (visual_bert: output folder).")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  flags.DEFINE_bool("overwrite", False, "visual_bert: replace an existing non-empty --out folder.")


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
