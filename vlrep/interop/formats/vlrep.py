"""vlrep's own shareable folder (export, and `read_folder` to load it back as a run): flat files a model repository
holds as they are, so a folder downloaded with huggingface_hub's `snapshot_download` loads as it is.

  python -m vlrep.interop.export --workdir=/tmp/vlrep_virtex_local --format=vlrep --out=/tmp/vlrep_virtex_shared

  FOLDER/config.json        data only: the run's method section (its backbone architecture included), the data's
                            plain name and its preprocessing, the tokenizer's kind, special tokens, file and SHA-256
  FOLDER/model.safetensors  every parameter and model-state leaf ("params/...", "batch_stats/..."), stored dtypes
  FOLDER/tokenizer.model    the run's vocabulary, copied
  FOLDER/README.md          a model card: method, backbone, data, steps, the run's summary.json metrics

The folder is data from someone else once shared: `read_folder` executes and unpickles nothing, opens only the three
files config.json names (a `.py` or a pickle beside them is never opened), checks the config's names as a run's
saved config is checked (`runs.saved_config`), refuses any file or folder path in it, checks the safetensors
header before reading a tensor, and refuses a file that is a link leading outside the folder (a link into the
Hugging Face cache's `blobs/` beside `snapshots/`, what `snapshot_download` makes, is the one link followed).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from vlrep import errors, run_summary, runs, safe_files, torch_files
from vlrep.data import pipeline, tokenizers
from vlrep.errors import BadFile
from vlrep.interop import keymaps

DESCRIPTION = "vlrep's shareable folder: config.json + model.safetensors + tokenizer.model + README.md"
OUT_SUFFIXES = ()  # a folder

FORMAT = "vlrep"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"
CARD_FILE = "README.md"
MAX_CONFIG_BYTES = 1 << 20  # a config of a few hundred values is a few KB
COLLECTIONS = ("params", "batch_stats")  # the variables' top-level names a folder may hold
_PLAIN_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")  # a file name in the folder: no '/', no leading '.'
_SPECIAL_TOKENS = ("vlrep", "virtex")  # tokenizers.SPECIAL_TOKEN_LAYOUTS of a BPE vocabulary


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
  vocabulary = keymaps.refusal(tokenizer_file, run)
  flat = {k: np.ascontiguousarray(v) for k, v in keymaps.flatten(run.variables).items()}
  safe_files.make_dirs(keymaps.out_root(folder))
  with safe_files.atomic_dir(folder) as tmp:
    save_file(flat, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "np"})
    with safe_files.open_atomic(os.path.join(tmp, TOKENIZER_FILE), "wb", root=tmp) as f, open(vocabulary, "rb") as v:
      shutil.copyfileobj(v, f)
    config["tokenizer"]["sha256"] = safe_files.sha256_of(os.path.join(tmp, TOKENIZER_FILE))
    safe_files.write_text(os.path.join(tmp, CONFIG_FILE), json.dumps(config, indent=2) + "\n", root=tmp)
    safe_files.write_text(os.path.join(tmp, CARD_FILE), model_card(run, config), root=tmp)
  parameters = sum(int(v.size) for k, v in flat.items() if k.startswith("params/"))
  return {"keys": len(flat), "parameters": parameters, "step": run.step, "files": sorted(os.listdir(folder))}


def folder_config(run: runs.Run) -> dict:
  """config.json's contents (without the tokenizer's SHA-256): data only, its names checked plain, no paths."""
  c = run.config
  tokenizer = c.get("tokenizer") or ConfigDict()
  kind = tokenizer.get("kind", "bpe")
  special = tokenizer.get("special_tokens", "vlrep")
  if kind != "bpe" or special not in _SPECIAL_TOKENS:
    raise ValueError(
      f"The run's tokenizer is kind={kind!r}, special_tokens={special!r}; --format=vlrep holds a BPE vocabulary "
      f"(special tokens {', '.join(_SPECIAL_TOKENS)})."
    )
  data = c.get("data") or ConfigDict()
  config = {
    "format": FORMAT,
    "format_version": FORMAT_VERSION,
    "step": int(run.step),
    "method": c.method.to_dict(),
    "architecture": runs.backbone_architecture(c.method.get("backbone", {})) if "backbone" in c.method else None,
    "data": {"name": data.get("name"), "config_name": data.get("config_name"), "pp": data.get("pp", "")},
    "tokenizer": {"kind": kind, "special_tokens": special, "file": TOKENIZER_FILE},
  }
  check_data_only(config, "the run's config")
  runs.check_saved_names(config, f"{run.path}: the run's config")
  return config


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
  summary = run_summary.read_summary(run.workdir)
  numbers = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
  metrics = [f"| {k} | {v} |" for k, v in sorted(numbers.items())]
  lines = [
    f"# vlrep {method.get('name')} model",
    "",
    f"A {method.get('name')} model (task: {method.get('task', '-')}) trained with vlrep for {run.step} steps on "
    f"{data['name']} ({data['config_name']}).",
    "",
    f"Backbone: {json.dumps(config['architecture'], sort_keys=True)}.",
    f"Preprocessing: `{data['pp']}`.",
    "",
    "## Metrics",
    "",
    "The run's own summary.json, measured by its evaluations during training (`python -m vlrep.main`) or later by "
    "`python -m vlrep.evaluate --workdir=RUN`:",
    "",
  ]
  lines += ["| metric | value |", "| --- | --- |", *metrics] if metrics else ["(none recorded)"]
  lines += [
    "",
    "## Loading",
    "",
    "```python",
    "from vlrep.interop.formats import vlrep as folder",
    "run = folder.read_folder('FOLDER')  # a vlrep.runs.Run: features, captions, evaluation",
    "```",
    "",
    "Files: config.json (data only), model.safetensors (every variable, 'params/...', 'batch_stats/...'), "
    "tokenizer.model (its SHA-256 in config.json).",
    "",
  ]
  return "\n".join(lines)


def check_data_only(config, where: str, key: str = "") -> None:
  """Refuses (BadFile) a string anywhere in `config` that is a file or folder path ('/', '\\' or a leading '~'):
  the folder's config is data, never a place to read or write."""
  if isinstance(config, dict):
    for k, v in config.items():
      check_data_only(v, where, f"{key}.{k}" if key else str(k))
  elif isinstance(config, (list, tuple)):
    for i, v in enumerate(config):
      check_data_only(v, where, f"{key}[{i}]")
  elif isinstance(config, str) and ("/" in config or "\\" in config or config.startswith("~")):
    raise BadFile(f"{where} has {key}={config[:200]!r}, a path; a shared folder's config.json holds data only.")


# ------------------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------------------
def read_folder(path: str) -> runs.Run:
  """The folder at `path` as a `runs.Run` (config rebuilt through `runs.saved_config`, variables from
  model.safetensors, the tokenizer pointing at the copied file); any malformed or crafted file a BadFile naming it."""
  folder = os.path.abspath(os.path.expanduser(path)).rstrip(os.sep)
  if not os.path.isdir(folder):
    raise runs.NotARun(f"No folder {path}.")
  config_path = _file_in(folder, CONFIG_FILE)
  with errors.reading(config_path, what="vlrep folder config (JSON)"):
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
      raise BadFile(f"{config_path}: larger than {MAX_CONFIG_BYTES >> 10} KB; a folder's config is a few KB.")
    with open(config_path, encoding="utf-8") as f:
      saved = json.load(f)
  if not isinstance(saved, dict) or saved.get("format") != FORMAT:
    raise BadFile(f'{config_path} is not a vlrep folder\'s config (no "format": "{FORMAT}").')
  check_data_only(saved, config_path)
  for section in ("method", "data", "tokenizer"):
    if not isinstance(saved.get(section), dict):
      raise BadFile(f"{config_path}: {section!r} is not an object.")
  tok = saved["tokenizer"]
  name = tok.get("file")
  if not (isinstance(name, str) and _PLAIN_FILE.match(name)) or tok.get("kind") != "bpe":
    raise BadFile(f"{config_path}: the tokenizer must be kind 'bpe' with a plain file name, got {tok}.")
  if tok.get("special_tokens") not in _SPECIAL_TOKENS:
    raise BadFile(f"{config_path}: tokenizer special_tokens {tok.get('special_tokens')!r}; known: {_SPECIAL_TOKENS}.")
  vocabulary = _file_in(folder, name)
  if safe_files.sha256_of(vocabulary) != tok.get("sha256"):
    raise BadFile(f"{vocabulary}: its SHA-256 is not the one {config_path} records; the folder is damaged.")
  step = saved.get("step", 0)
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise BadFile(f"{config_path}: step {step!r} is not a non-negative integer.")
  config = runs.saved_config(
    {
      "method": saved["method"],
      "data": {k: saved["data"].get(k) for k in ("name", "config_name", "pp")},
      # The path is the folder's own file, set here: never one a file names.
      "tokenizer": {"kind": "bpe", "special_tokens": tok["special_tokens"], "path": vocabulary},
    },
    config_path,
  )
  variables = _variables(_file_in(folder, WEIGHTS_FILE))
  return runs.Run(
    config=config,
    params=variables.pop("params", {}),
    model_state=variables,
    step=step,
    path=folder,
    meta={"config": config.to_dict(), "folder": folder},
  )


def _file_in(folder: str, name: str) -> str:
  """FOLDER/name, a regular file inside the folder (a link only into the Hugging Face cache's blobs/)."""
  path = os.path.join(folder, name)
  if not os.path.lexists(path):
    raise BadFile(f"{folder} is not a vlrep folder: it has no {name}.")
  real = os.path.realpath(path)
  allowed = [os.path.realpath(folder)]
  if os.path.basename(os.path.dirname(folder)) == "snapshots":  # huggingface_hub's cache: snapshots/<rev>/ -> blobs/
    allowed.append(os.path.realpath(os.path.join(folder, "..", "..", "blobs")))
  if not any(os.path.dirname(real) == root for root in allowed) or not os.path.isfile(real):
    raise BadFile(f"{path} leads to {real}, outside the folder (or not a file); a shared folder's files are its own.")
  return path


def _variables(path: str) -> dict:
  """model.safetensors as {'params': tree, 'batch_stats': tree, ...}, its header checked before any tensor is read."""
  tensors, _, _ = torch_files.safetensors_header(path)
  for name in tensors:
    parts = name.split("/")
    if len(parts) < 2 or parts[0] not in COLLECTIONS or not all(p for p in parts):
      raise BadFile(f"{path}: tensor {name[:100]!r} is not a variable name ({' or '.join(COLLECTIONS)}/...).")
  flat = torch_files.load_safetensors(path)
  return keymaps.unflatten({k: np.array(v) for k, v in flat.items()})
