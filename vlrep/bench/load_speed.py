r"""How long a user waits to use a shared model: a fresh Python process that imports vlrep, loads a folder
(`vlrep.load`) and captions or zero-shot classifies one photo, compile included, timed phase by phase.

  python -m vlrep.bench.load_speed --model=/tmp/vlrep_virtex_shared --task=caption --repeats=5
  python -m vlrep.bench.load_speed --model=/tmp/clip_shared --task=zero_shot --repeats=5

Each repeat is a new process (nothing cached in memory; XLA's persistent compilation cache is not used by
vlrep.load), started with this interpreter; the photo is scikit-image's `astronaut` written to a PNG. Per phase
(import, load, first call, a second call on another photo) and in total (from before `import vlrep` to the first
result), the median over repeats and the fastest and slowest are printed, with the process's wall time
from its start (interpreter start-up included) beside them. `--json_out` writes them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from PIL import Image

from vlrep import safe_files

TASKS = ("caption", "zero_shot")
LABELS = ("circle", "square", "triangle", "star", "ring", "disc", "cross", "heart", "hexagon", "diamond")

# The child: times each phase with the same clock from before `import vlrep`.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import vlrep
import vlrep.inference  # what vlrep.load imports on first use: timed as the import
t_import = time.perf_counter()
model = vlrep.load(sys.argv[1])
t_load = time.perf_counter()
task, photo, other = sys.argv[2], sys.argv[3], sys.argv[4]
run = (lambda p: model.caption([p])) if task == "caption" else (lambda p: model.zero_shot([p], sys.argv[5].split(",")))
first = run(photo)
t_first = time.perf_counter()
run(other)
t_second = time.perf_counter()
out = first if task == "caption" else first["top"][0][0][0]
print(json.dumps({"import": t_import - t0, "load": t_load - t_import, "first_call": t_first - t_load,
                  "second_call": t_second - t_first, "total": t_first - t0, "result": out}))
"""


def photos(folder: str) -> tuple[str, str]:
  """Two real photographs (scikit-image's astronaut and chelsea) as PNG files in `folder`."""
  from skimage import data  # a test dependency (setup.py's [test]), needed by this benchmark only

  paths = []
  for name in ("astronaut", "chelsea"):
    path = os.path.join(folder, f"{name}.png")
    Image.fromarray(getattr(data, name)()).save(path)
    paths.append(path)
  return paths[0], paths[1]


def time_once(model: str, task: str, photo: str, other: str) -> dict:
  """One fresh process's phase times (seconds) and its wall time from start to exit."""
  start = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, "-c", CHILD, model, task, photo, other, ",".join(LABELS)], capture_output=True, text=True
  )
  wall = time.perf_counter() - start
  if proc.returncode != 0:
    raise RuntimeError(f"The timed process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  return {**out, "process_wall": wall}


def summarize(times: list[dict]) -> dict:
  """{phase: {'median', 'min', 'max'}} over the repeats."""
  phases = ("import", "load", "first_call", "second_call", "total", "process_wall")
  return {
    p: {
      "median": statistics.median(t[p] for t in times),
      "min": min(t[p] for t in times),
      "max": max(t[p] for t in times),
    }
    for p in phases
  }


def define_flags():
  flags.DEFINE_string("model", None, "A shared folder (or run folder) to load.")
  flags.DEFINE_enum("task", "caption", TASKS, "What to do with the photo.")
  flags.DEFINE_integer("repeats", 5, "Fresh processes to time.")
  flags.DEFINE_string("json_out", None, "Also write the figures as JSON here.")


def main(argv):
  del argv
  f = flags.FLAGS
  with tempfile.TemporaryDirectory() as tmp:
    photo, other = photos(tmp)
    times = [time_once(f.model, f.task, photo, other) for _ in range(f.repeats)]
  summary = summarize(times)
  print(f"{f.task} on one photo with {f.model}, {f.repeats} fresh processes, {os.cpu_count()} CPUs:")
  for phase, s in summary.items():
    print(f"  {phase:12s} median {s['median']:6.2f} s  (min {s['min']:.2f}, max {s['max']:.2f})")
  print(f"  result: {times[0]['result']}")
  if f.json_out:
    safe_files.write_json(f.json_out, {"model": f.model, "task": f.task, "repeats": times, "summary": summary})


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["model"])
  app.run(main)
