"""Runs one vlrep command's `__main__` (as `python -m MODULE ARGS` runs it: its own flags, its own `app.run` wrapper)
over many argument lists in one process, so that a test can try dozens of crafted files on a command for the cost of
one jax import: `python -m bad_files_driver MODULE CASES.json RESULTS.json`.

CASES.json: {case name: [arg, ...]}. RESULTS.json: {case name: {"rc": exit status, "stderr": what it printed}};
an exception that escapes the command is what `python -m` prints for it: a traceback and status 1. The module is
executed afresh for each case (runpy, under the name '__main__'), and the flags it defined are removed after it.
"""

import contextlib
import importlib
import io
import json
import runpy
import sys
import traceback
import warnings

# runpy's note that the module was imported before (the driver imports it once, on purpose).
warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)


def run_case(module: str, args: list[str]) -> dict:
  from absl import app, flags, logging  # noqa: F401 (their flags are defined once, before `before`)

  importlib.import_module(module)  # its imports (and the flags they define) once; its own flags per case
  before = set(flags.FLAGS)
  err = io.StringIO()
  sys.argv = [module, *args]
  try:
    with contextlib.redirect_stderr(err):
      runpy.run_module(module, run_name="__main__", alter_sys=False)
    rc = 0
  except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, (int, type(None))):
      err.write(f"{e.code}\n")
  except BaseException:  # noqa: BLE001 -- what `python -m` does with an uncaught exception
    err.write(traceback.format_exc())
    rc = 1
  finally:
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
  return {"rc": rc, "stderr": err.getvalue()}


def main():
  module, cases_path, results_path = sys.argv[1:4]
  with open(cases_path) as f:
    cases = json.load(f)
  results = {name: run_case(module, args) for name, args in cases.items()}
  with open(results_path, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
