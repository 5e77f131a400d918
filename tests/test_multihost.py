"""Multi-process training on one machine: two CPU processes form one JAX distributed runtime (coordinator on
127.0.0.1), exactly as hosts of a pod or cluster do; the failures a launch can meet end in bounded time, and
preemption and faults across the processes (the fault harness, vlrep.bench.faults; the 22-fault table of
docs/reliability.md runs the same harness with more faults) lose nothing. One file, so that its two-process
launches run one after the other on one test worker rather than beside each other."""

import os
import re
import time

import pytest
from conftest import ROOT, with_devices

from vlrep.bench import faults, forkserver, scale_test

CONFIG = os.path.join(ROOT, "tests", "tiny_virtex.py")
OVERRIDES = ["--config=tests/tiny_virtex.py", "--config.evals={}", "--config.checkpoint.every_steps=4"]


def _start(server, workdir, port, process_id, num_processes, *extra, log):
  cmd = ["vlrep.main", f"--workdir={workdir}", *OVERRIDES]
  cmd += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}", f"--process_id={process_id}"]
  return server.start([*cmd, *extra], stdout=log, cwd=ROOT)


def test_two_processes_train_from_disk_survive_a_dead_host_and_resume_bit_identically(tmp_path):
  """The data-at-scale test (vlrep.bench.scale_test) at its smallest: two processes, two devices each, train on
  2,000 generated scenes read from disk; then a pair loses process 1 to a SIGKILL at a random step, process 0 stops
  by itself, and the same command on both resumes and ends with the uninterrupted pair's parameters."""
  result = scale_test.scale_test(
    str(tmp_path),
    str(tmp_path / "data"),
    ["2k"],
    steps=8,
    config=CONFIG,
    overrides=["batch_size=16"],
    modes=("disk",),
    devices_per_process=2,
    heartbeat_timeout=10,
    seed=3,
    checkpoint_every=4,
  )
  assert result["failures"] == [], result["failures"]
  for i, p in enumerate(result["runs"]["2k_disk"]["processes"]):
    # Each host trained on 8 local batches of 8 from its half of the records, and read them from disk: what those
    # batches needed and a few chunks ahead, not its share (the read check above held: fewer than 1,000).
    assert (p["process"], p["split_size"], p["share"], p["examples_trained"]) == (i, 2000, 1000, 64)
    assert 64 <= p["records_read"] < 1000 and p["peak_rss_gb"] > 0.1, p
  ref = open(tmp_path / "2k_disk" / "log0.txt").read()
  assert "process 0/2, 2 local / 4 global devices" in ref, ref[-3000:]
  assert re.search(r"Training stream over 1000 records of synthetic_scenes/train \(host 0/2\), read from disk", ref)

  killed = result["kill"]
  assert killed["bit_identical"] and len(set(killed["fingerprints"].values())) == 1, killed
  assert 4 < killed["kill_step"] < 7 and killed["resumed_from"] == 4 and killed["killed_at_log_step"] < 8, killed
  # The survivor stops by itself, within the heartbeat timeout and some slack. How it stops is a race: a failing
  # collective raises in Python (our message), a missed heartbeat aborts in C++ (the runtime's message); either
  # way its log says how to resume, since every multi-process run states that at startup.
  survivor = open(tmp_path / "2k_killed" / "log0.txt").read()
  assert killed["survivor_exit_code"] != 0 and killed["survivor_seconds"] < 60, (killed, survivor[-3000:])
  assert "rerun the same command on every host: the run resumes from its last checkpoint" in survivor
  assert "another task died" in survivor or "ERROR: process 0 stopped" in survivor, survivor[-3000:]
  assert f"Resumed from step {killed['resumed_from']}" in open(tmp_path / "2k_killed" / "log1.txt").read()


def test_bad_launches_fail_fast_with_a_clear_error(tmp_path):
  quick = ["--init_timeout=10", "--config.total_steps=2"]
  started = time.time()
  port_unreachable, port_mismatch, port_missing = scale_test.free_port(), scale_test.free_port(), scale_test.free_port()
  # Forked from a pre-warmed server (vlrep.bench.forkserver), as the harnesses launch. Nothing compiled is shared
  # with the session's cache: these launches fail before they compile anything.
  env = {**with_devices(2), "PYTHONUNBUFFERED": "1"}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  with forkserver.Server(env, cwd=ROOT) as server:
    procs = {
      # Nobody listens on the coordinator's port.
      "unreachable": _start(server, tmp_path / "u", port_unreachable, 1, 2, *quick, log=tmp_path / "unreachable.log"),
      # Process 0 was told 2 processes, process 1 was told 3.
      "mismatch0": _start(server, tmp_path / "m", port_mismatch, 0, 2, *quick, log=tmp_path / "mismatch0.log"),
      "mismatch1": _start(server, tmp_path / "m", port_mismatch, 1, 3, *quick, log=tmp_path / "mismatch1.log"),
      # Three processes expected, one launched.
      "missing": _start(server, tmp_path / "x", port_missing, 0, 3, *quick, log=tmp_path / "missing.log"),
    }
    for p in procs.values():
      p.wait(timeout=240)
  out = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
  assert all(p.returncode != 0 for p in procs.values()), {k: v[-2000:] for k, v in out.items()}
  assert time.time() - started < 240
  assert "never accepted a connection" in out["unreachable"], out["unreachable"][-2000:]
  for name in ("mismatch0", "mismatch1"):
    assert "Mismatched process counts" in out[name] and "[2, 3]" in out[name], out[name][-2000:]
  assert "did not form within --init_timeout=10s" in out["missing"], out["missing"][-2000:]
  # No run started: nothing was written where a checkpoint could be mistaken for progress.
  assert not any((tmp_path / d / "checkpoints").exists() for d in ("u", "m", "x"))


def test_scale_test_refuses_a_kill_with_no_checkpoint_before_it(tmp_path):
  """The killed pair dies after its first checkpoint and with a step to spare: a schedule without room for that is
  an error before anything is prepared or trained."""
  for steps, every in ((8, -1), (8, 6), (3, 0)):
    with pytest.raises(ValueError, match="the kill needs a checkpoint"):
      scale_test.scale_test(str(tmp_path), str(tmp_path / "data"), ["2k"], steps, CONFIG, [], checkpoint_every=every)
  assert not (tmp_path / "data").exists() and not (tmp_path / "2k_disk").exists()


def test_sigterm_to_one_process_stops_both_after_one_step_and_a_kill_mid_save_loses_nothing(tmp_path):
  """The fault harness on two processes (one device each), two faults: SIGTERM to process 1 mid-training, then
  SIGKILL of process 0 right after a checkpoint step's line (its save under way). Both processes stop after the same
  step, saved once, exit 0 within the deadline; after the kill process 1 stops by itself within the heartbeat
  timeout; each relaunch resumes from the newest intact checkpoint; the end equals an uninterrupted pair's bit for
  bit."""
  plan = [
    faults.Fault("sigterm", "train", delay=0.2, target="1", at_step=3),
    faults.Fault("sigkill", "checkpoint", delay=0.05, target="0"),
  ]
  # 40 steps: JAX's notice reaches the other process up to ~1 s after the signal, tens of tiny steps.
  overrides = ["total_steps=40", "checkpoint.every_steps=8", "evals={}"]
  result = faults.harness(CONFIG, str(tmp_path), kills=2, overrides=overrides, processes=2, plan=plan)
  table = faults.table(result)
  assert result["ok"] and result["equal"], table
  term, kill = result["faults"]
  assert term["injected"] and term["exit_codes"] == [0, 0], table
  # The agreed step: both say they stopped after it, it is the one new checkpoint, summary.json says it.
  assert len(set(term["stopped_at"])) == 1 and term["stopped_at"][0] == term["newest_after"] > 0, term
  assert term["exit_seconds"] < result["deadline_secs"], term
  log0, log1 = (tmp_path / "faulty.log").read_text(), (tmp_path / "faulty.1.log").read_text()
  # Process 0 never got the signal: it heard of it from JAX's preemption service.
  assert "Preemption notice (SIGTERM to a process at" in log0 and "Preemption notice" in log1
  assert f"Checkpoint at step {term['stopped_at'][0]} saved after SIGTERM" in log0
  assert kill["injected"] and kill["exit_codes"][0] == -9 and kill["exit_codes"][1] != 0, table
  assert kill["exit_seconds"] < result["heartbeat_timeout"] + 30, kill
  assert kill["resumed_from"] == kill["newest_after"] >= term["newest_after"], kill


def test_two_processes_train_in_microbatches_and_resume_bit_identically(tmp_path):
  """`microbatches=2` across two processes of two devices each (the global batch of 16 split over 4 devices, each
  device's 4 examples in 2 microbatches of 2: BatchNorm groups of 2 stay whole), with remat: a SIGKILL of process 1
  mid-training, then the same command on both resumes and ends with the uninterrupted pair's parameters."""
  overrides = [
    "total_steps=12",
    "checkpoint.every_steps=4",
    "evals={}",
    "batch_size=16",
    "microbatches=2",
    "remat=full",
    "method.backbone.bn_group_size=2",
  ]
  plan = [faults.Fault("sigkill", "train", delay=0.2, target="1", at_step=6)]
  result = faults.harness(
    CONFIG, str(tmp_path), kills=1, overrides=overrides, processes=2, devices_per_process=2, plan=plan
  )
  table = faults.table(result)
  assert result["ok"] and result["equal"], table
  (kill,) = result["faults"]
  assert kill["injected"] and kill["resumed_from"] >= 4, kill
  log = (tmp_path / "reference.log").read_text()
  assert "process 0/2, 2 local / 4 global devices" in log, log[-3000:]
