r"""Fault-injection harness: kills a training run again and again and checks that nothing is lost.

  python -m vlrep.bench.faults --config=tests/tiny_virtex.py --workdir=/tmp/faults --kills=30 \
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

With --processes=2 every run is a pair of processes forming one JAX distributed runtime over 127.0.0.1 (as the
hosts of a pod do; one device each unless --devices_per_process), and a fault hits one process or both:

  sigterm    to one process, or (target 'both') to both at moments up to 1.5 s apart: every process must stop
             after the same step, save it once, and exit 0 within the deadline
  sigkill    one process dies; the other must stop by itself within --heartbeat_timeout (and some slack)
  corrupt    as sigkill, then the newest checkpoint is truncated
  disk_full  one process runs on a "full disk": its save fails with the clear error

and the same command on both processes resumes. The arming lines are process 0's.

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

from vlrep import defaults, runs
from vlrep.bench import forkserver, scale_test

KINDS = ("sigterm", "sigkill", "corrupt", "disk_full")
PHASES = ("startup", "data", "init", "train", "checkpoint", "eval")
_ARMING_LINES = {"startup": "process 0/{processes}", "data": "Training stream over", "init": "parameters,"}
_STEP_LINE = re.compile(r"\] \[(\d+)/(\d+)\] loss")
_RESUMED = re.compile(r"Resumed from step (\d+)")
_STOPPED = re.compile(r"(?:Checkpoint at step|Nothing trained since step) (\d+)")
# A process of a multi-process run may stop this long after its peer died beyond --heartbeat_timeout (the runtime
# notices a missed heartbeat only at its next poll; then the process writes its error and exits).
_HEARTBEAT_SLACK_SECS = 30.0


@dataclasses.dataclass
class Fault:
  kind: str
  phase: str
  delay: float  # seconds after the arming line
  target: str = "0"  # the process it hits ("both": SIGTERM to every process, the later ones `spread` s later)
  spread: float = 0.0
  at_step: int | None = None  # train phase: armed this many steps after the resumed step (default: at random)
  attempt: int = 0
  injected: bool = False
  step_before: int = 0  # the newest intact checkpoint when the process started
  exit_code: int | None = None  # the targeted process's (the first targeted, for 'both')
  exit_codes: list | None = None  # every process's
  exit_seconds: float | None = (
    None  # SIGTERM: signal to every process's exit; a kill of one of several: to the survivors'
  )
  stopped_at: list | None = None  # SIGTERM: the step each process says it stopped after
  newest_after: int = 0  # the newest complete checkpoint when the process had ended
  resumed_from: int | None = None  # what the next process resumed from
  ok: bool = False
  note: str = ""


def schedule(kills: int, seed: int, phases=PHASES, processes: int = 1) -> list[Fault]:
  """`kills` faults in rounds: SIGTERM and SIGKILL in each of `phases`, a corruption and a full disk, in a random
  order (several processes: each aimed at a random one of them, and SIGTERM to every process once more in the
  train and checkpoint phases). A partial round takes one fault of each kind first, so that 4 or more faults cover
  every kind. A corruption never comes first (it needs two checkpoints)."""
  rng = np.random.default_rng(seed)
  one_round = [(k, p) for k in ("sigterm", "sigkill") for p in phases]
  one_round += [("corrupt", "train"), ("disk_full", "checkpoint")]
  if processes > 1:
    one_round += [("sigterm_all", p) for p in ("train", "checkpoint") if p in phases]
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
  faults = []
  for k, p in plan:
    fault = Fault(k, p, float(rng.uniform(0.0, 0.5)), target=str(int(rng.integers(processes))))
    if k == "sigterm_all":
      fault.kind, fault.target, fault.spread = "sigterm", "both", float(rng.uniform(0.2, 1.5))
    faults.append(fault)
  return faults


def complete_steps(workdir: str) -> list[int]:
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(p) for p in os.listdir(d) if p.isdigit()) if os.path.isdir(d) else []


class _Process:
  """A `vlrep.main` process (a session of its own) whose output is read line by line (a pipe: RLIMIT_FSIZE does
  not limit it)."""

  def __init__(self, server: forkserver.Server, argv, log_path, fsize_limit=0):
    self.lines: list[str] = []
    self.ended_at: float | None = None
    self.proc = server.start(argv, stdout=forkserver.PIPE)
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
    self.proc.wait()
    self.ended_at = time.time()

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


class _Run:
  """The processes of one launch of the run (one, or the processes of one distributed runtime): log lines are
  process 0's; `finish` waits for all of them."""

  def __init__(self, processes: list[_Process]):
    self.processes = processes

  def wait_for(self, predicate, timeout: float) -> bool:
    return self.processes[0].wait_for(predicate, timeout)

  def signal(self, target: str, sig: int) -> None:
    os.killpg(self.processes[int(target)].proc.pid, sig)

  def finish(self, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    return [p.finish(max(deadline - time.time(), 0.1)) for p in self.processes]

  def ended_at(self) -> list[float]:
    """When each process ended (time.time(); after `finish`)."""
    return [p.ended_at if p.ended_at is not None else time.time() for p in self.processes]

  @property
  def text(self) -> str:
    return self.processes[0].text

  @property
  def texts(self) -> list[str]:
    return [p.text for p in self.processes]


def _arming(fault: Fault, resumed: int, checkpoints: int, total, every_ckpt, every_eval, rng, processes=1):
  """The predicate on log lines that arms a fault (None: its phase does not come in this process). A corruption
  waits until two checkpoints exist (`checkpoints` exist when the process starts), so one intact one remains."""
  kind, phase = fault.kind, fault.phase
  if kind == "corrupt":
    target = (resumed // every_ckpt + max(1, 2 - checkpoints)) * every_ckpt + 1  # the step after that save
  elif phase in _ARMING_LINES:
    needle = _ARMING_LINES[phase].format(processes=processes)
    return lambda line: needle in line
  elif phase == "train":
    after = fault.at_step if fault.at_step is not None else int(rng.integers(2, 2 * every_ckpt + 1))
    target = min(total, resumed + after)
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
  processes: int = 1,
  devices_per_process: int = 1,
  heartbeat_timeout: int = 10,
  plan: list[Fault] | None = None,
) -> dict:
  """Runs the reference and the faulty run; -> {'faults': [...], 'equal': bool, 'ok': bool, ...}. `plan`: these
  faults, in this order, instead of `kills` drawn by `schedule`."""
  # Bad arguments fail before the reference run, not minutes later.
  if kills < 1:
    raise ValueError(f"--kills must be at least 1, got {kills}.")
  if processes < 1 or devices_per_process < 1:
    raise ValueError(
      f"--processes and --devices_per_process must be at least 1, got {processes}, {devices_per_process}."
    )
  if not phases or set(phases) - set(PHASES):
    raise ValueError(f"--phases must be among {PHASES}, got {list(phases)}.")
  if not os.path.exists(config.partition(":")[0]):
    raise FileNotFoundError(f"No config file {config.partition(':')[0]}.")
  # Every launch is forked from one pre-warmed server (vlrep.bench.forkserver): a fresh interpreter would import
  # JAX, TensorFlow and the rest again each time. Its environment is what the processes run in.
  env = scale_test.process_env(devices_per_process) if processes > 1 else None
  with forkserver.Server(env) as server:
    rng = np.random.default_rng(seed + 1)
    overrides = [*overrides, "log_every_steps=1"]
    reference, faulty = os.path.join(workdir, "reference"), os.path.join(workdir, "faulty")
    for d in (reference, faulty):
      if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "faulty.log")
    for i in range(processes):
      for path in (log_path, os.path.join(workdir, "reference.log")):
        open(_log_of(path, i), "w").close()

    cache = os.path.join(workdir, "jax_cache")

    def start(w, log, fsize_limit=0, limited="0") -> _Run:
      """A launch of the run: one process, or `processes` of one runtime (the full disk on process `limited`)."""
      cmd = ["vlrep.main", f"--config={config}", f"--workdir={w}"]
      cmd += [f"--config.{o}" for o in overrides]
      if processes == 1:
        return _Run([_Process(server, cmd, log, fsize_limit)])
      # The processes share a compilation cache that only launches before them filled (see scale_test.start_pair).
      cmd += [f"--coordinator_address=127.0.0.1:{scale_test.free_port()}", f"--num_processes={processes}"]
      cmd += [f"--heartbeat_timeout={heartbeat_timeout}", f"--compilation_cache={cache}"]
      return _Run(
        [
          _Process(server, [*cmd, f"--process_id={i}"], _log_of(log, i), fsize_limit if str(i) == limited else 0)
          for i in range(processes)
        ]
      )

    t0 = time.time()
    ref = start(reference, os.path.join(workdir, "reference.log"))
    if any(ref.finish(attempt_timeout)):
      raise RuntimeError(f"The reference run failed; see {workdir}/reference.log:\n{ref.text[-3000:]}")
    reference_seconds = time.time() - t0
    saved = runs.read_config(reference)
    total = int(saved.total_steps)
    every_ckpt = int(saved.checkpoint.every_steps)
    every_eval = min([int(e.get("every_steps", 0)) or total for e in saved.get("evals", {}).values()] or [0])
    deadline = float(saved.checkpoint.get("exit_deadline_secs", defaults.EXIT_DEADLINE_SECS))
    logging.info("Reference: %d steps in %.0f s (checkpoint every %d).", total, reference_seconds, every_ckpt)

    faults = list(plan) if plan is not None else schedule(kills, seed, phases, processes)
    queue = list(faults)
    expect: list = []  # [(fault, the step the next process that restores must resume from)]

    def check_resume(run: _Run):
      """Once a launch got as far as restoring: did every process resume from the step the last faults left?"""
      texts = [t for t in run.texts if _RESUMED.search(t) or "parameters," in t]
      if not texts:
        return  # it ended before restoring: the next launch is checked
      resumed = {int(m.group(1)) if (m := _RESUMED.search(t)) else 0 for t in texts}
      for fault, want in expect:
        fault.resumed_from = min(resumed)
        if resumed != {want}:
          fault.ok, fault.note = False, fault.note + f" resumed from step(s) {sorted(resumed)}, expected {want};"
      expect.clear()

    def expect_resume(fault):
      """A fault whose process did not restore leaves the checkpoints as they were, so an earlier fault still
      waiting for its check expects the same step, unless this fault changed the newest one (a corruption)."""
      for earlier, want in expect:
        if want != fault.newest_after:
          earlier.note += f" its resume check passed to the next fault (step {fault.newest_after});"
      expect[:] = [(f, fault.newest_after) for f, _ in expect] + [(fault, fault.newest_after)]

    # Checkpoints the harness truncated stay on disk until a restore sets them aside (damaged_<step>); a launch
    # killed before restoring leaves them there, and the resume is still expected from the newest intact one.
    corrupted: dict[int, int] = {}  # step -> how many damaged_<step>* directories existed when it was truncated

    def set_aside(step: int) -> int:
      root = os.path.join(faulty, "checkpoints")
      return len([d for d in os.listdir(root) if re.fullmatch(rf"damaged_{step}(\.\d+)?", d)])

    def intact_steps() -> list[int]:
      for step in [step for step, n in corrupted.items() if set_aside(step) > n]:
        del corrupted[step]
      return [step for step in complete_steps(faulty) if step not in corrupted]

    t0 = time.time()
    attempt = 0
    while True:
      attempt += 1
      before = intact_steps()
      newest_before = before[-1] if before else 0
      resumes_at = expect[-1][1] if expect else newest_before
      intact = len([step for step in before if step <= resumes_at])
      armed = ((f, _arming(f, resumes_at, intact, total, every_ckpt, every_eval, rng, processes)) for f in queue)
      fault, arm = next(((f, a) for f, a in armed if f.kind == "disk_full" or a is not None), (None, None))
      if fault is None:  # no fault can come any more: the run goes to its end
        p = start(faulty, log_path)
        codes = p.finish(attempt_timeout)
        check_resume(p)
        if any(codes):
          raise RuntimeError(f"The last launch failed (exit {codes}); see {log_path}:\n{p.text[-3000:]}")
        break
      queue.remove(fault)
      fault.attempt, fault.step_before = attempt, resumes_at
      if fault.kind == "disk_full":  # the whole process runs on a "full disk": its next save must fail clearly
        p = start(faulty, log_path, fsize_limit=disk_bytes, limited=fault.target)
        fault.injected = True
        fault.exit_codes = p.finish(attempt_timeout)
        fault.exit_code = fault.exit_codes[int(fault.target)]
        check_resume(p)
        after = intact_steps()
        text = p.texts[int(fault.target)]
        clear = "CheckpointSaveError" in text and "are untouched" in text
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
        codes = p.finish(attempt_timeout)
        check_resume(p)
        if any(codes):
          raise RuntimeError(f"A launch ended (exit {codes}) before its fault; see {log_path}:\n{p.text[-3000:]}")
        queue.insert(0, fault)  # the run finished first: the fault never armed
        break
      time.sleep(fault.delay)
      fault.injected = True
      sent = time.time()
      targets = [str(i) for i in reversed(range(processes))] if fault.target == "both" else [fault.target]
      for k, target in enumerate(targets):
        if k:
          time.sleep(fault.spread)
        p.signal(target, signal.SIGTERM if fault.kind == "sigterm" else signal.SIGKILL)
      fault.exit_codes = p.finish(attempt_timeout)
      fault.exit_code = fault.exit_codes[int(targets[0])]
      check_resume(p)
      after = intact_steps()
      fault.newest_after = after[-1] if after else 0
      fault.ok = fault.newest_after >= resumes_at  # (a corrupted newest one is set aside by the restore: not lost)
      if not fault.ok:
        fault.note += f" the newest intact checkpoint went from {resumes_at} to {fault.newest_after};"
      survivors = [i for i in range(processes) if str(i) not in targets]
      if fault.kind == "sigterm":
        fault.exit_seconds = max(p.ended_at()) - sent
        if fault.exit_seconds > deadline:
          fault.ok, fault.note = False, fault.note + f" exit took {fault.exit_seconds:.1f} s;"
        summary = (
          json.load(open(os.path.join(faulty, "summary.json")))
          if os.path.exists(os.path.join(faulty, "summary.json"))
          else {}
        )
        if (
          all(code == 0 for code in fault.exit_codes) and summary.get("steps") == total and not summary.get("preempted")
        ):
          # Several processes stop at the step JAX's preemption service agrees on, which its notice reaches up to
          # about a second after the signal: a run that ends first simply finishes.
          fault.note += " the run finished before the agreed stop step;"
          if processes == 1:
            fault.ok, fault.note = False, fault.note + " (one process stops at its next step);"
        elif all(code == 0 for code in fault.exit_codes):
          stopped = [_STOPPED.findall(t) for t in p.texts]
          fault.stopped_at = [int(m[-1]) if m else None for m in stopped]
          if len(set(fault.stopped_at)) != 1:  # every process stops after the same step
            fault.ok, fault.note = False, fault.note + f" processes stopped after steps {fault.stopped_at};"
          s = summary
          if not (s.get("preempted") is True and s.get("steps") == fault.newest_after and s.get("seconds", 0) > 0):
            fault.ok = False
            fault.note += f" summary.json: preempted={s.get('preempted')}, steps={s.get('steps')};"
          if f"Preempted (SIGTERM) after {s.get('steps')} steps" not in p.text:  # what the console tells the user
            fault.ok, fault.note = False, fault.note + " the console does not say it was preempted;"
        elif fault.exit_code == -signal.SIGTERM and "parameters," not in p.texts[int(targets[0])]:
          fault.note += " ended by the signal itself (before any handler: nothing to save);"
          if survivors:
            _check_survivors(fault, p, survivors, sent, heartbeat_timeout)
        else:
          fault.ok, fault.note = False, fault.note + f" exit codes {fault.exit_codes};"
      elif survivors:  # a process died: the others stop by themselves
        _check_survivors(fault, p, survivors, sent, heartbeat_timeout)
      if fault.kind == "corrupt":
        if len(after) >= 2:
          corrupted[after[-1]] = set_aside(after[-1])
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
      "processes_per_launch": processes,
      "devices_per_process": devices_per_process,
      "heartbeat_timeout": heartbeat_timeout,
      "launches": attempt,
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


def _check_survivors(fault: Fault, run: _Run, survivors: list[int], sent: float, heartbeat_timeout: float) -> None:
  """The processes a fault did not hit stop by themselves within the heartbeat timeout (and some slack)."""
  ended = run.ended_at()
  fault.exit_seconds = max(ended[i] for i in survivors) - sent
  if fault.exit_seconds > heartbeat_timeout + _HEARTBEAT_SLACK_SECS:
    fault.ok, fault.note = False, fault.note + f" the other processes took {fault.exit_seconds:.0f} s to stop;"


def _log_of(path: str, process: int) -> str:
  """Process 0 logs to `path`, process i to path's name with .i before the extension."""
  return path if process == 0 else f"{os.path.splitext(path)[0]}.{process}.log"


def table(result: dict) -> str:
  """Markdown: faults by kind, target and phase (injected / survived), exit times, the verdict."""
  faults = [f for f in result["faults"] if f["injected"]]
  several = result.get("processes_per_launch", 1) > 1
  when = "SIGTERM: to every process's exit" + ("; a process killed: to the others' stop" if several else "")
  lines = [f"| fault | phase | injected | survived | {when}, s (median, max) |", "|---|---|---|---|---|"]
  for kind in KINDS:
    for target, label in (("one", kind), ("both", f"{kind} to every process")) if several else (("one", kind),):
      for phase in PHASES:
        group = [
          f
          for f in faults
          if f["kind"] == kind and f["phase"] == phase and (f["target"] == "both") == (target == "both")
        ]
        if not group:
          continue
        times = [f["exit_seconds"] for f in group if f["exit_seconds"] is not None]
        t = f"{statistics.median(times):.1f}, {max(times):.1f}" if times else ""
        lines.append(f"| {label} | {phase} | {len(group)} | {sum(f['ok'] for f in group)} | {t} |")
  missed = len(result["faults"]) - len(faults)
  per = result.get("processes_per_launch", 1)
  launches = f"{result['launches']} launches of {per} processes" if several else f"{result['launches']} processes"
  lines += [
    "",
    f"{len(faults)} faults injected ({missed} never armed) over {launches}; "
    f"{sum(f['ok'] for f in faults)} survived. Final parameters and model state "
    f"{'bit-identical to' if result['equal'] else 'DIFFERENT from'} the uninterrupted run's "
    f"({result['steps']} steps). Damaged checkpoints set aside: {', '.join(result['damaged_set_aside']) or 'none'}. "
    f"Time: {result['faulty_seconds']:.0f} s with faults vs {result['reference_seconds']:.0f} s uninterrupted "
    f"({result['faulty_seconds'] - result['reference_seconds']:.0f} s lost).",
  ]
  bad = [f for f in faults if not f["ok"]]
  for f in bad:
    where = f" to process {f['target']}" if several else ""
    lines.append(f"- FAILED: {f['kind']}{where} in {f['phase']} (launch {f['attempt']}):{f['note']}")
  return "\n".join(lines) + "\n"


def define_flags():
  flags.DEFINE_string("config", "tests/tiny_virtex.py", "Config path (with :ARG) as vlrep.main takes it.")
  flags.DEFINE_string("workdir", None, "Where the reference and the faulty run go (both are started afresh).")
  flags.DEFINE_integer("kills", 30, "Faults to inject.")
  flags.DEFINE_list("overrides", [], "KEY=VALUE config overrides for both runs (without --config.).")
  flags.DEFINE_integer("seed", 0, "Seed of the fault schedule and delays.")
  flags.DEFINE_list("phases", list(PHASES), "Phases to inject SIGTERM and SIGKILL into ('eval' needs an evaluator).")
  flags.DEFINE_integer("disk_bytes", 64 << 10, "RLIMIT_FSIZE of the full-disk process: smaller than a checkpoint.")
  flags.DEFINE_integer("processes", 1, "Processes per launch: 2 or more form one JAX distributed runtime on 127.0.0.1.")
  flags.DEFINE_integer("devices_per_process", 1, "CPU devices per process when --processes > 1.")
  flags.DEFINE_integer("heartbeat_timeout", 10, "--heartbeat_timeout of a multi-process launch: the survivors' stop.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  result = harness(
    f.config,
    f.workdir,
    f.kills,
    f.overrides,
    f.seed,
    f.disk_bytes,
    phases=tuple(f.phases),
    processes=f.processes,
    devices_per_process=f.devices_per_process,
    heartbeat_timeout=f.heartbeat_timeout,
  )
  print(table(result))
  if not result["ok"]:
    sys.exit(1)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
