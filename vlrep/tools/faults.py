r"""Fault-injection harness: kills a training run again and again and checks that nothing is lost.

  python -m vlrep.tools.faults --config=tests/tiny_virtex.py --workdir=/tmp/faults --kills=30 \
      --overrides=total_steps=120,checkpoint.every_steps=4,evals.probe.every_steps=40

Trains CONFIG once without interruption (WORKDIR/reference), then again in WORKDIR/faulty while injecting
--kills faults, restarting the same command after each one until the run finishes. It checks that

  * the final parameters and model state equal the reference's bit for bit;
  * no complete checkpoint is lost: every restart resumes from the newest checkpoint on disk when the previous
    process ended (from the one before it when the harness corrupted the newest, which is set aside as
    damaged_<step>);
  * a failed save is a clear error (CheckpointSaveError) that keeps the earlier checkpoints;
  * a SIGTERM ends the process cleanly (exit 0, summary.json `preempted: true` at the step saved) within the
    run's deadline (checkpoint.exit_deadline_secs), timed per phase.

Faults (cycled through phases, each at a random delay after the log line that arms it):
  sigterm    SIGTERM, as a preemptible VM's notice: the time to exit is measured
  sigkill    SIGKILL, as a node dying
  corrupt    SIGKILL, then one file of the newest checkpoint is truncated (as a write torn by a dying node)
  disk_full  the restart runs with RLIMIT_FSIZE (no file may grow past --disk_bytes): its next checkpoint does not
             fit, as on a full disk; the restart after it has no limit

Phases, by the log line that arms them:
  startup     'process 0/1': devices up; dataset, tokenizer and method being built
  data        'Training stream over': the input pipeline started; the train state is being built
  init        'parameters,': the random-init evaluation (if any) and the first step's compilation
  train       a '[k/N]' line a few steps after the resumed step (log_every_steps=1 is set)
  checkpoint  the '[k/N]' line of a checkpoint step: the save follows it
  eval        the '[k/N]' line of an evaluation step: the evaluation follows it

It writes WORKDIR/faults.md (the table) and WORKDIR/faults.json (every fault) and exits non-zero when a check
fails. Everything runs in subprocesses of `python -m vlrep.main`, exactly as a user's restarts would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
from absl import app, flags, logging

from vlrep import runs

KINDS = ("sigterm", "sigkill", "corrupt", "disk_full")
PHASES = ("startup", "data", "init", "train", "checkpoint", "eval")
_ARMING_LINES = {"startup": "process 0/1", "data": "Training stream over", "init": "parameters,"}
_STEP_LINE = re.compile(r"\] \[(\d+)/(\d+)\] loss")
_RESUMED = re.compile(r"Resumed from step (\d+)")


@dataclasses.dataclass
class Fault:
  kind: str
  phase: str
  delay: float  # seconds after the arming line
  attempt: int = 0
  injected: bool = False
  step_before: int = 0  # the newest intact checkpoint when the process started
  exit_code: int | None = None
  exit_seconds: float | None = None  # SIGTERM: signal to process exit
  newest_after: int = 0  # the newest complete checkpoint when the process had ended
  resumed_from: int | None = None  # what the next process resumed from
  ok: bool = False
  note: str = ""


def schedule(kills: int, seed: int, phases=PHASES) -> list[Fault]:
  """`kills` faults in rounds: SIGTERM and SIGKILL in each of `phases`, a corruption and a full disk, in a random
  order. A partial round takes one fault of each kind first, so that 4 or more faults cover every kind. A
  corruption never comes first (it needs two checkpoints)."""
  rng = np.random.default_rng(seed)
  one_round = [(k, p) for k in ("sigterm", "sigkill") for p in phases]
  one_round += [("corrupt", "train"), ("disk_full", "checkpoint")]
  plan = []
  while len(plan) < kills:
    order = [one_round[i] for i in rng.permutation(len(one_round))]
    left = kills - len(plan)
    if left < len(order):
      firsts = [next(x for x in order if x[0] == kind) for kind in KINDS]
      rest = [x for x in order if x not in firsts]
      order = [(firsts + rest)[:left][i] for i in rng.permutation(left)]
    plan += order
  first_other = next((i for i, (k, _) in enumerate(plan) if k != "corrupt"), 0)
  plan[0], plan[first_other] = plan[first_other], plan[0]
  return [Fault(k, p, float(rng.uniform(0.0, 0.5))) for k, p in plan]


def complete_steps(workdir: str) -> list[int]:
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(p) for p in os.listdir(d) if p.isdigit()) if os.path.isdir(d) else []


class _Process:
  """A `vlrep.main` subprocess whose output is read line by line (a pipe: RLIMIT_FSIZE does not limit it)."""

  def __init__(self, cmd, log_path, fsize_limit=0):
    self.lines: list[str] = []
    self.proc = subprocess.Popen(
      cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    if fsize_limit:  # set from outside (no preexec_fn in a threaded parent); the process needs seconds to start
      resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    self._log = open(log_path, "a")  # noqa: SIM115 -- closed by the reader thread
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)
      self._log.write(line)
    self._log.close()

  def wait_for(self, predicate, timeout: float) -> bool:
    """Waits until a line satisfies `predicate` (True) or the process ends or times out (False)."""
    seen, deadline = 0, time.time() + timeout
    while time.time() < deadline:
      while seen < len(self.lines):
        if predicate(self.lines[seen]):
          return True
        seen += 1
      if self.proc.poll() is not None and seen >= len(self.lines):
        self._reader.join(timeout=5)
        if seen >= len(self.lines):
          return False
      time.sleep(0.005)
    return False

  def finish(self, timeout: float) -> int:
    try:
      code = self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(self.proc.pid, signal.SIGKILL)
      code = self.proc.wait()
    self._reader.join(timeout=10)
    return code

  @property
  def text(self) -> str:
    return "".join(self.lines)


def _arming(kind: str, phase: str, resumed: int, checkpoints: int, total, every_ckpt, every_eval, rng):
  """The predicate on log lines that arms a fault (None: its phase does not come in this process). A corruption
  waits until two checkpoints exist (`checkpoints` exist when the process starts), so one intact one remains."""
  if kind == "corrupt":
    target = (resumed // every_ckpt + max(1, 2 - checkpoints)) * every_ckpt + 1  # the step after that save
  elif phase in _ARMING_LINES:
    needle = _ARMING_LINES[phase]
    return lambda line: needle in line
  elif phase == "train":
    target = min(total, resumed + int(rng.integers(2, 2 * every_ckpt + 1)))
  elif phase == "checkpoint":
    target = min(total, (resumed // every_ckpt + 1) * every_ckpt)
  else:  # eval
    if not every_eval:
      return None
    target = (resumed // every_eval + 1) * every_eval
    if target >= total:  # the last step's evaluation: leave it to the final, unfaulted process
      return None
  if target >= total:
    return None

  def at_target(line):
    m = _STEP_LINE.search(line)
    return m is not None and int(m.group(1)) >= target

  return at_target


def _corrupt_newest(workdir: str) -> str:
  """Truncates the largest file of the newest checkpoint to half its size; returns what it touched."""
  step = complete_steps(workdir)[-1]
  root = os.path.join(workdir, "checkpoints", str(step))
  files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
  victim = max(files, key=os.path.getsize)
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  return os.path.relpath(victim, workdir)


def _variables(workdir: str, step: int) -> dict:
  return runs.load_run(workdir, str(step)).variables


def _equal(a, b) -> bool:
  if isinstance(a, dict):
    return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
  return np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)


def harness(
  config: str,
  workdir: str,
  kills: int,
  overrides=(),
  seed: int = 0,
  disk_bytes: int = 64 << 10,
  attempt_timeout: float = 600.0,
  phases=PHASES,
) -> dict:
  """Runs the reference and the faulty run; -> {'faults': [...], 'equal': bool, 'ok': bool, ...}."""
  # Bad arguments fail before the reference run, not minutes later.
  if kills < 1:
    raise ValueError(f"--kills must be at least 1, got {kills}.")
  if not phases or set(phases) - set(PHASES):
    raise ValueError(f"--phases must be among {PHASES}, got {list(phases)}.")
  if not os.path.exists(config.partition(":")[0]):
    raise FileNotFoundError(f"No config file {config.partition(':')[0]}.")
  rng = np.random.default_rng(seed + 1)
  overrides = [*overrides, "log_every_steps=1"]
  reference, faulty = os.path.join(workdir, "reference"), os.path.join(workdir, "faulty")
  for d in (reference, faulty):
    if os.path.exists(d):
      shutil.rmtree(d)
  os.makedirs(workdir, exist_ok=True)
  log_path = os.path.join(workdir, "faulty.log")
  for path in (log_path, os.path.join(workdir, "reference.log")):
    open(path, "w").close()

  def start(w, log, fsize_limit=0):
    cmd = [sys.executable, "-m", "vlrep.main", f"--config={config}", f"--workdir={w}"]
    return _Process(cmd + [f"--config.{o}" for o in overrides], log, fsize_limit)

  t0 = time.time()
  ref = start(reference, os.path.join(workdir, "reference.log"))
  if ref.finish(attempt_timeout) != 0:
    raise RuntimeError(f"The reference run failed; see {workdir}/reference.log:\n{ref.text[-3000:]}")
  reference_seconds = time.time() - t0
  saved = runs.read_config(reference)
  total = int(saved.total_steps)
  every_ckpt = int(saved.checkpoint.every_steps)
  every_eval = min([int(e.get("every_steps", 0)) or total for e in saved.get("evals", {}).values()] or [0])
  deadline = float(saved.checkpoint.get("exit_deadline_secs", 20.0))
  logging.info("Reference: %d steps in %.0f s (checkpoint every %d).", total, reference_seconds, every_ckpt)

  faults = schedule(kills, seed, phases)
  queue = list(faults)
  expect: list = []  # [(fault, the step the next process that restores must resume from)]

  def check_resume(text):
    """Once a process got as far as restoring: did it resume from the step the last faults left?"""
    m = _RESUMED.search(text)
    if m is None and "parameters," not in text:
      return  # it ended before restoring: the next process is checked
    for fault, want in expect:
      fault.resumed_from = int(m.group(1)) if m else 0
      if fault.resumed_from != want:
        fault.ok, fault.note = False, fault.note + f" resumed from step {fault.resumed_from}, expected {want};"
    expect.clear()

  def expect_resume(fault):
    """A fault whose process did not restore leaves the checkpoints as they were, so an earlier fault still
    waiting for its check expects the same step, unless this fault changed the newest one (a corruption)."""
    for earlier, want in expect:
      if want != fault.newest_after:
        earlier.note += f" its resume check passed to the next fault (step {fault.newest_after});"
    expect[:] = [(f, fault.newest_after) for f, _ in expect] + [(fault, fault.newest_after)]

  t0 = time.time()
  attempt = 0
  while True:
    attempt += 1
    before = complete_steps(faulty)
    newest_before = before[-1] if before else 0
    resumes_at = expect[-1][1] if expect else newest_before
    intact = len([step for step in before if step <= resumes_at])
    armed = ((f, _arming(f.kind, f.phase, resumes_at, intact, total, every_ckpt, every_eval, rng)) for f in queue)
    fault, arm = next(((f, a) for f, a in armed if f.kind == "disk_full" or a is not None), (None, None))
    if fault is None:  # no fault can come any more: the run goes to its end
      p = start(faulty, log_path)
      code = p.finish(attempt_timeout)
      check_resume(p.text)
      if code != 0:
        raise RuntimeError(f"The last process failed (exit {code}); see {log_path}:\n{p.text[-3000:]}")
      break
    queue.remove(fault)
    fault.attempt, fault.step_before = attempt, resumes_at
    if fault.kind == "disk_full":  # the whole process runs on a "full disk": its next save must fail clearly
      p = start(faulty, log_path, fsize_limit=disk_bytes)
      fault.injected = True
      fault.exit_code = p.finish(attempt_timeout)
      check_resume(p.text)
      after = complete_steps(faulty)
      clear = "CheckpointSaveError" in p.text and "are untouched" in p.text
      kept = bool(after) and after[-1] >= resumes_at if resumes_at else True
      fault.ok = fault.exit_code != 0 and clear and kept
      fault.note += (" the save failed with the clear error;" if clear else " no CheckpointSaveError;") + (
        "" if kept else " a checkpoint was lost;"
      )
      fault.newest_after = after[-1] if after else 0
      expect_resume(fault)
      continue
    p = start(faulty, log_path)
    if not p.wait_for(arm, attempt_timeout):
      code = p.finish(attempt_timeout)
      check_resume(p.text)
      if code != 0:
        raise RuntimeError(f"A process ended (exit {code}) before its fault; see {log_path}:\n{p.text[-3000:]}")
      queue.insert(0, fault)  # the run finished first: the fault never armed
      break
    time.sleep(fault.delay)
    fault.injected = True
    sent = time.time()
    os.killpg(p.proc.pid, signal.SIGTERM if fault.kind == "sigterm" else signal.SIGKILL)
    fault.exit_code = p.finish(attempt_timeout)
    check_resume(p.text)
    after = complete_steps(faulty)
    fault.newest_after = after[-1] if after else 0
    fault.ok = fault.newest_after >= resumes_at  # (a corrupted newest one is set aside by the restore: not lost)
    if not fault.ok:
      fault.note += f" the newest intact checkpoint went from {resumes_at} to {fault.newest_after};"
    if fault.kind == "sigterm":
      fault.exit_seconds = time.time() - sent
      if fault.exit_seconds > deadline:
        fault.ok, fault.note = False, fault.note + f" exit took {fault.exit_seconds:.1f} s;"
      if fault.exit_code == 0:
        s = json.load(open(os.path.join(faulty, "summary.json")))
        if not (s.get("preempted") is True and s.get("steps") == fault.newest_after and s.get("seconds", 0) > 0):
          fault.ok = False
          fault.note += f" summary.json: preempted={s.get('preempted')}, steps={s.get('steps')};"
        if f"Preempted (SIGTERM) after {s.get('steps')} steps" not in p.text:  # what the console tells the user
          fault.ok, fault.note = False, fault.note + " the console does not say it was preempted;"
      elif fault.exit_code == -signal.SIGTERM and "parameters," not in p.text:
        fault.note += " ended by the signal itself (before vlrep's handler: nothing to save);"
      else:
        fault.ok, fault.note = False, fault.note + f" exit code {fault.exit_code};"
    if fault.kind == "corrupt":
      if len(after) >= 2:
        fault.note += f" truncated {_corrupt_newest(faulty)};"
        fault.newest_after = after[-2]
      else:
        fault.ok, fault.note = False, fault.note + " one checkpoint only: nothing corrupted;"
    expect_resume(fault)
  faulty_seconds = time.time() - t0
  for fault, _ in expect:
    fault.ok, fault.note = False, fault.note + " no process resumed after it;"

  equal = _equal(_variables(reference, total), _variables(faulty, total))
  damaged = sorted(p for p in os.listdir(os.path.join(faulty, "checkpoints")) if p.startswith("damaged_"))
  injected = [f for f in faults if f.injected]
  result = {
    "config": config,
    "overrides": overrides,
    "steps": total,
    "processes": attempt,
    "equal": bool(equal),
    "damaged_set_aside": damaged,
    "reference_seconds": reference_seconds,
    "faulty_seconds": faulty_seconds,
    "deadline_secs": deadline,
    "ok": bool(equal) and len(injected) == len(faults) and all(f.ok for f in injected),
    "faults": [dataclasses.asdict(f) for f in faults],
  }
  with open(os.path.join(workdir, "faults.json"), "w") as f:
    json.dump(result, f, indent=2)
  with open(os.path.join(workdir, "faults.md"), "w") as f:
    f.write(table(result))
  return result


def table(result: dict) -> str:
  """Markdown: faults by kind and phase (injected / survived), SIGTERM exit times per phase, the verdict."""
  faults = [f for f in result["faults"] if f["injected"]]
  lines = ["| fault | phase | injected | survived | SIGTERM to exit, s (median, max) |", "|---|---|---|---|---|"]
  for kind in KINDS:
    for phase in PHASES:
      group = [f for f in faults if f["kind"] == kind and f["phase"] == phase]
      if not group:
        continue
      times = [f["exit_seconds"] for f in group if f["exit_seconds"] is not None]
      t = f"{statistics.median(times):.1f}, {max(times):.1f}" if times else ""
      lines.append(f"| {kind} | {phase} | {len(group)} | {sum(f['ok'] for f in group)} | {t} |")
  missed = len(result["faults"]) - len(faults)
  lines += [
    "",
    f"{len(faults)} faults injected ({missed} never armed) over {result['processes']} processes; "
    f"{sum(f['ok'] for f in faults)} survived. Final parameters and model state "
    f"{'bit-identical to' if result['equal'] else 'DIFFERENT from'} the uninterrupted run's "
    f"({result['steps']} steps). Damaged checkpoints set aside: {', '.join(result['damaged_set_aside']) or 'none'}. "
    f"Time: {result['faulty_seconds']:.0f} s with faults vs {result['reference_seconds']:.0f} s uninterrupted "
    f"({result['faulty_seconds'] - result['reference_seconds']:.0f} s lost).",
  ]
  bad = [f for f in faults if not f["ok"]]
  for f in bad:
    lines.append(f"- FAILED: {f['kind']} in {f['phase']} (process {f['attempt']}):{f['note']}")
  return "\n".join(lines) + "\n"


def define_flags():
  flags.DEFINE_string("config", "tests/tiny_virtex.py", "Config path (with :ARG) as vlrep.main takes it.")
  flags.DEFINE_string("workdir", None, "Where the reference and the faulty run go (both are started afresh).")
  flags.DEFINE_integer("kills", 30, "Faults to inject.")
  flags.DEFINE_list("overrides", [], "KEY=VALUE config overrides for both runs (without --config.).")
  flags.DEFINE_integer("seed", 0, "Seed of the fault schedule and delays.")
  flags.DEFINE_list("phases", list(PHASES), "Phases to inject SIGTERM and SIGKILL into ('eval' needs an evaluator).")
  flags.DEFINE_integer("disk_bytes", 64 << 10, "RLIMIT_FSIZE of the full-disk process: smaller than a checkpoint.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  result = harness(f.config, f.workdir, f.kills, f.overrides, f.seed, f.disk_bytes, phases=tuple(f.phases))
  print(table(result))
  if not result["ok"]:
    sys.exit(1)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
