"""vlrep.bench.device_turns: benchmark processes on one accelerator compile together and time one at a time."""

import json
import subprocess
import sys
import time

from vlrep.bench import device_turns

# A party: joins, "compiles" for its first argument's seconds, then "times" for 0.3 s inside its turn and prints
# when it held the device.
PARTY = """
import json, sys, time
from vlrep.bench import device_turns
folder, parties, deadline, compile_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
turns = device_turns.join(folder, parties, deadline, optional=sys.argv[5] == "optional")
time.sleep(compile_s)
ready_at = time.time()
with device_turns.turn(turns, poll_s=0.02) as info:
  time.sleep(0.3)
print(json.dumps(dict(info, ready_at=ready_at)))
"""


def start(folder, parties, deadline, compile_s, optional=False):
  args = [str(folder), str(parties), str(deadline), str(compile_s), "optional" if optional else "required"]
  return subprocess.Popen([sys.executable, "-c", PARTY, *args], stdout=subprocess.PIPE, text=True)


def test_turns_start_after_every_party_is_ready_and_never_overlap(tmp_path):
  deadline = time.time() + 60
  procs = [start(tmp_path, 3, deadline, s) for s in (0.0, 0.8, 0.4)]
  infos = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
  last_ready = max(i["ready_at"] for i in infos)
  held = sorted((i["held_from"], i["held_until"]) for i in infos)
  # Nobody times while another party still compiles ...
  assert all(start_ >= last_ready for start_, _ in held), (held, last_ready)
  # ... and the turns follow one another.
  assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(held, held[1:], strict=False)), held
  assert all(i["ready"] == 3 and i["killed"] == [] for i in infos)


def test_an_optional_party_still_compiling_at_the_deadline_is_killed_and_the_others_go_on(tmp_path):
  late = start(tmp_path, 2, time.time() + 60, 30.0, optional=True)  # would compile for 30 s
  time.sleep(0.5)  # registered
  on_time = start(tmp_path, 2, time.time() + 1.5, 0.0)
  info = json.loads(on_time.communicate(timeout=30)[0])
  assert info["killed"] == [late.pid] and info["waited_s"] < 5
  assert late.wait(timeout=10) == -9


def test_a_required_party_still_compiling_at_the_deadline_is_waited_for(tmp_path):
  deadline = time.time() + 0.5
  slow = start(tmp_path, 2, deadline, 2.0)  # required: compiles past the deadline
  fast = start(tmp_path, 2, deadline, 0.0)
  info, slow_info = (json.loads(p.communicate(timeout=30)[0]) for p in (fast, slow))
  assert info["killed"] == [] and slow.returncode == 0
  assert min(info["held_from"], slow_info["held_from"]) >= slow_info["ready_at"]


def test_a_party_that_crashed_before_its_turn_is_not_waited_for(tmp_path):
  code = f"from vlrep.bench import device_turns; device_turns.join({str(tmp_path)!r}, 2, 0); raise SystemExit(1)"
  crashed = subprocess.run([sys.executable, "-c", code])
  assert crashed.returncode == 1
  info = json.loads(start(tmp_path, 2, time.time() + 60, 0.0).communicate(timeout=30)[0])
  assert info["waited_s"] < 5 and info["killed"] == []


def test_no_folder_means_no_turns():
  assert device_turns.join("", 3, 0) is None
  with device_turns.turn(None) as info:
    assert info["killed"] == []
