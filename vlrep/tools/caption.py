r"""Captions image files with a checkpoint's forward model; optionally saves per-token attention overlays.

  python -m vlrep.tools.caption --workdir=/tmp/virtex_local photo1.jpg photo2.png
  python -m vlrep.tools.caption --workdir=DIR --decoding=nucleus --attention_dir=/tmp/att photo.jpg

The Python call is `vlrep.load(workdir).caption(images)`; this command decodes through it.

Images are resized (shorter side) and centre-cropped to the size the run trained on (--size to override), bicubic,
with torchvision's sizes and offsets (the features tool's and vlrep.load's preprocessing);
--preprocess=virtex_official is the official VirTex evaluation's instead (shorter side 256, bilinear without
antialiasing as OpenCV's INTER_LINEAR, centre crop 224). --decoding=virtex_official is the official evaluation's
beam search (vlrep.decoding.virtex_official); both together caption a zoo checkpoint as its published results did:

  python -m vlrep.tools.caption --workdir=/runs/virtex_zoo --decoding=virtex_official \
      --preprocess=virtex_official photo.jpg

With --attention_dir, DIR/<image name>/NN_<word>.png shows the decoder's cross-attention over the final
feature grid for each predicted token, averaged over heads and upsampled bicubically (VirTex figure 6).
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

from vlrep import decoding, inference, safe_files, visualize
from vlrep.errors import UserError, exit_2_on_user_error


def define_flags():
  flags.DEFINE_string("workdir", None, "The training run's directory.")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number.")
  flags.DEFINE_enum("decoding", "beam", list(decoding.METHODS), "Decoding method.")
  flags.DEFINE_integer("beam_size", 5, "Beams for --decoding=beam and virtex_official.")
  flags.DEFINE_enum(
    "preprocess", "crop", list(PREPROCESS), "crop: shorter side to --size, centre crop; virtex_official: 256, 224."
  )
  flags.DEFINE_float("top_p", 0.9, "Probability mass kept by --decoding=nucleus.")
  flags.DEFINE_integer("max_len", 30, "Most tokens per caption (at most the head's positions).")
  flags.DEFINE_integer("size", 0, "Input size (0: the training crop size of the run's config).")
  flags.DEFINE_integer("seed", 0, "Sampling seed for nucleus decoding.")
  flags.DEFINE_string("attention_dir", None, "Write per-token attention overlays (PNG) here.")
  flags.DEFINE_string("json_out", None, "Also write {image: caption} as JSON here.")


PREPROCESS = ("crop", "virtex_official")


class NoImageFile(UserError, FileNotFoundError):
  """An image file named on the command line does not exist."""


def caption_files(
  workdir: str,
  paths: list[str],
  checkpoint: str = "best",
  decoding_method: str = "beam",
  size: int = 0,
  max_len: int = 30,
  seed: int = 0,
  attention_dir: str | None = None,
  preprocess: str = "crop",
  **decode_kwargs,
) -> dict[str, dict]:
  """{path: {'caption', 'tokens', 'attention_pngs'}} for each image file: `vlrep.load(workdir).caption_tokens`,
  the decoding `vlrep.load(...).caption` runs."""
  if preprocess not in PREPROCESS:
    raise UserError(f"--preprocess={preprocess!r}: one of {', '.join(PREPROCESS)}.")
  if not paths:
    raise UserError("Give at least one image file.")
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise NoImageFile(f"No such image file(s): {missing}")
  visualize.check_images(paths)  # every file an image of a size vlrep decodes, before the model is built
  model = inference.load(workdir, checkpoint)
  with inference.saved_config_errors(model.run):
    if preprocess == "crop":
      prep = inference.preprocessing(model.run.config, "resize_crop", size)
    else:
      prep = inference.preprocessing(model.run.config, "virtex_official")
  images = np.stack([inference.load_image(p, prep) for p in paths])  # a damaged file refused before the model builds
  size = images.shape[1]
  tokens, attention = model.caption_tokens(visualize.normalize(images), decoding_method, max_len, seed, **decode_kwargs)
  out = {}
  for i, path in enumerate(paths):
    entry = {"caption": model.decode(tokens[i]), "tokens": model.pieces(tokens[i])}
    if attention_dir:
      name = os.path.splitext(os.path.basename(path))[0]
      n = len(entry["tokens"])
      entry["attention_pngs"] = visualize.save_token_overlays(
        images[i], attention[i, :n], entry["tokens"], os.path.join(attention_dir, name), upscale=max(1, 224 // size)
      )
    out[path] = entry
  return out


def main(argv):
  paths = argv[1:]
  f = flags.FLAGS
  kwargs = {"beam_size": f.beam_size} if f.decoding in ("beam", "virtex_official") else {}
  kwargs.update({"top_p": f.top_p} if f.decoding == "nucleus" else {})
  results = caption_files(
    f.workdir, paths, f.checkpoint, f.decoding, f.size, f.max_len, f.seed, f.attention_dir, f.preprocess, **kwargs
  )
  for path, entry in results.items():
    print(f"{path}: {entry['caption']}")
    if entry.get("attention_pngs"):
      print(f"  {len(entry['attention_pngs'])} attention maps in {os.path.dirname(entry['attention_pngs'][0])}")
  if f.json_out:
    safe_files.write_json(f.json_out, {p: e["caption"] for p, e in results.items()})


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["workdir"])
  app.run(exit_2_on_user_error(main))
