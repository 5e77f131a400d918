"""Preemption: during an evaluation SIGTERM stops the evaluation, and the exit deadline bounds a phase that would
run on. (SIGTERM in every phase, its checkpoint, summary, console message and resume: the fault harness in
test_faults.)"""

import os
import signal
import time

import pytest
from conftest import ROOT, command_server


def _sigterm_when_logged(workdir, line, *overrides):
  """Starts a tiny VirTex run (forked from the worker's process server), sends SIGTERM once its log shows `line`;
  -> (returncode, log, seconds to exit)."""
  argv = ["vlrep.main", "--config=tests/tiny_virtex.py", f"--workdir={workdir}", *overrides]
  log_path = str(workdir) + ".log"
  proc = command_server().start(argv, stdout=log_path, cwd=ROOT)
  deadline = time.time() + 300
  while line not in open(log_path).read() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  sent = time.time()
  proc.wait(timeout=120)
  return proc.returncode, open(log_path).read(), time.time() - sent


def test_the_sigterm_deadline_starts_at_the_signal_and_bounds_the_exit(tmp_path):
  # A deadline shorter than the phase in progress (the state's compilation) ends the process at the deadline, with
  # SIGTERM's exit code: the deadline starts when the signal arrives, not when Python next runs a handler. (A
  # SIGTERM in each phase with the default deadline: the fault harness in test_faults.)
  code, log, seconds = _sigterm_when_logged(
    tmp_path / "deadline", "Training stream over", "--config.checkpoint.exit_deadline_secs=0.2"
  )
  assert code == 143 and "SIGTERM deadline (0.2 s) passed" in log, log[-3000:]
  assert "Random init:" not in log and seconds < 10, seconds


def test_an_evaluation_stops_between_batches_once_sigterm_arrives(tiny_builder):
  from vlrep import preemption
  from vlrep.data import pipeline

  before = signal.getsignal(signal.SIGTERM)
  guard = preemption.Preemption(deadline_secs=0)  # no deadline timer: this is the test process
  try:
    batches = pipeline.eval_batches(tiny_builder, "val", "decode|normalize", ("image",), 4)
    next(batches)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.time() + 5
    while not preemption.requested() and time.time() < deadline:  # the watcher thread sees it, not a handler
      time.sleep(0.01)
    assert preemption.requested()
    with pytest.raises(preemption.Interrupted):
      next(batches)
  finally:
    guard.close()
  assert signal.getsignal(signal.SIGTERM) is before and not preemption.requested()
  preemption.check()  # nothing installed: a no-op, as in vlrep.evaluate
