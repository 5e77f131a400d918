r"""Exports a checkpoint's visual backbone (or a whole VirTex or VisualBERT model) for PyTorch users.

  python -m vlrep.export --workdir=DIR --format=torchvision --out=backbone.safetensors   # or backbone.pth
  python -m vlrep.export --workdir=DIR --format=detectron2 --out=backbone.pkl
  python -m vlrep.export --workdir=DIR --format=virtex --out=virtex.pth
  python -m vlrep.export --workdir=DIR --format=visual_bert --out=FOLDER

torchvision: a ResNet state_dict with torchvision's names (`conv1.weight`, `layer1.0.bn1.running_mean`,
`layer1.0.downsample.0.weight`, ...) and no `fc`; load it with
`torchvision.models.resnet50().load_state_dict(sd, strict=False)` (the missing keys are exactly fc.weight and
fc.bias). Written as safetensors (`.safetensors`, no pickle) or with torch.save (`.pth`, needs torch).

virtex: the whole VirTex model (backbone, visual projection, textual head) as the official kdexd/virtex code's
state dict, {"model": state_dict, "iteration": step} written with torch.save (`.pth`, needs torch): every key its
model has (load_state_dict strict=True), the attention key biases as zeros (vlrep has none: they cancel in softmax)
and the tied copies (output = embedding, the backward head's shared modules) written out. A run imported from an
official checkpoint (vlrep.import_run --format=virtex) gets its vocabulary rows back in the official order, so
import -> export is the identity. The official config values that build the model are printed (MODEL.TEXTUAL.NAME,
DATA.VOCAB_SIZE, the special token indices, ...).

visual_bert: a Hugging Face folder that `transformers.VisualBertForPreTraining.from_pretrained(FOLDER)` loads with no
missing or unexpected keys: config.json (VisualBertConfig: the run's BERT sizes, activation, LayerNorm eps and
visual_embedding_dim), model.safetensors (float32, `visual_bert.*` and `cls.*`, the tied MLM decoder written as
copies) and the run's WordPiece vocab.txt, by the key map the visual_bert importer reads
(vlrep/importers/visual_bert.py: `write_folder`). Exports a run whose model is VisualBERT's: an imported one
(vlrep.import_run --format=visual_bert; import -> export is the identity, bit for bit) or a configs/vlbert.py:
arch=visual_bert run trained with --config.method.region_boxes=False --config.method.region_norm=shared
--config.method.region_type_embedding=tables --config.method.text_pool=cls; any other run is refused, naming those
flags. Notes are printed: a run without a trained alignment head gets `cls.seq_relationship` as zeros, a run
whose regions' token type is 0 (MMF's) needs `visual_token_type_ids` of zeros, a task head is not written. The
folder is written beside --out and renamed into place; an existing non-empty --out needs --overwrite.

detectron2: the same weights renamed as Detectron2's ResNet (layerN -> res{N+1}, bnK -> convK.norm,
downsample.0/1 -> shortcut / shortcut.norm, stem keys under `stem.`), pickled as
{"model": {name: numpy array}, "__author__": ..., "matching_heuristics": True}; `MODEL.WEIGHTS=backbone.pkl`
in the configs of configs/detectron2/ loads it (Detectron2 adds its `backbone.bottom_up.` prefix itself).
"""

from __future__ import annotations

import os
import pickle
import re
from collections import OrderedDict

import numpy as np
from absl import app, flags, logging

from vlrep import runs
from vlrep.errors import exit_2_on_user_error
from vlrep.importers import torchvision as tv_importer
from vlrep.importers import virtex as virtex_format
from vlrep.importers import visual_bert as visual_bert_format

FORMATS = ("torchvision", "detectron2", "virtex", "visual_bert")


def torchvision_state_dict(
  backbone_params: dict, backbone_stats: dict | None, counters: dict | None = None
) -> OrderedDict:
  """Flax ResNet variables -> torchvision-named float32 numpy arrays (convs OIHW, BN weight/bias/running_*), by the
  key map `vlrep.importers.torchvision` imports with (import -> export is the identity). `counters`: BatchNorm
  `num_batches_tracked` values an imported run kept (0 otherwise)."""
  if backbone_stats is None:
    raise ValueError("The backbone has no BatchNorm statistics (batch_stats); it cannot be exported.")
  return OrderedDict(tv_importer.state_dict(backbone_params, backbone_stats, counters).items())


def _imported_counters(run) -> dict:
  """BatchNorm `num_batches_tracked` values an imported run kept (vlrep.import_run), under torchvision's names."""
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


def export(workdir: str, fmt: str, out: str, checkpoint: str = "best", overwrite: bool = False) -> dict:
  """Writes the backbone of WORKDIR's checkpoint to `out` (the whole model for virtex and visual_bert); returns
  {'keys', 'parameters', 'step'} (and what the format adds: 'official_config', 'notes'). `overwrite`: replace an
  existing non-empty --out folder (visual_bert; it is an error otherwise)."""
  if fmt not in FORMATS:
    raise ValueError(f"Unknown export format {fmt!r}; expected one of {FORMATS}.")
  run = runs.load_run(workdir, checkpoint)
  if fmt == "virtex":
    return _export_virtex(run, out)
  if fmt == "visual_bert":
    return _export_visual_bert(run, out, overwrite)
  if run.config.method.get("backbone", {}).get("arch", "resnet") != "resnet":
    raise ValueError(f"{run.path}: export to torchvision/Detectron2 supports ResNet backbones only (this is a VGG16).")
  stem = run.config.method.get("backbone", {}).get("stem", "imagenet")
  if stem != "imagenet":
    # torchvision's and Detectron2's ResNets build the 7x7 stride-2 stem and max-pool in code: a 3x3 stem's weights
    # would load under conv1's name only to fail on its shape, or (strict=False) be silently dropped.
    raise ValueError(
      f"{run.path}: the backbone uses stem={stem!r} (a 3x3 convolution, no max-pool), which neither torchvision's "
      "nor Detectron2's ResNet has; only stem='imagenet' backbones (every paper recipe) export. Inspect it with "
      "vlrep.evaluate or load its checkpoint in JAX instead."
    )
  _, variables = runs.backbone_of(run)
  sd = torchvision_state_dict(variables["params"], variables.get("batch_stats"), _imported_counters(run))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  tmp = out + ".tmp"
  if fmt == "torchvision":
    if out.endswith(".safetensors"):
      from safetensors.numpy import save_file

      save_file(dict(sd), tmp, metadata={"format": "pt", "source": run.path})
    elif out.endswith((".pth", ".pt")):
      try:
        import torch
      except ImportError as e:
        raise ImportError("Writing .pth needs PyTorch; install torch or export to .safetensors instead.") from e
      torch.save(OrderedDict((k, torch.from_numpy(np.array(v))) for k, v in sd.items()), tmp)
    else:
      raise ValueError(f"--out for torchvision must end in .safetensors or .pth, got {out!r}.")
  else:
    if not out.endswith(".pkl"):
      raise ValueError(f"--out for detectron2 must end in .pkl, got {out!r}.")
    sd = detectron2_state_dict(sd)
    with open(tmp, "wb") as f:
      pickle.dump({"model": dict(sd), "__author__": f"vlrep ({run.path})", "matching_heuristics": True}, f)
  os.replace(tmp, out)
  params = sum(
    int(np.prod(v.shape))
    for k, v in sd.items()
    if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))
  )
  logging.info("Wrote %d tensors (%d parameters) of step %d to %s.", len(sd), params, run.step, out)
  return {"keys": len(sd), "parameters": params, "step": run.step}


def _export_virtex(run, out: str) -> dict:
  if not out.endswith((".pth", ".pt")):
    raise ValueError(f"--out for virtex must end in .pth (the official code reads it with torch.load), got {out!r}.")
  try:
    import torch
  except ImportError as e:
    raise ImportError("--format=virtex writes a torch checkpoint: install torch.") from e
  sd, official = virtex_format.state_dict(run)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  tmp = out + ".tmp"
  model = OrderedDict((k, torch.from_numpy(np.array(v))) for k, v in sd.items())
  torch.save({"model": model, "iteration": int(run.step)}, tmp)
  os.replace(tmp, out)
  params = sum(
    int(np.prod(v.shape))
    for k, v in sd.items()
    if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))
  )
  logging.info("Wrote %d tensors of step %d to %s; official config: %s", len(sd), run.step, out, official)
  return {"keys": len(sd), "parameters": params, "step": run.step, "official_config": official}


def _export_visual_bert(run, out: str, overwrite: bool) -> dict:
  info = visual_bert_format.write_folder(run, out, overwrite)
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
