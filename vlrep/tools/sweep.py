r"""Runs a family of configs and collects their metrics into one markdown table and one plot.

  python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 20 50 100" \
      --root=/tmp/sweep_fraction --metrics=probe/map,probe/map_random_init

  # several arguments: the product of their values; fixed ones join the base config argument
  python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="hidden=128 256;layers=1 2" --root=DIR

  # only collect runs that exist (e.g. trained on a cluster)
  python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 100" --root=DIR --collect_only

  # several seeds: each variant once per seed; cells show the mean ± std and each seed's value
  python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,variant=tp --vary="tags=postag" --seeds=0,1,2 \
      --root=R/tp
  # a run that starts from another sweep's run of the same seed: {suffix} is the seed's workdir suffix
  python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,warmup_frozen=150 --vary="variant=tfm att_fc" \
      --seeds=0,1,2 --overrides="init_from=R/tp/tagspostag{suffix}" --root=R/icmlm

Each variant trains with `python -m vlrep.main` into ROOT/<name> (finished runs are skipped, interrupted ones
resume), then an optional --eval_config runs `python -m vlrep.evaluate` on it (on a finished run too when its
summary lacks one of --metrics: an evaluation added to runs already trained). The table (ROOT/sweep.md) has one
row per variant and one column per metric from the runs' summary.json; the plot (ROOT/sweep.png) draws each
metric against the first varied argument. With --seeds, seed 0 trains into ROOT/<name> and seed N into
ROOT/<name>_sN with `--config.seed=N` (the convention of vlrep.tools.vl_study); in --overrides, `{seed}` becomes
the seed and `{suffix}` its workdir suffix ('' or '_sN'). A cell is then 'mean ± std (seed 0 / seed 1 / ...)', the mean
over the seeds whose run has the metric, and the plot draws the means.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shlex
import subprocess
import sys

import ml_collections
from absl import app, flags, logging

from vlrep import run_summary, safe_files


def define_flags():
  flags.DEFINE_string("config", None, "Base config, e.g. configs/virtex.py:runlocal.")
  flags.DEFINE_string("vary", None, "'arg=v1 v2 ...;arg2=...': config arguments to sweep (their product).")
  flags.DEFINE_string("root", None, "Directory holding one workdir per variant.")
  flags.DEFINE_list("metrics", ["probe/map"], "summary.json keys to tabulate.")
  flags.DEFINE_string("eval_config", None, "Also run this eval config (vlrep.evaluate) on each variant.")
  flags.DEFINE_bool("collect_only", False, "Do not train; tabulate the runs found under --root.")
  flags.DEFINE_bool("dry_run", False, "Resolve every run's config and print its command; train nothing.")
  flags.DEFINE_list(
    "overrides", [], "Extra --config.KEY=VALUE flags for every run (without the --config. prefix; {seed}, {suffix})."
  )
  flags.DEFINE_list("seeds", ["0"], "Seeds of every variant; with more than one, cells show mean ± std (each seed).")


def parse_vary(vary: str) -> list[tuple[str, list[str]]]:
  out = []
  for part in filter(None, (p.strip() for p in vary.split(";"))):
    name, _, values = part.partition("=")
    if not values.split():
      raise ValueError(f"--vary part {part!r} has no values; write 'arg=v1 v2'.")
    out.append((name.strip(), values.split()))
  if not out:
    raise ValueError("--vary is empty.")
  return out


def variants(base: str, vary: list[tuple[str, list[str]]]) -> list[tuple[str, str, dict]]:
  """[(name, config argument string, {arg: value})] for the product of the varied values."""
  path, _, base_arg = base.partition(":")
  out = []
  for combo in itertools.product(*[values for _, values in vary]):
    assignment = dict(zip([n for n, _ in vary], combo, strict=True))
    arg = ",".join(filter(None, [base_arg, *[f"{k}={v}" for k, v in assignment.items()]]))
    name = "_".join(f"{k}{v}" for k, v in assignment.items())
    out.append((name, f"{path}:{arg}", assignment))
  return out


def parse_seeds(seeds) -> tuple[int, ...]:
  try:
    out = tuple(int(s) for s in seeds)
  except ValueError:
    raise ValueError(f"--seeds must be integers, got {list(seeds)}.") from None
  if not out or len(set(out)) != len(out):
    raise ValueError(f"--seeds must list distinct seeds, got {list(seeds)}.")
  return out


def seed_suffix(seed: int) -> str:
  """The workdir suffix of a seed's run: '' for seed 0 (so a one-seed sweep keeps its names), '_sN' otherwise."""
  return f"_s{seed}" if seed else ""


def seed_overrides(overrides: list[str], seed: int) -> list[str]:
  """The overrides of one seed's run: `{seed}` and `{suffix}` filled in, and `seed=N` added for N != 0."""
  out = [o.replace("{seed}", str(seed)).replace("{suffix}", seed_suffix(seed)) for o in overrides]
  return out + ([f"seed={seed}"] if seed else [])


def mean_cell(values: list) -> tuple[float | None, str | None]:
  """(mean of the values that exist, 'mean ± std (v0 / v1 / ...)' with '—' for missing ones) of one metric over
  seeds. std is the sample standard deviation (n - 1), 0 for a single value."""
  found = [v for v in values if v is not None]
  if not found:
    return None, None
  mean = sum(found) / len(found)
  std = (sum((v - mean) ** 2 for v in found) / (len(found) - 1)) ** 0.5 if len(found) > 1 else 0.0
  each = " / ".join("—" if v is None else f"{v:.2f}" for v in values)
  return mean, f"{mean:.2f} ± {std:.2f} ({each})"


def resolve_config(config: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """The config a run of `config` ('FILE.py[:ARG]') with `overrides` ('KEY=VALUE') would train: the file's
  get_config(ARG), then every override's key looked up (an unknown key is an error, as vlrep.main makes it)."""
  path, _, arg = config.partition(":")
  spec = importlib.util.spec_from_file_location("sweep_variant_config", path)
  if spec is None or not os.path.exists(path):
    raise FileNotFoundError(f"No config file {path!r}.")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config(arg or None)
  for override in overrides:
    key, sep, _ = override.partition("=")
    node = cfg
    for part in key.split("."):
      if not sep or not isinstance(node, ml_collections.ConfigDict) or part not in node:
        raise ValueError(f"Override {override!r}: {config} has no key {key!r}.")
      node = node[part]
  return cfg


def run_variant(
  config: str, workdir: str, overrides: list[str], eval_config: str | None, dry_run: bool = False
) -> None:
  """Trains one variant (vlrep.main in a subprocess), then evaluates it with `eval_config`. `dry_run`: resolves
  the variant's config and prints the command instead (arguments and override keys checked, nothing trained)."""
  cmd = [sys.executable, "-m", "vlrep.main", f"--config={config}", f"--workdir={workdir}"]
  cmd += [f"--config.{o}" for o in overrides]
  if dry_run:
    resolve_config(config, overrides)
    print("Would run:", shlex.join(["python", *cmd[1:]]), flush=True)
    return
  logging.info("Running %s", " ".join(cmd))
  subprocess.run(cmd, check=True)
  if eval_config:
    evaluate_run(eval_config, workdir)


def evaluate_run(eval_config: str, workdir: str) -> None:
  """`python -m vlrep.evaluate --config=EVAL_CONFIG --workdir=WORKDIR` (it merges its metrics into summary.json)."""
  cmd = [sys.executable, "-m", "vlrep.evaluate", f"--config={eval_config}", f"--workdir={workdir}"]
  logging.info("Running %s", " ".join(cmd))
  subprocess.run(cmd, check=True)


def finished(workdir: str) -> bool:
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    summary = json.load(f)
  return summary.get("preempted") is False


def collect(rows: list[tuple[str, dict, str]], metrics: list[str]) -> list[dict]:
  table = []
  for name, assignment, workdir in rows:
    summary = run_summary.read_summary(workdir)
    table.append({"name": name, **assignment, **{m: summary.get(m) for m in metrics}})
  return table


def collect_seeds(rows: list[tuple[str, dict, list[str]]], metrics: list[str]) -> tuple[list[dict], list[dict]]:
  """For rows with one workdir per seed: (table of 'mean (each seed)' cells, table of the means for the plot)."""
  cells, means = [], []
  for name, assignment, workdirs in rows:
    summaries = [run_summary.read_summary(w) for w in workdirs]
    cell_row, mean_row = {"name": name, **assignment}, {"name": name, **assignment}
    for m in metrics:
      mean_row[m], cell_row[m] = mean_cell([s.get(m) for s in summaries])
    cells.append(cell_row)
    means.append(mean_row)
  return cells, means


def markdown(table: list[dict], columns: list[str]) -> str:
  fmt = lambda v: "—" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in table]
  return "\n".join(lines) + "\n"


def plot(table: list[dict], x_key: str, metrics: list[str], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
  xs = [str(row[x_key]) for row in table]
  for m in metrics:
    ys = [row.get(m) for row in table]
    ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=m)
  ax.set_xlabel(x_key)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  with safe_files.atomic_path(path, suffix=os.path.splitext(path)[1]) as tmp:
    fig.savefig(tmp)
  plt.close(fig)


def sweep(
  config: str,
  vary: str,
  root: str,
  metrics: list[str],
  eval_config: str | None = None,
  collect_only: bool = False,
  overrides: list[str] | None = None,
  seeds=(0,),
  dry_run: bool = False,
) -> tuple[str, str] | None:
  """Runs (or only collects) the variants, each once per seed; returns (markdown path, plot path). `dry_run`:
  resolves each variant's config and prints its command; trains and writes nothing (returns None)."""
  parsed = parse_vary(vary)
  seeds = parse_seeds(seeds)
  if seeds != (0,) and any(o.startswith("seed=") for o in overrides or []):
    raise ValueError("Give the seeds with --seeds, not --overrides=seed=N, when sweeping over seeds.")
  rows = []
  for name, cfg, assignment in variants(config, parsed):
    workdirs = []
    for seed in seeds:
      workdir = os.path.join(root, name + seed_suffix(seed))
      if dry_run or (not collect_only and not finished(workdir)):
        run_variant(cfg, workdir, seed_overrides(overrides or [], seed), eval_config, dry_run)
      elif eval_config and not collect_only and any(m not in run_summary.read_summary(workdir) for m in metrics):
        evaluate_run(eval_config, workdir)  # trained before, without this evaluation
      workdirs.append(workdir)
    rows.append((name, assignment, workdirs))
  if dry_run:
    return None
  if len(seeds) == 1:
    table = plotted = collect([(n, a, w[0]) for n, a, w in rows], metrics)
  else:
    table, plotted = collect_seeds(rows, metrics)
  safe_files.make_dirs(root)
  md_path, png_path = os.path.join(root, "sweep.md"), os.path.join(root, "sweep.png")
  described = "; ".join(n + "=" + " ".join(v) for n, v in parsed)
  header = f"Sweep of `{config}` over {described}"
  if len(seeds) > 1:
    header += f", seeds {', '.join(map(str, seeds))}: mean ± std (each seed)"
  safe_files.write_text(md_path, header + "\n\n" + markdown(table, [n for n, _ in parsed] + metrics), root=root)
  plot(plotted, parsed[0][0], metrics, png_path)
  return md_path, png_path


def main(argv):
  del argv
  f = flags.FLAGS
  result = sweep(f.config, f.vary, f.root, f.metrics, f.eval_config, f.collect_only, f.overrides, f.seeds, f.dry_run)
  if result is None:
    return
  md, png = result
  print(open(md).read())
  print(f"Table: {md}\nPlot: {png}")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["config", "vary", "root"])
  app.run(main)
