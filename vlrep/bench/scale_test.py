r"""Data-at-scale test: two processes train from on-disk datasets of growing size; memory stays flat, each process
reads only what it needs of its own share, input speed matches the in-memory path, and a killed run resumes to
bit-identical parameters.

  python -m vlrep.bench.scale_test --workdir=/tmp/vlrep_scale --sizes=20k,200k --steps=300

Each size is `synthetic_scenes/scale<size>` (2k, 20k or 200k 64x64 training scenes), prepared into --data_dir
on first use with `python -m vlrep.data.prepare` (ArrayRecord; 200k takes minutes).
On each size, --config trains for --steps in two processes forming one JAX runtime over 127.0.0.1, exactly as two
hosts do (--devices_per_process CPU devices each): once reading its records from disk (the default) and once with
`data.in_memory=True` (--modes). On the largest size a third pair, reading from disk, is restarted after
process 1 is SIGKILLed at a random step past the first checkpoint (process 0 stops by itself within
--heartbeat_timeout, as when a node dies), and the restarted pair's final parameters are compared with the
uninterrupted run's.

Reported per run, from the processes' own log lines (`Input (process i): read N records ...; peak RSS`,
`[k/N] ... images/s`): each process's peak resident memory (VmHWM), the records it read against its share of the
split, and training images/s per CPU core (median and range of the log windows after the first). Checks, exit
code 1 when one fails:

  * from disk, a process that trains on at most half its share reads less than its share (only what its batches
    need, and the few read ahead);
  * from disk, a process's peak RSS grows from the smallest to the largest size by less than a tenth of what the
    in-memory path holds for that growth (the share's encoded records);
  * from disk, images/s per core is at least 90% of the in-memory path's, on every size;
  * the killed and restarted pair ends with the uninterrupted pair's parameter fingerprint, on both processes.

The tokenizer is trained on the `val` split (tokenizer.corpus_split): otherwise process 0 would read every
caption of the training split once to build it. WORKDIR/scale.md holds the table, WORKDIR/scale.json every figure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags, logging

from vlrep.bench import forkserver

_STEP_LINE = re.compile(r"\] \[(\d+)/(\d+)\] loss [-\d.naninf]+ \| [\d.]+ steps/s, ([\d.]+) images/s")
_INPUT_LINE = re.compile(
  r"Input \(process (\d+)\): read (\d+) records of (\S+) \((\d+) examples\) for (\d+) training examples; "
  r"peak RSS ([\d.]+) GB"
)
_FINGERPRINT = re.compile(r"Parameter fingerprint \(process (\d+)\): (\w+)")
_SIZES = {"2k": 2_000, "20k": 20_000, "200k": 200_000}


def prepare(server: forkserver.Server, size: str, data_dir: str, workdir: str) -> None:
  """Generates synthetic_scenes/scale<size> into `data_dir` unless it is there (output: WORKDIR/prepare_<size>.log)."""
  if os.path.isdir(os.path.join(data_dir, "synthetic_scenes", f"scale{size}")):
    return
  cmd = ["vlrep.data.prepare", "--dataset=synthetic_scenes", f"--config_name=scale{size}", f"--data_dir={data_dir}"]
  log_path = os.path.join(workdir, f"prepare_{size}.log")
  logging.info("Preparing: python -m %s (output: %s)", " ".join(cmd), log_path)
  t0 = time.time()
  code = server.start(cmd, stdout=log_path).wait()
  if code:
    raise RuntimeError(f"Preparing scale{size} failed (exit {code}):\n{open(log_path).read()[-3000:]}")
  logging.info("Prepared scale%s in %.0f s.", size, time.time() - t0)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(devices_per_process: int) -> dict[str, str]:
  """The environment of one process of a local multi-process launch: `devices_per_process` CPU devices, unbuffered
  output, and no inherited JAX_COMPILATION_CACHE_DIR (the launch names its own cache with --compilation_cache)."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}"
  return env


def start_pair(server: forkserver.Server, run_dir: str, config: str, overrides, heartbeat_timeout: int, cache: str):
  """Two `vlrep.main` processes of one runtime, training into RUN_DIR/run; logs RUN_DIR/log<i>.txt (appended).
  They are forked from `server`, started in `process_env`'s environment (its device count).

  `cache`, their compilation cache, is empty when the pair starts or was filled by pairs that have ended, never
  one that other running processes fill: then a process could load an executable that its partner still compiles
  and wait for it at a collective past Gloo's 30 s, and the pair fails ("Gloo context initialization failed:
  DEADLINE_EXCEEDED"). What the pair itself adds was compiled by one of them, so loading it can only let a process
  that is behind catch up."""
  os.makedirs(run_dir, exist_ok=True)
  port = free_port()
  procs = []
  for i in range(2):
    cmd = ["vlrep.main", f"--config={config}", f"--workdir={run_dir}/run"]
    cmd += [f"--config.{o}" for o in overrides]
    cmd += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"]
    cmd += [f"--heartbeat_timeout={heartbeat_timeout}", f"--compilation_cache={cache}"]
    procs.append(server.start(cmd, stdout=os.path.join(run_dir, f"log{i}.txt"), append=True))
  return procs


def logs(run_dir: str) -> list[str]:
  return [open(os.path.join(run_dir, f"log{i}.txt")).read() for i in range(2)]


def wait_pair(procs, run_dir: str, timeout: float) -> list[str]:
  deadline = time.time() + timeout
  for p in procs:
    try:
      p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  texts = logs(run_dir)
  if any(p.returncode for p in procs):
    tails = "\n".join(
      f"--- process {i} (exit {p.returncode}):\n{t[-3000:]}" for i, (p, t) in enumerate(zip(procs, texts, strict=True))
    )
    raise RuntimeError(f"A training process failed in {run_dir}:\n{tails}")
  return texts


def measure(texts: list[str]) -> dict:
  """Per process: records read, the split's size, peak RSS; the run's images/s windows and fingerprints."""
  out = {"processes": [], "fingerprints": {}}
  for text in texts:
    m = _INPUT_LINE.search(text)
    if not m:
      raise RuntimeError(f"No 'Input (process i): ...' line in the log:\n{text[-3000:]}")
    out["processes"].append(
      {
        "process": int(m.group(1)),
        "records_read": int(m.group(2)),
        "split_size": int(m.group(4)),
        "examples_trained": int(m.group(5)),
        "peak_rss_gb": float(m.group(6)),
      }
    )
    for proc, fingerprint in _FINGERPRINT.findall(text):
      out["fingerprints"][int(proc)] = fingerprint
  windows = [float(m.group(3)) for m in _STEP_LINE.finditer(texts[0])][1:]  # the first holds compilation
  if not windows:
    raise RuntimeError("Fewer than two '[k/N] ... images/s' log windows: raise --steps or lower log_every_steps.")
  cores = os.cpu_count() or 1
  per_core = [w / cores for w in windows]
  out["images_per_sec_per_core"] = {
    "median": statistics.median(per_core),
    "min": min(per_core),
    "max": max(per_core),
    "windows": len(per_core),
  }
  return out


def kill_and_resume(server, run_dir, config, overrides, steps, every, heartbeat_timeout, rng, timeout, cache) -> dict:
  """SIGKILLs process 1 at a random step after the first checkpoint, lets process 0 stop on its own, restarts the
  pair with the same command until it finishes; returns the kill step, the step resumed from, and fingerprints."""
  # At most steps - 2: a step to spare, so that the run cannot end before the kill.
  kill_step = max(every + 1, min(int(rng.integers(every + 1, steps)), steps - 2))
  procs = start_pair(server, run_dir, config, [*overrides, "log_every_steps=1"], heartbeat_timeout, cache)
  deadline = time.time() + timeout
  while time.time() < deadline and procs[0].poll() is None:
    steps_seen = [int(m.group(1)) for m in _STEP_LINE.finditer(logs(run_dir)[0])]
    if steps_seen and steps_seen[-1] >= kill_step:
      break
    time.sleep(0.05)
  killed_at = max([int(m.group(1)) for m in _STEP_LINE.finditer(logs(run_dir)[0])], default=0)
  if killed_at < kill_step or killed_at >= steps:
    raise RuntimeError(f"The pair to kill did not reach step {kill_step}:\n{logs(run_dir)[0][-3000:]}")
  procs[1].send_signal(signal.SIGKILL)
  t0 = time.time()
  procs[0].wait(timeout=heartbeat_timeout + 120)
  survivor_seconds = time.time() - t0
  resumed = start_pair(server, run_dir, config, overrides, heartbeat_timeout, cache)
  texts = wait_pair(resumed, run_dir, timeout)
  found = re.findall(r"Resumed from step (\d+)", texts[0])
  return {
    "kill_step": kill_step,
    "killed_at_log_step": killed_at,
    "survivor_exit_code": procs[0].returncode,
    "survivor_seconds": survivor_seconds,
    "resumed_from": int(found[-1]) if found else None,
    "fingerprints": measure(texts)["fingerprints"],
  }


def scale_test(
  workdir: str,
  data_dir: str,
  sizes,
  steps: int,
  config: str,
  overrides=(),
  modes=("disk", "memory"),
  devices_per_process: int = 1,
  heartbeat_timeout: int = 10,
  kill: bool = True,
  seed: int = 0,
  timeout: float = 3600,
  checkpoint_every: int = 0,
) -> dict:
  """Runs the test (see the module docstring); returns every figure and `failures` (empty when all checks hold).
  Checkpoints every `checkpoint_every` steps (0: a sixth of the run)."""
  every = checkpoint_every or max(1, steps // 6)
  # The killed pair dies after its first checkpoint and before its last step but one (kill_and_resume).
  if checkpoint_every < 0 or (kill and every + 1 > steps - 2):
    raise ValueError(
      f"checkpoint_every={checkpoint_every} with steps={steps}: the kill needs a checkpoint before step {steps - 2} "
      "(0 <= checkpoint_every <= steps - 3; 0 checkpoints every sixth of the run)."
    )
  base = [
    f"total_steps={steps}",
    f"checkpoint.every_steps={every}",
    "checkpoint.async_save=False",
    "evals={}",
    f"log_every_steps={max(1, steps // 15)}",
    f"data.data_dir={data_dir}",
    "tokenizer.corpus_split=val",
    *overrides,
  ]
  result = {"sizes": list(sizes), "steps": steps, "config": config, "overrides": base, "runs": {}, "failures": []}
  failures = result["failures"]
  # Every process (the pairs, the preparation) is forked from one pre-warmed server (vlrep.bench.forkserver), in
  # a local multi-process launch's environment: a fresh interpreter would import JAX, TensorFlow and the rest again.
  server = forkserver.Server(process_env(devices_per_process))
  try:
    for size in sizes:
      prepare(server, size, data_dir, workdir)
      for mode in modes:
        name = f"{size}_{mode}"
        run_dir = os.path.join(workdir, name)
        if os.path.isdir(run_dir):
          raise FileExistsError(f"{run_dir} exists: give the test a fresh --workdir.")
        opts = [*base, f"data.config_name=scale{size}", f"data.in_memory={mode == 'memory'}"]
        logging.info("Training %s (%d steps, two processes) in %s", name, steps, run_dir)
        procs = start_pair(server, run_dir, config, opts, heartbeat_timeout, f"{run_dir}/jax_cache")
        run = measure(wait_pair(procs, run_dir, timeout))
        result["runs"][name] = run
        for p in run["processes"]:
          share = len(range(p["process"], p["split_size"], 2))
          p["share"] = share
          logging.info(
            "%s process %d: read %d of its %d records; peak RSS %.3f GB",
            name,
            p["process"],
            p["records_read"],
            share,
            p["peak_rss_gb"],
          )
          # Only a run that needs at most half its share can show that it reads no more than it needs.
          if mode == "disk" and 2 * p["examples_trained"] <= share and p["records_read"] >= share:
            failures.append(
              f"{name}: process {p['process']} read {p['records_read']} records, its whole share ({share})"
            )
        logging.info("%s: %.1f images/s per core (median)", name, run["images_per_sec_per_core"]["median"])
        if len(set(run["fingerprints"].values())) != 1:
          failures.append(f"{name}: the processes' parameters differ: {run['fingerprints']}")

    runs_ = result["runs"]
    if "disk" in modes and "memory" in modes:
      for size in sizes:
        disk, memory = runs_[f"{size}_disk"], runs_[f"{size}_memory"]
        ratio = disk["images_per_sec_per_core"]["median"] / memory["images_per_sec_per_core"]["median"]
        result.setdefault("disk_over_memory_images_per_sec", {})[size] = ratio
        if ratio < 0.9:
          failures.append(f"{size}: from disk, {ratio:.1%} of the in-memory path's images/s per core (< 90%)")
      if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        for mode in ("disk", "memory"):
          result.setdefault("rss_growth_gb", {})[mode] = [
            b["peak_rss_gb"] - a["peak_rss_gb"]
            for a, b in zip(runs_[f"{small}_{mode}"]["processes"], runs_[f"{large}_{mode}"]["processes"], strict=True)
          ]
        for i, (d, m) in enumerate(
          zip(result["rss_growth_gb"]["disk"], result["rss_growth_gb"]["memory"], strict=True)
        ):
          if d >= 0.1 * m:
            failures.append(
              f"process {i}: peak RSS from disk grew {d:.3f} GB from {small} to {large} (in memory: {m:.3f} GB)"
            )

    if kill:
      size = sizes[-1]
      reference = runs_[f"{size}_disk"]["fingerprints"] if "disk" in modes else None
      opts = [*base, f"data.config_name=scale{size}", "data.in_memory=False"]
      rng = np.random.default_rng(seed)
      logging.info("Killing and resuming a pair on %s", size)
      run_dir = os.path.join(workdir, f"{size}_killed")
      # The uninterrupted disk pair's cache (it has ended): the same executables, not compiled again.
      cache = os.path.join(workdir, f"{size}_disk" if "disk" in modes else f"{size}_killed", "jax_cache")
      killed = kill_and_resume(
        server,
        run_dir,
        config,
        opts,
        steps,
        every,
        heartbeat_timeout,
        rng,
        timeout,
        cache,
      )
      result["kill"] = killed
      if reference is not None:
        killed["reference_fingerprints"] = reference
        killed["bit_identical"] = killed["fingerprints"] == reference
        if not killed["bit_identical"]:
          failures.append(
            f"resumed after a SIGKILL at step {killed['kill_step']}: {killed['fingerprints']} != {reference}"
          )
      if not killed["resumed_from"]:
        failures.append(f"the restarted pair did not resume from a checkpoint: {killed}")
  finally:
    server.close()

  with open(os.path.join(workdir, "scale.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(workdir, "scale.md"), "w") as f:
    f.write(table(result))
  return result


def table(result: dict) -> str:
  lines = [
    "| dataset | storage | peak RSS per process, GB | records read for examples trained (share), per process "
    "| images/s per core: median (range) |",
    "| --- | --- | --- | --- | --- |",
  ]
  for name, run in result["runs"].items():
    size, mode = name.split("_")
    procs = run["processes"]
    rss = " / ".join(f"{p['peak_rss_gb']:.3f}" for p in procs)
    read = " / ".join(f"{p['records_read']:,} for {p['examples_trained']:,} ({p['share']:,})" for p in procs)
    ips = run["images_per_sec_per_core"]
    lines.append(
      f"| scale{size} ({procs[0]['split_size']:,}) | {mode} | {rss} | {read} "
      f"| {ips['median']:.1f} ({ips['min']:.1f}-{ips['max']:.1f}) |"
    )
  out = "\n".join(lines) + "\n"
  if "kill" in result:
    k = result["kill"]
    out += (
      f"\nSIGKILL of process 1 at step {k['kill_step']} (of {result['steps']}); process 0 stopped in "
      f"{k['survivor_seconds']:.1f} s; resumed from step {k['resumed_from']}; final parameters "
      f"{'bit-identical to' if k.get('bit_identical') else 'DIFFERENT from'} the uninterrupted run's.\n"
    )
  if result["failures"]:
    out += "\nFailed checks:\n" + "".join(f"- {x}\n" for x in result["failures"])
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  unknown = [s for s in f.sizes if s not in _SIZES]
  if unknown:
    raise app.UsageError(f"--sizes takes {', '.join(_SIZES)}; got {unknown}")
  os.makedirs(f.workdir, exist_ok=True)
  result = scale_test(
    f.workdir,
    os.path.abspath(os.path.expanduser(f.data_dir or os.path.join(f.workdir, "data"))),
    f.sizes,
    f.steps,
    f.config,
    f.overrides,
    tuple(f.modes),
    f.devices_per_process,
    f.heartbeat_timeout,
    f.kill,
    f.seed,
    checkpoint_every=f.checkpoint_every,
  )
  print(table(result))
  sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "Where the runs, scale.md and scale.json go (a fresh folder).")
  flags.DEFINE_string("data_dir", None, "Where the scale<size> datasets are prepared (default WORKDIR/data).")
  flags.DEFINE_list("sizes", ["20k", "200k"], "Dataset sizes, smallest first: 2k, 20k, 200k.")
  flags.DEFINE_integer("steps", 300, "Training steps per run.")
  flags.DEFINE_string("config", "tests/tiny_virtex.py", "The run config (its data is replaced by scale<size>).")
  flags.DEFINE_list("overrides", ["batch_size=64"], "KEY=VALUE config overrides for every run (without --config.).")
  flags.DEFINE_list("modes", ["disk", "memory"], "Storage paths to train from: disk, memory.")
  flags.DEFINE_integer("devices_per_process", 1, "CPU devices per process.")
  flags.DEFINE_integer("heartbeat_timeout", 10, "Seconds after which the survivor of the killed pair stops.")
  flags.DEFINE_bool("kill", True, "Kill and resume a pair on the largest size.")
  flags.DEFINE_integer("seed", 0, "Seed of the kill step.")
  flags.DEFINE_integer("checkpoint_every", 0, "Steps between checkpoints (0: a sixth of --steps).")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
