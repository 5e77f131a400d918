r"""Uses a trained model from the command line: captions, zero-shot labels or embeddings of your own photos, as JSON
lines (one object per image or text, in the order given) on stdout; logs go to stderr.

  python -m vlrep.predict --model=/tmp/vlrep_virtex_local caption photo.jpg
  python -m vlrep.predict --model=/tmp/vlrep_virtex_local zero-shot --labels=cat,dog,boat photo.jpg
  python -m vlrep.predict --model=/tmp/vlrep_virtex_local embed photo.jpg

--model is a run folder (any method, trained with vlrep.main or imported with vlrep.interop.import_run; its
--checkpoint=best, latest or a step number) or a shared folder (vlrep.interop.export --format=vlrep, or that
folder downloaded from a model hub). The first word after the flags is what to do, the rest are image files:

  caption IMAGES...     {"image": "photo.jpg", "caption": "a dog on a boat"}
      Captioners only (VirTex, CapPa, an imported VirTex). --decoding=beam (default), greedy, nucleus or
      virtex_official; --beam_size=5, --max_len=30, --top_p=0.9 and --seed=0 (nucleus). --preprocess=crop (the
      shorter side resized to the run's training crop size, centre crop) or virtex_official (the official VirTex
      evaluation's: shorter side 256, bilinear, centre crop 224); with --decoding=virtex_official it captions a
      zoo checkpoint as its published results did.
  zero-shot IMAGES...   {"image": "photo.jpg", "top": [{"label": "dog", "score": 0.71}, ...]}
      The labels as class names: --labels=cat,dog,boat or --labels_file=FILE (one name a line). Each name goes
      into every template (--templates, repeatable or '|'-separated, each with '{}' where the name goes; default
      the zero_shot evaluator's "a photo of a {}." and three more); the --top_k=5 best labels, best first. A text
      tower (CLIP, SigLIP, LocTex, MCT) scores by cosine to each label's mean prompt embedding, a captioner
      (VirTex) by its class posterior from the prompts' log-likelihoods: the zero_shot evaluator's scores.
  embed IMAGES...       {"image": "photo.jpg", "pooled": [0.12, ...]}
      The backbone's pooled features (what every transfer evaluation uses). --features=pooled,grid,embedding
      picks others: the final feature map ("grid", [h][w][C]) or a text tower's l2-normalised image embedding.
      --texts="a dog on a boat." (repeatable) embeds texts instead or as well: {"text": ..., "embedding": [...]},
      after the images (text towers only; a VirTex has no text embedding).

For example, the same photos under other settings:

  ... --model=RUN caption --decoding=greedy --max_len=20 photo.jpg other.png
  ... --model=RUN zero-shot --labels_file=classes.txt --templates="a photo of a {}.|a drawing of a {}." --top_k=3 *.jpg
  ... --model=RUN embed --features=pooled,grid photo.jpg
  ... --model=RUN embed --texts="a dog on a boat." --texts="a red bus."

Every input is checked before the model runs (each image file read whole, the labels and templates, what the
model can do): a bad one ends the command with status 2 and a one-line "ERROR: ..." on stderr, nothing on stdout.
Nothing is written anywhere. Images are processed --batch_size at a time (default 32), each batch's lines
printed and flushed as it finishes. The values are those of the Python call, `vlrep.load(model).caption(images)`,
`.zero_shot(images, labels, templates, top_k)`, `.encode_images(images, features)` and `.encode_text(texts)`.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

from vlrep import inference, visualize
from vlrep.decoding import METHODS as DECODINGS
from vlrep.errors import UserError, exit_2_on_user_error, reading
from vlrep.evaluators import zero_shot as zero_shot_eval
from vlrep.tools.caption import PREPROCESS

SUBCOMMANDS = ("caption", "zero-shot", "embed")
USAGE = "python -m vlrep.predict --model=DIR_OR_RUN caption|zero-shot|embed IMAGES... (--help: every flag)"
FEATURES = ("pooled", "grid", "embedding")
MAX_LABELS_FILE_BYTES = 16 << 20  # a list of class names; far more than any label set

# The flags each subcommand reads; given to another, they are refused rather than silently ignored.
_OWN_FLAGS = {
  "caption": ("decoding", "beam_size", "max_len", "top_p", "seed", "preprocess"),
  "zero-shot": ("labels", "labels_file", "templates", "top_k"),
  "embed": ("features", "texts"),
}


def define_flags():
  flags.DEFINE_string("model", None, "A run folder or a shared folder (vlrep.interop.export --format=vlrep).")
  flags.DEFINE_string("checkpoint", "best", "'best', 'latest' or a step number (run folders).")
  flags.DEFINE_integer("batch_size", 32, "Images per batch.")
  flags.DEFINE_enum("decoding", "beam", list(DECODINGS), "caption: the decoding method.")
  flags.DEFINE_integer("beam_size", 5, "caption: beams for --decoding=beam and virtex_official.")
  flags.DEFINE_integer("max_len", 30, "caption: most tokens per caption (at most the head's positions).")
  flags.DEFINE_float("top_p", 0.9, "caption: probability mass kept by --decoding=nucleus.")
  flags.DEFINE_integer("seed", 0, "caption: sampling seed for --decoding=nucleus.")
  flags.DEFINE_enum(
    "preprocess", "crop", list(PREPROCESS), "caption: crop (the run's crop size) or virtex_official (256, 224)."
  )
  flags.DEFINE_string("labels", None, "zero-shot: class names, comma-separated.")
  flags.DEFINE_string("labels_file", None, "zero-shot: a text file of class names, one a line.")
  flags.DEFINE_multi_string("templates", [], "zero-shot: prompt templates with '{}' (repeatable or '|'-separated).")
  flags.DEFINE_integer("top_k", 5, "zero-shot: the best labels to print per image.")
  flags.DEFINE_string("features", "pooled", "embed: image features, comma-separated: pooled, grid, embedding.")
  flags.DEFINE_multi_string("texts", [], "embed: texts to embed (repeatable; text towers only).")


# -- checking the inputs (all of them, before the model is opened) ---------------------------------------------------
def subcommand_and_images(argv: list[str]) -> tuple[str, list[str]]:
  if len(argv) < 2:
    raise UserError(f"Say what to do: caption, zero-shot or embed. Usage: {USAGE}")
  sub = argv[1]
  if sub not in SUBCOMMANDS:
    raise UserError(f"Unknown subcommand {sub!r}: caption, zero-shot or embed. Usage: {USAGE}")
  return sub, argv[2:]


def check_flags(sub: str, f) -> None:
  """The flags given belong to `sub`, and their values are in range."""
  foreign = [name for other, names in _OWN_FLAGS.items() if other != sub for name in names if f[name].present]
  if foreign:
    raise UserError(f"{', '.join('--' + n for n in foreign)}: not a flag of {sub!r}. Usage: {USAGE}")
  if not f.model:
    raise UserError(f"Give --model=DIR: a run folder or a shared folder. Usage: {USAGE}")
  for name, low in (("batch_size", 1), ("beam_size", 1), ("max_len", 1), ("top_k", 1)):
    if f[name].value < low:
      raise UserError(f"--{name}={f[name].value}: at least {low}.")
  if not 0 < f.top_p <= 1:
    raise UserError(f"--top_p={f.top_p}: in (0, 1].")


def check_image_files(paths: list[str]) -> list[str]:
  """Every path an image file read whole (a truncated file fails only when decoded): a bad one refused before the
  model is opened, never after some lines were printed."""
  folders = [p for p in paths if os.path.isdir(p)]
  if folders:
    raise UserError(f"{folders[0]} is a folder; give image files (e.g. {os.path.join(folders[0], '*.jpg')}).")
  paths = inference.check_images(paths)
  for path in paths:
    visualize.read_rgb(path)
  return paths


def read_labels(labels: str | None, labels_file: str | None) -> list[str]:
  if (labels is None) == (labels_file is None):
    raise UserError("zero-shot needs the class names: --labels=cat,dog,boat or --labels_file=FILE (one of them).")
  if labels is not None:
    names, where = [x.strip() for x in labels.split(",")], "--labels"
    empty = [i + 1 for i, x in enumerate(names) if not x]
    if empty:
      raise UserError(f"--labels={labels!r}: name {empty[0]} is empty; give comma-separated class names.")
  else:
    where = f"--labels_file={labels_file}"
    if not os.path.isfile(labels_file):
      raise UserError(f"{where}: no such file.")
    if os.path.getsize(labels_file) > MAX_LABELS_FILE_BYTES:
      raise UserError(f"{where}: larger than {MAX_LABELS_FILE_BYTES >> 20} MB; a labels file is class names.")
    with reading(labels_file, what="text file of class names (UTF-8, one a line)"):
      with open(labels_file, encoding="utf-8") as fh:
        names = [line.strip() for line in fh.read().splitlines()]
    names = [x for x in names if x]  # blank lines (a trailing newline) are no class
  if not names:
    raise UserError(f"{where}: no class names.")
  seen = set()
  for name in names:
    if name in seen:
      raise UserError(f"{where}: {name!r} is given twice; each class once.")
    seen.add(name)
  return names


def read_templates(values: list[str]) -> tuple[str, ...]:
  """--templates, each value '|'-separated; each with one '{}' and no other braces (str.format fills it)."""
  templates = [t.strip() for v in values for t in v.split("|")]
  for t in templates:
    if "{}" not in t:
      raise UserError(f"--templates: {t!r} has no '{{}}' where the class name goes (e.g. 'a photo of a {{}}.').")
    try:
      t.format("x")
    except (IndexError, KeyError, ValueError):
      raise UserError(f"--templates: {t!r} holds braces other than one '{{}}' (write '{{{{' for a brace).") from None
  return tuple(templates) or zero_shot_eval.DEFAULT_TEMPLATES


def read_features(value: str) -> tuple[str, ...]:
  names = tuple(x.strip() for x in value.split(","))
  unknown = [x for x in names if x not in FEATURES]
  if unknown or not names:
    raise UserError(f"--features={value!r}: comma-separated names from {', '.join(FEATURES)}.")
  return names


def open_model(path: str, checkpoint: str, batch_size: int) -> inference.TrainedModel:
  model = inference.load(path, checkpoint, batch_size, flag="--model")
  logging.info("Loaded %r; images: %s.", model, inference.describe(model.preprocessing))
  return model


# -- running ---------------------------------------------------------------------------------------------------------
def _json_lines_out():
  """A text stream on the process's stdout for the JSON lines alone: fd 1 then points at stderr, so that whatever a
  library prints (to sys.stdout or from C) lands among the logs and never between two lines of results."""
  sys.stdout.flush()
  out = os.fdopen(os.dup(1), "w", encoding="utf-8")
  os.dup2(2, 1)
  return out


def _emit(out, obj: dict) -> None:
  out.write(json.dumps(obj) + "\n")


def _floats(array) -> list:
  return array.tolist()  # float32 -> Python floats, exact: json writes each as the shortest repr that reads back


def run(sub: str, paths: list[str], f, out) -> None:
  """Checks every input, opens the model and writes one JSON line per image (then per text) to `out`."""
  check_flags(sub, f)
  if sub == "caption":
    settings = {"decoding": f.decoding, "beam_size": f.beam_size, "max_len": f.max_len, "top_p": f.top_p}
    settings["seed"] = f.seed
  elif sub == "zero-shot":
    labels, templates = read_labels(f.labels, f.labels_file), read_templates(f.templates)
  else:
    features, texts = read_features(f.features), list(f.texts)
    if any(not t.strip() for t in texts):
      raise UserError("--texts: an empty text; give each text to embed.")
  if sub == "embed" and not paths and not texts:
    raise UserError(f"embed needs image files, --texts, or both. Usage: {USAGE}")
  if paths or sub != "embed":
    paths = check_image_files(paths)
  model = open_model(f.model, f.checkpoint, f.batch_size)
  text_lines = []
  if sub == "embed" and texts:
    # First, though printed last: a model without a text embedding is refused before any image line is printed.
    text_lines = [{"text": t, "embedding": _floats(e)} for t, e in zip(texts, model.encode_text(texts), strict=True)]
  prep = None
  if sub == "caption" and f.preprocess == "virtex_official":
    with inference.saved_config_errors(model.run):
      prep = inference.preprocessing(model.run.config, "virtex_official")
  # Batches of --batch_size images, the ones the Python call runs in: the same values, and each batch's lines out
  # as it finishes.
  for start in range(0, len(paths), f.batch_size):
    chunk = paths[start : start + f.batch_size]
    if sub == "caption":
      for path, text in zip(chunk, model.caption(chunk, preprocessing=prep, **settings), strict=True):
        _emit(out, {"image": path, "caption": text})
    elif sub == "zero-shot":
      result = model.zero_shot(chunk, labels, templates, top_k=min(f.top_k, len(labels)))
      for path, top in zip(chunk, result["top"], strict=True):
        _emit(out, {"image": path, "top": [{"label": label, "score": score} for label, score in top]})
    else:
      encoded = model.encode_images(chunk, features)
      for i, path in enumerate(chunk):
        _emit(out, {"image": path, **{name: _floats(encoded[name][i]) for name in features}})
    out.flush()
  for line in text_lines:
    _emit(out, line)
  out.flush()


def main(argv):
  sub, paths = subcommand_and_images(argv)
  out = _json_lines_out()
  try:
    run(sub, paths, flags.FLAGS, out)
  finally:
    out.flush()


def _parse_flags(argv):
  """absl's flag parsing, but an unknown flag or a bad value is the user's to fix: exit status 2 (absl's is 1)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    message = str(e).strip()
    message += "" if message.endswith((".", "?")) else "."
    print(f"ERROR: {message} Usage: {USAGE}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
  define_flags()
  app.run(exit_2_on_user_error(main), flags_parser=_parse_flags)
