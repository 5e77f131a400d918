"""vlrep.bench.forkserver: its children behave as `subprocess.Popen` children of `python -m` would, for what the
harnesses and tests rely on (exit statuses, signals to a session of their own, a pipe read line by line, the
environment and path of the request, a timeout that kills)."""

import os
import signal
import subprocess
import time

import pytest
from conftest import command_server

SLEEP = ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)"]


def test_a_child_reports_its_exit_status_output_and_environment(tmp_path):
  server = command_server()
  (tmp_path / "probe_module.py").write_text(
    "import os, sys\nprint('argv', sys.argv[1:], os.environ['PROBE'], flush=True)\n"
    "print('to stderr', file=sys.stderr)\nsys.exit(int(sys.argv[1]))\n"
  )
  child = server.start(["probe_module", "3"], stdout=subprocess.PIPE, env={"PROBE": "x", "PYTHONPATH": str(tmp_path)})
  lines = list(child.stdout)
  assert child.wait(timeout=60) == 3 and child.returncode == 3
  assert lines == ["argv ['3'] x\n", "to stderr\n"]
  rc, seconds, text = server.run(["probe_module", "0"], str(tmp_path / "log"), 60, env={"PROBE": "y"})
  assert rc == 1 and "No module named probe_module" in text  # PYTHONPATH was that request's alone
  rc, _, text = server.run(
    ["probe_module", "0"],
    str(tmp_path / "log"),
    60,
    err=str(tmp_path / "err"),
    env={"PROBE": "y", "PYTHONPATH": str(tmp_path)},
  )
  assert (rc, text, (tmp_path / "err").read_text()) == (0, "argv ['0'] y\n", "to stderr\n")


def test_signals_reach_a_child_and_its_session_and_a_timeout_kills_it(tmp_path):
  server = command_server()
  child = server.start(SLEEP, stdout=str(tmp_path / "a.log"))
  assert child.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    child.wait(timeout=0.5)
  assert os.getpgid(child.pid) == child.pid  # a session and process group of its own: killpg reaches it
  os.killpg(child.pid, signal.SIGKILL)
  assert child.wait(timeout=30) == -signal.SIGKILL
  child = server.start(SLEEP, stdout=str(tmp_path / "b.log"))
  child.send_signal(signal.SIGTERM)
  assert child.wait(timeout=30) == -signal.SIGTERM
  started = time.time()
  rc, _, _ = server.run(SLEEP, str(tmp_path / "c.log"), timeout=1)
  assert rc == 124 and time.time() - started < 30
