"""THE training loop: any config (method + data + optimizer + evaluators) -> a sharded, checkpointed,
resumable run. It knows nothing of any method's maths; methods know nothing of devices or checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import os
import resource
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers

from vlrep import checkpoint as ckpt_lib
from vlrep import defaults, evaluators, optim, run_setup, run_summary, runs, sharding, train_state, train_step
from vlrep import preemption as preemption_lib
from vlrep.data import pipeline, records
from vlrep.errors import UserError
from vlrep.train_step import make_train_step


class NonFiniteLossError(RuntimeError):
  pass


# ----------------------------------------------------------------------------------------------------------
# Durations: steps, epochs or examples, converted in this one place.
# ----------------------------------------------------------------------------------------------------------
def to_steps(config: ml_collections.ConfigDict, prefix: str, steps_per_epoch: float, global_batch: int) -> int:
  given = {u: config.get(f"{prefix}_{u}") for u in ("steps", "epochs", "examples")}
  given = {u: v for u, v in given.items() if v}
  if len(given) > 1 or (not given and prefix != "warmup"):
    raise ValueError(
      f"Set exactly one of {prefix}_steps / {prefix}_epochs / {prefix}_examples to a positive "
      f"value (got {given}); the others must be 0."
    )
  if not given:
    return 0
  unit, value = next(iter(given.items()))
  if unit == "steps":
    return int(value)
  if unit == "epochs":
    return int(round(value * steps_per_epoch))
  return int(round(value / global_batch))


DURATION_UNITS = ("steps", "epochs", "examples")


def replaced_durations(config: ml_collections.ConfigDict, set_keys) -> dict[str, Any]:
  """The recipe's durations a duration the user set replaces (`set_keys`: the config keys the command line set,
  e.g. {'total_steps'}), as {dotted key: 0 of its type}: the units of the same duration (total_*, optim.warmup_*)
  that the user did not set, so `--config.total_steps=2` on a recipe measured in epochs trains 2 steps instead of
  being refused. Reads `config` only."""
  replaced = {}
  for prefix in ("total", "optim.warmup"):
    keys = [f"{prefix}_{u}" for u in DURATION_UNITS]
    if not any(k in set_keys for k in keys):
      continue
    for key in keys:
      parent, _, leaf = key.rpartition(".")
      if parent and parent not in config:
        continue
      node = config[parent] if parent else config
      if key not in set_keys and leaf in node and node[leaf]:
        replaced[key] = type(node[leaf])(0)
  return replaced


def config_as_trained(
  config: ml_collections.ConfigDict, command_line_keys, adopted_backbone: dict[str, Any]
) -> ml_collections.ConfigDict:
  """The config the run builds its model from and its checkpoints record (so that resume, vlrep.evaluate, export
  and import rebuild the same model): a copy of `config` with the recipe's durations the command line replaced
  set to 0 (replaced_durations) and the backbone architecture init_from adopted
  (train_state.init_from_architecture). `config` itself stays as loaded."""
  replaced = replaced_durations(config, command_line_keys)
  if replaced:
    logging.info("The command line's duration replaces the recipe's: %s set to 0.", ", ".join(replaced))
  trained = copy.deepcopy(config)
  with trained.unlocked():
    for key, value in replaced.items():
      parent, _, leaf = key.rpartition(".")
      (trained[parent] if parent else trained)[leaf] = value
    if adopted_backbone:
      trained.method.backbone.update(adopted_backbone)
  return trained


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
  """What the loop derives from the config once, before training, and never writes back into it: the run's
  length in steps, from steps, epochs or examples and the training split's size (the evaluations' and
  checkpoints' cadences are steps in the config already)."""

  num_examples: int  # of the training split (its fraction, e.g. 'train[:10%]')
  steps_per_epoch: float
  total_steps: int
  warmup_steps: int

  @classmethod
  def of(cls, config: ml_collections.ConfigDict, num_examples: int) -> TrainingPlan:
    steps_per_epoch = num_examples / config.batch_size
    return cls(
      num_examples=num_examples,
      steps_per_epoch=steps_per_epoch,
      total_steps=to_steps(config, "total", steps_per_epoch, config.batch_size),
      warmup_steps=to_steps(config.optim, "warmup", steps_per_epoch, config.batch_size),
    )


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  on_preempted=None,
  allow_changed_data: bool = False,
  command_line_keys=(),
) -> dict[str, Any]:
  """Trains (or resumes) the run defined by `config` in `workdir`; returns the final summary. `config` is only
  read: what the run derives from it (its length in steps, an adopted backbone) is computed once, beside it.

  After a SIGTERM the run saves, writes summary.json and calls `on_preempted(summary)` (if given) before tearing
  anything down: a command-line process ends there (vlrep.main), because releasing the input pipeline waits for
  tf.data's workers to finish their elements, seconds to tens of seconds on a loaded machine.

  Before anything is built, every dataset the run reads must be prepared, and a run resumed in `workdir` must
  read the data, tokenizer and method it was trained with (`allow_changed_data` continues it on others). Once
  steps are trained, an exception (an evaluation's, the input's, ...) first saves the newest trained state, then
  propagates with a note saying which step is saved where. `command_line_keys`: the config keys the command line
  set (vlrep.main's); a duration among them replaces the recipe's (replaced_durations)."""
  preemption = preemption_lib.Preemption(
    config.checkpoint.get("exit_deadline_secs", defaults.EXIT_DEADLINE_SECS), jax.process_count()
  )
  try:
    return _train(config, workdir, preemption, on_preempted, allow_changed_data, command_line_keys)
  finally:
    preemption.close()


def check_before_building(config: ml_collections.ConfigDict, workdir: str, allow_changed_data: bool) -> str:
  """The checks that need nothing built: every dataset the run reads is prepared, a run resumed in `workdir` reads
  the data, tokenizer and method it was trained with (unless allowed), and the best checkpoint's selection rule
  names an evaluator's metric. Returns that rule, in words (the summary's `best_checkpoint_selected_on`)."""
  run_setup.check_datasets_prepared(config)
  if has_checkpoints(workdir) and not allow_changed_data:
    try:
      # What the resume continues (`resuming`: only compared with the user's config, nothing looked up by its names).
      saved_config = runs.read_config(workdir, resuming=True, checkpoint="latest")
    except RuntimeError:  # no readable metadata: the restore names the damaged checkpoints
      saved_config = None
    if saved_config is not None:
      run_setup.check_resumed_inputs(saved_config, config, workdir)
      unknown = runs.unknown_keys(saved_config.to_dict(), config.to_dict())
      if unknown:
        logging.warning(
          "The run in %s was saved with config keys this config does not have: %s; they are ignored.",
          workdir,
          ", ".join(unknown),
        )
  return evaluators.selection_rule(
    config.get("evals", {}), config.get("best_metric", ""), config.get("select_on_test", False)
  )


def _train(
  config: ml_collections.ConfigDict,
  workdir: str,
  preemption: preemption_lib.Preemption,
  on_preempted,
  allow_changed_data: bool,
  command_line_keys,
) -> dict[str, Any]:
  # ---------------------------------------------------------------------------------------------------- #
  # Checks that need nothing built: the datasets are prepared; a resumed run reads what it was trained with.
  # ---------------------------------------------------------------------------------------------------- #
  t_start = time.time()
  selected_on = check_before_building(config, workdir, allow_changed_data)

  # ---------------------------------------------------------------------------------------------------- #
  # Setup: devices and batch sizes, the data's builder, tokenizer and method (built from the config as trained:
  # the user's, with the command line's durations and init_from's architecture), the run's length.
  # ---------------------------------------------------------------------------------------------------- #
  os.makedirs(workdir, exist_ok=True)
  host, num_hosts = jax.process_index(), jax.process_count()
  writer = metric_writers.create_default_writer(workdir, just_logging=host > 0)
  mesh = sharding.make_mesh(config.sharding.num_devices or None)
  global_bs = config.batch_size
  local_bs = local_batch_size(global_bs, mesh, num_hosts)
  step_errors = train_step.step_errors(config, train_step.batch_shards(sharding.batch_sharding(mesh)))
  if step_errors:
    raise UserError("The train step's settings:\n  " + "\n  ".join(step_errors))
  if config.get("microbatches", 1) > 1 and train_step.whole_batch_norms(config):
    logging.warning(
      "microbatches=%d: %s take BatchNorm statistics over each microbatch of %d examples, not the whole batch.",
      config.microbatches,
      ", ".join(train_step.whole_batch_norms(config)),
      config.batch_size // config.microbatches,
    )
  if config.get("remat", "none") != "none" and jax.default_backend() == "cpu":
    # Measured (tests/test_remat.py, docs/speed.md): the CPU compiler's cse_barrier_expander removes the barriers
    # that keep a block's recomputation apart, and XLA then reuses the forward pass's values.
    logging.warning(
      "remat=%r saves no memory on the CPU: XLA's CPU compiler merges the recomputation back.", config.remat
    )
  trained_config = config_as_trained(config, command_line_keys, train_state.init_from_architecture(config, workdir))
  run_data, builder, eval_inputs, plan = build_for_training(trained_config, workdir, allow_changed_data)
  method, total_steps = eval_inputs.method, plan.total_steps
  ckpt = ckpt_lib.Checkpointer(workdir, keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)

  # ---------------------------------------------------------------------------------------------------- #
  # Input: this process's training stream from the step the run resumes at, as global device batches.
  # ---------------------------------------------------------------------------------------------------- #
  batch_sharding = sharding.batch_sharding(mesh)
  train_input = TrainInput(builder, config.data, method.fields, local_bs, config.seed, eval_inputs, batch_sharding)
  start_step = ckpt.latest_step() or 0
  first_batch = train_input.start(start_step)

  # ---------------------------------------------------------------------------------------------------- #
  # State: the optimizer, and the train state created in its sharded layout or restored into it.
  # ---------------------------------------------------------------------------------------------------- #
  base_rng = jax.random.PRNGKey(config.seed)
  init_rng = jax.random.fold_in(base_rng, -1 % 2**31)
  # The optimizer only needs the parameter tree's paths, which the abstract (shape-only) init provides.
  abstract_params = jax.eval_shape(method.init, init_rng, first_batch)["params"]
  tx, schedules = optim.build(config.optim, abstract_params, total_steps, plan.warmup_steps)
  layout = train_state.layout(method, tx, mesh, config.sharding, init_rng, first_batch)
  if start_step:
    restored_step, state, summary = train_state.restore(ckpt, workdir, layout)
    if restored_step != start_step:  # the data stream restarts where the restored state left it
      logging.warning("Resuming from step %d, the newest intact checkpoint, instead of %d.", restored_step, start_step)
      start_step, first_batch = restored_step, train_input.start(restored_step)
  else:
    state, summary = train_state.fresh(layout, method, tx, init_rng, first_batch, config.get("init_from", "")), {}
  summary.update(starting_summary(selected_on, run_data.fields))
  log_plan(config.method.name, state, plan)

  # ---------------------------------------------------------------------------------------------------- #
  # The jitted step, the evaluators (through the same sharded feature extraction as vlrep.evaluate's) and the
  # checkpoint's metadata.
  # ---------------------------------------------------------------------------------------------------- #
  step_fn = jit_train_step(
    make_train_step(
      method,
      tx,
      schedules,
      base_rng,
      optim.frozen_rules(config.optim),
      config.get("microbatches", 1),
      batch_sharding,
    ),
    layout,
    batch_sharding,
  )
  evals = evaluators.build_all(config.get("evals", {}), eval_inputs)
  extract = runs.sharded_features(method.features, mesh)
  pending = PendingMetrics(ckpt, workdir)

  def evaluate(names: list[str]) -> dict[str, float] | None:
    """`{name/metric: value}` of the named evaluators on the current state; None if SIGTERM interrupted them."""
    variables = {"params": state["params"], **state["model_state"]}
    model = evaluators.Model(variables, functools.partial(extract, variables))
    return run_evaluators(evals, names, model)

  def meta() -> dict:
    return {"signature": ckpt_lib.signature(state["params"]), "config": trained_config.to_dict(), "summary": summary}

  def evaluate_and_keep_best(names: list[str]) -> bool:
    """Runs the named evaluators on the current step, logs them and saves a new best checkpoint; False when
    SIGTERM interrupted them."""
    t0 = time.time()
    eval_metrics = evaluate(names)
    if eval_metrics is None:
      return False
    log_eval_metrics(writer, step, time.time() - t0, eval_metrics)
    summary.update(eval_metrics)
    if update_best(summary, config.get("best_metric"), eval_metrics, step):
      pending.check_finite(step)
      ckpt.save(step, state, meta(), best=True)
    return True

  # ---------------------------------------------------------------------------------------------------- #
  # The loop: evaluate the random initialisation once (the baseline every table compares to), then per step:
  # train, log, check for a preemption, evaluate, checkpoint. The last step is saved, and the save waited for,
  # before the final evaluations; an exception once steps are trained saves the newest state before it propagates.
  # ---------------------------------------------------------------------------------------------------- #
  step = saved_step = log_step = start_step  # saved_step: the newest step with a periodic checkpoint
  batch, log_time = first_batch, time.time()
  train_start_time = log_time
  try:
    preempted = preemption.stop_before_training(step)  # startup, data loading or the state's creation
    random_init_evals = [n for n, e in evals.items() if e.config.get("random_init", False)]
    if not preempted and start_step == 0 and random_init_evals:
      preempted = not evaluate_random_init(evaluate, random_init_evals, summary)

    while not preempted and step < total_steps:
      state, metrics = step_fn(state, batch)
      pending.append(metrics)
      step += 1
      if step < total_steps:
        batch = next(train_input)
      else:
        train_input.close()  # stop the input workers before the final checkpoint and evaluations

      if step % config.log_every_steps == 0 or step == total_steps:
        now = time.time()
        means = pending.means(step)
        means["perf/steps_per_sec"] = (step - log_step) / max(now - log_time, 1e-9)
        means["perf/images_per_sec"] = means["perf/steps_per_sec"] * global_bs
        log_train_metrics(writer, step, total_steps, means)
        summary["train/loss"] = means["train/loss"]
        log_time, log_step = now, step

      # The one preemption check of a step, before its evaluations (a SIGTERM during them interrupts them).
      preempted = preemption.stop_after(step)
      if preempted or step == total_steps:
        break  # the last step: its checkpoint, then its evaluations, below
      due = [n for n, e in evals.items() if e.config.every_steps and step % e.config.every_steps == 0]
      if due:
        preempted = not evaluate_and_keep_best(due)
      if not preempted and step % config.checkpoint.every_steps == 0:
        pending.check_finite(step)
        ckpt.save(step, state, meta())
        saved_step = step

    # The end of training: the last step's checkpoint on disk first, then every evaluator (a run resumed at its
    # last step evaluates unless its summary.json says it finished: an evaluation that failed runs again).
    if not preempted and step == total_steps:
      if step > saved_step:
        pending.check_finite(step)
        ckpt.save(step, state, meta())
        saved_step = step
      ckpt.wait()
      finished = records.as_process_0_sees(step == start_step and finished_at(workdir, step))
      if finished:
        summary.update({k: v for k, v in previous_summary(workdir).items() if k not in summary})
      elif evals:
        preempted = not evaluate_and_keep_best(list(evals))

    # ------------------------------------------------------------------------------------------------ #
    # Finish: after a preemption, save the newest step and exit; otherwise the run's summary and report.
    # ------------------------------------------------------------------------------------------------ #
    if preempted:
      train_input.close(wait=False)  # the input thread stops on its own; the process is about to exit
      if step > saved_step:
        pending.check_finite(step)
        ckpt.save(step, state, meta())
      ckpt.wait()
      what = f"Checkpoint at step {step} saved" if step > saved_step else f"Nothing trained since step {step}"
      saved_step = step
      logging.warning("%s after SIGTERM; exiting. Rerun the same command to resume.", what)
      summary.update({"steps": step, "preempted": True, "seconds": time.time() - t_start})
    else:
      ckpt.wait()
      ckpt.close()
      split_desc = f"{builder.name}/{config.data.split} ({plan.num_examples} examples)"
      summary.update(process_report(state, train_input, split_desc, (step - start_step) * local_bs))
      images_per_sec = (step - start_step) * global_bs / max(time.time() - train_start_time, 1e-9)
      summary.update({"steps": step, "preempted": False, "seconds": time.time() - t_start})
      summary["train/images_per_sec"] = images_per_sec
  except (Exception, KeyboardInterrupt) as error:
    note_what_is_saved(error, save_after_error(error, ckpt, pending, state, step, saved_step, meta))
    raise
  if host == 0:
    run_summary.write_summary(workdir, summary)
  writer.flush()
  if preempted:
    preemption.exited_cleanly()
    if on_preempted is not None:
      on_preempted(summary)
  return summary


def build_for_training(config: ml_collections.ConfigDict, workdir: str, allow_changed_data: bool):
  """(RunData, the training data's builder, EvalInputs, TrainingPlan) of the config as trained
  (config_as_trained): the prepared data and tokenizer checked against what the run in `workdir` was trained with
  (and recorded) before the tokenizer is built (a changed dataset is refused unless allowed, and a run's tokenizer
  is never rebuilt); then the method, and the run's length from the training split's size."""
  run_data = run_setup.RunData(
    workdir, has_checkpoints(workdir), saved_steps(workdir), allow_changed_data, config.get("init_from", "")
  )
  builder, eval_inputs = run_setup.build(config, for_training=True, run_data=run_data)
  split, fraction = records.split_name(config.data.split)
  plan = TrainingPlan.of(config, int(builder.info.splits[split].num_examples * fraction))
  return run_data, builder, eval_inputs, plan


def jit_train_step(train_step, layout: train_state.Layout, batch_sharding):
  """The step compiled for the state's layout; the state's buffers are donated to the step that replaces it."""
  return jax.jit(
    train_step,
    in_shardings=(layout.shardings, batch_sharding),
    out_shardings=(layout.shardings, None),
    donate_argnums=(0,),
  )


def starting_summary(selected_on: str, fields: dict) -> dict[str, Any]:
  """The summary's entries known before training: how the best checkpoint is selected and what the method trains
  on (its fields' coverage of the training split)."""
  summary: dict[str, Any] = {"best_checkpoint_selected_on": selected_on}
  for field, counted in fields.items():
    summary[f"data/{field}_examples"] = counted["examples"]
    summary[f"data/{field}_fraction"] = counted["fraction"]
  return summary


def log_plan(method_name: str, state: dict, plan: TrainingPlan) -> None:
  logging.info(
    "%s: %.2fM parameters, %d steps (%.1f epochs of %d examples), warmup %d.",
    method_name,
    sum(x.size for x in jax.tree.leaves(state["params"])) / 1e6,
    plan.total_steps,
    plan.total_steps / max(plan.steps_per_epoch, 1e-9),
    plan.num_examples,
    plan.warmup_steps,
  )


def evaluate_random_init(evaluate, names: list[str], summary: dict) -> bool:
  """The named evaluators on the random initialisation (the baseline every table compares to), into the summary
  as `{name/metric}_random_init`; False when SIGTERM interrupted them."""
  t0 = time.time()
  init_metrics = evaluate(names)
  for k, v in (init_metrics or {}).items():
    summary[f"{k}_random_init"] = v
    logging.info("Random init: %s = %.2f (%.1fs)", k, v, time.time() - t0)
  return init_metrics is not None


# ----------------------------------------------------------------------------------------------------------
# What is on disk: checkpoints, a finished run's summary, the state saved when something fails.
# ----------------------------------------------------------------------------------------------------------
def has_checkpoints(workdir: str) -> bool:
  """Whether `workdir` holds periodic checkpoints (a run to resume), without creating anything."""
  folder = os.path.join(workdir, "checkpoints")
  return os.path.isdir(folder) and any(p.isdigit() for p in os.listdir(folder))


def saved_steps(workdir: str) -> int:
  """The newest periodic checkpoint's step in `workdir` (0 without one), from the folder names alone."""
  folder = os.path.join(workdir, "checkpoints")
  steps = [int(p) for p in os.listdir(folder) if p.isdigit()] if os.path.isdir(folder) else []
  return max(steps, default=0)


def previous_summary(workdir: str) -> dict[str, Any]:
  return run_summary.read_summary(workdir)


def finished_at(workdir: str, step: int) -> bool:
  """Whether summary.json says the run finished at `step`, its final evaluations included (it is written after
  them; a run that failed or was preempted in them has none, or one saying `preempted`)."""
  summary = previous_summary(workdir)
  return summary.get("steps") == step and summary.get("preempted") is False


def note_what_is_saved(error: BaseException, note: str) -> None:
  """Logs `note` (save_after_error's) and adds it to the error, printed under its message and traceback."""
  if note:
    logging.error("%s", note)
    error.add_note(note)


def save_after_error(error: BaseException, ckpt, pending, state, step: int, saved_step: int, meta) -> str:
  """Saves the newest trained state when an exception ends the run after training steps (unless that step is
  saved already), so that an evaluation's crash never costs the training; returns the line saying what is saved
  where ('' when nothing was trained). Not saved: a state after a non-finite loss (it would be the newest
  checkpoint a rerun resumes from), a state a failed step consumed (its buffers were donated to the step), after
  a failed save (the disk is the problem), and in a run of several processes (a save needs all of them, and the
  others may be waiting elsewhere)."""
  where = ckpt.latest.directory
  if step == 0:
    return ""
  if isinstance(error, (NonFiniteLossError, ckpt_lib.CheckpointSaveError)):
    return ""  # their messages say which checkpoint is intact
  newest = f"the newest checkpoint is step {saved_step} in {where}" if saved_step else "no checkpoint was saved"
  if jax.process_count() > 1:
    return f"The run stopped at step {step}, not saved here (a save needs every process); {newest}."
  if step <= saved_step:
    try:
      ckpt.wait()
    except ckpt_lib.CheckpointSaveError as e:
      return f"The run stopped at step {step}; saving it had failed: {e}"
    return f"The run stopped at step {step}, which is saved in {where}/{step}; rerun the same command to resume."
  if any(leaf.is_deleted() for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)):
    return f"The run stopped in step {step + 1}, whose inputs it consumed; {newest}."
  try:
    pending.check_finite(step)
  except Exception as e:  # noqa: BLE001 -- a non-finite loss, or the failed step's own error surfacing here
    return f"The run stopped at step {step}, not saved ({type(e).__name__}: {e}); {newest}."
  try:
    ckpt.save(step, state, meta())
    ckpt.wait()
  except Exception as e:  # noqa: BLE001 -- reported with the original error, which stays the one raised
    return f"The run stopped at step {step}; saving it failed ({type(e).__name__}: {e}); {newest}."
  return (
    f"The run stopped at step {step}: the trained state was saved first, in {where}/{step}; rerun the same "
    "command to resume from it."
  )


# ----------------------------------------------------------------------------------------------------------
# The loop's parts.
# ----------------------------------------------------------------------------------------------------------
def local_batch_size(global_bs: int, mesh, num_hosts: int) -> int:
  """This process's share of the global batch; the batch must split evenly over devices and hosts."""
  num_devices = mesh.devices.size
  if global_bs % num_devices or global_bs % num_hosts:
    raise ValueError(f"batch_size {global_bs} must be divisible by the {num_devices} devices and {num_hosts} hosts.")
  logging.info(
    "Mesh %s over %d devices (%s), %d host(s); global batch %d.",
    dict(mesh.shape),
    num_devices,
    jax.devices()[0].platform,
    num_hosts,
    global_bs,
  )
  return global_bs // num_hosts


class TrainInput:
  """This process's training batches as global device arrays: a thread assembles each batch and starts its
  transfer while the previous step runs. `start(step)` (re)starts the stream at `step` and returns its first
  batch (a second stream when resuming from an older checkpoint than the newest)."""

  def __init__(self, builder, data_config, fields, local_batch: int, seed: int, eval_inputs, batch_sharding):
    self._make = functools.partial(
      pipeline.train_stream,
      builder,
      data_config,
      fields,
      local_batch,
      seed=seed,
      host_index=eval_inputs.host,
      host_count=eval_inputs.num_hosts,
      context=eval_inputs.pp_context,
    )
    self._sharding, self._prefetch = (
      batch_sharding,
      data_config.get("device_prefetch", defaults.DATA_READING["device_prefetch"]),
    )
    self._streams: list = []  # every stream this run opened, for the records they read
    self._batches = None

  def start(self, step: int):
    if self._batches is not None:
      self._batches.close()
    self._streams.append(self._make(start_step=step))
    self._batches = sharding.device_prefetch(self._streams[-1], self._sharding, self._prefetch)
    return next(self._batches)

  def __next__(self):
    return next(self._batches)

  def close(self, wait: bool = True) -> None:
    self._batches.close(wait=wait)

  def records_read(self) -> int:
    return sum(s.records_read() for s in self._streams)


class PendingMetrics:
  """The step metrics since the last log line, still on device until they are logged or a checkpoint is written:
  fetching them is where a non-finite loss is found, before it can reach a checkpoint."""

  def __init__(self, ckpt: ckpt_lib.Checkpointer, workdir: str):
    self._ckpt, self._workdir, self._metrics = ckpt, workdir, []

  def append(self, metrics: dict) -> None:
    self._metrics.append(metrics)

  def check_finite(self, step: int) -> list[dict]:
    """The pending metrics on the host; raises NonFiniteLossError if a loss among them is not finite."""
    self._metrics = [dict(m) for m in jax.device_get(self._metrics)]
    for m in self._metrics:
      loss = float(m["train/loss"])
      if not np.isfinite(loss):
        raise NonFiniteLossError(
          f"Loss became {loss} during the steps before {step}. The last good checkpoint "
          f"(step {self._ckpt.latest_step()}) in {self._workdir} is untouched; lower the learning rate or check "
          "the data."
        )
    return self._metrics

  def means(self, step: int) -> dict[str, float]:
    """Means over the pending steps (sums for the data counters `data/...`), then cleared."""
    fetched = self.check_finite(step)
    out = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0] if not k.startswith("data/")}
    out.update({k: float(np.sum([m[k] for m in fetched])) for k in fetched[0] if k.startswith("data/")})
    self._metrics = []
    return out


def log_train_metrics(writer, step: int, total_steps: int, means: dict[str, float]) -> None:
  writer.write_scalars(step, means)
  steps_per_s = means["perf/steps_per_sec"]
  logging.info(
    "[%d/%d] loss %.4f | %.2f steps/s, %.1f images/s | ETA %s",
    step,
    total_steps,
    means["train/loss"],
    steps_per_s,
    means["perf/images_per_sec"],
    _hms((total_steps - step) / max(steps_per_s, 1e-9)),
  )


def log_eval_metrics(writer, step: int, seconds: float, metrics: dict[str, float]) -> None:
  writer.write_scalars(step, metrics)
  logging.info("Step %d evals (%.1fs): %s", step, seconds, ", ".join(f"{k}={v:.2f}" for k, v in metrics.items()))


def run_evaluators(evals: dict, names: list[str], model: evaluators.Model) -> dict[str, float] | None:
  """`{name/metric: value}` of the named evaluators; None when SIGTERM interrupted one (the loop then stops)."""
  out = {}
  try:
    for name in names:
      out.update({f"{name}/{k}": v for k, v in evals[name].evaluate(model).items()})
  except preemption_lib.Interrupted:
    logging.warning("Evaluations interrupted by SIGTERM.")
    return None
  return out


def update_best(summary: dict, best_metric: str | None, eval_metrics: dict, step: int) -> bool:
  """Records a new best value of `best_metric` in the summary; True when this step is the new best."""
  if not best_metric or best_metric not in eval_metrics:
    return False
  if eval_metrics[best_metric] <= summary.get(f"{best_metric}_best", -np.inf):
    return False
  summary[f"{best_metric}_best"] = eval_metrics[best_metric]
  summary[f"{best_metric}_best_step"] = step
  return True


def process_report(state: dict, train_input: TrainInput, split: str, examples_trained: int) -> dict[str, float]:
  """The end of a run on this process, logged by every process: its parameters' fingerprint (with replicated
  parameters, equal fingerprints show the hosts stayed in step), the records it read of the training split and
  its peak resident memory (`split`: "builder/split (N examples)", as vlrep.bench.scale_test reads it). Returns
  the summary's `input/` entries."""
  host = jax.process_index()
  logging.info("Parameter fingerprint (process %d): %s", host, params_fingerprint(state["params"]))
  records_read, peak_rss_gb = train_input.records_read(), peak_rss_bytes() / 1e9
  logging.info(
    "Input (process %d): read %d records of %s for %d training examples; peak RSS %.3f GB",
    host,
    records_read,
    split,
    examples_trained,
    peak_rss_gb,
  )
  return {"input/records_read": records_read, "input/peak_rss_gb": peak_rss_gb}


def peak_rss_bytes() -> int:
  """This process's peak resident memory: Linux's VmHWM, the high-water mark of its own address space. Not
  getrusage's ru_maxrss: Linux carries that across exec, so a process started by a large one (a pytest worker, a
  notebook) would report its launcher's resident memory at the fork as its own peak."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024  # kB
  except OSError:
    pass
  maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


def params_fingerprint(params) -> str:
  """SHA-256 of this process's first local shard of every parameter (the whole array when replicated)."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
  return digest.hexdigest()[:16]


def _hms(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
