"""Errors a user can fix: a dataset not prepared, a field the data lacks, a bad config value. `vlrep.main` prints
their message and exits with status 2, without a Python traceback; every other exception is an internal error
and keeps its traceback. A leaf module: any layer may raise them."""

from __future__ import annotations

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
