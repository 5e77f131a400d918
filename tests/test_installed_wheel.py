"""A non-editable install works outside the checkout: the package never reads the repository's files (configs/,
tests/) by path. The wheel is built from the checkout's sources, installed without its dependencies (they come from
this environment's site-packages: nothing is downloaded) into a fresh venv outside the checkout, and from a folder
outside it an import, an export and `vlrep.main --help` run, each with the venv's copy of vlrep (not the editable
checkout's, which this environment also has: proven by `vlrep.__file__`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torchvision
from conftest import ROOT
from safetensors.torch import load_file


def _clean_env(home) -> dict:
  """This environment without what would point Python at the checkout (PYTHONPATH) or at the tests' settings."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLREP_"))}
  env.update(HOME=str(home), PYTHONNOUSERSITE="1", TF_CPP_MIN_LOG_LEVEL="2")
  return env


def _run(args, cwd, env, status=0, timeout=300) -> str:
  done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
  assert done.returncode == status, f"{args} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(the venv's python, a working folder outside the checkout, the environment to run it in)."""
  tmp = tmp_path_factory.mktemp("wheel")
  # The checkout's sources (setup.py and the package), copied so the build writes nothing into the checkout.
  src = tmp / "src"
  shutil.copytree(os.path.join(ROOT, "vlrep"), src / "vlrep", ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(os.path.join(ROOT, "setup.py"), src / "setup.py")
  wheels = tmp / "wheels"
  _run(
    [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
    tmp,
    os.environ,
  )
  (wheel,) = wheels.glob("vlrep-*.whl")
  venv = tmp / "venv"
  _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], tmp, os.environ)
  python = str(venv / "bin" / "python")
  env = _clean_env(tmp / "home")
  # The system's pip, run by the venv's interpreter, installs into the venv.
  _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp, env)
  work = tmp / "work"
  work.mkdir()
  return python, work, env, venv


def test_the_installed_wheel_imports_and_exports_outside_the_checkout(installed):
  python, work, env, venv = installed
  where = _run([python, "-c", "import vlrep; print(vlrep.__file__)"], work, env).strip()
  assert where.startswith(str(venv)) and not where.startswith(ROOT), where
  torch.manual_seed(0)
  original = torchvision.models.resnet18().state_dict()
  torch.save(original, work / "resnet18.pth")
  out = _run(
    [python, "-m", "vlrep.interop.import_run", "--format=torchvision", "--checkpoint=resnet18.pth", "--workdir=r18"],
    work,
    env,
  )
  assert "Imported resnet18.pth (torchvision)" in out
  out = _run(
    [python, "-m", "vlrep.interop.export", "--workdir=r18", "--format=torchvision", "--out=r18.safetensors"],
    work,
    env,
  )
  assert "Exported step 0: 120 tensors" in out  # resnet18's 122 but fc's two (its 20 BatchNorm counters included)
  exported = load_file(str(work / "r18.safetensors"))  # import -> export is the identity, tensor for tensor
  assert sorted(exported) == sorted(k for k in original if not k.startswith("fc."))
  assert all(torch.equal(exported[k], original[k]) for k in exported)
  # absl's --help prints the usage and exits with status 1 (absl.app.HelpFlag), whatever the program.
  out = _run([python, "-m", "vlrep.main", "--help"], work, env, status=1)
  assert "--config" in out and "--workdir" in out and "Try --helpfull" in out
  # Nothing was written outside the working folder (no configs/ or tests/ looked up, nothing created beside them).
  assert sorted(os.listdir(work)) == ["r18", "r18.safetensors", "resnet18.pth"]
