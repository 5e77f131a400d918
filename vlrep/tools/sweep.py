r"""Runs a family of configs and collects their metrics into one markdown table and one plot.

  python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 20 50 100" \
      --root=/tmp/sweep_fraction --metrics=probe/map,probe/map_random_init

  # several arguments: the product of their values; fixed ones join the base config argument
  python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="hidden=128 256;layers=1 2" --root=DIR

  # only collect runs that exist (e.g. trained on a cluster)
  python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 100" --root=DIR --collect_only

Each variant trains with `python -m vlrep.main` into ROOT/<name> (finished runs are skipped, interrupted ones
resume), then an optional --eval_config runs `python -m vlrep.evaluate` on it. The table (ROOT/sweep.md) has one
row per variant and one column per metric from the runs' summary.json; the plot (ROOT/sweep.png) draws each
metric against the first varied argument.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

from absl import app, flags, logging


def define_flags():
  flags.DEFINE_string("config", None, "Base config, e.g. configs/virtex.py:runlocal.")
  flags.DEFINE_string("vary", None, "'arg=v1 v2 ...;arg2=...': config arguments to sweep (their product).")
  flags.DEFINE_string("root", None, "Directory holding one workdir per variant.")
  flags.DEFINE_list("metrics", ["probe/map"], "summary.json keys to tabulate.")
  flags.DEFINE_string("eval_config", None, "Also run this eval config (vlrep.evaluate) on each variant.")
  flags.DEFINE_bool("collect_only", False, "Do not train; tabulate the runs found under --root.")
  flags.DEFINE_list("overrides", [], "Extra --config.KEY=VALUE flags for every run (without the --config. prefix).")


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


def run_variant(config: str, workdir: str, overrides: list[str], eval_config: str | None) -> None:
  cmd = [sys.executable, "-m", "vlrep.main", f"--config={config}", f"--workdir={workdir}"]
  cmd += [f"--config.{o}" for o in overrides]
  logging.info("Running %s", " ".join(cmd))
  subprocess.run(cmd, check=True)
  if eval_config:
    subprocess.run(
      [sys.executable, "-m", "vlrep.evaluate", f"--config={eval_config}", f"--workdir={workdir}"], check=True
    )


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
    path = os.path.join(workdir, "summary.json")
    summary = {}
    if os.path.exists(path):
      with open(path) as f:
        summary = json.load(f)
    table.append({"name": name, **assignment, **{m: summary.get(m) for m in metrics}})
  return table


def markdown(table: list[dict], columns: list[str]) -> str:
  fmt = lambda v: "—" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
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
  fig.savefig(path)
  plt.close(fig)


def sweep(
  config: str,
  vary: str,
  root: str,
  metrics: list[str],
  eval_config: str | None = None,
  collect_only: bool = False,
  overrides: list[str] | None = None,
) -> tuple[str, str]:
  """Runs (or only collects) the variants; returns (markdown path, plot path)."""
  parsed = parse_vary(vary)
  rows = []
  for name, cfg, assignment in variants(config, parsed):
    workdir = os.path.join(root, name)
    if not collect_only and not finished(workdir):
      run_variant(cfg, workdir, overrides or [], eval_config)
    rows.append((name, assignment, workdir))
  table = collect(rows, metrics)
  os.makedirs(root, exist_ok=True)
  md_path, png_path = os.path.join(root, "sweep.md"), os.path.join(root, "sweep.png")
  described = "; ".join(n + "=" + " ".join(v) for n, v in parsed)
  header = f"Sweep of `{config}` over {described}\n\n"
  with open(md_path, "w") as f:
    f.write(header + markdown(table, [n for n, _ in parsed] + metrics))
  plot(table, parsed[0][0], metrics, png_path)
  return md_path, png_path


def main(argv):
  del argv
  f = flags.FLAGS
  md, png = sweep(f.config, f.vary, f.root, f.metrics, f.eval_config, f.collect_only, f.overrides)
  print(open(md).read())
  print(f"Table: {md}\nPlot: {png}")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["config", "vary", "root"])
  app.run(main)
