"""Preprocessing strings as data: `name(args)|name|...` split and parsed into (name, args, kwargs) without
building any op. A leaf without TensorFlow, so tools that only read a recipe's shapes (the step benchmark on a GPU
machine without TF) can use it."""

from __future__ import annotations

import ast


def _split_ops(pp: str) -> list[str]:
  """The `|`-separated op specs of `pp`; a `|` inside a quoted argument (a user's path) does not split."""
  specs, current, quote = [], [], ""
  for ch in pp:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "|":
      specs.append("".join(current))
      current = []
      continue
    current.append(ch)
  specs.append("".join(current))
  return [s.strip() for s in specs if s.strip()]


def op_specs(pp: str) -> list[str]:
  """The op specs of `pp` as written (`name(args)`), in order: what `op_calls` parses."""
  return _split_ops(pp)


def op_calls(pp: str) -> list[tuple[str, tuple, dict]]:
  """`[(name, args, kwargs), ...]` of a preprocessing string, its literal arguments evaluated; builds nothing."""
  calls = []
  for spec in _split_ops(pp):
    try:
      call = ast.parse(spec if "(" in spec else spec + "()", mode="eval").body
      ok = isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
    except SyntaxError:
      ok = False
    if not ok:
      raise ValueError(f"Cannot parse preprocessing op {spec!r}; expected name or name(literal args).")
    try:
      args = tuple(ast.literal_eval(a) for a in call.args)
      kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except ValueError as e:
      raise ValueError(f"Preprocessing op {spec!r}: arguments must be Python literals ({e}).") from None
    calls.append((call.func.id, args, kwargs))
  return calls
