"""The one lookup of a name in a config or on a command line: big_vision's convention, module vlrep.<kind>.<name>.

A kind is a package below vlrep ("methods", "evaluators", "interop.formats", "data.builders", ...) whose entries
are its plain modules: a method, an evaluator type, a file format, a dataset's builder. A module of such a package
that is not an entry (a helper the entries share) is named with a leading underscore, so `available` lists only
entries. Listing reads the package's folder (pkgutil), importing nothing; `get` imports one module, and import is
thread-safe, so both may run from many threads at once.

A user's own module, outside vlrep, is named by its dotted path (`own`). A leaf: imports only vlrep.errors.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from vlrep.errors import UserError


def _package(kind: str) -> ModuleType:
  """The package vlrep.<kind> (a programming error, not the user's, when it does not exist)."""
  if not isinstance(kind, str) or not all(part.isidentifier() for part in kind.split(".")):
    raise ValueError(f"kind={kind!r} is not a dotted package name below vlrep")
  return importlib.import_module(f"vlrep.{kind}")


def available(kind: str) -> tuple[str, ...]:
  """The sorted names of the entries of vlrep.<kind>: its modules (not subpackages) not named with a leading '_'."""
  package = _package(kind)
  return tuple(sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.ispkg and m.name[0] != "_"))


def get(kind: str, name: str, what: str) -> ModuleType:
  """The module vlrep.<kind>.<name>; `what` names the thing in errors (e.g. "method", "evaluator type"). A name
  that is not one of `available(kind)` is the user's to fix: the error lists the known ones."""
  if not (isinstance(name, str) and name.isidentifier() and name in available(kind)):
    raise UserError(f"Unknown {what} {name!r}. Known: {', '.join(available(kind))}")
  return importlib.import_module(f"vlrep.{kind}.{name}")


def own(name: str, what: str) -> ModuleType:
  """The user's own module `name` (a dotted path in their config; `what` names the setting in errors, e.g.
  "method.name"). One that is not on the Python path is the user's to fix; a module it imports that is missing stays
  the module's own error."""
  if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
    raise UserError(f"{what}={name!r} is not a module's dotted path.")
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name and (name == e.name or name.startswith(e.name + ".")):
      raise UserError(f"{what}={name!r}: no module {e.name!r} on the Python path (PYTHONPATH).") from e
    raise
