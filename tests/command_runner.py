"""Runs `python -m MODULE ARGS` commands fast: one server process imports the heavy libraries once (JAX,
TensorFlow, TFDS, Flax, Optax, Orbax, scikit-learn) and forks a fresh child per command, which runs MODULE as
`__main__` with the command's argv exactly as `python -m` would, without a new interpreter's seconds of imports
(most of the time of a command that refuses at once). No vlrep module is imported and no JAX backend is started
before the fork, so each child defines its own flags and reads XLA_FLAGS (e.g. a device count) when its backend
starts.

Protocol (JSON lines): stdin {"argv": [module, arg...], "log": path, "err": path or absent (then stderr goes to
`log` too), "env": {name: value} set in the child before it runs (PYTHONPATH's entries also go on sys.path, as an
interpreter's startup puts them), "timeout": seconds} -> stdout {"rc": int, "seconds": float}; rc 124 when the
command ran past its timeout (it is killed). `Runner` is the client.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(argv: list[str], log: str, err: str | None, env: dict[str, str]) -> None:
  os.environ.update(env)
  if env.get("PYTHONPATH"):
    sys.path[1:1] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
  fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(fd, 1)
  os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if err else fd, 2)
  os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
  sys.argv = list(argv)
  code = 0
  try:
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:  # noqa: BLE001 -- what `python -m` would print, then its exit status
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def serve() -> None:
  import absl.app  # noqa: F401
  import clu.metric_writers  # noqa: F401
  import flax.linen  # noqa: F401
  import jax  # noqa: F401
  import jax.numpy  # noqa: F401
  import ml_collections  # noqa: F401
  import optax  # noqa: F401
  import orbax.checkpoint  # noqa: F401
  import sklearn.svm  # noqa: F401
  import tensorflow  # noqa: F401
  import tensorflow_datasets  # noqa: F401

  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    request = json.loads(line)
    start = time.time()
    pid = os.fork()
    if pid == 0:
      _child(request["argv"], request["log"], request.get("err"), request.get("env", {}))
    deadline, rc = start + request.get("timeout", 300), None
    while rc is None:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        rc = os.waitstatus_to_exitcode(status)
      elif time.time() > deadline:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        rc = 124
      else:
        time.sleep(0.05)
    print(json.dumps({"rc": rc, "seconds": time.time() - start}), flush=True)


class Runner:
  """The client: starts the server under `env` (the environment every command inherits) and runs commands."""

  def __init__(self, env: dict):
    self.proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__)],
      cwd=ROOT,
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    assert json.loads(self.proc.stdout.readline()) == {"ready": True}

  def run(self, argv: list[str], log: str, timeout: int, err: str | None = None, env: dict | None = None):
    """Runs `python -m argv[0] argv[1:]` with stdout (and stderr, unless `err`) in `log`: (rc, seconds, log's text)."""
    request = {"argv": argv, "log": log, "err": err, "env": env or {}, "timeout": timeout}
    self.proc.stdin.write(json.dumps(request) + "\n")
    self.proc.stdin.flush()
    reply = json.loads(self.proc.stdout.readline())
    with open(log, errors="replace") as f:
      return reply["rc"], reply["seconds"], f.read()

  def close(self):
    self.proc.stdin.close()
    self.proc.wait(timeout=60)


if __name__ == "__main__":
  serve()
