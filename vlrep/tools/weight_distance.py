r"""How far fine-tuning moves each self-attention layer from its pretrained weights (Singh et al., figures 4-5).

  python -m vlrep.tools.weight_distance --root=/tmp/vl_study --arch=visual_bert --task=vqa

For each pretraining source of a `vlrep.tools.vl_study` root, compares the fine-tuned run
ROOT/<arch>_<source>_<task>_finetune with where it started: the pretraining run ROOT/<arch>_<source>, or for
'none' the BERT checkpoint itself. Per layer, the self-attention matrices (query, key, value, output kernels;
for ViLBERT also the visual stream's) give two distances, averaged over the layer's matrices as the paper does:
  L1       mean |W_finetuned - W_pretrained| over the matrix's entries;
  angular  arccos(cosine(vec W_finetuned, vec W_pretrained)) / pi, in [0, 1].
Writes ROOT/weight_distance_<arch>_<task>.png (two heatmaps: rows = sources, columns = layers) and .md.
"""

from __future__ import annotations

import os
import re

import numpy as np
from absl import app, flags, logging

from vlrep import runs, safe_files
from vlrep.models import bert as bert_lib

ATTENTION = ("query", "key", "value", "attention_output")


def l1_distance(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.mean(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def angular_distance(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
  return float(np.arccos(np.clip(cos, -1.0, 1.0)) / np.pi)


def attention_layers(params: dict) -> dict[str, dict[str, np.ndarray]]:
  """{'t0': {'query': kernel, ...}, ..., 'v0': ...}: the text layers (params['bert']['layer_i']) and ViLBERT's
  visual layers (params['v_layer_i'])."""
  out = {}
  for name, layer in params.get("bert", {}).items():
    if m := re.fullmatch(r"layer_(\d+)", name):
      out[f"t{m.group(1)}"] = {k: np.asarray(layer[k]["kernel"]) for k in ATTENTION}
  for name, layer in params.items():
    if m := re.fullmatch(r"v_layer_(\d+)", name):
      out[f"v{m.group(1)}"] = {k: np.asarray(layer[k]["kernel"]) for k in ATTENTION}
  return dict(sorted(out.items(), key=lambda kv: (kv[0][0] == "v", int(kv[0][1:]))))


def layer_distances(pretrained: dict, finetuned: dict) -> dict[str, dict[str, float]]:
  """{layer: {'l1', 'angular'}} averaged over the layer's attention matrices; layers both trees have."""
  a, b = attention_layers(pretrained), attention_layers(finetuned)
  out = {}
  for layer in a:
    if layer not in b:
      continue
    mats = [(a[layer][k], b[layer][k]) for k in ATTENTION]
    out[layer] = {
      "l1": float(np.mean([l1_distance(x, y) for x, y in mats])),
      "angular": float(np.mean([angular_distance(x, y) for x, y in mats])),
    }
  return out


def starting_params(root: str, arch: str, source: str, finetuned_run) -> dict:
  if source != "none":
    return runs.load_run(os.path.join(root, f"{arch}_{source}"), "best").params
  cfg = finetuned_run.config.method
  _, enc, _, _ = bert_lib.load_pretrained(cfg.get("bert_path", ""))
  return {"bert": enc}


def study_distances(root: str, arch: str, task: str, sources) -> dict[str, dict[str, dict[str, float]]]:
  out = {}
  for source in sources:
    workdir = os.path.join(root, f"{arch}_{source}_{task}_finetune")
    if not os.path.isdir(workdir):
      logging.warning("No run %s: skipped.", workdir)
      continue
    run = runs.load_run(workdir, "best")
    out[source] = layer_distances(starting_params(root, arch, source, run), run.params)
  return out


def write(distances: dict, path_prefix: str) -> tuple[str, str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sources = list(distances)
  layers = list(next(iter(distances.values())))
  lines = []
  width = 2 * (2.2 + 0.5 * len(layers))  # room for the source names and the colour bar of each panel
  fig, axes = plt.subplots(1, 2, figsize=(width, 1.2 + 0.4 * len(sources)), dpi=120)
  for ax, kind in zip(axes, ("l1", "angular"), strict=True):
    grid = np.array([[distances[s].get(layer, {}).get(kind, np.nan) for layer in layers] for s in sources])
    im = ax.imshow(grid, cmap="Blues", aspect="auto")
    ax.set_xticks(range(len(layers)), layers, fontsize=7)
    ax.set_yticks(range(len(sources)), sources, fontsize=7)
    ax.set_title(f"{kind} distance", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.08, pad=0.04, format="%.1e")
    lines.append(f"**{kind}** (x1e3)\n\n| source | " + " | ".join(layers) + " |\n|" + "---|" * (len(layers) + 1))
    for source, row in zip(sources, grid, strict=True):
      lines.append(f"| {source} | " + " | ".join(f"{1e3 * v:.2f}" for v in row) + " |")
    lines.append("")
  fig.tight_layout()
  png, md = path_prefix + ".png", path_prefix + ".md"
  with safe_files.atomic_path(png, suffix=".png") as tmp:
    fig.savefig(tmp)
  plt.close(fig)
  safe_files.write_text(md, "\n".join(lines) + "\n")
  return png, md


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  distances = study_distances(f.root, f.arch, f.task, f.sources)
  if not distances:
    raise app.UsageError(f"No fine-tuned runs of {f.arch}/{f.task} under {f.root}.")
  png, md = write(distances, os.path.join(f.root, f"weight_distance_{f.arch}_{f.task}"))
  with open(md) as fh:
    print(fh.read())
  print(f"Heatmaps: {png}")


if __name__ == "__main__":
  flags.DEFINE_string("root", None, "A vlrep.tools.vl_study root.")
  flags.DEFINE_string("arch", "visual_bert", "visual_bert or vilbert.")
  flags.DEFINE_string("task", "vqa", "The downstream task.")
  flags.DEFINE_list("sources", ["none", "captions", "questions", "ood_captions", "generated"], "Pretraining data.")
  flags.mark_flags_as_required(["root"])
  app.run(main)
