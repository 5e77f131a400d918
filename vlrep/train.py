"""THE training loop: any config (method + data + optimizer + evaluators) -> a sharded, checkpointed,
resumable run. It knows nothing of any method's maths; methods know nothing of devices or checkpoints.
"""

from __future__ import annotations

import functools
import hashlib
import os
import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers

from vlrep import checkpoint as ckpt_lib
from vlrep import evaluators, methods, optim, runs, sharding
from vlrep import preemption as preemption_lib
from vlrep.data import concepts, pipeline, records, tokenizers
from vlrep.train_step import init_train_state, make_train_step


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


def run(config: ml_collections.ConfigDict, workdir: str, on_preempted=None) -> dict[str, Any]:
  """Trains (or resumes) the run defined by `config` in `workdir`; returns the final summary.

  After a SIGTERM the run saves, writes summary.json and calls `on_preempted(summary)` (if given) before tearing
  anything down: a command-line process ends there (vlrep.main), because releasing the input pipeline waits for
  tf.data's workers to finish their elements, seconds to tens of seconds on a loaded machine."""
  preemption = preemption_lib.Preemption(config.checkpoint.get("exit_deadline_secs", 20.0), jax.process_count())
  try:
    return _train(config, workdir, preemption, on_preempted)
  finally:
    preemption.close()


def _train(
  config: ml_collections.ConfigDict, workdir: str, preemption: preemption_lib.Preemption, on_preempted
) -> dict[str, Any]:
  t_start = time.time()
  os.makedirs(workdir, exist_ok=True)
  host, num_hosts = jax.process_index(), jax.process_count()
  writer = metric_writers.create_default_writer(workdir, just_logging=host > 0)

  # ---------------------------------------------------------------------------------------------------- #
  # Devices, data, tokenizer, method.
  # ---------------------------------------------------------------------------------------------------- #
  mesh = sharding.make_mesh(config.sharding.num_devices or None)
  num_devices = mesh.devices.size
  global_bs = config.batch_size
  if global_bs % num_devices or global_bs % num_hosts:
    raise ValueError(f"batch_size {global_bs} must be divisible by the {num_devices} devices and {num_hosts} hosts.")
  local_bs = global_bs // num_hosts
  logging.info(
    "Mesh %s over %d devices (%s), %d host(s); global batch %d.",
    dict(mesh.shape),
    num_devices,
    jax.devices()[0].platform,
    num_hosts,
    global_bs,
  )

  adopt_init_from_architecture(config, workdir)
  selected_on = evaluators.selection_rule(
    config.get("evals", {}), config.get("best_metric", ""), config.get("select_on_test", False)
  )
  builder = pipeline.get_builder(config.data.name, config.data.data_dir, config.data.get("config_name"))
  pipeline.check_required_fields(builder, config.data.split, config.data.get("requires", {}), config.method.name)
  # Methods without text (e.g. the fine-tuning classifier) have no tokenizer.
  tokenizer = tokenizers.ensure_tokenizer(config.tokenizer, builder) if config.get("tokenizer") else None
  # What the method is built with: a concept set (ICMLM, MCT's tags on own data), a VQA run's answer vocabulary.
  needs = {**concepts.run_concepts(config, builder, tokenizer), **methods.setup(config, builder, tokenizer)}
  method = methods.build(config.method, tokenizer.vocab_size if tokenizer else 0, **needs)
  run_inputs = evaluators.RunInputs(tokenizer=tokenizer, method=method, needs=needs, host=host, num_hosts=num_hosts)
  split, fraction = records.split_name(config.data.split)
  num_examples = int(builder.info.splits[split].num_examples * fraction)
  steps_per_epoch = num_examples / global_bs
  total_steps = to_steps(config, "total", steps_per_epoch, global_bs)
  warmup_steps = to_steps(config.optim, "warmup", steps_per_epoch, global_bs)

  ckpt = ckpt_lib.Checkpointer(workdir, keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
  start_step = ckpt.latest_step() or 0
  batch_sharding = sharding.batch_sharding(mesh)

  streams = []  # this process's training streams (a second one when resuming from an older checkpoint)

  def input_batches(step: int):
    """Global device batches from `step` on: a thread assembles them and starts their transfer while the
    previous step runs."""
    stream = pipeline.train_stream(
      builder,
      config.data,
      method.fields,
      local_bs,
      seed=config.seed,
      start_step=step,
      host_index=host,
      host_count=num_hosts,
      context=run_inputs.pp_context,
    )
    streams.append(stream)
    return sharding.device_prefetch(stream, batch_sharding, config.data.get("device_prefetch", 2))

  device_batches = input_batches(start_step)
  first_batch = next(device_batches)

  # ---------------------------------------------------------------------------------------------------- #
  # Train state, created directly in its sharded layout (or restored into it).
  # ---------------------------------------------------------------------------------------------------- #
  base_rng = jax.random.PRNGKey(config.seed)
  init_rng = jax.random.fold_in(base_rng, -1 % 2**31)
  # The optimizer only needs the parameter tree's paths, which the abstract (shape-only) init provides.
  tx, schedules = optim.build(
    config.optim, jax.eval_shape(method.init, init_rng, first_batch)["params"], total_steps, warmup_steps
  )
  init_state = functools.partial(init_train_state, method, tx)
  abstract = jax.eval_shape(init_state, init_rng, first_batch)
  state_sh = sharding.state_shardings(mesh, abstract, config.sharding.params, rules=config.sharding.get("rules", ()))
  summary: dict[str, Any] = {}
  if start_step:
    runs.read_config(workdir, resuming=True)  # a removed speed switch that changed the train state: a clear error
    abstract_sh = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)
    restored_step, state, meta, skipped = ckpt.restore_newest_intact(abstract_sh)
    for step, why in skipped:
      logging.warning("Checkpoint at step %d does not restore (%s): skipped.", step, why)
    if restored_step != start_step:  # the data stream restarts where the restored state left it
      logging.warning("Resuming from step %d, the newest intact checkpoint, instead of %d.", restored_step, start_step)
      device_batches.close()
      start_step = restored_step
      device_batches = input_batches(start_step)
      first_batch = next(device_batches)
    summary.update(meta.get("summary", {}))
    logging.info("Resumed from step %d in %s.", start_step, workdir)
  else:
    state = jax.jit(init_state, out_shardings=state_sh)(init_rng, first_batch)
    state = load_pretrained_variables(state, pretrained_variables_of(method), tx, state_sh)
    if config.get("init_from"):
      state = init_from_checkpoint(state, config.init_from, tx, state_sh)
  summary["best_checkpoint_selected_on"] = selected_on
  num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  logging.info(
    "%s: %.2fM parameters, %d steps (%.1f epochs of %d examples), warmup %d.",
    config.method.name,
    num_params / 1e6,
    total_steps,
    total_steps / max(steps_per_epoch, 1e-9),
    num_examples,
    warmup_steps,
  )

  # ---------------------------------------------------------------------------------------------------- #
  # Jitted step and feature extraction.
  # ---------------------------------------------------------------------------------------------------- #
  train_step = make_train_step(method, tx, schedules, base_rng, optim.frozen_rules(config.optim))
  step_fn = jax.jit(
    train_step, in_shardings=(state_sh, batch_sharding), out_shardings=(state_sh, None), donate_argnums=(0,)
  )

  extract = runs.sharded_features(method.features, mesh)  # the same extraction as vlrep.evaluate's

  def variables_of(st):
    return {"params": st["params"], **st["model_state"]}

  evals = evaluators.build_all(config.get("evals", {}), run_inputs)

  def run_evals(st, names=None) -> dict[str, float]:
    out = {}
    for name, ev in evals.items():
      if names is not None and name not in names:
        continue

      def features(batch, st=st, key=ev.feature_key):
        return extract(variables_of(st), batch, key)

      # Evaluators of backbone features get features_fn; whole-model ones (captioning) the variables.
      result = ev.run(features) if ev.feature_key else ev.run(None, variables=variables_of(st))
      for k, v in result.items():
        out[f"{name}/{k}"] = v
    return out

  def meta() -> dict:
    return {"signature": ckpt_lib.signature(state["params"]), "config": config.to_dict(), "summary": summary}

  # ---------------------------------------------------------------------------------------------------- #
  # The loop.
  # ---------------------------------------------------------------------------------------------------- #
  pending: list[dict] = []
  last_log_time, last_log_step = time.time(), start_step
  best_metric = config.get("best_metric")
  batch = first_batch
  step = start_step
  train_start_time = time.time()

  def check_finite(metrics_list):
    for m in metrics_list:
      loss = float(m["train/loss"])
      if not np.isfinite(loss):
        last = ckpt.latest_step()
        raise NonFiniteLossError(
          f"Loss became {loss} during the steps before {step}. The last good checkpoint "
          f"(step {last}) in {workdir} is untouched; lower the learning rate or check the data."
        )

  saved_step = start_step  # the newest step with a periodic checkpoint (restored or written by this run)

  def save(at_step):
    nonlocal saved_step
    check_finite(pending_fetched())
    ckpt.save(at_step, state, meta())
    saved_step = at_step

  def stop_for_preemption(at_step):
    """Saves `at_step` unless it is already saved, and returns the preempted run's summary."""
    device_batches.close(wait=False)  # the input thread stops on its own; the process is about to exit
    newly_trained = at_step > saved_step
    if newly_trained:
      save(at_step)
    ckpt.wait()
    what = f"Checkpoint at step {at_step} saved" if newly_trained else f"Nothing trained since step {at_step}"
    logging.warning("%s after SIGTERM; exiting. Rerun the same command to resume.", what)
    summary.update({"steps": at_step, "preempted": True, "seconds": time.time() - t_start})
    if host == 0:
      runs.write_summary(workdir, summary)
    writer.flush()
    preemption.exited_cleanly()
    if on_preempted is not None:
      on_preempted(summary)
    return summary

  def pending_fetched():
    fetched = jax.device_get(pending)
    pending[:] = [dict(m) for m in fetched]
    return pending

  # ---------------------------------------------------------------------------------------------------- #
  # Evaluate the random initialisation once (the baseline every table compares to).
  # ---------------------------------------------------------------------------------------------------- #
  if preemption.stop_before_training(step):  # during startup, data loading or the state's creation: nothing to save
    return stop_for_preemption(step)
  if start_step == 0 and evals:
    t0 = time.time()
    try:
      init_metrics = run_evals(state, [n for n, e in evals.items() if e.config.get("random_init", False)])
    except preemption_lib.Interrupted:
      return stop_for_preemption(step)
    summary.update({f"{k}_random_init": v for k, v in init_metrics.items()})
    for k, v in init_metrics.items():
      logging.info("Random init: %s = %.2f (%.1fs)", k, v, time.time() - t0)

  while step < total_steps:
    if preemption.stop_after(step):  # a signal during the random-init evaluation, or the last evaluations / save
      return stop_for_preemption(step)
    state, metrics = step_fn(state, batch)
    pending.append(metrics)
    step += 1
    if step < total_steps:
      batch = next(device_batches)
    else:
      device_batches.close()  # stop the input workers before the final evaluation and checkpoint

    if step % config.log_every_steps == 0 or step == total_steps:
      fetched = pending_fetched()
      check_finite(fetched)
      means = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0] if not k.startswith("data/")}
      means.update({k: float(np.sum([m[k] for m in fetched])) for k in fetched[0] if k.startswith("data/")})
      now = time.time()
      steps_per_s = (step - last_log_step) / max(now - last_log_time, 1e-9)
      means["perf/steps_per_sec"] = steps_per_s
      means["perf/images_per_sec"] = steps_per_s * global_bs
      eta = (total_steps - step) / max(steps_per_s, 1e-9)
      writer.write_scalars(step, means)
      logging.info(
        "[%d/%d] loss %.4f | %.2f steps/s, %.1f images/s | ETA %s",
        step,
        total_steps,
        means["train/loss"],
        steps_per_s,
        steps_per_s * global_bs,
        _hms(eta),
      )
      summary["train/loss"] = means["train/loss"]
      pending.clear()
      last_log_time, last_log_step = now, step

    if preemption.stop_after(step):  # before this step's evaluations
      return stop_for_preemption(step)

    is_last = step == total_steps
    eval_names = [n for n, e in evals.items() if is_last or (e.config.every_steps and step % e.config.every_steps == 0)]
    if eval_names:
      t0 = time.time()
      try:
        eval_metrics = run_evals(state, eval_names)
      except preemption_lib.Interrupted:  # SIGTERM during the evaluation: this step's state is what is saved
        logging.warning("Step %d evaluations interrupted by SIGTERM.", step)
        return stop_for_preemption(step)
      writer.write_scalars(step, eval_metrics)
      logging.info(
        "Step %d evals (%.1fs): %s", step, time.time() - t0, ", ".join(f"{k}={v:.2f}" for k, v in eval_metrics.items())
      )
      summary.update(eval_metrics)
      if best_metric in eval_metrics and eval_metrics[best_metric] > summary.get(f"{best_metric}_best", -np.inf):
        summary[f"{best_metric}_best"] = eval_metrics[best_metric]
        summary[f"{best_metric}_best_step"] = step
        check_finite(pending_fetched())
        ckpt.save(step, state, meta(), best=True)

    if step % config.checkpoint.every_steps == 0 or is_last:
      save(step)

  ckpt.wait()
  ckpt.close()
  # Every process logs its own: with replicated parameters, equal fingerprints show the hosts stayed in step.
  logging.info("Parameter fingerprint (process %d): %s", host, params_fingerprint(state["params"]))
  # Per process: what it read of the training split, and its peak resident memory.
  records_read = sum(s.records_read() for s in streams)
  peak_rss_gb = peak_rss_bytes() / 1e9
  logging.info(
    "Input (process %d): read %d records of %s/%s (%d examples) for %d training examples; peak RSS %.3f GB",
    host,
    records_read,
    builder.name,
    config.data.split,
    num_examples,
    (step - start_step) * local_bs,
    peak_rss_gb,
  )
  seconds = time.time() - t_start
  summary.update(
    {
      "steps": step,
      "preempted": False,
      "seconds": seconds,
      "train/images_per_sec": (step - start_step) * global_bs / max(time.time() - train_start_time, 1e-9),
      "input/records_read": records_read,
      "input/peak_rss_gb": peak_rss_gb,
    }
  )
  if host == 0:
    runs.write_summary(workdir, summary)
  writer.flush()
  return summary


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


def pretrained_variables_of(method) -> dict:
  """A method's pretrained values (its optional `pretrained_variables(pretrained)`), given the runs it names in
  its optional `pretrained_runs()` ({name: workdir}), each loaded here at its best checkpoint: methods read
  checkpoints only through the loop."""
  if not hasattr(method, "pretrained_variables"):
    return {}
  wanted = method.pretrained_runs() if hasattr(method, "pretrained_runs") else {}
  return method.pretrained_variables({name: runs.load_run(path, "best") for name, path in wanted.items()})


def load_pretrained_variables(state: dict, pretrained: dict, tx, state_sh) -> dict:
  """Writes a method's pretrained values (numpy trees under 'params' / 'model_state', e.g. ICMLM's frozen BERT)
  into a fresh state, in its sharding; then re-initialises the optimizer state. A subtree whose structure is the
  model's is checked whole (every path and shape); a dict that names only some of a subtree's entries (MCT's
  momentum copy: {'momentum': {'params': {'textual': ...}}}) is descended into, each named entry checked."""
  if not pretrained:
    return state

  def put(a, s):
    a = np.asarray(a, np.float32)
    return jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx])

  def merge(current, given, shardings, where):
    if not isinstance(given, dict) or not isinstance(current, dict):
      ckpt_lib.check_signature(ckpt_lib.signature(given), ckpt_lib.signature(current), where)
      return jax.tree.map(put, given, shardings)
    try:
      ckpt_lib.check_signature(ckpt_lib.signature(given), ckpt_lib.signature(current), where)
      logging.info("Loaded pretrained %s (%d tensors).", where, len(jax.tree.leaves(given)))
      return jax.tree.map(put, given, shardings)
    except ValueError:
      if set(given) == set(current):  # the same entries with other shapes or paths: report the mismatch
        raise
    out = dict(current)
    for name, tree in given.items():
      if name not in current:
        raise ValueError(f"Pretrained values for {where}/{name}, which this model does not have.")
      out[name] = merge(current[name], tree, shardings[name], f"{where}/{name}")
    return out

  new = dict(state)
  for part, trees in pretrained.items():
    new[part] = merge(state[part], trees, state_sh[part], part)
  if "params" in pretrained:
    new["opt_state"] = jax.jit(tx.init, out_shardings=state_sh["opt_state"])(new["params"])
  return new


def adopt_init_from_architecture(config: ml_collections.ConfigDict, workdir: str) -> None:
  """`init_from=RUN`: this run's backbone takes RUN's architecture (depth, width, stem, ...), so any config can
  start from any run's backbone (e.g. finetune.py:runlocal from the quick start's ResNet-10); its BatchNorm
  grouping stays this config's. When resuming, the architecture is the one this run saved, so
  RUN is not read again. Said in the log when it changes the config."""
  if not config.get("init_from") or "backbone" not in config.get("method", {}):
    return
  try:
    source, saved = workdir, runs.read_config(workdir)  # resuming: what this run was built with
  except (FileNotFoundError, RuntimeError):
    source, saved = config.init_from, runs.read_config(config.init_from)
  if "backbone" not in saved.method:
    raise ValueError(f"init_from={config.init_from}: that run's model has no 'backbone' to start from.")
  want = runs.backbone_architecture(saved.method.backbone)
  have = runs.backbone_architecture(config.method.backbone)
  changed = {k: (have[k], v) for k, v in want.items() if have[k] != v}
  if changed:
    with config.unlocked():
      config.method.backbone.update({k: v for k, (_, v) in changed.items()})
    logging.info(
      "init_from: the backbone takes the architecture of %s: %s.",
      source,
      ", ".join(f"{k}={new!r} (config: {old!r})" for k, (old, new) in changed.items()),
    )


def init_from_checkpoint(state: dict, workdir: str, tx, state_sh) -> dict:
  """Copies the visual backbone (parameters and BatchNorm statistics) of another run's best checkpoint into a
  fresh state, then re-initialises the optimizer state from the new parameters (LookAhead keeps a copy)."""
  run = runs.load_run(workdir, "best")
  src_params, src_stats = runs.backbone_of(run)[1]["params"], run.model_state.get("batch_stats", {})
  if "backbone" not in state["params"]:
    raise ValueError("init_from needs a model with a 'backbone'; this config's model has none.")
  want = ckpt_lib.signature(state["params"]["backbone"])
  ckpt_lib.check_signature(ckpt_lib.signature(src_params), want, run.path)
  params = dict(state["params"], backbone=jax.tree.map(jnp.asarray, src_params))
  model_state = dict(state["model_state"])
  if "backbone" in src_stats:
    model_state["batch_stats"] = dict(model_state.get("batch_stats", {}), backbone=src_stats["backbone"])
  new = {**state, "params": params, "model_state": model_state}
  new = jax.device_put(new, state_sh)
  new["opt_state"] = jax.jit(tx.init, out_shardings=state_sh["opt_state"])(new["params"])
  logging.info("Backbone initialised from %s (step %d).", run.path, run.step)
  return new


def _hms(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
