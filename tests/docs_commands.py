"""The `python -m vlrep...` commands the documentation shows, collected from the files themselves: README.md,
docs/**/*.md, configs/** (the configs' docstrings and READMEs), launch/*.sh and the module docstrings of vlrep/
(the usage lines of the tools and benchmarks). tests/test_docs_commands.py runs each one in its smallest real
form, from the table there, so a command is covered the day it is documented.
"""

from __future__ import annotations

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMMAND = re.compile(r"python3? -m vlrep[\w.]*(?:[ \t]+[^\s`#|;&)][^\s`|;&]*)*")


def _texts(root: str):
  """(relative path, documentation text) of every file whose text shows commands."""
  for pattern in ("README.md", "docs/**/*.md", "configs/**/*.md", "launch/*.sh", "launch/*.sbatch"):
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
      with open(path, encoding="utf-8") as f:
        yield os.path.relpath(path, root), f.read()
  for pattern in ("configs/**/*.py", "vlrep/**/*.py"):
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
      with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read()), clean=False)
      if doc:
        yield os.path.relpath(path, root), doc


def commands_in(text: str) -> list[str]:
  """The commands in a text: continuation lines joined, trailing comments dropped, whitespace collapsed."""
  text = re.sub(r"\\\n\s*", " ", text)
  out = []
  for line in text.splitlines():
    for m in _COMMAND.finditer(line):
      out.append(" ".join(m.group(0).split()).replace("python3 -m", "python -m"))
  return out


def documented_commands(root: str = ROOT) -> dict[str, list[str]]:
  """{command: [files showing it]}."""
  found: dict[str, list[str]] = {}
  for path, text in _texts(root):
    for command in commands_in(text):
      found.setdefault(command, [])
      if path not in found[command]:
        found[command].append(path)
  return found
