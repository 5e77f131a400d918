r"""Captions every image of a dataset split with a VirTex run's forward model: the study's "generated captions"
pretraining data (a captioner trained in-domain, run over another image collection).

  python -m vlrep.tools.generate_captions --workdir=/tmp/virtex_local --dataset=synthetic_scenes \
      --split=ood_train --output=/tmp/ood_generated.json

Writes JSON {image_id: [caption, ...]} (`--num_captions` per image: the top beams of beam search, or nucleus
samples), which `configs/vlbert.py:data=generated,generated=PATH` reads through the `generated_captions` op.
Images are resized and centre-cropped to the run's training size.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import ConfigDict

from vlrep import inference, run_setup, runs, safe_files
from vlrep.data import pipeline
from vlrep.evaluators.captioning import captioner_for


def generate(
  workdir: str,
  dataset: str,
  split: str,
  output: str,
  data_dir: str = "",
  config_name: str = "",
  decoding: str = "beam",
  beam_size: int = 5,
  num_captions: int = 1,
  max_len: int = 30,
  batch_size: int = 64,
  seed: int = 0,
) -> dict[str, list[str]]:
  run = runs.load_run(workdir, "best")
  inputs = run_setup.build_inputs(run.config, run.workdir)  # the run's saved config: what it names is only read
  size = inference.training_size(run.config)
  builder = pipeline.get_builder(dataset, data_dir or None, config_name or None)
  kwargs = {"beam_size": beam_size} if decoding == "beam" else {}
  caption = captioner_for(inputs.method, ConfigDict({"decoding": decoding, "max_len": max_len, **kwargs}))
  variables = jax.device_put(run.variables)
  pp = f"decode|resize_small({size})|central_crop({size})|normalize"
  out: dict[str, list[str]] = {}
  t0 = time.time()
  rng = jax.random.PRNGKey(seed)
  for i, batch in enumerate(pipeline.eval_batches(builder, split, pp, ("image", "image_id"), batch_size)):
    keep = batch["_mask"].astype(bool)
    texts = [[] for _ in range(len(keep))]
    for k in range(num_captions):
      # Beam search is deterministic: more than one caption per image needs sampling (--decoding=nucleus).
      tokens, _ = caption(variables, batch["image"], jax.random.fold_in(rng, i * num_captions + k))
      for j, ids in enumerate(np.asarray(tokens)):
        texts[j].append(inputs.tokenizer.decode(ids.tolist()))
    for j in np.flatnonzero(keep):
      out[str(int(batch["image_id"][j]))] = texts[j]
    logging.info("%d images captioned (%.1fs).", len(out), time.time() - t0)
  safe_files.make_dirs(os.path.dirname(os.path.abspath(output)))
  safe_files.write_json(output, out, indent=1, sort_keys=True)
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if f.decoding == "beam" and f.num_captions > 1:
    raise app.UsageError("Beam search gives one caption per image; use --decoding=nucleus for --num_captions > 1.")
  out = generate(
    f.workdir,
    f.dataset,
    f.split,
    f.output,
    f.data_dir,
    f.config_name,
    f.decoding,
    f.beam_size,
    f.num_captions,
    f.max_len,
    f.batch_size,
    f.seed,
  )
  first = next(iter(out.items()))
  print(f"{len(out)} images captioned into {f.output}; e.g. image {first[0]}: {first[1][0]!r}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A VirTex run (forward or bicaptioning) directory.")
  flags.DEFINE_string("dataset", "synthetic_scenes", "Dataset whose images are captioned.")
  flags.DEFINE_string("split", "ood_train", "Split to caption.")
  flags.DEFINE_string("data_dir", "", "TFDS data dir ('' = default).")
  flags.DEFINE_string("config_name", "", "Builder config ('' = default).")
  flags.DEFINE_string("output", None, "JSON file to write.")
  flags.DEFINE_enum("decoding", "beam", ["greedy", "beam", "nucleus"], "Decoding method.")
  flags.DEFINE_integer("beam_size", 5, "Beams for --decoding=beam.")
  flags.DEFINE_integer("num_captions", 1, "Captions per image (nucleus sampling for more than one).")
  flags.DEFINE_integer("max_len", 30, "Most tokens per caption.")
  flags.DEFINE_integer("batch_size", 64, "Images per decoding batch.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.mark_flags_as_required(["workdir", "output"])
  app.run(main)
