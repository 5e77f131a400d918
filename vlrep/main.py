"""Entry point: `python -m vlrep.main --config=configs/virtex.py[:ARG] --workdir=DIR [--config.KEY=VALUE]`.

Multi-host (TPU pods, SLURM, several processes on one machine): pass --multihost to call
jax.distributed.initialize(), which reads the cluster's environment; or give --coordinator_address,
--num_processes and --process_id explicitly. Failures are bounded in time: a runtime that does not form within
--init_timeout seconds (a wrong process count or coordinator address, an unreachable coordinator) is a clear
error, and when a process dies the others stop within about --heartbeat_timeout seconds. Rerunning the same
command on all hosts resumes from the last checkpoint; a resume with other training data (another dataset, or the
same one prepared again from changed files: WORKDIR/data_identity.json records its fingerprint), tokenizer or
method than the run was trained with is refused unless --allow_changed_data, and a run's tokenizer is never
rebuilt (it keeps its own copy in WORKDIR/tokenizer/). A duration set with --config (total_steps,
total_epochs or total_examples; optim.warmup_*) replaces the config file's, in whatever unit that gave it.
"""

from __future__ import annotations

import logging as pylogging
import os
import socket
import sys
import threading
import time
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from vlrep import defaults
from vlrep.errors import UserError

config_flags.DEFINE_config_file("config", None, "Run config: configs/NAME.py[:ARG].", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and summary.json (resumes if it has some).")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() from the cluster environment.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (explicit multi-process setup).")
flags.DEFINE_integer("num_processes", None, "Number of processes (explicit multi-process setup).")
flags.DEFINE_integer("process_id", None, "This process's id (explicit multi-process setup).")
flags.DEFINE_list(
  "local_device_ids", None, "This process's accelerators (default: all, or on SLURM the task's SLURM_LOCALID)."
)
flags.DEFINE_integer("init_timeout", 300, "Seconds to wait for all processes to join the distributed runtime.")
flags.DEFINE_string(
  "compilation_cache",
  defaults.COMPILATION_CACHE_DIR,
  "JAX's persistent compilation cache ('' disables; JAX_COMPILATION_CACHE_DIR, when set, wins): a restarted run, "
  "after a preemption, loads its compiled steps instead of compiling them again.",
)
flags.DEFINE_integer("heartbeat_timeout", 100, "Seconds without a heartbeat after which a process counts as dead.")
flags.DEFINE_bool(
  "allow_changed_data",
  False,
  "Resume the run in --workdir although its dataset (name, config, data_dir, split, or the prepared data itself: "
  "its source fingerprint and example counts, WORKDIR/data_identity.json), tokenizer or method differ from those "
  "it was trained with, or start from --config.init_from=RUN on RUN's own dataset prepared again since (without "
  "it, these are refused, naming both). A resumed run keeps its own vocabulary (WORKDIR/tokenizer/), never "
  "rebuilt.",
)
flags.mark_flags_as_required(["config", "workdir"])

FLAGS = flags.FLAGS


class _QuietLibraries(pylogging.Filter):
  """Drops INFO chatter of orbax (dozens of lines per checkpoint); warnings and errors still show."""

  def filter(self, record):
    return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  for handler in pylogging.getLogger().handlers + pylogging.getLogger("absl").handlers:
    handler.addFilter(_QuietLibraries())
  # tf.data must not grab accelerator memory meant for JAX.
  import tensorflow as tf

  tf.config.set_visible_devices([], "GPU")
  import jax

  if FLAGS.compilation_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(FLAGS.compilation_cache))
  if FLAGS.coordinator_address or FLAGS.multihost:
    try:
      initialize_distributed(jax)
      check_hosts_agree(jax, FLAGS.config)
    except DistributedSetupError as e:
      raise SystemExit(f"ERROR: {e}") from e
    # When a peer dies the runtime usually ends this process with a C++ abort ("another task died") that Python
    # cannot intercept (jaxlib's missed-heartbeat callback cannot carry its status to Python), so say up front
    # what to do then.
    logging.info(
      "If any process dies, the others stop within about --heartbeat_timeout=%ds; then rerun the same command on "
      "every host: the run resumes from its last checkpoint in %s/checkpoints.",
      FLAGS.heartbeat_timeout,
      FLAGS.workdir,
    )
  # Only now: nothing may start JAX's backend (or TensorFlow's) before jax.distributed.initialize above.
  from vlrep import train

  logging.info(
    "JAX %s: process %d/%d, %d local / %d global devices.",
    jax.__version__,
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  try:
    summary = train.train_and_evaluate(
      FLAGS.config,
      FLAGS.workdir,
      on_preempted=_exit_preempted,
      allow_changed_data=FLAGS.allow_changed_data,
      command_line_keys=set(config_flags.get_override_values(FLAGS["config"])),
    )
  except UserError as e:
    # Something the user fixes (data not prepared, a field the data lacks, a bad config value): the message
    # says what and how; a traceback would bury it. Its notes say what the run saved before stopping.
    print("\n".join([f"ERROR: {e}", *getattr(e, "__notes__", [])]), file=sys.stderr, flush=True)
    sys.exit(2)
  except Exception as e:
    # A non-finite loss is global, so every process raises it at the same step and can leave normally.
    if jax.process_count() > 1 and not isinstance(e, train.NonFiniteLossError):
      # A collective failing mid-run almost always means another process died; the runtime then stops this
      # one within --heartbeat_timeout seconds. An error of this process alone (e.g. its save failed on a full
      # disk) ends it at once: leaving through jax.distributed's shutdown barrier would wait for peers that wait
      # for it in a collective or a save; a dead process is what ends them, within --heartbeat_timeout.
      traceback.print_exc()
      print(
        f"ERROR: process {jax.process_index()} stopped: {type(e).__name__}: {str(e)[:300]}\n"
        "If another process died, rerun the same command on every host: the run resumes from its last "
        f"checkpoint in {FLAGS.workdir}/checkpoints.",
        flush=True,
      )
      logging.flush()
      sys.stderr.flush()
      os._exit(1)
    raise
  if jax.process_index() == 0:
    _print_result(summary)


class DistributedSetupError(RuntimeError):
  pass


def initialize_distributed(jax) -> None:
  """jax.distributed.initialize from the flags (explicit) or the cluster's environment (--multihost), with
  bounded waits and an error that says what to check."""
  explicit = bool(FLAGS.coordinator_address)
  if explicit:
    n, i = FLAGS.num_processes, FLAGS.process_id
    if n is None or i is None or n < 1 or not 0 <= i < n:
      raise app.UsageError(
        f"--coordinator_address needs --num_processes >= 1 and 0 <= --process_id < --num_processes (got "
        f"num_processes={n}, process_id={i})."
      )
  where = FLAGS.coordinator_address or "the address the cluster's environment gives"
  advice = (
    f"The distributed runtime did not form within --init_timeout={FLAGS.init_timeout}s (coordinator {where}, "
    f"{FLAGS.num_processes or 'auto'} processes, this is process {FLAGS.process_id if explicit else 'auto'}). "
    "Check that every host runs the same command with the same --num_processes and --coordinator_address, "
    "that each --process_id is used once, and that process 0 is running and its port is reachable."
  )
  if explicit and FLAGS.process_id != 0:
    _wait_for_coordinator(FLAGS.coordinator_address, FLAGS.init_timeout, advice)
  # A runtime that does not form ends in a C++ abort that Python cannot catch; say what to check just before.
  watchdog = threading.Timer(max(FLAGS.init_timeout - 1, 0.5), lambda: print(f"ERROR: {advice}", flush=True))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
      FLAGS.coordinator_address,
      FLAGS.num_processes,
      FLAGS.process_id,
      local_device_ids=[int(i) for i in FLAGS.local_device_ids] if FLAGS.local_device_ids else None,
      initialization_timeout=FLAGS.init_timeout,
      heartbeat_timeout_seconds=FLAGS.heartbeat_timeout,
    )
  except Exception as e:  # the runtime raises various XlaRuntimeError/ValueError/RuntimeError kinds
    raise DistributedSetupError(f"{advice} Cause: {type(e).__name__}: {e}") from e
  finally:
    watchdog.cancel()


def check_hosts_agree(jax, config) -> None:
  """Every process must claim the same process count (the runtime takes process 0's word for it) and run the
  same config; otherwise each would shard data and parameters differently without noticing."""
  import zlib

  import numpy as np
  from jax.experimental import multihost_utils

  claimed = FLAGS.num_processes or jax.process_count()
  mine = np.array([claimed, zlib.crc32(config.to_json(sort_keys=True).encode())], np.int64)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), 2)
  if (every[:, 0] != jax.process_count()).any():
    raise DistributedSetupError(
      f"Mismatched process counts: the runtime has {jax.process_count()} processes, and processes 0..N-1 were "
      f"launched with --num_processes={every[:, 0].tolist()}. Launch every process with the same count."
    )
  if (every[:, 1] != every[0, 1]).any():
    differ = [i for i in range(len(every)) if every[i, 1] != every[0, 1]]
    raise DistributedSetupError(f"Processes {differ} run a different config from process 0; launch all alike.")


def _wait_for_coordinator(address: str, timeout: float, advice: str) -> None:
  """Polls the coordinator's port until it accepts a connection, so an unreachable one is a Python error."""
  host, _, port = address.rpartition(":")
  deadline = time.time() + timeout
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
        return
    except OSError as e:
      if time.time() > deadline:
        raise DistributedSetupError(f"{advice} The coordinator {address} never accepted a connection: {e}") from e
      time.sleep(0.5)


def _exit_preempted(summary: dict) -> None:
  """Ends a preempted process once its checkpoint and summary are written, skipping the interpreter's teardown:
  releasing tf.data's iterators waits for their workers, which takes seconds on a loaded machine."""
  import jax

  if jax.process_index() == 0:
    _print_result(summary)
  logging.flush()
  if jax.process_count() > 1:  # leave together: a process that ends first looks like a dead peer to the others
    jax.distributed.shutdown()
  os._exit(0)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, but a bad flag or config value (a config file's get_config refusing an argument) is the
  user's to fix: its message and exit status 2, as a UserError in the run (absl's own exits with 1)."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    lines = [line for line in str(e).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
      # ml_collections puts the config file's traceback in the message: its first line and the error it ended in.
      lines = [lines[0].rstrip(":"), lines[-1]]
    print("ERROR: " + "\n".join(lines) + "\nPass --helpfull to see the flags.", file=sys.stderr, flush=True)
    sys.exit(2)


def _print_result(summary: dict) -> None:
  done = "Preempted (SIGTERM) after" if summary.get("preempted") else "Finished"
  lines = [
    f"{done} {int(summary.get('steps', 0))} steps in {summary.get('seconds', 0):.0f}s; "
    f"summary in {os.path.join(FLAGS.workdir, 'summary.json')}"
  ]
  for key in sorted(k for k in summary if k.endswith("/map")):
    base = summary.get(f"{key}_random_init")
    lines.append(f"{key}: pretrained {summary[key]:.2f}" + (f" vs random init {base:.2f}" if base is not None else ""))
  for key in sorted(k for k in summary if k.endswith(("/cider", "/bleu4", "/top1"))):
    lines.append(f"{key}: {summary[key]:.2f}")
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
