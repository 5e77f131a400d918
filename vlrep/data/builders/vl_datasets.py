"""The vision-and-language study's datasets (Singh et al.) from local copies in their official formats: VQA 2.0,
VizWiz, SNLI-VE, MM-IMDB and Conceptual Captions. Each is prepared with
`python -m vlrep.data.prepare --dataset=NAME --manual_dir=DIR`; the expected layout is in each builder's
docstring. One example per image, with all of its texts, so that `vl_pairs` pairs an image's regions with several
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

import collections
import csv
import json
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from vlrep import errors
from vlrep.data.builders import common

NUM_ANSWERS = 10  # VQA 2.0 and VizWiz collect ten human answers per question
ENTAILMENT_LABELS = ("entailment", "contradiction", "neutral")  # synthetic_scenes' order (scenes.ENTAILMENT_LABELS)
# The 23 genres of Arevalo et al. (2017), most frequent first; MM-IMDB's other genres are too rare to split.
MMIMDB_GENRES = (
  "Drama", "Comedy", "Romance", "Thriller", "Crime", "Action", "Adventure", "Horror", "Documentary", "Mystery",
  "Sci-Fi", "Fantasy", "Family", "Biography", "War", "History", "Music", "Animation", "Musical", "Western", "Sport",
  "Short", "Film-Noir",
)  # fmt: skip


def _qa_features() -> tfds.features.FeaturesDict:
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


def _answers(raw: list, dataset: str, question_id) -> list[str]:
  """The human answers, NUM_ANSWERS of them ('' pads a question with fewer; extra ones are cut and counted)."""
  answers = [str(a.get("answer", "")).strip() if isinstance(a, dict) else str(a).strip() for a in raw or []]
  if len(answers) > NUM_ANSWERS:
    common.skip(dataset, f"answers beyond the first {NUM_ANSWERS} (dropped)", f"question {question_id}")
    answers = answers[:NUM_ANSWERS]
  return answers + [""] * (NUM_ANSWERS - len(answers))


def _stored_image(builder, path: str, dataset: str, root) -> bytes | None:
  """The image file at `path` as a viewer shows it, as JPEG (common.viewer_jpeg: an upright RGB or grayscale JPEG
  byte for byte, others converted and counted in the builder's metadata `converted`, the prepare report's), or
  None (a counted skip): missing, outside manual_dir, over common.LIMITS or undecodable."""
  raw = common.read_image_file(path, dataset, root and os.fspath(root))
  stored = None if raw is None else common.viewer_jpeg(raw, dataset, path)
  if stored is None:
    return None
  builder.info.metadata["converted"] = common.converted(dataset)
  return stored[0]


class MissingFile(errors.UserError, FileNotFoundError):
  """A file the dataset's layout requires is not in manual_dir."""


def _load_json(path: str, what: str):
  if not os.path.exists(path):
    raise MissingFile(f"{what}: {path} does not exist.")
  with errors.reading(path, f"{what.split(' ')[0]} JSON file", "Expected the dataset's official JSON, as downloaded."):
    with common.open_regular(path) as f:
      return json.load(f)


def _texts(f):
  """The lines of the binary file `f` as text, each at most common.LIMITS.max_text_bytes (TooLarge: the whole
  file is refused by the errors.reading around it, as a line that is not UTF-8 is)."""
  limit = common.LIMITS.max_text_bytes
  for number, raw in common.lines(f, limit):
    if raw is None:
      raise common.TooLarge(f"line {number} is over {limit:,} bytes (--max_text_bytes)")
    yield raw.decode("utf-8")


def _structure(path: str, dataset: str):
  """errors.reading for the body that walks a parsed file: a key missing or a value of the wrong type there is the
  file's fault (a BadFile naming it), not vlrep's."""
  return errors.reading(path, f"{dataset} annotation file", "Expected the dataset's official format, as downloaded.")


class Vqa2(tfds.core.GeneratorBasedBuilder):
  """VQA 2.0 (Goyal et al. 2017) from a local copy (manual_dir), with the COCO 2014 images:

    MANUAL_DIR/v2_OpenEnded_mscoco_{train,val}2014_questions.json   {"questions": [{image_id, question, question_id}]}
    MANUAL_DIR/v2_mscoco_{train,val}2014_annotations.json          {"annotations": [{question_id, answers: [{answer,
                                                                    answer_confidence, answer_id}] x 10, ...}]}
    MANUAL_DIR/{train,val}2014/COCO_{train,val}2014_000000000009.jpg

  Splits train and val (test-dev has no answers). Questions without an annotation keep no answers ('' x 10; VQA
  accuracy scores them 0) and are counted."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__
  SPLITS = {"train": "train2014", "val": "val2014"}

  def _info(self):
    return self.dataset_info_from_configs(
      features=_qa_features(), homepage="https://visualqa.org", metadata=tfds.core.MetadataDict()
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_stored_image)
    root, out = dl_manager.manual_dir, {}
    for split, folder in self.SPLITS.items():
      questions = os.path.join(root, f"v2_OpenEnded_mscoco_{folder}_questions.json")
      if os.path.exists(questions):
        annotations = os.path.join(root, f"v2_mscoco_{folder}_annotations.json")
        out[split] = self._generate_examples(questions, annotations, os.path.join(root, folder), folder, root)
    if not out:
      raise FileNotFoundError(f"No v2_OpenEnded_mscoco_*_questions.json under {root}. Expected layout:\n{__doc__}")
    return out

  def _generate_examples(self, questions_file, annotations_file, image_dir, folder, root=None):
    with _structure(questions_file, "vqa2"):
      questions = _load_json(questions_file, "vqa2")["questions"]
    annotations = {}
    if os.path.exists(annotations_file):
      with _structure(annotations_file, "vqa2"):
        annotations = {a["question_id"]: a for a in _load_json(annotations_file, "vqa2")["annotations"]}
    with _structure(questions_file, "vqa2"):
      by_image = self._by_image(questions, annotations)
    for image_id, qs in sorted(by_image.items()):
      path = os.path.join(image_dir, f"COCO_{folder}_{image_id:012d}.jpg")
      image = _stored_image(self, path, "vqa2", root)
      if image is not None:
        yield image_id, {"image": image, "image_id": image_id, "questions": qs}

  @staticmethod
  def _by_image(questions, annotations) -> dict:
    by_image = collections.defaultdict(list)
    for q in questions:
      text = (q.get("question") or "").strip()
      if not text:
        common.skip("vqa2", "empty question", f"question {q.get('question_id')}")
        continue
      ann = annotations.get(q["question_id"])
      if ann is None:
        common.skip("vqa2", "question without an annotation (no answers)", f"question {q['question_id']}")
      answers = _answers(ann["answers"] if ann else [], "vqa2", q["question_id"])
      by_image[int(q["image_id"])].append({"question": text, "answers": answers, "question_id": q["question_id"]})
    return by_image


class Vizwiz(tfds.core.GeneratorBasedBuilder):
  """VizWiz VQA (Gurari et al. 2018) from a local copy (manual_dir):

    MANUAL_DIR/annotations/{train,val}.json   [{"image": "VizWiz_train_00000000.jpg", "question": ...,
                                                "answers": [{"answer", "answer_confidence"}] x 10, "answerable": 0|1,
                                                "answer_type": ...}]
    MANUAL_DIR/{train,val}/VizWiz_train_00000000.jpg

  One question per image; 'unanswerable' is an answer like any other (it enters the answer vocabulary)."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=_qa_features(), homepage="https://vizwiz.org", metadata=tfds.core.MetadataDict()
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_stored_image)
    root, out = dl_manager.manual_dir, {}
    for split in ("train", "val"):
      ann = os.path.join(root, "annotations", f"{split}.json")
      if os.path.exists(ann):
        out[split] = self._generate_examples(ann, os.path.join(root, split), root)
    if not out:
      raise FileNotFoundError(f"No annotations/{{train,val}}.json under {root}. Expected layout:\n{__doc__}")
    return out

  def _generate_examples(self, annotation_file, image_dir, root=None):
    items = _load_json(annotation_file, "vizwiz")
    for k, item in enumerate(items if isinstance(items, list) else []):
      if not isinstance(item, dict) or not isinstance(item.get("image", ""), str):
        common.skip("vizwiz", "malformed entry", f"{annotation_file} entry {k}")
        continue
      name = item.get("image", "")
      text = (item.get("question") or "").strip()
      if not text:
        common.skip("vizwiz", "empty question", name)
        continue
      digits = re.findall(r"\d+", name)
      image_id = int(digits[-1]) if digits else k
      path = os.path.join(image_dir, name)
      image = _stored_image(self, path, "vizwiz", root)
      if image is None:
        continue
      q = {"question": text, "answers": _answers(item.get("answers"), "vizwiz", name), "question_id": image_id}
      yield name, {"image": image, "image_id": image_id, "questions": [q]}


class SnliVe(tfds.core.GeneratorBasedBuilder):
  """SNLI-VE (Xie et al. 2019) from a local copy (manual_dir), with the Flickr30k images:

    MANUAL_DIR/snli_ve_{train,dev,test}.jsonl   one pair per line: {"Flikr30kID": "2248275918.jpg", "sentence1"
                                                (the premise caption), "sentence2" (the hypothesis), "gold_label":
                                                entailment|neutral|contradiction, "pairID", ...}
    MANUAL_DIR/flickr30k_images/2248275918.jpg

  Splits train, val (the dev file) and test. Pairs whose gold_label is '-' (no annotator consensus, as in SNLI)
  are skipped and counted, as are empty hypotheses and malformed lines."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "captions": tfds.features.Sequence(tfds.features.Text()),
          "entailment": tfds.features.Sequence(
            {"statement": tfds.features.Text(), "label": tfds.features.ClassLabel(names=ENTAILMENT_LABELS)}
          ),
        }
      ),
      homepage="https://github.com/necla-ml/SNLI-VE",
      metadata=tfds.core.MetadataDict(),  # `converted` (_stored_image)
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_stored_image)
    root, out = dl_manager.manual_dir, {}
    for split, name in (("train", "train"), ("val", "dev"), ("test", "test")):
      path = os.path.join(root, f"snli_ve_{name}.jsonl")
      if os.path.exists(path):
        out[split] = self._generate_examples(path, os.path.join(root, "flickr30k_images"), root)
    if not out:
      raise FileNotFoundError(f"No snli_ve_*.jsonl under {root}. Expected layout:\n{__doc__}")
    return out

  def _generate_examples(self, path, image_dir, root=None):
    pairs, premises = collections.defaultdict(list), collections.defaultdict(list)
    with errors.reading(path, "SNLI-VE JSONL file"), common.open_regular(path) as f:
      for n, raw in common.lines(f, common.LIMITS.max_text_bytes):
        try:
          line = raw.decode("utf-8")
          if not line.strip():
            continue
          item = json.loads(line)
          name = item["Flikr30kID"] if "Flikr30kID" in item else item["Flickr30kID"]
          if not isinstance(name, str):
            raise TypeError(name)
        except (AttributeError, ValueError, RecursionError, KeyError, TypeError):  # too long, not UTF-8, not JSON
          common.skip("snli_ve", "malformed line", f"{path}:{n}")
          continue
        label, statement = item.get("gold_label", "-"), str(item.get("sentence2") or "").strip()
        if not isinstance(label, str) or label not in ENTAILMENT_LABELS:
          common.skip("snli_ve", "no gold label ('-')", f"pair {item.get('pairID', n)}")
          continue
        if not statement:
          common.skip("snli_ve", "empty hypothesis", f"pair {item.get('pairID', n)}")
          continue
        pairs[name].append({"statement": statement, "label": label})
        premise = str(item.get("sentence1") or "").strip()
        if premise and premise not in premises[name]:
          premises[name].append(premise)
    for name, items in sorted(pairs.items()):
      path = os.path.join(image_dir, name)
      image = _stored_image(self, path, "snli_ve", root)
      if image is not None:
        image_id = int(re.sub(r"\D", "", name) or 0)
        yield name, {"image": image, "image_id": image_id, "captions": premises[name], "entailment": items}


class MmImdb(tfds.core.GeneratorBasedBuilder):
  """MM-IMDB (Arevalo et al. 2017) from a local copy of the official release (manual_dir):

    MANUAL_DIR/split.json                {"train": ["0000008", ...], "dev": [...], "test": [...]}
    MANUAL_DIR/dataset/0000008.json      {"plot": ["summary", ...], "genres": ["Drama", ...], "title": ..., ...}
    MANUAL_DIR/dataset/0000008.jpeg      the poster

  Splits train, val (dev) and test. The text is the first plot summary; labels are the movie's genres among the 23
  of the paper (MMIMDB_GENRES); other genres are dropped and counted, and movies left without any are skipped."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "plot": tfds.features.Text(),
          "genres": tfds.features.Sequence(tfds.features.ClassLabel(names=MMIMDB_GENRES)),
        }
      ),
      homepage="http://lisi1.unal.edu.co/mmimdb/",
      metadata=tfds.core.MetadataDict(),  # `converted` (_stored_image)
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_stored_image)
    root = dl_manager.manual_dir
    splits = _load_json(os.path.join(root, "split.json"), f"mm_imdb (expected layout:\n{__doc__})")
    names = {"train": "train", "val": "dev", "test": "test"}
    folder = os.path.join(root, "dataset")
    if not isinstance(splits, dict) or not all(isinstance(v, list) for v in splits.values()):
      raise errors.BadFile(f"{os.path.join(root, 'split.json')}: expected {{'train': [ids], 'dev': [...], ...}}.")
    return {s: self._generate_examples(splits[n], folder, root) for s, n in names.items() if n in splits}

  def _generate_examples(self, ids, folder, root=None):
    known = set(MMIMDB_GENRES)
    for movie in ids:
      if not (isinstance(movie, str) and movie.isdigit()):
        common.skip("mm_imdb", "movie id not a string of digits", repr(movie)[:60])
        continue
      meta_path = os.path.join(folder, f"{movie}.json")
      if not os.path.exists(meta_path):
        common.skip("mm_imdb", "missing metadata file", meta_path)
        continue
      meta = _load_json(meta_path, "mm_imdb")
      if not isinstance(meta, dict) or not isinstance(meta.get("plot") or [], list):
        common.skip("mm_imdb", "metadata not a JSON object with a plot list", meta_path)
        continue
      plots = [p.strip() for p in meta.get("plot") or [] if isinstance(p, str) and p.strip()]
      if not plots:
        common.skip("mm_imdb", "movie without a plot", movie)
        continue
      genres = []
      for g in meta.get("genres") if isinstance(meta.get("genres"), list) else []:
        if not isinstance(g, str):
          continue
        if g in known and g not in genres:
          genres.append(g)
        elif g not in known:
          common.skip("mm_imdb", "genre outside the 23 (dropped)", f"{movie}: {g}")
      if not genres:
        common.skip("mm_imdb", "movie without any of the 23 genres", movie)
        continue
      path = os.path.join(folder, f"{movie}.jpeg")
      image = _stored_image(self, path, "mm_imdb", root)
      if image is not None:
        yield movie, {"image": image, "image_id": int(movie), "plot": plots[0], "genres": genres}


class ConceptualCaptions(tfds.core.GeneratorBasedBuilder):
  """Conceptual Captions 3M (Sharma et al. 2018) from a local copy (manual_dir): the official TSVs and the images
  a downloader saved under the row's index (about a sixth of the URLs are dead: those rows are skipped and counted):

    MANUAL_DIR/Train_GCC-training.tsv              caption <TAB> url, one image per line
    MANUAL_DIR/Validation_GCC-1.1.0-Validation.tsv
    MANUAL_DIR/training/<row>.jpg                  row = the 0-based line number in the TSV
    MANUAL_DIR/validation/<row>.jpg
  """

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = __doc__
  FILES = {
    "train": ("Train_GCC-training.tsv", "training"),
    "val": ("Validation_GCC-1.1.0-Validation.tsv", "validation"),
  }

  def _info(self):
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(encoding_format="jpeg"),
          "image_id": np.int64,
          "captions": tfds.features.Sequence(tfds.features.Text()),
        }
      ),
      homepage="https://ai.google.com/research/ConceptualCaptions",
      metadata=tfds.core.MetadataDict(),  # `converted` (_stored_image)
    )

  def _split_generators(self, dl_manager):
    self.info.metadata["converted"] = {}  # filled as images are stored (_stored_image)
    root, out = dl_manager.manual_dir, {}
    for split, (tsv, folder) in self.FILES.items():
      if os.path.exists(os.path.join(root, tsv)):
        out[split] = self._generate_examples(os.path.join(root, tsv), os.path.join(root, folder), root)
    if not out:
      raise FileNotFoundError(f"No Conceptual Captions TSV under {root}. Expected layout:\n{__doc__}")
    return out

  def _generate_examples(self, tsv, image_dir, root=None):
    with errors.reading(tsv, "Conceptual Captions TSV", "Expected UTF-8 lines caption<TAB>url, as downloaded."):
      yield from self._rows(tsv, image_dir, root)

  def _rows(self, tsv, image_dir, root):
    with common.open_regular(tsv) as f:
      for row, fields in enumerate(csv.reader(_texts(f), delimiter="\t", quoting=csv.QUOTE_NONE)):
        caption = fields[0].strip() if fields else ""
        if not caption:
          common.skip("conceptual_captions", "empty caption", f"{tsv}:{row}")
          continue
        path = os.path.join(image_dir, f"{row}.jpg")
        image = _stored_image(self, path, "conceptual_captions", root)
        if image is not None:
          yield row, {"image": image, "image_id": row, "captions": [caption]}
