"""A run's working directory: restoring its checkpoints without the training data (`load_run`) and its frozen
backbone (`backbone_of`, `backbone_fn`: BatchNorm in inference mode, float32, as every transfer evaluation uses);
its flat metrics file, summary.json, is `vlrep.run_summary`'s. Shared by the loop, `vlrep.evaluate`, export, the
tools and the notebook; it imports only the models, sharding and the methods' lookup (a shared folder's method is
checked at load), so any of them can import it.

A run folder may come from someone else, so the config a checkpoint saved is data (`saved_config`): the names in it
that vlrep looks code or data up by (the method, the evaluator types, the datasets) must be plain names, which
resolve only among vlrep's own modules and datasets; a dotted module path is refused (`python -m` puts the working
directory on sys.path, so a run folder shipping `payload.py` beside a saved `method.name="run.payload"` would run
it). A run you trained with a method or evaluator of your own (a dotted path in your own config) is read once you
name its modules in the environment: VLREP_OWN_MODULES=my_pkg.method,my_pkg.evaluator. And the paths a saved
config holds are only read: a run loaded from a folder never builds a missing tokenizer or concept set
(`build_if_missing` is turned off), so nothing is written where a file says.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from ml_collections import ConfigDict

from vlrep import methods, safe_files, sharding, torch_files
from vlrep.errors import BadFile, UserError, reading
from vlrep.models import backbones, resnet, vgg, vit


class NotARun(UserError, FileNotFoundError):
  """The folder named as a run is missing, or holds no checkpoint (of the step asked for)."""


class NoCheckpointRestores(BadFile, RuntimeError):
  """Every checkpoint of a run failed to restore (each failure is listed): damaged or crafted files."""


@dataclasses.dataclass
class Run:
  """A restored checkpoint: its training config, parameters and model state (numpy), step and where."""

  config: ConfigDict
  params: dict
  model_state: dict
  step: int
  path: str
  meta: dict

  @property
  def variables(self) -> dict:
    return {"params": self.params, **self.model_state}

  @property
  def workdir(self) -> str:
    """The run's folder (`path` is WORKDIR/checkpoints/<step> or WORKDIR/best/<step>; a shared folder, export
    --format=vlrep, is its own, `meta['folder']`)."""
    return self.meta.get("folder") or os.path.dirname(os.path.dirname(self.path))


def load_run(workdir: str, checkpoint: str = "best") -> Run:
  """Restores WORKDIR's 'best' or 'latest' checkpoint, or the one of a given step (as a string of digits).

  'best' falls back to 'latest' when the run kept no best checkpoint (no evaluator had a best metric) or when
  its best checkpoint does not restore (damaged files); 'latest' falls back to the newest step that restores.
  Each fallback is logged with the error that caused it; a step asked for by number never falls back.
  A shared folder (`vlrep.interop.export --format=vlrep`: config.json and model.safetensors, no checkpoints) holds
  one model, read by `load_shared_folder`.
  """
  workdir, dirs = _run_dirs(workdir)
  if not any(os.path.isdir(d) for d in dirs.values()) and all(
    os.path.lexists(os.path.join(workdir, name)) for name in (FOLDER_CONFIG, FOLDER_WEIGHTS)
  ):
    if checkpoint not in ("best", "latest"):
      raise NotARun(f"{workdir} is a shared vlrep folder: one model, no checkpoint {checkpoint!r}.")
    return load_shared_folder(workdir)
  if checkpoint.isdigit():
    step = int(checkpoint)
    directory = next((d for d in dirs.values() if step in _steps_in(d)), None)
    if directory is None:
      available = sorted(set(_steps_in(dirs["best"]) + _steps_in(dirs["latest"])))
      raise NotARun(f"{workdir} has no checkpoint of step {step}; available steps: {available}")
    return _restore_run(directory, step)
  if checkpoint not in dirs:
    raise ValueError(f"--checkpoint must be 'best', 'latest' or a step number, got {checkpoint!r}.")
  failures = []
  for directory, step in _candidates(workdir, dirs, checkpoint):
    try:
      run = _restore_run(directory, step)
    except ForeignName:
      raise  # a crafted config, not a damaged checkpoint: an older one is no answer
    except Exception as e:  # noqa: BLE001 -- a damaged checkpoint: the next candidate, said in the log
      path, why = os.path.join(directory, str(step)), f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
      failures.append(f"{path}: {why}")
      logging.warning("Checkpoint %s does not restore (%s); trying the next one.", path, why)
      continue
    return run
  raise NoCheckpointRestores(f"No checkpoint of {workdir} restores:\n  " + "\n  ".join(failures))


def read_config(workdir: str, resuming: bool = False, checkpoint: str = "best") -> ConfigDict:
  """The training config a run saved with its newest checkpoint (best or latest; `checkpoint='latest'`: the
  periodic ones only, what a resumed run continues), read without restoring any weights: cheap enough for a config
  file to resolve what it inherits from another run. Backbone keys this version of vlrep does not know are
  dropped, said in the log (without_unknown_keys).

  The config is checked as `saved_config` checks it, except when `resuming`: the training loop continuing its own
  workdir builds everything from the user's command-line config and only compares the saved one with it, so a
  run trained with a method of the user's own (a dotted `method.name`) resumes as before."""
  workdir, dirs = _run_dirs(workdir)
  failures = []
  for directory, step in _candidates(workdir, dirs, checkpoint):
    try:
      meta = _restore_meta(directory, step)
    except Exception as e:  # noqa: BLE001 -- a damaged checkpoint's metadata: the next candidate
      failures.append(f"{os.path.join(directory, str(step))}: {type(e).__name__}: {str(e)[:200]}")
      continue
    if resuming:  # compared with the user's config (unknown_keys says what it has that the user's has not)
      return ConfigDict(meta["config"])
    return saved_config(meta.get("config"), _meta_path(directory, step))
  raise NoCheckpointRestores(f"No checkpoint of {workdir} has a readable config:\n  " + "\n  ".join(failures))


def _run_dirs(workdir):
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isdir(workdir):
    raise NotARun(f"No run directory {workdir}.")
  return workdir, {"best": os.path.join(workdir, "best"), "latest": os.path.join(workdir, "checkpoints")}


def _steps_in(d):
  return sorted(int(s) for s in os.listdir(d) if s.isdigit()) if os.path.isdir(d) else []


def _candidates(workdir, dirs, checkpoint):
  """(directory, step) to try, newest first: the best checkpoints (for 'best'), then the latest ones."""
  candidates = [(dirs["best"], s) for s in _steps_in(dirs["best"])[::-1]] if checkpoint == "best" else []
  candidates += [(dirs["latest"], s) for s in _steps_in(dirs["latest"])[::-1]]
  if not candidates:
    raise NotARun(f"{workdir} has no checkpoint (looked in {dirs[checkpoint]}). Train with vlrep.main first.")
  return candidates


def _restore_meta(directory: str, step: int) -> dict:
  mngr = ocp.CheckpointManager(directory)
  try:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  finally:
    mngr.close()


def _meta_path(directory: str, step: int) -> str:
  """The file that holds a checkpoint's saved config (orbax's JSON item `meta`), for messages."""
  return os.path.join(directory, str(step), "meta", "metadata")


# Where a saved config names code or data that vlrep looks up by name: each must be a plain name.
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")  # vlrep.methods.<name>, vlrep.evaluators.<type>
_DATASET_NAME = re.compile(r"[A-Za-z0-9_]+\Z")  # a builder of vlrep/data/builders/ or a TFDS dataset
_CONFIG_NAME = re.compile(r"[A-Za-z0-9_.\-]*\Z")  # a builder config ('tiny', '2017'): no '/' or ':' (TFDS namespaces)
OWN_MODULES_ENV = "VLREP_OWN_MODULES"


class ForeignName(BadFile):
  """A run's saved config names a module outside vlrep (or a dataset by other than a plain name)."""


def _own_modules() -> set[str]:
  """The dotted modules the user allows a saved config to name (VLREP_OWN_MODULES, comma-separated): set in the
  user's own environment, never by a file."""
  return {m.strip() for m in os.environ.get(OWN_MODULES_ENV, "").split(",") if m.strip()}


def check_saved_names(config: dict, where: str) -> None:
  """Refuses (ForeignName, naming `where` and the entry) a saved config whose method or evaluator types are not
  plain module names (unless the user named them in VLREP_OWN_MODULES), or whose datasets are not plain names."""
  if not isinstance(config, dict):
    raise BadFile(f"{where}: the run's saved config is not a config (a {type(config).__name__}).")
  section = lambda value: value if isinstance(value, dict) else {}
  modules = [("method.name", section(config.get("method")).get("name"))]
  datasets = [("data.name", section(config.get("data")).get("name"), section(config.get("data")).get("config_name"))]
  for name, entry in section(config.get("evals")).items():
    entry = section(entry)
    modules.append((f"evals.{name}.type", entry.get("type")))
    if entry.get("dataset"):
      datasets.append((f"evals.{name}.dataset", entry.get("dataset"), entry.get("config_name")))
  own = _own_modules()
  for key, value in modules:
    if value is None or (isinstance(value, str) and (_MODULE_NAME.match(value) or value in own)):
      continue
    raise ForeignName(
      f"{where}: this run's saved config has {key}={value!r}, which is not the plain name of one of vlrep's own "
      "modules. A run folder's files are data: vlrep looks the methods and evaluators they name up only among its "
      "own modules and never imports a module path a file names (it could be code shipped with the run). If you "
      f"trained this run yourself with a module of your own, allow it: {OWN_MODULES_ENV}={value}"
    )
  for key, value, config_name in datasets:
    section_key = key.rsplit(".", 1)[0]
    for k, v, pattern in ((key, value, _DATASET_NAME), (f"{section_key}.config_name", config_name, _CONFIG_NAME)):
      if v is not None and not (isinstance(v, str) and pattern.match(v)):
        raise ForeignName(
          f"{where}: this run's saved config has {k}={v!r}, which is not a plain dataset name (letters, digits "
          "and '_'; no ':' or '/', which would reach a dataset namespace outside this machine's prepared data)."
        )


def saved_config(config: dict, where: str) -> ConfigDict:
  """The training config a run saved (in checkpoint metadata `where`), as data: its names checked
  (`check_saved_names`), backbone keys this version does not know dropped (without_unknown_keys), and every path
  in it read only (a missing tokenizer or concept set is an error, never built where the file says)."""
  check_saved_names(config, where)
  out = ConfigDict(without_unknown_keys(config, where))
  for section in ("tokenizer", "concepts"):
    if isinstance(out.get(section), ConfigDict):
      out[section].build_if_missing = False
  return out


# The config sections a network is built from by keyword (`resnet.from_config(section)`, VGG16 for arch='vgg16'):
# the only places where a key this version of vlrep does not know would fail, instead of being read by nothing.
BACKBONE_SECTIONS = ("method.backbone", "method.visual.backbone")


def backbone_keys() -> frozenset[str]:
  """The keys a backbone section may hold: its networks' own arguments (ResNet's, VGG16's, ViT's) and `arch`."""
  return backbones.all_fields()


_SAID: set[tuple[str, tuple[str, ...]]] = set()


def without_unknown_keys(config: dict, where: str) -> dict:
  """A run's saved config without the keys of its backbone sections that none of this version's networks takes
  (an earlier version's option that this one has no code for), said once in one warning naming them: the network
  is built from the keys it knows. The weights must still fit it: a restore that does not fit is refused by the
  checkpoint's signature check. A key elsewhere that nothing reads (an optimizer option, say) is ignored as it is:
  nothing reads it; a resumed run names those too (unknown_keys)."""
  out, dropped, known = dict(config), [], backbone_keys()
  for dotted in BACKBONE_SECTIONS:
    *parents, leaf = dotted.split(".")
    node = out
    for key in parents:
      if not isinstance(node.get(key), dict):
        break
      node[key] = dict(node[key])  # copied on the way down: `config` itself is left as read
      node = node[key]
    else:
      if isinstance(node.get(leaf), dict):
        unknown = sorted(k for k in node[leaf] if k not in known)
        node[leaf] = {k: v for k, v in node[leaf].items() if k in known}
        dropped += [f"{dotted}.{k}" for k in unknown]
  run_folder = re.split(r"[/\\](?:checkpoints|best)[/\\]\d+[/\\]", where)[0]
  if dropped and (run_folder, tuple(dropped)) not in _SAID:  # once per run, however often its config is read
    _SAID.add((run_folder, tuple(dropped)))
    logging.warning(
      "%s: this run's saved config has keys this version of vlrep does not know: %s; they are ignored.",
      where,
      ", ".join(dropped),
    )
  return out


def unknown_keys(saved: dict, config: dict, prefix: str = "") -> list[str]:
  """The dotted keys of a run's `saved` config that `config` (the one it is resumed with) does not have: options
  of an earlier version, which the resumed run ignores. In a backbone section, the keys none of this version's
  networks takes (an architecture key init_from adopted is known, though the user's config may not set it). Not
  under `evals`: which evaluations a command runs is its own choice (`--config.evals={}` drops them all)."""
  if prefix.rstrip(".") in BACKBONE_SECTIONS:
    return [f"{prefix}{key}" for key in saved if key not in backbone_keys()]
  out = []
  for key, value in saved.items():
    full = f"{prefix}{key}"
    if full == "evals":
      continue
    if key not in config:
      out.append(full)
    elif isinstance(value, dict) and isinstance(config[key], dict):
      out += unknown_keys(value, config[key], full + ".")
  return out


def _restore_run(directory: str, step: int) -> Run:
  meta = _restore_meta(directory, step)
  config = saved_config(meta.get("config"), _meta_path(directory, step))
  # Onto this process's first device, whatever device count and sharding wrote the checkpoint. Read through the
  # step's manager, as it was written: a standalone checkpointer pointed at the `state` item folder looks there
  # for the step's _CHECKPOINT_METADATA, which lives one level up, and logs "Metadata file does not exist" on
  # every load.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  mngr = ocp.CheckpointManager(
    directory, item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  )
  try:
    abstract = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), mngr.item_metadata(step)["state"]
    )
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
  finally:
    mngr.close()
  to_np = lambda tree: {k: to_np(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}
  return Run(
    config=config,
    params=to_np(state["params"]),
    model_state=to_np(state.get("model_state", {})),
    step=step,
    path=os.path.join(directory, str(step)),
    meta=meta,
  )


def backbone_of(run: Run) -> tuple[Any, dict]:
  """(backbone module in float32 for inference, its variables) of a run; a clear error when the checkpoint has no
  backbone."""
  if "backbone" not in run.params:
    raise ValueError(
      f"The checkpoint {run.path} has no visual backbone (top-level parameters: {sorted(run.params)}); "
      "transfer evaluation and export need a model with a 'backbone' network."
    )
  cfg = dict(run.config.method.get("backbone", {}))
  arch = backbones.arch_of(cfg)
  if arch == "vgg16":
    module = vgg.VGG16(**{k: cfg[k] for k in ("width",) if k in cfg})  # an omitted width: VGG16's own default
  elif arch in ("vit", "modified_resnet"):
    module = backbones.from_config(backbone_architecture(cfg))  # float32; BatchNorm groups do not apply in eval
  else:
    module = resnet.ResNet(**resnet_kwargs(cfg))
  variables = {"params": run.params["backbone"]}
  stats = run.model_state.get("batch_stats", {}).get("backbone")
  if stats is not None:
    variables["batch_stats"] = stats
  return module, variables


# The keys of a `method.backbone` section that fix its architecture (what its weights' shapes and its function
# depend on), with the value an omitted key means: the networks' own defaults (one place). BatchNorm grouping,
# dropout and remat are training choices, not architecture.
_RESNET_DEFAULTS = {f.name: f.default for f in dataclasses.fields(resnet.ResNet)}
BACKBONE_ARCHITECTURE = {
  "arch": "resnet",
  **{k: _RESNET_DEFAULTS[k] for k in ("depth", "width", "inner_multiplier", "stem", "stem_stride")},
}
_VIT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(vit.ViT)}
VIT_ARCHITECTURE = {
  "arch": "vit",
  **{
    k: _VIT_DEFAULTS[k]
    for k in (
      "width",
      "depth",
      "mlp_dim",
      "num_heads",
      "patch_size",
      "pool_type",
      "posemb",
      "pre_norm",
      "mlp_act",
      "ln_eps",
      "patch_bias",
    )
  },
}


# OpenAI's ModifiedResNet (CLIP's RN50 and kin, imported from open_clip): its stage sizes and stem width.
MODIFIED_RESNET_ARCHITECTURE = {"arch": "modified_resnet", "layers": (3, 4, 6, 3), "width": 64}


def backbone_architecture(cfg) -> dict:
  """The architecture of a backbone config section, every key of its arch's table (BACKBONE_ARCHITECTURE for a
  ResNet or VGG16, VIT_ARCHITECTURE for a ViT, MODIFIED_RESNET_ARCHITECTURE for CLIP's ResNets) filled in."""
  tables = {"vit": VIT_ARCHITECTURE, "modified_resnet": MODIFIED_RESNET_ARCHITECTURE}
  table = tables.get(cfg.get("arch", "resnet"), BACKBONE_ARCHITECTURE)
  return {k: cfg.get(k, default) for k, default in table.items()}


def resnet_kwargs(cfg) -> dict:
  """The keyword arguments of `resnet.ResNet` that rebuild a backbone config section (a run's `method.backbone`)
  for inference (no BN groups); the section's omitted keys take ResNet's defaults."""
  return {**{k: cfg.get(k, default) for k, default in BACKBONE_ARCHITECTURE.items() if k != "arch"}, "bn_group_size": 0}


def sharded_features(features, mesh):
  """THE feature extraction of every backbone evaluation (the training loop's and vlrep.evaluate's):
  `features(variables, images) -> {name: array}` jitted once, the batch sharded over the mesh's data axis.
  Returns extract(variables, local batch dict with 'image', name) -> (global features np, global batch np)."""
  batch_sharding = sharding.batch_sharding(mesh)

  def apply(variables, batch, key):
    return features(variables, batch["image"])[key], batch

  jitted = jax.jit(apply, static_argnums=2, out_shardings=sharding.replicated(mesh))

  def extract(variables, local_batch, key):
    f, b = jitted(variables, sharding.global_batch(local_batch, batch_sharding), key)
    return np.asarray(f), {k: np.asarray(v) for k, v in b.items()}

  return extract


def backbone_fn(run: Run, mesh=None):
  """features_fn(local batch, key) -> (global features np, global batch np) of a run's backbone, with key one of
  'pre_logits', 'grid', 'stage1'..'stage4'; what evaluators call."""
  module, variables = backbone_of(run)
  mesh = mesh or sharding.make_mesh()

  def features(v, images):
    grid, aux = module.apply(v, images, False)
    return {"grid": grid, **aux}

  extract = sharded_features(features, mesh)
  variables = jax.device_put(variables, sharding.replicated(mesh))
  return lambda local_batch, key: extract(variables, local_batch, key)


# ------------------------------------------------------------------------------------------------------------------
# A shared folder (`vlrep.interop.export --format=vlrep`): one model as flat files a model repository holds
# (what huggingface_hub's snapshot_download returns), data only: nothing in it is executed or unpickled, and only
# config.json, model.safetensors and the tokenizer file it names (a BPE vocabulary, or none: "tokenizer": null for a
# run without text, e.g. an imported torchvision classifier) are opened.
# ------------------------------------------------------------------------------------------------------------------
FOLDER_FORMAT = "vlrep"
FOLDER_FORMAT_VERSION = 1
FOLDER_CONFIG = "config.json"
FOLDER_WEIGHTS = "model.safetensors"
FOLDER_TOKENIZER = "tokenizer.model"
FOLDER_CARD = "README.md"
FOLDER_MAX_CONFIG_BYTES = 1 << 20  # a config of a few hundred values is a few KB
FOLDER_COLLECTIONS = ("params", "batch_stats")  # the variables' top-level names a folder may hold
_FOLDER_PLAIN_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")  # a file name in the folder: no '/', no leading '.'
FOLDER_SPECIAL_TOKENS = ("vlrep", "virtex")  # tokenizers.SPECIAL_TOKEN_LAYOUTS of a BPE vocabulary


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


def load_shared_folder(path: str) -> Run:
  """The shared folder at `path` (`vlrep.interop.export --format=vlrep`) as a Run: the config rebuilt through
  `saved_config`, the variables from model.safetensors, the tokenizer pointing at the folder's copy; any malformed
  or crafted file a BadFile naming it. `load_run` calls it for such a folder."""
  folder = os.path.abspath(os.path.expanduser(path)).rstrip(os.sep)
  if not os.path.isdir(folder):
    raise NotARun(f"No folder {path}.")
  config_path = _file_in(folder, FOLDER_CONFIG)
  with reading(config_path, what="vlrep folder config (JSON)"):
    if os.path.getsize(config_path) > FOLDER_MAX_CONFIG_BYTES:
      raise BadFile(f"{config_path}: larger than {FOLDER_MAX_CONFIG_BYTES >> 10} KB; a folder's config is a few KB.")
    with open(config_path, encoding="utf-8") as f:
      saved = json.load(f)
  if not isinstance(saved, dict) or saved.get("format") != FOLDER_FORMAT:
    raise BadFile(f'{config_path} is not a vlrep folder\'s config (no "format": "{FOLDER_FORMAT}").')
  check_data_only(saved, config_path)
  for section in ("method", "data"):
    if not isinstance(saved.get(section), dict):
      raise BadFile(f"{config_path}: {section!r} is not an object.")
  if not isinstance(saved.get("tokenizer", ()), (dict, type(None))):  # null: a run without a vocabulary
    raise BadFile(f"{config_path}: 'tokenizer' is neither an object nor null.")
  step = saved.get("step", 0)
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise BadFile(f"{config_path}: step {step!r} is not a non-negative integer.")
  image_size = saved["data"].get("image_size")
  if image_size is not None and (not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 1):
    raise BadFile(f"{config_path}: data.image_size {image_size!r} is not a positive integer or null.")
  run_config = {
    "method": saved["method"],
    "data": {k: saved["data"].get(k) for k in ("name", "config_name", "pp", "image_size")},
  }
  if saved["tokenizer"] is not None:
    # The path is the folder's own file, set here: never one a file names.
    run_config["tokenizer"] = _folder_tokenizer(folder, saved["tokenizer"], config_path)
  config = saved_config(run_config, config_path)
  if saved["tokenizer"] is None:
    _check_builds_without_tokenizer(config, config_path)
  variables = _variables(_file_in(folder, FOLDER_WEIGHTS))
  return Run(
    config=config,
    params=variables.pop("params", {}),
    model_state=variables,
    step=step,
    path=folder,
    meta={"config": config.to_dict(), "folder": folder},
  )


def _folder_tokenizer(folder: str, tok: dict, config_path: str) -> dict:
  """The run config's tokenizer section of the folder's vocabulary: its file checked against its SHA-256."""
  name = tok.get("file")
  if not (isinstance(name, str) and _FOLDER_PLAIN_FILE.match(name)) or tok.get("kind") != "bpe":
    raise BadFile(f"{config_path}: the tokenizer must be kind 'bpe' with a plain file name (or null), got {tok}.")
  if tok.get("special_tokens") not in FOLDER_SPECIAL_TOKENS:
    known = FOLDER_SPECIAL_TOKENS
    raise BadFile(f"{config_path}: tokenizer special_tokens {tok.get('special_tokens')!r}; known: {known}.")
  vocabulary = _file_in(folder, name)
  if safe_files.sha256_of(vocabulary) != tok.get("sha256"):
    raise BadFile(f"{vocabulary}: its SHA-256 is not the one {config_path} records; the folder is damaged.")
  return {"kind": "bpe", "special_tokens": tok["special_tokens"], "path": vocabulary}


def _check_builds_without_tokenizer(config: ConfigDict, config_path: str) -> None:
  """A folder without a vocabulary ("tokenizer": null) holds a method that reads no text: built as every run's
  method is without a tokenizer (`methods.build`, vocabulary size 0), it reads no token field. Otherwise the folder
  is refused here, not with an error deep inside the method the first time it is used."""
  name = config.method.get("name")
  try:
    fields = tuple(methods.build(config.method, 0).fields)
  except Exception as e:  # noqa: BLE001 -- a method's own check of its config (any type): the folder is refused
    why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    raise BadFile(f'{config_path} says "tokenizer": null, but method {name!r} does not build without one: {why}') from e
  text = [f for f in fields if f.startswith("tokens")]
  if text:
    raise BadFile(
      f'{config_path} says "tokenizer": null, but method {name!r} reads text ({", ".join(text)}) and needs its '
      "vocabulary; the folder is incomplete (export the run again with its tokenizer)."
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
    if len(parts) < 2 or parts[0] not in FOLDER_COLLECTIONS or not all(p and p not in (".", "..") for p in parts):
      raise BadFile(f"{path}: tensor {name[:100]!r} is not a variable name ({' or '.join(FOLDER_COLLECTIONS)}/...).")
  flat = torch_files.load_safetensors(path)
  return unflatten({k: np.array(v) for k, v in flat.items()})


def unflatten(flat: dict[str, Any]) -> dict:
  """{'a/b/c': x} -> {'a': {'b': {'c': x}}}."""
  out: dict = {}
  for path, v in flat.items():
    node = out
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out
