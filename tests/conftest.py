import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

import pytest  # noqa: E402


def pytest_sessionstart(session):
  """Generates the tiny dataset once, under a file lock: with pytest-xdist (`-n 2`) the workers start together
  and would otherwise race to write the same TFDS directory."""
  from filelock import FileLock

  data_dir = os.environ["VLREP_TEST_DATA_DIR"]
  os.makedirs(data_dir, exist_ok=True)
  with FileLock(os.path.join(data_dir, ".generate.lock")):
    from vlrep.data import pipeline

    pipeline.get_builder("synthetic_scenes", data_dir, "tiny")


def load_tiny_config(arg=None):
  import tiny_virtex

  return tiny_virtex.get_config(arg)


@pytest.fixture(scope="session")
def tiny_builder():
  from vlrep.data import pipeline

  return pipeline.get_builder("synthetic_scenes", os.environ["VLREP_TEST_DATA_DIR"], "tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_builder):
  from vlrep.data import tokenizers

  return tokenizers.ensure_tokenizer(load_tiny_config().tokenizer, tiny_builder)


def run_main(workdir, *overrides, env=None, config="tests/tiny_virtex.py", timeout=600):
  """Runs `python -m vlrep.main` in a subprocess; returns CompletedProcess."""
  import subprocess

  cmd = [sys.executable, "-m", "vlrep.main", f"--config={config}", f"--workdir={workdir}", *overrides]
  full_env = {**os.environ, **(env or {})}
  return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
