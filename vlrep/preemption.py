"""SIGTERM, as a preemptible VM or a cluster scheduler sends it: the training loop saves and exits within a
deadline, and long evaluations stop between batches (`check`) instead of holding the exit up.

A leaf module (standard library and absl only): the loop installs a `Preemption`, the input pipeline and the
evaluators call `check()`, which does nothing when no run installed one (e.g. `vlrep.evaluate`).
"""

from __future__ import annotations

import os
import signal
import threading

from absl import logging


class Interrupted(Exception):  # noqa: N818 -- not an error: the run is being preempted
  """Raised by `check()` in an evaluation once SIGTERM arrived; the loop then saves and exits."""


_current: Preemption | None = None


def requested() -> bool:
  return _current is not None and _current.requested


def check() -> None:
  """Raises Interrupted once SIGTERM arrived, where the installed Preemption allows evaluations to stop."""
  if _current is not None and _current.requested and _current.interrupt_evaluations:
    raise Interrupted()


class Preemption:
  """SIGTERM sets a flag that the loop checks between steps and before long phases: it saves the newest trained
  step (if not saved yet) and exits cleanly. A timer bounds the whole exit: `deadline_secs` after the signal the
  process ends even if a compilation, evaluation or save is still running (Orbax renames a checkpoint only once it
  is complete, so the newest complete one survives). 0 disables the timer.

  Python runs a signal handler only when the main thread next executes bytecode, which a compilation or a long
  device computation can delay by tens of seconds; the signal's wakeup byte, written at C level the moment it
  arrives, lets a watcher thread start the deadline at once."""

  def __init__(self, deadline_secs: float, interrupt_evaluations: bool = True):
    global _current
    _current = self
    self.requested = False
    # One process can stop an evaluation on its own; several must agree first (their collectives stay in step).
    self.interrupt_evaluations = interrupt_evaluations
    self.deadline_secs = deadline_secs
    self._timer: threading.Timer | None = None
    self._lock = threading.Lock()
    self._wakeup = None  # (read fd, write fd, the wakeup fd it replaced)
    self._previous_handler = None
    try:
      self._previous_handler = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread (e.g. notebooks): rely on periodic checkpoints
      return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    self._wakeup = (read_fd, write_fd, signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))
    threading.Thread(target=self._watch, args=(read_fd,), daemon=True, name="vlrep-sigterm").start()

  def _watch(self, read_fd):
    while True:
      try:
        data = os.read(read_fd, 64)
      except OSError:
        return
      if not data:  # closed: the run ended
        return
      if signal.SIGTERM in data:
        self._handle(signal.SIGTERM, None)

  def _handle(self, signum, frame):
    del frame
    with self._lock:
      if self.requested:
        return
      self.requested = True
    logging.warning("Received signal %d: saving a checkpoint and exiting.", signum)
    if self.deadline_secs > 0:
      self._timer = threading.Timer(self.deadline_secs, self._expire)
      self._timer.daemon = True
      self._timer.start()

  def exited_cleanly(self):
    """The clean exit finished in time: the deadline no longer applies (run() may be called in-process again)."""
    if self._timer is not None:
      self._timer.cancel()

  def close(self):
    """Gives SIGTERM and the wakeup fd back as they were (run() may be called again in this process) and ends the
    watcher."""
    global _current
    if _current is self:
      _current = None
    if self._previous_handler is not None:
      signal.signal(signal.SIGTERM, self._previous_handler)
      self._previous_handler = None
    if self._wakeup is not None:
      read_fd, write_fd, previous = self._wakeup
      self._wakeup = None
      signal.set_wakeup_fd(previous)
      os.close(write_fd)
      os.close(read_fd)

  def _expire(self):
    logging.error(
      "SIGTERM deadline (%g s) passed before a clean exit: exiting now. The newest complete checkpoint is kept; "
      "rerun the same command to resume.",
      self.deadline_secs,
    )
    logging.flush()
    os._exit(143)  # 128 + SIGTERM, what a scheduler expects of a terminated task
