"""How config files load: by path, from any working directory, their imports at the top."""

import ast
import glob
import importlib.util
import os
import sys

from conftest import ROOT, TESTS

CONFIGS = os.path.join(ROOT, "configs")


def test_a_config_loads_by_path_from_any_working_directory(tmp_path, monkeypatch):
  """config_flags (and vlrep.tools.sweep) load a config file by path; run from another directory, with vlrep
  installed (its package alone), neither the repository nor configs/ is on sys.path: each config file finds
  configs/common.py from its own location."""
  monkeypatch.chdir(tmp_path)
  away = {os.path.realpath(p) for p in (ROOT, CONFIGS, TESTS)}
  monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.realpath(p or ".") not in away])
  for name in ("virtex", "eval/voc07_svm"):
    spec = importlib.util.spec_from_file_location(f"test_configs_{name}", os.path.join(CONFIGS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_config("runlocal").evals, name
    assert os.path.realpath(module.common.__file__) == os.path.realpath(os.path.join(CONFIGS, "common.py")), name
  assert "common" not in sys.modules  # found by path, not through sys.path


def test_config_files_import_at_the_top():
  paths = glob.glob(os.path.join(CONFIGS, "**", "*.py"), recursive=True) + glob.glob(os.path.join(TESTS, "tiny_*.py"))
  local = []
  for path in sorted(paths):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
      local += [
        f"{os.path.relpath(path, ROOT)}:{n.lineno}" for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)
      ]
  assert len(paths) > 15 and local == []
