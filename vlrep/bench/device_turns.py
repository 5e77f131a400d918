"""Processes that share one accelerator compile together and time in turns.

A lent accelerator is paid by the second, and compiling a step (XLA's autotuning, `torch.compile`, Triton) takes
far longer than timing it. `launch/benchmark_gpu.sh` therefore starts every benchmark process at once; each
registers in a shared folder (`join`), compiles, and then times inside `turn()`: a turn starts only once every
registered process has finished compiling, and turns run one at a time under a file lock. So no timed window
shares the device with another process's work, while the compilations overlap. Parties that join as `optional`
(the PyTorch references, the other methods) are killed if they are still compiling at the
deadline, so that the others time without them; the required ones (what the run is for) are always waited for.

  turns = device_turns.join(DIR, parties=N, deadline=T)   # at start (T: Unix time); None without DIR
  ... compile, warm up ...
  with device_turns.turn(turns):                              # waits for the others, then holds the device
    ... timed windows ...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import time
from typing import NamedTuple


class Turns(NamedTuple):
  folder: str
  parties: int
  deadline: float  # time.time() after which the optional parties still compiling are killed


def join(folder: str, parties: int, deadline: float, optional: bool = False) -> Turns | None:
  """Registers this process as one of `parties` sharing the device; an `optional` one is killed if it is still
  compiling at `deadline` (Unix time, the same for all). None (no turns) when `folder` is empty."""
  if not folder:
    return None
  if parties < 1:
    raise ValueError(f"parties must be >= 1, got {parties}.")
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, f"party.{os.getpid()}"), "w") as f:
    f.write(" ".join(sys.argv))
  if optional:
    open(os.path.join(folder, f"optional.{os.getpid()}"), "w").close()
  return Turns(folder, parties, deadline)


def _pids(folder: str, kind: str) -> set[int]:
  return {int(n.split(".")[1]) for n in os.listdir(folder) if n.startswith(kind + ".")}


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited; its parent has not reaped it
  except (FileNotFoundError, IndexError):
    return False


@contextlib.contextmanager
def turn(turns: Turns | None, poll_s: float = 0.2):
  """Waits until every party is ready or has exited (at the deadline, the optional parties still compiling are
  killed, reported on stderr), then holds the device's lock for the body. Yields {'waited_s', 'ready', 'killed',
  'held_from', 'held_until'} (Unix times; the last is filled in when the body ends)."""
  info = {"waited_s": 0.0, "ready": 1, "killed": []}
  if turns is None:
    yield info
    return
  me = os.getpid()
  open(os.path.join(turns.folder, f"ready.{me}"), "w").close()
  t0 = time.time()
  while True:
    ready = _pids(turns.folder, "ready")
    # A party that exited before it was ready (a crash) is waited for no longer.
    dead = {p for p in _pids(turns.folder, "party") - ready if not _alive(p)}
    if len(ready) + len(dead) >= turns.parties:
      break
    if time.time() > turns.deadline:
      late = (_pids(turns.folder, "party") - ready - dead) & _pids(turns.folder, "optional")
      for pid in sorted(late):
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGKILL)
      if late:
        info["killed"] = sorted(set(info["killed"]) | late)
        print(f"device_turns: optional {sorted(late)} still compiling at the deadline: killed.", file=sys.stderr)
    time.sleep(poll_s)
  info["ready"] = len(_pids(turns.folder, "ready"))
  with open(os.path.join(turns.folder, "lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    info["waited_s"] = time.time() - t0
    info["held_from"] = time.time()
    try:
      yield info
    finally:
      info["held_until"] = time.time()
      open(os.path.join(turns.folder, f"done.{me}"), "w").close()
      fcntl.flock(lock, fcntl.LOCK_UN)
