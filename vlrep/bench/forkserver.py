"""Starts `python -m MODULE ARGS` processes fast: a server process imports the heavy libraries once (JAX,
TensorFlow, TFDS, Flax, Optax, Orbax, scikit-learn: about 10 s of a fresh interpreter's start on a CPU) and forks a
child per process, which runs MODULE as `__main__` with its argv exactly as `python -m` would. No vlrep module is
imported and no JAX backend is started before the fork, so each child defines its own flags and reads XLA_FLAGS
(its device count) when its backend starts. JAX reads its JAX_* variables at import, in the server: start the
server with the environment its children need (`Server(env)`).

The fault harness (vlrep.bench.faults), the data-at-scale test (vlrep.bench.scale_test) and the tests launch their
processes here. A child is a process of its own: signals, resource limits, exit statuses (-9 after SIGKILL) and a
session of its own (so `os.killpg(child.pid, ...)` reaches what it started) are those of a `subprocess.Popen`
child; `Process` has the parts of Popen's interface they use.

Protocol (JSON lines): stdin {"id", "argv": [module, arg...], "stdout": path, "stderr": path or absent (then into
stdout's), both created by the client, "env": {name: value} set in the child before it runs (PYTHONPATH's entries
also go on sys.path, as an interpreter's startup puts them), "cwd"} -> stdout {"id", "pid"} once forked, {"id",
"rc"} once it ended.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

PIPE = subprocess.PIPE
HEAVY = (
  "absl.app",
  "clu.metric_writers",
  "flax.linen",
  "jax",
  "jax.numpy",
  "ml_collections",
  "optax",
  "orbax.checkpoint",
  "sklearn.svm",
  "tensorflow",
  "tensorflow_datasets",
)


def _child(request: dict) -> None:
  os.setsid()  # a session (and process group) of its own, as Popen(start_new_session=True)
  os.environ.update(request.get("env", {}))
  if request.get("env", {}).get("PYTHONPATH"):
    sys.path[1:1] = [p for p in request["env"]["PYTHONPATH"].split(os.pathsep) if p]
  if request.get("cwd"):
    os.chdir(request["cwd"])
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # never the server's requests
  # The client created (or truncated) the files before the request: they exist once `start` returns, as with Popen.
  out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)  # a FIFO (PIPE) ignores O_APPEND
  os.dup2(out, 1)
  os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_APPEND) if request.get("stderr") else out, 2)
  sys.argv = list(request["argv"])
  code = 0
  try:
    runpy.run_module(request["argv"][0], run_name="__main__", alter_sys=True)
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:  # noqa: BLE001 -- what `python -m` would print, then its exit status
    traceback.print_exc()
    code = 1
  # What the interpreter's exit does that matters, as `python -m` ends: non-daemon threads joined, then the atexit
  # handlers (jax.distributed's shutdown among them: without it the other processes of a run lose the coordination
  # service mid-shutdown and abort). Then out, without tearing down every module the server imported (seconds).
  threading._shutdown()
  atexit._run_exitfuncs()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def serve() -> None:
  for module in HEAVY:
    importlib.import_module(module)
  reply = sys.stdout
  print(json.dumps({"ready": True}), file=reply, flush=True)
  children: dict[int, str] = {}  # pid -> request id
  selector = selectors.DefaultSelector()
  selector.register(0, selectors.EVENT_READ)
  pending, open_input = b"", True
  while open_input or children:
    if open_input and selector.select(timeout=0.02):
      chunk = os.read(0, 1 << 16)  # raw reads: a buffered reader could hold a request the selector no longer sees
      open_input = bool(chunk)
      pending += chunk
      while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
          _child(request)
        children[pid] = request["id"]
        print(json.dumps({"id": request["id"], "pid": pid}), file=reply, flush=True)
    elif not open_input:
      time.sleep(0.02)
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if not pid:
        break
      rid = children.pop(pid, None)
      if rid is not None:
        print(json.dumps({"id": rid, "rc": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


class Process:
  """A child of the server, with the parts of subprocess.Popen's interface the harnesses use."""

  def __init__(self, server: Server, rid: str, pid: int, args: list[str], stdout=None):
    self._server, self._id, self.pid, self.args, self.stdout = server, rid, pid, args, stdout
    self.returncode: int | None = None

  def poll(self) -> int | None:
    if self.returncode is None:
      self.returncode = self._server._exit_code(self._id, 0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None:
      self.returncode = self._server._exit_code(self._id, timeout)
      if self.returncode is None:
        raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, sig: int) -> None:
    if self.returncode is None:
      try:
        os.kill(self.pid, sig)
      except ProcessLookupError:
        pass

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


class Server:
  """The client: starts the server under `env` (what JAX reads at import comes from it; default: this process's
  environment) and starts processes from it. Close it (or use it as a context manager) when done."""

  def __init__(self, env: dict | None = None, cwd: str | None = None):
    self._proc = subprocess.Popen(
      [sys.executable, "-m", "vlrep.bench.forkserver"],
      cwd=cwd,
      env=dict(os.environ if env is None else env),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    if json.loads(self._proc.stdout.readline() or "{}") != {"ready": True}:
      raise RuntimeError(f"The process server did not start (exit {self._proc.wait()}).")
    self._fifos = tempfile.mkdtemp(prefix="vlrep_forkserver_")
    self._lock = threading.Condition()
    self._pids: dict[str, int] = {}
    self._codes: dict[str, int] = {}
    self._count = 0
    self._closed = False  # the server's output ended (it exited)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self._proc.stdout:
      message = json.loads(line)
      with self._lock:
        if "pid" in message:
          self._pids[message["id"]] = message["pid"]
        else:
          self._codes[message["id"]] = message["rc"]
        self._lock.notify_all()
    with self._lock:
      self._closed = True
      self._lock.notify_all()

  def _exit_code(self, rid: str, timeout: float | None) -> int | None:
    with self._lock:
      self._lock.wait_for(lambda: rid in self._codes or self._closed, timeout)
      if rid not in self._codes and self._closed:
        raise RuntimeError(f"The process server ended (exit {self._proc.wait()}) before its child {rid} did.")
      return self._codes.get(rid)

  def start(self, argv, stdout=None, stderr=None, append=False, env=None, cwd=None) -> Process:
    """Starts `python -m argv[0] argv[1:]`. `stdout`: a file path, or PIPE (then `Process.stdout` reads its lines,
    stderr included); `stderr`: a path, or None (into stdout's). `env` is set on top of the server's."""
    with self._lock:
      self._count += 1
      rid = str(self._count)
    pipe = stdout is PIPE
    if pipe:
      stdout = os.path.join(self._fifos, rid)
      os.mkfifo(stdout)
    elif stdout is None:
      stdout = os.devnull
    files = [] if pipe or stdout == os.devnull else [stdout]
    for path in [*files, *([stderr] if stderr is not None else [])]:  # they exist once `start` returns, as with Popen
      open(path, "a" if append else "w").close()
    request = {"id": rid, "argv": list(argv), "stdout": os.fspath(stdout), "env": env or {}}
    if stderr is not None:
      request["stderr"] = os.fspath(stderr)
    if cwd is not None:
      request["cwd"] = os.fspath(cwd)
    with self._lock:
      self._proc.stdin.write(json.dumps(request) + "\n")
      self._proc.stdin.flush()
      self._lock.wait_for(lambda: rid in self._pids or self._closed)
      if rid not in self._pids:
        raise RuntimeError(f"The process server ended (exit {self._proc.returncode}).")
      pid = self._pids[rid]
    reader = None
    if pipe:
      reader = open(stdout, errors="replace")  # noqa: SIM115 -- the caller reads it to the end
      os.unlink(stdout)
    return Process(self, rid, pid, ["python", "-m", *argv], reader)

  def run(self, argv, log: str, timeout: float, err: str | None = None, env: dict | None = None):
    """Runs `python -m argv[0] argv[1:]` to its end, stdout (and stderr, unless `err`) in `log`: (exit status,
    seconds, log's text); exit status 124 when it ran past `timeout` (it is killed, with what it started)."""
    start = time.time()
    child = self.start(argv, stdout=log, stderr=err, env=env)
    try:
      rc = child.wait(timeout)
    except subprocess.TimeoutExpired:
      try:
        os.killpg(child.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      child.wait()
      rc = 124
    with open(log, errors="replace") as f:
      return rc, time.time() - start, f.read()

  def close(self):
    if self._proc.stdin and not self._proc.stdin.closed:
      self._proc.stdin.close()
    try:
      self._proc.wait(timeout=600)  # it ends once its children have
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    shutil.rmtree(self._fifos, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


if __name__ == "__main__":
  serve()
