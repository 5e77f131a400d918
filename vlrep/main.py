"""Entry point: `python -m vlrep.main --config=configs/virtex.py[:ARG] --workdir=DIR [--config.KEY=VALUE]`.

Multi-host (TPU pods, SLURM, several processes on one machine): pass --multihost to call
jax.distributed.initialize(), which reads the cluster's environment; or give --coordinator_address,
--num_processes and --process_id explicitly.
"""

from __future__ import annotations

import logging as pylogging
import os

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Run config: configs/NAME.py[:ARG].", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and summary.json (resumes if it has some).")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() from the cluster environment.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (explicit multi-process setup).")
flags.DEFINE_integer("num_processes", None, "Number of processes (explicit multi-process setup).")
flags.DEFINE_integer("process_id", None, "This process's id (explicit multi-process setup).")
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

  if FLAGS.coordinator_address:
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  elif FLAGS.multihost:
    jax.distributed.initialize()
  from vlrep import train

  logging.info(
    "JAX %s: process %d/%d, %d local / %d global devices.",
    jax.__version__,
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  summary = train.run(FLAGS.config, FLAGS.workdir)
  if jax.process_index() == 0:
    _print_result(summary)


def _print_result(summary: dict) -> None:
  lines = [
    f"Finished {int(summary.get('steps', 0))} steps in {summary.get('seconds', 0):.0f}s; "
    f"summary in {os.path.join(FLAGS.workdir, 'summary.json')}"
  ]
  for key in sorted(k for k in summary if k.endswith("/map")):
    base = summary.get(f"{key}_random_init")
    lines.append(f"{key}: pretrained {summary[key]:.2f}" + (f" vs random init {base:.2f}" if base is not None else ""))
  for key in sorted(k for k in summary if k.endswith(("/cider", "/bleu4", "/top1"))):
    lines.append(f"{key}: {summary[key]:.2f}")
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  app.run(main)
