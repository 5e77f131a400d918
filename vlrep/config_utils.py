"""Helpers for config files (big_vision style `get_config(arg)`)."""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from vlrep.data import op_strings


def config_module(this_file: str, relative_path: str):
  """The Python file at `relative_path` from `this_file`'s folder, loaded as a module: how a config file reaches
  another (configs/common.py, a recipe built on another), since configs/ is no package and config files are loaded
  by path from any working directory."""
  path = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(this_file)), relative_path))
  name = os.path.splitext(os.path.relpath(path, os.path.dirname(os.path.dirname(path))))[0]
  spec = importlib.util.spec_from_file_location("vlrep_config_" + name.replace(os.sep, "_"), path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def sibling_config(this_file: str, name: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """get_config(arg) of the config file `name`.py beside `this_file`: one recipe built on another's (e.g. the
  supervised reference on virtex.py:runlocal)."""
  return config_module(this_file, f"{name}.py").get_config(arg)


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'runlocal,task=captioning,hidden=1024' against typed defaults; unknown names are errors.

  A bare name sets a boolean to True. Values are converted to the default's type.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    name, _, value = item.partition("=")
    if name not in defaults:
      raise ValueError(f"Unknown config argument {name!r}; known: {', '.join(sorted(defaults))}")
    default = defaults[name]
    if not _:
      if not isinstance(default, bool):
        raise ValueError(f"Config argument {name!r} needs a value ({name}=...).")
      out[name] = True
    elif isinstance(default, bool):
      out[name] = value.lower() in ("1", "true", "yes")
    else:
      out[name] = type(default)(value)
  return out


# The held-out share of a user's own data (`data=DIR`) when a config is not told otherwise (`val=P`).
OWN_DATA_VAL_PERCENT = 5.0


def use_own_data(
  c: ml_collections.ConfigDict,
  data_dir: str,
  val_percent: float,
  requires: dict,
  held_out_evals: tuple[str, ...] = (),
  drop_evals: tuple[str, ...] = (),
  *,
  image_size: int,
) -> None:
  """Points config `c` (a recipe or runlocal) at the user's own `image_text` dataset, prepared in `data_dir` with
  `python -m vlrep.data.prepare --dataset=image_text`: training reads `train[P%:]`, and the evaluators named in
  `held_out_evals` (those that read the method's own kind of data: captioning, retrieval, masked tokens, ...)
  read the held-out first P% instead (`train[:P%]`; one that trains, VSE++, trains on `train[P%:]`), so
  validation never sees a training image. The tokenizer and concept sets are built from the training part.
  Every other evaluator stays as it is (the transfer probes on VOC07 or synthetic_scenes' labelled probe splits);
  `drop_evals` names those that need annotations own data cannot have (LocTex's ground-truth object masks).
  `requires` {field: what needs it}: checked before training (`pipeline.check_required_fields`).

  Your photos have any size and any number of captions: the training and held-out preprocessing get a fixed size
  (`fixed_size_pp`, `image_size` the config's resolution) where they have none, and the held-out evaluators that
  group captions by image read every caption of each image (`num_captions` 0)."""
  if not 0 < val_percent < 100:
    raise ValueError(f"val={val_percent:g}: the held-out share of your data must be a percentage in (0, 100).")
  train, held = f"train[{val_percent:g}%:]", f"train[:{val_percent:g}%]"
  c.data.update(name="image_text", config_name="", data_dir=data_dir, split=train, requires=dict(requires))
  c.data.pp = fixed_size_pp(c.data.pp, image_size)
  if c.get("tokenizer") and "corpus_split" in c.tokenizer:
    c.tokenizer.update(path="", corpus_split=train)
  if c.get("concepts"):
    c.concepts.corpus_split = train
  for name in drop_evals:
    if name in c.get("evals", {}):
      del c.evals[name]
  for name in held_out_evals:
    if name not in c.get("evals", {}):
      continue
    e = c.evals[name]
    e.update(dataset="image_text", config_name="", data_dir=data_dir, pp=fixed_size_pp(e.pp, image_size))
    if "num_captions" in e:  # every caption of each image (the evaluator pads them), not COCO's first 5
      e.num_captions = 0
      e.pp = _without_fixed_captions(e.pp, e.get("captions_key", "captions"))
    if "fold_size" in e:
      e.fold_size = 0  # rank against the whole held-out part (COCO's 1K folds assume 5K test images)
    for key in list(e.keys()):
      if key == "train_split":
        e[key] = train  # an evaluator that trains (VSE++) trains on your training part
      elif key == "split" or key.endswith("_split"):
        e[key] = held


# Ops after which every image of a pipeline has the same size: without one, only images of one size batch.
SIZE_FIXING_OPS = ("inception_crop", "resize", "central_crop")


def fixed_size_pp(pp: str, image_size: int) -> str:
  """`pp` as it is when an op in it fixes the image size (a recipe's random or central crop), else with
  `resize_small(S)|central_crop(S)` after each `decode`: the shorter side to S, then the centre S x S (runlocal
  preprocessing has no crop: a random one cuts named objects out of the picture, so the captions would be wrong).
  Both ops move the companions a crop moves (LocTex's traces, object maps) with the image."""
  calls = op_strings.op_calls(pp)
  if any(name in SIZE_FIXING_OPS for name, _, _ in calls):
    return pp
  specs = []
  for spec, (name, _, kwargs) in zip(op_strings.op_specs(pp), calls, strict=True):
    specs.append(spec)
    if name == "decode":
      key = f", key={kwargs['key']!r}" if "key" in kwargs else ""
      specs += [f"resize_small({image_size}{key})", f"central_crop({image_size}{key})"]
  return "|".join(specs)


def _without_fixed_captions(pp: str, key: str) -> str:
  """`pp` without its `fixed_captions` ops on `key`: the first N captions, which an evaluator reading every caption
  of each image must not cut to N."""
  calls = op_strings.op_calls(pp)
  keep = [
    spec
    for spec, (name, _, kwargs) in zip(op_strings.op_specs(pp), calls, strict=True)
    if not (name == "fixed_captions" and kwargs.get("key", "captions") == key)
  ]
  return "|".join(keep)
