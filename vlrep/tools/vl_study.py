r"""The pretraining study's grid (Singh et al., tables 1 and 2): pretrain each model on each source, fine-tune every
pretrained model (and BERT alone: no pretraining) on each task with the base fine-tuned or frozen, and tabulate.

  python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal --root=/tmp/vl_study \
      --archs=visual_bert,vilbert --sources=none,captions,questions,ood_captions,generated --tasks=vqa,ve \
      --generated=/tmp/ood_generated.json

Runs go to ROOT/<arch>_<source> (pretraining) and ROOT/<arch>_<source>_<task>_<finetune|frozen> (seed 0; other
--seeds add `_s<seed>`; --modes=frozen runs only the frozen-base column); finished ones are skipped and interrupted
ones resume (as `vlrep.tools.sweep`). The tables, ROOT/study.md, have the paper's layout: one per mode (fine-tuned,
frozen base), rows = model x pretraining data, columns = tasks, each cell the task's best validation score over the
run's evaluations — with several --seeds, the mean over the seeds' downstream runs followed by each seed's score.
Seeds vary the downstream run (head initialisation, data order) of one pretraining run per source.
ROOT/study.png plots the means.
--collect_only tabulates what exists (runs trained elsewhere).
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from vlrep import run_summary, safe_files
from vlrep.tools import sweep

METRIC = {
  "vqa": "task/vqa_best",
  "vizwiz": "task/vqa_best",
  "ve": "task/accuracy_best",
  "mmimdb": "task/micro_f1_best",
}
TASK_NAMES = {"vqa": "VQA acc", "vizwiz": "VizWiz acc", "ve": "entailment acc", "mmimdb": "MM-IMDB micro-F1"}
MODES = ("finetune", "frozen")


def finetune_name(arch: str, source: str, task: str, mode: str, seed: int = 0) -> str:
  return f"{arch}_{source}_{task}_{mode}" + sweep.seed_suffix(seed)


def grid(archs, sources, tasks, seeds=(0,), modes=MODES, downstream_overrides=()):
  """[(workdir name, config argument, pretraining run name or '', extra overrides)] in dependency order; the
  downstream runs' extra overrides are their seed (when not 0) and `downstream_overrides`."""
  runs = []
  for arch in archs:
    for source in sources:
      if source != "none":
        runs.append((f"{arch}_{source}", f"arch={arch},stage=pretrain,data={source}", "", []))
    for source in sources:
      for task in tasks:
        for mode in modes:
          for seed in seeds:
            arg = f"arch={arch},stage=finetune,task={task}" + (",frozen" if mode == "frozen" else "")
            pretrained = "" if source == "none" else f"{arch}_{source}"
            extra = ([f"seed={seed}"] if seed else []) + list(downstream_overrides)
            runs.append((finetune_name(arch, source, task, mode, seed), arg, pretrained, extra))
  return runs


def cell(root: str, arch: str, source: str, task: str, mode: str, seeds=(0,)) -> list:
  """Each seed's best score (None where its run has none)."""
  workdirs = [os.path.join(root, finetune_name(arch, source, task, mode, seed)) for seed in seeds]
  return [run_summary.read_summary(w).get(METRIC[task]) for w in workdirs]


def tables(root: str, archs, sources, tasks, seeds=(0,), modes=MODES) -> str:
  out = []
  for mode in modes:
    title = "fine-tuned" if mode == "finetune" else "frozen base (only the head trains)"
    out.append(f"**{title}**\n")
    rows = []
    for arch in archs:
      for source in sources:
        row = {"model": arch, "pretrained on": source}
        for task in tasks:
          mean, text = sweep.mean_cell(cell(root, arch, source, task, mode, seeds))
          row[TASK_NAMES[task]] = text if len(seeds) > 1 else mean
        rows.append(row)
    out.append(sweep.markdown(rows, ["model", "pretrained on", *[TASK_NAMES[t] for t in tasks]]))
  return "\n".join(out)


def plot(root: str, archs, sources, tasks, path: str, seeds=(0,), modes=MODES) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  fig, axes = plt.subplots(len(tasks), len(modes), figsize=(5 * len(modes), 3 * len(tasks)), dpi=110, squeeze=False)
  width = 0.8 / max(len(archs), 1)
  for i, task in enumerate(tasks):
    for j, mode in enumerate(modes):
      ax = axes[i][j]
      for k, arch in enumerate(archs):
        vals = []
        for source in sources:
          mean, _ = sweep.mean_cell(cell(root, arch, source, task, mode, seeds))
          vals.append(np.nan if mean is None else mean)
        ax.bar(np.arange(len(sources)) + k * width, vals, width, label=arch)
      ax.set_xticks(np.arange(len(sources)) + width * (len(archs) - 1) / 2, sources, fontsize=7)
      ax.set_title(f"{TASK_NAMES[task]}, {mode}", fontsize=9)
      ax.grid(axis="y", alpha=0.3)
      ax.legend(fontsize=7)
  fig.tight_layout()
  with safe_files.atomic_path(path, suffix=os.path.splitext(path)[1]) as tmp:
    fig.savefig(tmp)
  plt.close(fig)


def study(
  config,
  root,
  archs,
  sources,
  tasks,
  generated="",
  collect_only=False,
  overrides=(),
  seeds=(0,),
  modes=MODES,
  downstream_overrides=(),
  dry_run=False,
):
  """Runs what is missing of the grid, then writes ROOT/study.md and ROOT/study.png. `overrides` go to every run,
  `downstream_overrides` to the fine-tuning / frozen runs only (e.g. a longer head budget)."""
  path, _, base_arg = config.partition(":")
  if "generated" in sources and not generated and not collect_only:
    raise ValueError("--sources has 'generated': give --generated=PATH (vlrep.tools.generate_captions).")
  seeds = sweep.parse_seeds(seeds)
  if not modes or set(modes) - set(MODES):
    raise ValueError(f"--modes must be among {MODES}, got {modes}.")
  for name, arg, pretrained, run_overrides in grid(archs, sources, tasks, seeds, modes, downstream_overrides):
    workdir = os.path.join(root, name)
    if not dry_run and (collect_only or sweep.finished(workdir)):
      continue
    extra = list(overrides) + run_overrides
    if pretrained:
      extra.append(f"method.pretrained_run={os.path.join(root, pretrained)}")
    if name.endswith("_generated"):
      arg += f",generated={generated}"
    sweep.run_variant(f"{path}:{','.join(filter(None, [base_arg, arg]))}", workdir, extra, None, dry_run)
  if dry_run:
    return None, None
  md = tables(root, archs, sources, tasks, seeds, modes)
  safe_files.make_dirs(root)
  md_path, png_path = os.path.join(root, "study.md"), os.path.join(root, "study.png")
  safe_files.write_text(md_path, f"Study of `{config}`: best validation score per run\n\n{md}", root=root)
  plot(root, archs, sources, tasks, png_path, seeds, modes)
  logging.info("Wrote %s and %s", md_path, png_path)
  return md_path, png_path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  md_path, _ = study(
    f.config,
    f.root,
    f.archs,
    f.sources,
    f.tasks,
    f.generated,
    f.collect_only,
    [o for o in f.overrides if o],
    f.seeds,
    f.modes,
    [o for o in f.downstream_overrides if o],
    f.dry_run,
  )
  if md_path is None:
    return
  with open(md_path) as fh:
    print(fh.read())


if __name__ == "__main__":
  flags.DEFINE_string("config", None, "Base config, e.g. configs/vlbert.py:runlocal (the study's arguments are added).")
  flags.mark_flag_as_required("config")
  flags.DEFINE_string("root", None, "Directory of the study's runs.")
  flags.DEFINE_list("archs", ["visual_bert", "vilbert"], "Models.")
  flags.DEFINE_list("sources", ["none", "captions", "questions", "ood_captions", "generated"], "Pretraining data.")
  flags.DEFINE_list("tasks", ["vqa", "ve"], "Downstream tasks.")
  flags.DEFINE_string("generated", "", "Generated-caption JSON for the 'generated' source.")
  flags.DEFINE_bool("collect_only", False, "Do not train; tabulate the runs found under --root.")
  flags.DEFINE_bool("dry_run", False, "Resolve every run's config and print its command; train nothing.")
  flags.DEFINE_list("modes", list(MODES), "Downstream modes: finetune (whole model), frozen (head only).")
  flags.DEFINE_list("seeds", ["0"], "Seeds of every downstream run; cells show their mean and each seed's score.")
  flags.DEFINE_list(
    "downstream_overrides", [], "Extra --config.KEY=VALUE flags for the fine-tuning / frozen runs only."
  )
  flags.DEFINE_list("overrides", [], "Extra --config.KEY=VALUE flags for every run (without the prefix).")
  flags.mark_flags_as_required(["root"])
  app.run(main)
