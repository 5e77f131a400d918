r"""Renders a LocTex checkpoint's image-caption attention for every token of a caption (LocTex figure 4).

  # Narrations of the run's own validation images (synthetic_scenes: val), first 4:
  python -m vlrep.tools.attention_maps --workdir=/tmp/loctex_local --out_dir=/tmp/att --num_examples=4
  # Your own images and caption:
  python -m vlrep.tools.attention_maps --workdir=RUN --out_dir=/tmp/att --caption="a dog on the left" dog.jpg

Writes OUT_DIR/<name>/NN_<token>.png (one overlay per token: the softmax over grid cells of the chosen map,
upsampled bicubically) and OUT_DIR/<name>.png, a strip of the image and every word's map with its word.
--map picks '1x', '2x', ... (the localization projections at that scale) or 'contrastive' (the contrastive
projections applied per location: what a model trained without L_L attends to).
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags
from PIL import Image, ImageDraw

from vlrep import inference, run_setup, safe_files, visualize
from vlrep.data import pipeline, tokenizers
from vlrep.errors import UserError, exit_2_on_user_error
from vlrep.tools.caption import NoImageFile


def define_flags():
  flags.DEFINE_string("workdir", None, "The LocTex run's directory.")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  flags.DEFINE_string("out_dir", None, "Where to write the PNGs.")
  flags.DEFINE_string("map", "", "Attention map: '1x', '2x', ... or 'contrastive' (default: the finest scale).")
  flags.DEFINE_string("caption", None, "Caption for the image files given as arguments.")
  flags.DEFINE_string("split", "val", "Dataset split to take examples from when no image files are given.")
  flags.DEFINE_integer("num_examples", 4, "How many dataset examples to render when no image files are given.")
  flags.DEFINE_integer("size", 0, "Input size (0: the training crop size of the run's config).")
  flags.DEFINE_integer("upscale", 4, "Upsampling of the saved overlays (small images).")
  flags.DEFINE_list("words", [], "Show only these tokens (e.g. the object words) in the strips and PNGs.")


def strip(image: np.ndarray, maps: np.ndarray, words: list[str], label_height: int = 14) -> Image.Image:
  """The image and one overlay per word side by side, each with its word underneath."""
  h, w = image.shape[:2]
  tiles = [image] + [visualize.overlay(image, m) for m in maps]
  labels = ["image"] + words
  out = Image.new("RGB", (w * len(tiles), h + label_height), "white")
  draw = ImageDraw.Draw(out)
  for k, (tile, label) in enumerate(zip(tiles, labels, strict=True)):
    out.paste(Image.fromarray(tile), (k * w, 0))
    draw.text((k * w + 2, h + 1), label[: max(1, w // 6)], fill="black")
  return out


def render(
  workdir: str,
  out_dir: str,
  images: np.ndarray,
  captions: list[str],
  names: list[str],
  checkpoint: str = "best",
  map_name: str = "",
  upscale: int = 4,
  words: list[str] | None = None,
) -> dict[str, dict]:
  """uint8 images [B, S, S, 3] and their captions -> {name: {'tokens', 'pngs', 'strip'}} (only the tokens
  in `words`, if given)."""
  import jax

  run = inference.load_run(workdir, checkpoint)
  with inference.saved_config_errors(run):
    _, inputs = run_setup.build(run.config)
  method, tok = inputs.method, inputs.tokenizer
  if not hasattr(method, "attention"):
    raise UserError(f"{workdir} is a {run.config.method.name} run; attention maps need a LocTex run.")
  max_len = run.config.method.text.max_len
  tokens = np.stack([tok.encode(c, max_len)[0] for c in captions])
  maps = jax.jit(method.attention)(jax.device_put(run.variables), visualize.normalize(images), tokens)
  map_name = map_name or f"{max(method.scales)}x"
  if map_name not in maps:
    raise ValueError(f"Unknown map {map_name!r}; this run has {sorted(maps)}.")
  att = np.asarray(maps[map_name])
  big = np.stack(
    [np.asarray(Image.fromarray(im).resize((im.shape[1] * upscale, im.shape[0] * upscale))) for im in images]
  )
  out = {}
  for i, name in enumerate(names):
    ids = tokens[i].tolist()
    keep = [t for t, x in enumerate(ids) if x >= tokenizers.NUM_SPECIAL or x == tokenizers.UNK_ID]
    if words:
      keep = [t for t in keep if tok.sp.id_to_piece(ids[t]).replace("\u2581", "") in words]
    pieces = [tok.sp.id_to_piece(ids[t]).replace("\u2581", "") for t in keep]
    flat = att[i][keep].reshape(len(keep), -1)
    pngs = visualize.save_token_overlays(big[i], flat, pieces, os.path.join(out_dir, name))
    path = os.path.join(out_dir, f"{name}.png")
    with safe_files.atomic_path(path, suffix=".png") as tmp:
      strip(big[i], att[i][keep], pieces).save(tmp)
    out[name] = {"tokens": pieces, "pngs": pngs, "strip": path, "map": map_name}
  return out


def load_inputs(
  paths: list[str],
  caption: str | None,
  run_config,
  split: str,
  num_examples: int,
  size: int,
  text_pp: str = "",
  text_field: str = "narration",
):
  """(uint8 images, captions, names): image files with one --caption, or the first examples of the run's dataset
  (`text_pp` then `text_field` gives each example's caption). Shared by the attention tools."""
  if paths:
    if not caption:
      raise app.UsageError("Give --caption with image files (or no files, to use the run's dataset).")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
      raise NoImageFile(f"No such image file(s): {missing}")
    visualize.check_images(paths)
    images = np.stack([visualize.load_image(p, size) for p in paths])
    return images, [caption] * len(paths), [os.path.splitext(os.path.basename(p))[0] for p in paths]
  d = run_config.data
  builder = pipeline.get_builder(d.name, d.data_dir, d.get("config_name"))
  pp = f"decode|resize({size}){text_pp}"
  batch = next(pipeline.eval_batches(builder, split, pp, ("image", text_field), num_examples))
  images = batch["image"][batch["_mask"]]
  texts = np.asarray(batch[text_field])[batch["_mask"]]
  captions = [(t.reshape(-1)[0] if isinstance(t, np.ndarray) else t).decode("utf-8") for t in texts]
  return images, captions, [f"{split}_{i:03d}" for i in range(len(images))]


def main(argv):
  f = flags.FLAGS
  run_config = inference.load_run(f.workdir, f.checkpoint).config
  size = f.size or inference.training_size(run_config)
  images, captions, names = load_inputs(argv[1:], f.caption, run_config, f.split, f.num_examples, size)
  results = render(f.workdir, f.out_dir, images, captions, names, f.checkpoint, f.map, f.upscale, f.words)
  for name, entry in results.items():
    print(f"{name} ({entry['map']}): {' '.join(entry['tokens'])}\n  -> {entry['strip']} and {len(entry['pngs'])} maps")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir", "out_dir"])
  app.run(exit_2_on_user_error(main))
