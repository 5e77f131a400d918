"""vlrep: visual representations learned from text annotations, in JAX/Flax.

`vlrep.load(path)` opens a trained run or a shared folder as a model to use from Python (`vlrep.inference`). It is
looked up on first use (PEP 562), so that `import vlrep.data` or the PyTorch wing (`vlrep.pytorch`, no JAX) load
nothing else: this file imports no module.
"""

import importlib

__all__ = ["load"]


def __getattr__(name: str):
  if name == "load":
    return importlib.import_module("vlrep.inference").load
  raise AttributeError(f"module 'vlrep' has no attribute {name!r}")
