"""The shared parts of the vision-and-language study's dataset builders (Singh et al.), a module each here: vqa2,
vizwiz, snli_ve, mm_imdb and conceptual_captions, prepared from local copies in their official formats with
`python -m vlrep.data.prepare --dataset=NAME --manual_dir=DIR` (the expected layout is in each builder's
docstring). One example per image, with all of its texts, so that `vl_pairs` pairs an image's regions with several
of its texts:

  vqa2, vizwiz         questions: {question, answers [10] (the human answers, '' padded), question_id}
  snli_ve              entailment: {statement (the hypothesis), label}, captions (the premises)
  mm_imdb              plot (the first plot summary), genres (of the 23 used in the MM-IMDB paper)
  conceptual_captions  captions (one)

Images are stored as a viewer shows them (vlrep.data.images): an upright RGB or grayscale JPEG byte for byte, an
EXIF-rotated, CMYK, 16-bit, transparent or non-JPEG file (a PNG or GIF saved as .jpg by a downloader) converted and
counted in the report's `converted`. Inputs that cannot be used are skipped and counted (the prepare command prints
the counts and saves them): missing or undecodable images, empty questions or statements, SNLI-VE pairs without a
gold label ('-'), MM-IMDB movies without a plot or without any of the 23 genres, genres outside them (dropped,
counted).
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow_datasets as tfds

from vlrep import errors
from vlrep.data import manual_files

NUM_ANSWERS = 10  # VQA 2.0 and VizWiz collect ten human answers per question


def qa_features() -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict(
    {
      "image": tfds.features.Image(encoding_format="jpeg"),
      "image_id": np.int64,
      "questions": tfds.features.Sequence(
        {
          "question": tfds.features.Text(),
          "answers": tfds.features.Tensor(shape=(NUM_ANSWERS,), dtype=np.str_),
          "question_id": np.int64,
        }
      ),
    }
  )


def answers(raw: list, dataset: str, question_id) -> list[str]:
  """The human answers, NUM_ANSWERS of them ('' pads a question with fewer; extra ones are cut and counted)."""
  answers = [str(a.get("answer", "")).strip() if isinstance(a, dict) else str(a).strip() for a in raw or []]
  if len(answers) > NUM_ANSWERS:
    manual_files.skip(dataset, f"answers beyond the first {NUM_ANSWERS} (dropped)", f"question {question_id}")
    answers = answers[:NUM_ANSWERS]
  return answers + [""] * (NUM_ANSWERS - len(answers))


def stored_image(builder, path: str, dataset: str, root) -> bytes | None:
  """The image file at `path` as a viewer shows it, as JPEG (manual_files.viewer_jpeg: an upright RGB or grayscale JPEG
  byte for byte, others converted and counted in the builder's metadata `converted`, the prepare report's), or
  None (a counted skip): missing, outside manual_dir, over manual_files.LIMITS or undecodable."""
  raw = manual_files.read_image_file(path, dataset, root and os.fspath(root))
  stored = None if raw is None else manual_files.viewer_jpeg(raw, dataset, path)
  if stored is None:
    return None
  builder.info.metadata["converted"] = manual_files.converted(dataset)
  return stored[0]


class MissingFile(errors.UserError, FileNotFoundError):
  """A file the dataset's layout requires is not in manual_dir."""


def load_json(path: str, what: str):
  if not os.path.exists(path):
    raise MissingFile(f"{what}: {path} does not exist.")
  with errors.reading(path, f"{what.split(' ')[0]} JSON file", "Expected the dataset's official JSON, as downloaded."):
    with manual_files.open_regular(path) as f:
      return json.load(f)


def texts(f):
  """The lines of the binary file `f` as text, each at most manual_files.LIMITS.max_text_bytes (TooLarge: the whole
  file is refused by the errors.reading around it, as a line that is not UTF-8 is)."""
  limit = manual_files.LIMITS.max_text_bytes
  for number, raw in manual_files.lines(f, limit):
    if raw is None:
      raise manual_files.TooLarge(f"line {number} is over {limit:,} bytes (--max_text_bytes)")
    yield raw.decode("utf-8")


def structure(path: str, dataset: str):
  """errors.reading for the body that walks a parsed file: a key missing or a value of the wrong type there is the
  file's fault (a BadFile naming it), not vlrep's."""
  return errors.reading(path, f"{dataset} annotation file", "Expected the dataset's official format, as downloaded.")
