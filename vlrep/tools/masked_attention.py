r"""Renders an ICMLM checkpoint's attention for masked concept tokens (the ICMLM paper's figures 1 and 3).

  # The run's own validation images (synthetic_scenes: val), first 4, every concept of their first caption:
  python -m vlrep.tools.masked_attention --workdir=/tmp/icmlm_attfc --out_dir=/tmp/icmlm_maps
  # Your own image and caption:
  python -m vlrep.tools.masked_attention --workdir=RUN --out_dir=/tmp/maps --caption="a dog on a red sofa" dog.jpg

For each image and each concept word of its caption, the word is replaced by [MASK] and the model's attention
over the grid for that masked token is drawn over the image: att-fc's pooling weights p_att (eq. 5), or for
ICMLM_tfm the transformer's attention of the masked token on the visual tokens (mean over heads). Writes
OUT_DIR/<name>/NN_<word>.png and OUT_DIR/<name>.png, a strip labelled 'word>prediction' per masked word; the
top-5 predictions are printed.
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

from vlrep import inference, run_setup, runs, visualize
from vlrep.tools.attention_maps import load_inputs, strip


def define_flags():
  flags.DEFINE_string("workdir", None, "The ICMLM run's directory.")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  flags.DEFINE_string("out_dir", None, "Where to write the PNGs.")
  flags.DEFINE_string("caption", None, "Caption for the image files given as arguments.")
  flags.DEFINE_string("split", "val", "Dataset split to take examples from when no image files are given.")
  flags.DEFINE_integer("num_examples", 4, "How many dataset examples to render when no image files are given.")
  flags.DEFINE_integer("size", 0, "Input size (0: the training crop size of the run's config).")
  flags.DEFINE_integer("upscale", 4, "Upsampling of the saved overlays (small images).")


def render(workdir, out_dir, images, captions, names, checkpoint="best", upscale=4) -> dict[str, dict]:
  """uint8 images [B, S, S, 3] and captions -> {name: {'words', 'predictions', 'pngs', 'strip'}}."""
  import jax
  from PIL import Image

  run = runs.load_run(workdir, checkpoint)
  _, inputs = run_setup.build(run.config)
  method, tok = inputs.method, inputs.tokenizer
  if run.config.method.name != "icmlm" or method.variant not in ("tfm", "att_fc"):
    raise ValueError(f"{workdir} is not an ICMLM tfm/att_fc run; masked-token attention needs one.")
  concept_mask = np.asarray(method.concept_mask)
  variables = jax.device_put(run.variables)
  attend = jax.jit(method.attention_map)
  predict = jax.jit(lambda v, x, t, p: jax.lax.top_k(method.predict_masked(v, x, t, p), 5)[1])
  out = {}
  for i, name in enumerate(names):
    ids, _ = tok.encode(captions[i], 40)
    positions = np.flatnonzero(concept_mask[ids]).astype(np.int32)
    if not len(positions):
      print(f"{name}: no concept word in {captions[i]!r}; skipped.")
      continue
    x = np.repeat(visualize.normalize(images[i : i + 1]), len(positions), axis=0)
    t = np.repeat(ids[None], len(positions), axis=0)
    maps = np.asarray(attend(variables, x, t, positions))
    top5 = np.asarray(predict(variables, x, t, positions))
    words = [tok.pieces[ids[p]] for p in positions]
    preds = [[tok.pieces[k] for k in row] for row in top5]
    big = np.asarray(Image.fromarray(images[i]).resize((images.shape[2] * upscale, images.shape[1] * upscale)))
    labels = [f"{w}>{p[0]}" for w, p in zip(words, preds, strict=True)]
    pngs = visualize.save_token_overlays(big, maps.reshape(len(words), -1), labels, os.path.join(out_dir, name))
    path = os.path.join(out_dir, f"{name}.png")
    strip(big, maps, labels).save(path)
    out[name] = {"caption": captions[i], "words": words, "predictions": preds, "pngs": pngs, "strip": path}
  return out


def main(argv):
  f = flags.FLAGS
  run_config = runs.load_run(f.workdir, f.checkpoint).config
  size = f.size or inference.training_size(run_config)
  images, captions, names = load_inputs(
    argv[1:], f.caption, run_config, f.split, f.num_examples, size, "|fixed_captions(1)", "captions"
  )
  results = render(f.workdir, f.out_dir, images, captions, names, f.checkpoint, f.upscale)
  for name, entry in results.items():
    print(f"{name}: {entry['caption']}")
    for w, p in zip(entry["words"], entry["predictions"], strict=True):
      print(f"  [MASK]={w}: {' '.join(p)}")
    print(f"  -> {entry['strip']} and {len(entry['pngs'])} maps")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir", "out_dir"])
  app.run(main)
