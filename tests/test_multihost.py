"""Multi-process training on one machine: two CPU processes form one JAX distributed runtime (coordinator on
127.0.0.1), exactly as hosts of a pod or cluster do, and the failures a launch can meet end in bounded time."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

from conftest import ROOT, with_devices

OVERRIDES = ["--config=tests/tiny_virtex.py", "--config.evals={}", "--config.checkpoint.every_steps=4"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir, port, process_id, num_processes, *extra, log, cache=None):
  cmd = [sys.executable, "-m", "vlrep.main", f"--workdir={workdir}", *OVERRIDES]
  cmd += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}", f"--process_id={process_id}"]
  env = {**with_devices(2), "PYTHONUNBUFFERED": "1"}
  # The two processes must meet at each collective within Gloo's 30 s. With the session's shared compilation cache
  # one process could load an executable that the other still compiles (CI failed exactly so: "Gloo context
  # initialization failed: DEADLINE_EXCEEDED"). A cache of the pair's own (`cache`: empty when they first start)
  # holds only what one of them already compiled, so loading from it can only let a process that is behind catch
  # up; without one, nothing is cached.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  if cache is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
  return subprocess.Popen([*cmd, *extra], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _run_pair(tmp_path, tag, workdir, *extra, timeout=400, cache=None):
  port = _free_port()
  logs = [open(tmp_path / f"{tag}{i}.log", "w") for i in range(2)]
  procs = [_start(workdir, port, i, 2, *extra, log=logs[i], cache=cache) for i in range(2)]
  for p in procs:
    p.wait(timeout=timeout)
  for f in logs:
    f.close()
  return [p.returncode for p in procs], [(tmp_path / f"{tag}{i}.log").read_text() for i in range(2)]


def test_two_processes_train_together_survive_a_dead_host_and_resume(tmp_path):
  workdir = tmp_path / "run"
  steps = ["--config.total_steps=16", "--heartbeat_timeout=10"]
  port = _free_port()
  logs = [open(tmp_path / f"a{i}.log", "w") for i in range(2)]
  cache = tmp_path / "jax_cache"  # the pair's own: filled by this pair, read by the resuming pair
  procs = [_start(workdir, port, i, 2, *steps, log=logs[i], cache=cache) for i in range(2)]
  # Kill process 1 (SIGKILL: no chance to clean up) once a checkpoint exists.
  deadline = time.time() + 300
  while not (workdir / "checkpoints" / "8").exists() and procs[0].poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert (workdir / "checkpoints" / "8").exists(), (tmp_path / "a0.log").read_text()[-3000:]
  procs[1].send_signal(signal.SIGKILL)
  killed_at = time.time()
  procs[0].wait(timeout=120)
  survivor_s = time.time() - killed_at
  for f in logs:
    f.close()
  log0 = (tmp_path / "a0.log").read_text()
  # The survivor stops by itself, within the heartbeat timeout and some slack. How it stops is a race: a failing
  # collective raises in Python (our message), a missed heartbeat aborts in C++ (the runtime's message); either
  # way its log says how to resume, since every multi-process run states that at startup.
  assert procs[0].returncode != 0 and survivor_s < 60, (survivor_s, log0[-3000:])
  assert "rerun the same command on every host: the run resumes from its last checkpoint" in log0, log0[:3000]
  assert "another task died" in log0 or "ERROR: process 0 stopped" in log0, log0[-3000:]
  saved = max(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  assert 8 <= saved < 16

  # The same command on both hosts resumes from the last checkpoint and finishes in step.
  codes, outs = _run_pair(tmp_path, "b", workdir, *steps, cache=cache)
  assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  for i, out in enumerate(outs):
    assert f"Resumed from step {saved}" in out, out[-3000:]
    assert f"process {i}/2, 2 local / 4 global devices" in out
    # Each host reads its own half of the 64 training records.
    assert re.search(rf"Training stream over 32 records of synthetic_scenes/train \(host {i}/2\)", out), out[-3000:]
  fingerprints = [re.search(r"Parameter fingerprint \(process \d\): (\w+)", out).group(1) for out in outs]
  assert fingerprints[0] == fingerprints[1]
  assert "Finished 16 steps" in outs[0]


def test_bad_launches_fail_fast_with_a_clear_error(tmp_path):
  quick = ["--init_timeout=10", "--config.total_steps=2"]
  started = time.time()
  port_unreachable, port_mismatch, port_missing = _free_port(), _free_port(), _free_port()
  logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("unreachable", "mismatch0", "mismatch1", "missing")}
  procs = {
    # Nobody listens on the coordinator's port.
    "unreachable": _start(tmp_path / "u", port_unreachable, 1, 2, *quick, log=logs["unreachable"]),
    # Process 0 was told 2 processes, process 1 was told 3.
    "mismatch0": _start(tmp_path / "m", port_mismatch, 0, 2, *quick, log=logs["mismatch0"]),
    "mismatch1": _start(tmp_path / "m", port_mismatch, 1, 3, *quick, log=logs["mismatch1"]),
    # Three processes expected, one launched.
    "missing": _start(tmp_path / "x", port_missing, 0, 3, *quick, log=logs["missing"]),
  }
  for p in procs.values():
    p.wait(timeout=240)
  for f in logs.values():
    f.close()
  out = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
  assert all(p.returncode != 0 for p in procs.values()), {k: v[-2000:] for k, v in out.items()}
  assert time.time() - started < 240
  assert "never accepted a connection" in out["unreachable"], out["unreachable"][-2000:]
  for name in ("mismatch0", "mismatch1"):
    assert "Mismatched process counts" in out[name] and "[2, 3]" in out[name], out[name][-2000:]
  assert "did not form within --init_timeout=10s" in out["missing"], out["missing"][-2000:]
  # No run started: nothing was written where a checkpoint could be mistaken for progress.
  assert not any((tmp_path / d / "checkpoints").exists() for d in ("u", "m", "x"))
