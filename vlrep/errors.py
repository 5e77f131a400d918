"""Errors a user can fix: a dataset not prepared, a field the data lacks, a bad config value. `vlrep.main` prints
their message and exits with status 2, without a Python traceback; every other exception is an internal error
and keeps its traceback. A leaf module: any layer may raise them."""

from __future__ import annotations


class UserError(ValueError):
  """Something the user's data, files or config must change; the message says what and how."""


class DatasetNotPrepared(UserError, FileNotFoundError):
  """A real dataset that `vlrep.data.prepare` has not prepared in the data directory."""


class MissingField(UserError):
  """The dataset lacks an annotation the configured method needs (e.g. LocTex's mouse traces)."""
