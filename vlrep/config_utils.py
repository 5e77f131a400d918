"""Helpers for config files (big_vision style `get_config(arg)`)."""

from __future__ import annotations

import importlib.util
import os

import ml_collections


def sibling_config(this_file: str, name: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """get_config(arg) of the config file `name`.py beside `this_file`: one recipe built on another's (e.g. the
  supervised reference on virtex.py:runlocal), without configs/ being an importable package."""
  path = os.path.join(os.path.dirname(os.path.abspath(this_file)), f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"vlrep_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


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
