"""vlrep's own shareable folder, written here and read back as a run by `vlrep.runs.load_run` (its
`load_shared_folder`): flat files a model repository holds as they are, so a folder downloaded with
huggingface_hub's `snapshot_download` loads as it is.

  python -m vlrep.interop.export --workdir=/tmp/vlrep_virtex_local --format=vlrep --out=/tmp/vlrep_virtex_shared

  FOLDER/config.json        data only: the run's method section (its backbone architecture included), the data's
                            plain name and its preprocessing, the tokenizer's kind, special tokens, file and SHA-256
                            ("tokenizer": null for a run without one: an imported torchvision model, a classifier)
  FOLDER/model.safetensors  every parameter and model-state leaf ("params/...", "batch_stats/..."), stored dtypes
  FOLDER/tokenizer.model    the run's BPE vocabulary, copied (none without a tokenizer)
  FOLDER/README.md          a model card: method, backbone, data, steps, the run's summary.json metrics

A WordPiece tokenizer (ICMLM, VisualBERT, CLIP with text=bert) is refused: its vocabulary is a BERT folder beside
the BERT weights the method names, which this folder does not carry; such a run is shared as its run folder.

The folder is data from someone else once shared: reading it executes and unpickles nothing, opens only the
files config.json names (a `.py` or a pickle beside them is never opened), checks the config's names as a run's
saved config is checked (`runs.saved_config`), refuses any file or folder path in it, checks the safetensors
header before reading a tensor, and refuses a file that is a link leading outside the folder (a link into the
Hugging Face cache's `blobs/` beside `snapshots/`, what `snapshot_download` makes, is the one link followed).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from vlrep import run_summary, runs, safe_files
from vlrep.data import pipeline, tokenizers
from vlrep.interop import keymaps

DESCRIPTION = "vlrep's shareable folder: config.json + model.safetensors (+ tokenizer.model, BPE) + README.md"
OUT_SUFFIXES = ()  # a folder


# ------------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------------
def export(run: runs.Run, out: str, overwrite: bool = False) -> dict:
  """Writes `run` as a shareable folder at `out` (built beside it and renamed into place when whole). An existing
  non-empty `out` needs `overwrite`. Returns {'keys', 'parameters', 'step', 'files'}."""
  folder = os.path.abspath(os.path.expanduser(out)).rstrip(os.sep)
  if os.path.lexists(folder) and not os.path.isdir(folder) or os.path.islink(folder):
    raise keymaps.NotExportable(f"--out={out} is a file or a link; --format=vlrep writes a folder.")
  if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
    raise keymaps.OutExists(
      f"--out={out} already exists and is not empty; pass --overwrite to replace it, or choose another folder."
    )
  config = keymaps.refusal(folder_config, run)
  vocabulary = keymaps.refusal(tokenizer_file, run) if config["tokenizer"] else None
  # np.ascontiguousarray makes a 0-d array 1-d (CLIP's logit_scale): the reshape keeps every variable's shape.
  flat = {k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in keymaps.flatten(run.variables).items()}
  safe_files.make_dirs(keymaps.out_root(folder))
  with safe_files.atomic_dir(folder) as tmp:
    save_file(flat, os.path.join(tmp, runs.FOLDER_WEIGHTS), metadata={"format": "np"})
    if vocabulary:
      copy = os.path.join(tmp, runs.FOLDER_TOKENIZER)
      with safe_files.open_atomic(copy, "wb", root=tmp) as f, open(vocabulary, "rb") as v:
        shutil.copyfileobj(v, f)
      config["tokenizer"]["sha256"] = safe_files.sha256_of(copy)
    safe_files.write_text(os.path.join(tmp, runs.FOLDER_CONFIG), json.dumps(config, indent=2) + "\n", root=tmp)
    safe_files.write_text(os.path.join(tmp, runs.FOLDER_CARD), model_card(run, config), root=tmp)
  parameters = sum(int(v.size) for k, v in flat.items() if k.startswith("params/"))
  return {"keys": len(flat), "parameters": parameters, "step": run.step, "files": sorted(os.listdir(folder))}


def folder_config(run: runs.Run) -> dict:
  """config.json's contents (without the tokenizer's SHA-256): data only, its names checked plain, no paths; the
  tokenizer null for a run without one."""
  c = run.config
  data = c.get("data") or ConfigDict()
  config = {
    "format": runs.FOLDER_FORMAT,
    "format_version": runs.FOLDER_FORMAT_VERSION,
    "step": int(run.step),
    "method": c.method.to_dict(),
    "architecture": runs.backbone_architecture(c.method.get("backbone", {})) if "backbone" in c.method else None,
    "data": {
      "name": data.get("name"),
      "config_name": data.get("config_name"),
      "pp": data.get("pp", ""),
      # The side of the training images (vlrep.load's default input size), known here beside the dataset's
      # definition; null when unknown.
      "image_size": pipeline.training_image_size(data),
    },
    "tokenizer": tokenizer_section(c.get("tokenizer")),
  }
  runs.check_data_only(config, "the run's config")
  runs.check_saved_names(config, f"{run.path}: the run's config")
  return config


def tokenizer_section(tokenizer) -> dict | None:
  """config.json's tokenizer: a BPE vocabulary's kind, special tokens and file, or None for a run without one."""
  if not tokenizer:
    return None
  kind, special = tokenizer.get("kind", "bpe"), tokenizer.get("special_tokens", "vlrep")
  if kind == "wordpiece":
    raise ValueError(
      "The run's tokenizer is WordPiece (tokenizer.kind='wordpiece': ICMLM, VisualBERT, CLIP with text=bert, MCT "
      "with a BERT text tower). Its vocabulary is a BERT folder's vocab.txt, read with the BERT weights the method "
      "names (method.bert_path), and --format=vlrep holds a BPE vocabulary or none: it cannot carry them. Share the "
      "run folder itself (its checkpoints, with the BERT folder its config names), or export the visual backbone "
      "alone (--format=backbone)."
    )
  if kind != "bpe" or special not in runs.FOLDER_SPECIAL_TOKENS:
    raise ValueError(
      f"The run's tokenizer is kind={kind!r}, special_tokens={special!r}; --format=vlrep holds a BPE vocabulary "
      f"(special tokens {' or '.join(runs.FOLDER_SPECIAL_TOKENS)}) or none. Share the run folder itself instead."
    )
  return {"kind": kind, "special_tokens": special, "file": runs.FOLDER_TOKENIZER}


def tokenizer_file(run: runs.Run) -> str:
  """The run's vocabulary file (its config's path, or the default one beside its dataset's files)."""
  c = run.config
  path = c.tokenizer.get("path", "")
  if not path:
    builder = pipeline.get_builder(c.data.name, c.data.get("data_dir"), c.data.get("config_name"), generate=False)
    path = tokenizers.default_path(c.tokenizer, builder)
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise ValueError(f"The run's vocabulary {path} is missing; the folder needs it (copy it there, then export).")
  return path


def model_card(run: runs.Run, config: dict) -> str:
  """README.md: what the folder holds, where it came from, the run's own metrics and how to load it."""
  method, data = config["method"], config["data"]
  lines = [
    f"# vlrep {method.get('name')} model",
    "",
    f"A {method.get('name')} model (task: {method.get('task', '-')}) trained with vlrep for {run.step} steps on "
    f"{data['name']} ({data['config_name']}).",
    "",
    f"Backbone: {json.dumps(config['architecture'], sort_keys=True)}.",
    f"Preprocessing: `{data['pp']}`; vlrep.load's input size {data.get('image_size') or 'unknown (224)'} px.",
    "",
    "## Metrics",
    "",
    *metrics_section(run),
    "",
    "## Loading",
    "",
    "```python",
    "import vlrep",
    'model = vlrep.load("FOLDER")          # or a hub download: vlrep.load(huggingface_hub.snapshot_download(REPO))',
    'model.encode_images(["photo.jpg"])    # pooled and grid backbone features',
    *(CARD_USES[use] for use in uses(method)),
    "```",
    "",
    "Files: config.json (data only), model.safetensors (every variable, 'params/...', 'batch_stats/...')"
    + (", tokenizer.model (its SHA-256 in config.json)." if config["tokenizer"] else "; no tokenizer (no text side)."),
    "",
  ]
  return "\n".join(lines)


def metrics_section(run: runs.Run) -> list[str]:
  """The card's metrics: the run's own summary.json, one table per evaluation with what measured it (the
  evaluator, its dataset and split from the run's config, and the command that measures it again), then training's."""
  summary = run_summary.read_summary(run.workdir)
  numbers = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
  if not numbers:
    return ["(none recorded)"]
  evals = run.config.get("evals") or {}
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  out = [
    "From the run's own summary.json: its evaluations during training (`python -m vlrep.main`) or later "
    "(`python -m vlrep.evaluate`).",
  ]
  if isinstance(summary.get("best_checkpoint_selected_on"), str):
    out += ["", f"These weights are the best checkpoint by {summary['best_checkpoint_selected_on']}."]
  groups: dict[str, list[str]] = {}
  for key in sorted(numbers):
    groups.setdefault(key.split("/", 1)[0] if "/" in key and key.split("/", 1)[0] in evals else "", []).append(key)
  for name in sorted(g for g in groups if g):
    entry = evals[name]
    kind = entry.get("type", name)
    where = " ".join(str(x) for x in (entry.get("dataset"), entry.get("config_name"), entry.get("split")) if x)
    command = (
      f" To measure it again or on other data: `python -m vlrep.evaluate --config=configs/eval/{kind}.py[:ARGS] "
      "--workdir=FOLDER` (that evaluator's config; its arguments choose the data)."
      if kind in EVAL_CONFIGS
      else ""
    )
    out += ["", f"`{name}`: the run's `evals.{name}`, the {kind} evaluator on {where or 'its data'}.{command}", ""]
    out += ["| metric | value |", "| --- | --- |", *(f"| {k} | {fmt(numbers[k])} |" for k in groups[name])]
  if groups.get(""):
    out += ["", "Training:", "", "| metric | value |", "| --- | --- |"]
    out += [f"| {k} | {fmt(numbers[k])} |" for k in groups[""]]
  return out


# The evaluators with a config file of their own in configs/eval/ (what `vlrep.evaluate --config=` takes).
EVAL_CONFIGS = (
  "captioning",
  "detection",
  "linear_probe",
  "localization",
  "retrieval",
  "tagging",
  "voc07_svm",
  "zero_shot",
)


# What `vlrep.load(FOLDER)` gives beyond image features (`vlrep.inference.TrainedModel`), one card line each.
CARD_USES = {
  "caption": 'model.caption(["photo.jpg"])          # a caption per image',
  "zero_shot": 'model.zero_shot(["photo.jpg"], ["cat", "dog", "boat"])  # class scores, top labels',
  "encode_text": 'model.encode_text(["a dog on a boat."])  # l2-normalised text embeddings',
}
# Which a method has, by its name (and VirTex's by its task: only a forward captioning head captions and scores a
# text given an image); a method not named here gives image features alone.
METHOD_USES = {
  "clip": ("zero_shot", "encode_text"),
  "loctex": ("zero_shot", "encode_text"),
  "mct": ("zero_shot", "encode_text"),
  ("virtex", "captioning"): ("caption", "zero_shot"),
  ("virtex", "bicaptioning"): ("caption", "zero_shot"),
  ("virtex", "cappa"): ("caption", "zero_shot"),
}


def uses(method: dict) -> tuple[str, ...]:
  """The keys of CARD_USES that the folder's method (config.json's "method") has."""
  name = method.get("name")
  return METHOD_USES.get((name, method.get("task")), METHOD_USES.get(name, ()))
