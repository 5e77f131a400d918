"""SIGTERM, as a preemptible VM or a cluster scheduler sends it: the training loop saves and exits within a
deadline, and long evaluations stop between batches (`check`) instead of holding the exit up.

One process: vlrep's own SIGTERM handler sets a flag that the loop reads between steps. Several processes (a pod,
a multi-node job): the processes must stop after the same step and save it together, whichever of them got the
signal. JAX's preemption service does that (`jax.distributed.initialize` starts it): its SIGTERM handler reports the
notice to the coordination service, and `multihost_utils.reached_preemption_sync_point(step)`, called at every
step by every process, becomes true on all of them at the same step. So in a multi-process run vlrep installs no
handler of its own (it would replace JAX's) and reads the notice from the coordination service only to start the
exit deadline and to log it. JAX's protocol drops a notice that arrives before every process has made its first
call, so the processes also agree once, at the loop's start, on whether any of them saw one (one all-gather).

The loop installs a `Preemption`; the input pipeline and the evaluators call `check()`, which does nothing when no
run installed one (e.g. `vlrep.evaluate`).
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
from absl import logging
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

# The coordination-service key under which JAX's preemption service (TSL's PreemptionSyncManager) records the
# notice (the signal's time) for every process to see; the two-process test fails if it is renamed.
_JAX_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


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

  def __init__(self, deadline_secs: float, processes: int = 1):
    global _current
    _current = self
    self.requested = False
    self.processes = processes
    # One process can stop an evaluation on its own; several would leave each other's collectives waiting, so
    # their evaluations finish and the processes stop at the agreed step after them.
    self.interrupt_evaluations = processes == 1
    self.deadline_secs = deadline_secs
    self._timer: threading.Timer | None = None
    self._lock = threading.Lock()
    self._wakeup = None  # (read fd, write fd, the wakeup fd it replaced)
    self._previous_handler = None
    self._closed = threading.Event()
    if processes > 1:  # JAX's handler owns SIGTERM; watch the coordination service for the notice
      threading.Thread(target=self._watch_notice, daemon=True, name="vlrep-preemption-notice").start()
      return
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

  def _watch_notice(self):
    while not self._closed.wait(0.2):
      notice = jax_preemption_notice()
      if notice is not None:
        self._request(
          f"Preemption notice (SIGTERM to a process at {notice}): every process stops after the same step (JAX's "
          "preemption sync point), saves it and exits."
        )
        return

  def _handle(self, signum, frame):
    del frame
    self._request(f"Received signal {signum}: saving a checkpoint and exiting.")

  def _request(self, message: str) -> None:
    """Marks the stop as requested (once) and starts the exit deadline."""
    with self._lock:
      if self.requested:
        return
      self.requested = True
    logging.warning("%s", message)
    if self.deadline_secs > 0:
      self._timer = threading.Timer(self.deadline_secs, self._expire)
      self._timer.daemon = True
      self._timer.start()

  def stop_before_training(self, step: int) -> bool:
    """Whether to stop before the first step of this process (at `step`, the restored one): once, at the loop's
    start. Several processes: each first registers `step` with JAX's sync protocol (a notice that reaches it before
    every process has called it is dropped, so it is read here instead), then they agree on whether any saw a
    notice."""
    if self.processes == 1:
      return self.requested
    multihost_utils.reached_preemption_sync_point(step)
    seen = self.requested or jax_preemption_notice() is not None
    agreed = bool(np.asarray(multihost_utils.process_allgather(np.array([seen]))).any())
    if agreed:
      self._request("Preemption notice before training: every process stops before its first step.")
    return agreed

  def stop_after(self, step: int) -> bool:
    """Whether to stop after `step` (saving it): at once on one process; on several, at the step JAX's preemption
    sync point gives every process (call at every step, the same sequence on all)."""
    if self.processes == 1:
      return self.requested
    return multihost_utils.reached_preemption_sync_point(step)

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
    self._closed.set()
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


def jax_preemption_notice() -> str | None:
  """The preemption notice JAX's preemption service recorded for this multi-process run (the signal's time), or
  None: none yet, or no distributed runtime."""
  client = jax_distributed.global_state.client
  if client is None:
    return None
  try:
    return client.key_value_try_get(_JAX_NOTICE_KEY)
  except Exception:  # noqa: BLE001 -- NOT_FOUND (no notice yet) or a runtime shutting down: no notice to act on
    return None
