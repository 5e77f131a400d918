"""Errors a user can fix: a dataset not prepared, a field the data lacks, a bad config value. `vlrep.main` prints
their message and exits with status 2, without a Python traceback; every other exception is an internal error
and keeps its traceback. A leaf module: any layer may raise them."""

from __future__ import annotations

import contextlib
import functools
import sys


class UserError(ValueError):
  """Something the user's data, files or config must change; the message says what and how."""


def exit_2_on_user_error(main):
  """An absl `main` whose UserErrors end the program as `vlrep.main`'s do: 'ERROR: message' on stderr and exit
  status 2, no traceback (a refused checkpoint file, a run folder that is not one, ...)."""

  @functools.wraps(main)
  def wrapped(argv):
    try:
      return main(argv)
    except UserError as e:
      print(f"ERROR: {e}", file=sys.stderr, flush=True)
      sys.exit(2)

  return wrapped


class DatasetNotPrepared(UserError, FileNotFoundError):
  """A real dataset that `vlrep.data.prepare` has not prepared in the data directory."""


class MissingField(UserError):
  """The dataset lacks an annotation the configured method needs (e.g. LocTex's mouse traces)."""


class BadFile(UserError):
  """A file vlrep was given (a checkpoint, a run folder's file, a dataset file, a vocabulary) that is not what it
  should be: truncated, malformed, crafted, or too large for what it claims to hold."""


# What reading a malformed file raises from the libraries that parse it (zipfile, json, pickle, safetensors,
# sentencepiece, PIL, numpy): each is a property of the file, not of vlrep, inside a `reading` block.
_MALFORMED = (
  ValueError,
  OSError,
  EOFError,
  KeyError,
  IndexError,
  TypeError,
  AttributeError,
  LookupError,
  RecursionError,
  OverflowError,
  MemoryError,
  NotImplementedError,
  RuntimeError,
  ArithmeticError,
  UnicodeError,
  AssertionError,
)


@contextlib.contextmanager
def reading(path, what: str = "file", hint: str = ""):
  """Turns any error raised while reading the foreign file `path` into one BadFile message naming the file, what it
  should have been, what was wrong and (`hint`) what to do; UserErrors (already worded) pass unchanged."""
  try:
    yield
  except UserError:
    raise
  except _MALFORMED as e:
    # Some libraries raise errors that are not Exception subclasses of these (safetensors' SafetensorError is an
    # Exception); those are caught by name below.
    raise BadFile(_bad_file_message(path, what, e, hint)) from e
  except Exception as e:
    if type(e).__name__ in ("SafetensorError", "BadZipFile", "UnpicklingError", "DecompressionBombError", "error"):
      raise BadFile(_bad_file_message(path, what, e, hint)) from e
    raise


def _bad_file_message(path, what, e, hint) -> str:
  detail = str(e).splitlines()[0][:300] if str(e) else ""
  kind = type(e).__name__
  text = f"{path}: cannot be read as a {what} ({kind}{': ' + detail if detail else ''})."
  if isinstance(e, RecursionError):
    text = f"{path}: cannot be read as a {what}: it nests deeper than vlrep reads (RecursionError)."
  elif isinstance(e, MemoryError):
    text = f"{path}: cannot be read as a {what}: it asks for more memory than this machine has (MemoryError)."
  return text + (" " + hint if hint else " Check that it is the file you meant, whole and from a trusted source.")
