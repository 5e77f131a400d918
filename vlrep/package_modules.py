"""Lookup by module convention: which modules of a package define a given name (a method package's `Method`, an
evaluator package's `Evaluator`, the methods with an `embed`), found by reading their source, not importing it, so
listing what exists (an unknown name's error) costs no imports; and the one way a user's own module named by a dotted
path is imported. A leaf: imports only vlrep.errors."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import threading

from vlrep.errors import UserError

# CPython 3.11 can fail `ast.parse` run from several threads at once ("SystemError: AST constructor recursion depth
# mismatch", seen when vlrep.bench.benchmark --compile_threads built variants together): one parse at a time.
_PARSE_LOCK = threading.Lock()


def _parse(path: str) -> ast.Module:
  with open(path, encoding="utf-8") as f:
    source = f.read()
  with _PARSE_LOCK:
    return ast.parse(source, path)


def binds(path: str, name: str) -> bool:
  """Whether the Python file at `path` binds `name` at its top level (a class or an assignment), read, not run."""
  tree = _parse(path)
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name == name:
      return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      return True
  return False


def defines_function(path: str, name: str) -> bool:
  """Whether the Python file at `path` defines a function or method `name` anywhere (e.g. a Method class's
  optional `embed`), read, not run."""
  tree = _parse(path)
  return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def modules_defining(package_dir: str, name: str, anywhere: bool = False) -> tuple[str, ...]:
  """The sorted names of the modules directly in `package_dir` that bind `name` at their top level (or, with
  `anywhere`, define a function or method of that name)."""
  found = defines_function if anywhere else binds
  return tuple(
    sorted(
      m.name
      for m in pkgutil.iter_modules([package_dir])
      if not m.ispkg and found(os.path.join(package_dir, f"{m.name}.py"), name)
    )
  )


def import_own(name: str, what: str):
  """The user's own module `name` (a dotted path in their config); one that is not on the Python path is the
  user's to fix (a module it imports that is missing stays the module's own error)."""
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name and (name == e.name or name.startswith(e.name + ".")):
      raise UserError(f"{what}={name!r}: no module {e.name!r} on the Python path (PYTHONPATH).") from e
    raise
