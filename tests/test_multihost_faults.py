"""Preemption and faults across the processes of one run: the fault harness (vlrep.bench.faults) on two processes
forming one JAX distributed runtime on 127.0.0.1, as the hosts of a pod do (the 22-fault table of
docs/reliability.md runs the same harness with more faults)."""

import os

from conftest import ROOT

from vlrep.bench import faults

CONFIG = os.path.join(ROOT, "tests", "tiny_virtex.py")


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
