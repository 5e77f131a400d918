"""The study's datasets (VQA 2.0, VizWiz, SNLI-VE, MM-IMDB, Conceptual Captions) prepared from fixture files in
their official formats, their bad inputs counted, and the examples fed through the study's ops."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from vlrep.data import pipeline, prepare, records, registry, vl_ops
from vlrep.data.builders import mm_imdb


def _jpeg(path, seed):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(np.random.default_rng(seed).integers(0, 255, (20, 28, 3), dtype=np.uint8)).save(path, "JPEG")


def _write(path, obj):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    if isinstance(obj, str):
      f.write(obj)
    else:
      json.dump(obj, f)


def _examples(name, data_dir, split):
  builder = pipeline.get_builder(name, str(data_dir))
  return builder, {int(e["image_id"]): e for e in records.examples(builder, split, decode_images=True)}


def _human(answers):
  return [a if isinstance(a, str) else a.decode() for a in np.asarray(answers)]


def test_vqa2_from_local_files_and_its_ops(tmp_path):
  root = tmp_path / "vqa2"
  questions = [
    {"image_id": 9, "question": "What color is the cat?", "question_id": 90},
    {"image_id": 9, "question": "How many cats?", "question_id": 91},
    {"image_id": 9, "question": "  ", "question_id": 92},  # empty: skipped, counted
    {"image_id": 25, "question": "Is it raining?", "question_id": 250},  # no annotation: kept, no answers
    {"image_id": 30, "question": "Where?", "question_id": 300},  # image missing: skipped, counted
  ]
  ans = lambda *xs: [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(xs)]
  annotations = [
    {"question_id": 90, "image_id": 9, "answers": ans(*["black"] * 7, "gray", "grey", "Black"), "answer_type": "other"},
    {"question_id": 91, "image_id": 9, "answers": ans("2", "two", "2", "2", "3", "2", "2", "2", "2", "2")},
    {"question_id": 300, "image_id": 30, "answers": ans(*["home"] * 10)},
  ]
  _write(str(root / "v2_OpenEnded_mscoco_train2014_questions.json"), {"questions": questions})
  _write(str(root / "v2_mscoco_train2014_annotations.json"), {"annotations": annotations})
  for i in (9, 25):
    _jpeg(str(root / "train2014" / f"COCO_train2014_{i:012d}.jpg"), i)
  report = prepare.prepare("vqa2", str(root), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 2}
  assert report["skipped"] == {
    "empty question": 1,
    "question without an annotation (no answers)": 1,
    "missing image file": 1,
  }
  builder, examples = _examples("vqa2", tmp_path / "tfds", "train")
  qs = examples[9]["questions"]
  assert [q.decode() for q in qs["question"].numpy()] == ["What color is the cat?", "How many cats?"]
  assert _human(qs["answers"].numpy()[0]) == ["black"] * 7 + ["gray", "grey", "Black"]
  assert _human(examples[25]["questions"]["answers"].numpy()[0]) == [""] * 10
  # The answer vocabulary reads all ten human answers ('' padding left out), normalised as VQA does.
  answers = vl_ops.read_answers(builder, "train")
  assert sorted(len(a) for a in answers) == [0, 10, 10] and ["black"] * 7 + ["gray", "grey", "Black"] in answers
  # vl_pairs keeps the ten human answers per question; a sampled answer is the pretraining text_b.
  ex = {**{k: v for k, v in examples[9].items() if k != "image"}, "_rng": tf.constant([1, 2], tf.int64)}
  out = registry.parse("vl_pairs('qa', 3, sample=False)").example_fn(ex)
  assert out["answers"].shape == (3, 10) and out["pair_mask"].numpy().tolist() == [True, True, False]
  pre = registry.parse("vl_pairs('qa', 2, answer_as_text_b=True)").example_fn(ex)
  for text, humans in zip(pre["text_b"].numpy(), pre["answers"].numpy(), strict=True):
    assert text in humans and text != b""
  # Soft scores and VQA accuracy from these annotations: 'black' 8 of 10 (normalised 'Black'), 'gray' 1.
  from vlrep.evaluators import _vl_metrics

  index = {"black": 0, "gray": 1, "2": 2}
  scores, in_vocab = _vl_metrics.soft_scores([a for a in _human(qs["answers"].numpy()[0]) if a], index)
  assert in_vocab and scores[0] == pytest.approx(1.0) and scores[1] == pytest.approx(0.3, abs=1e-6)
  assert _vl_metrics.answer_score(_human(qs["answers"].numpy()[1]), "2") == pytest.approx(1.0)


def test_vizwiz_snli_ve_mmimdb_and_conceptual_captions_from_local_files(tmp_path):
  data_dir = str(tmp_path / "tfds")
  # VizWiz: a list of one-question images; 'unanswerable' is an answer.
  viz = tmp_path / "vizwiz"
  items = [
    {"image": "VizWiz_train_00000001.jpg", "question": "What is this?", "answerable": 0,
     "answers": [{"answer": "unanswerable", "answer_confidence": "yes"}] * 10},
    {"image": "VizWiz_train_00000002.jpg", "question": "", "answers": []},  # empty question
  ]  # fmt: skip
  _write(str(viz / "annotations" / "train.json"), items)
  _jpeg(str(viz / "train" / "VizWiz_train_00000001.jpg"), 1)
  report = prepare.prepare("vizwiz", str(viz), data_dir)
  assert report["splits"] == {"train": 1} and report["skipped"] == {"empty question": 1}
  _, examples = _examples("vizwiz", data_dir, "train")
  assert _human(examples[1]["questions"]["answers"].numpy()[0]) == ["unanswerable"] * 10

  # SNLI-VE: JSON lines with Flickr30k ids; '-' labels and malformed lines are counted.
  ve = tmp_path / "snli_ve"
  pair = lambda img, s2, label, pid: json.dumps(
    {"Flikr30kID": img, "sentence1": "Two dogs run on grass.", "sentence2": s2, "gold_label": label, "pairID": pid}
  )
  lines = [pair("100.jpg", "Animals are outside.", "entailment", "a"), pair("100.jpg", "Cats sleep.", "contradiction",
           "b"), pair("100.jpg", "The dogs are brothers.", "-", "c"), pair("200.jpg", "A dog.", "neutral", "d"),
           "{not json", pair("300.jpg", "Missing image.", "neutral", "e")]  # fmt: skip
  _write(str(ve / "snli_ve_train.jsonl"), "\n".join(lines) + "\n")
  _write(str(ve / "snli_ve_dev.jsonl"), pair("200.jpg", "A dog runs.", "entailment", "f") + "\n")
  for i in (100, 200):
    _jpeg(str(ve / "flickr30k_images" / f"{i}.jpg"), i)
  report = prepare.prepare("snli_ve", str(ve), data_dir)
  assert report["splits"] == {"train": 2, "val": 1}
  assert report["skipped"] == {"no gold label ('-')": 1, "malformed line": 1, "missing image file": 1}
  _, examples = _examples("snli_ve", data_dir, "train")
  ent = examples[100]["entailment"]
  assert [s.decode() for s in ent["statement"].numpy()] == ["Animals are outside.", "Cats sleep."]
  assert ent["label"].numpy().tolist() == [0, 1]  # entailment, contradiction: synthetic_scenes' label order
  assert [c.decode() for c in examples[100]["captions"].numpy()] == ["Two dogs run on grass."]
  out = registry.parse("vl_pairs('entailment', 3, sample=False)|onehot_targets(3)").example_fn(
    {"entailment": ent, "_rng": tf.constant([1, 2], tf.int64)}
  )
  np.testing.assert_array_equal(out["targets"].numpy(), [[1, 0, 0], [0, 1, 0], [1, 0, 0]])
  assert out["pair_mask"].numpy().tolist() == [True, True, False]

  # MM-IMDB: split.json + per-movie JSON and poster; genres outside the 23 dropped and counted.
  mm = tmp_path / "mmimdb"
  movies = {
    "0000008": {"plot": ["A man builds a boat.", "Second summary."], "genres": ["Drama", "Adventure", "Reality-TV"]},
    "0000009": {"plot": [], "genres": ["Comedy"]},  # no plot
    "0000010": {"plot": ["Talk show."], "genres": ["Talk-Show"]},  # no genre of the 23
    "0000011": {"plot": ["A heist."], "genres": ["Crime", "Film-Noir"]},
  }
  for movie, meta in movies.items():
    _write(str(mm / "dataset" / f"{movie}.json"), meta)
    _jpeg(str(mm / "dataset" / f"{movie}.jpeg"), int(movie))
  _write(str(mm / "split.json"), {"train": ["0000008", "0000009", "0000010", "0000012"], "dev": ["0000011"]})
  report = prepare.prepare("mm_imdb", str(mm), data_dir)
  assert report["splits"] == {"train": 1, "val": 1}
  assert report["skipped"] == {
    "genre outside the 23 (dropped)": 2,
    "movie without a plot": 1,
    "movie without any of the 23 genres": 1,
    "missing metadata file": 1,
  }
  _, examples = _examples("mm_imdb", data_dir, "train")
  assert examples[8]["plot"].numpy().decode() == "A man builds a boat."
  out = registry.parse("vl_pairs('plot', 1, sample=False)|multihot_targets(23)").example_fn(
    {"plot": examples[8]["plot"], "genres": examples[8]["genres"], "_rng": tf.constant([1, 2], tf.int64)}
  )
  want = np.zeros((1, 23))
  want[0, [mm_imdb.MMIMDB_GENRES.index("Drama"), mm_imdb.MMIMDB_GENRES.index("Adventure")]] = 1
  np.testing.assert_array_equal(out["targets"].numpy(), want)
  assert out["text_a"].numpy().tolist() == [b"A man builds a boat."]
  # A movie with no genre left (possible in other data) gets all-zero targets, not -inf.
  empty = registry.parse("multihot_targets(23)").example_fn({"genres": tf.zeros([0], tf.int64)})
  assert not empty["targets"].numpy().any()

  # Conceptual Captions: the TSV and images named by row; dead URLs (no image) counted.
  cc = tmp_path / "cc"
  _write(str(cc / "Train_GCC-training.tsv"), "a dog on a beach\thttp://x/1\n\thttp://x/2\nan old map\thttp://x/3\n")
  _jpeg(str(cc / "training" / "0.jpg"), 0)
  report = prepare.prepare("conceptual_captions", str(cc), data_dir)
  assert report["splits"] == {"train": 1}
  assert report["skipped"] == {"empty caption": 1, "missing image file": 1}
  _, examples = _examples("conceptual_captions", data_dir, "train")
  assert [c.decode() for c in examples[0]["captions"].numpy()] == ["a dog on a beach"]


def test_a_missing_layout_names_the_expected_files(tmp_path):
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="(?s)is empty.*v2_OpenEnded_mscoco"):
    prepare.prepare("vqa2", str(tmp_path / "empty"), str(tmp_path / "tfds"))
  _write(str(tmp_path / "other" / "README.txt"), "not the dataset")
  for name, expected in (("vqa2", "v2_OpenEnded_mscoco"), ("snli_ve", "snli_ve_"), ("mm_imdb", "split.json")):
    with pytest.raises(FileNotFoundError, match=expected):
      prepare.prepare(name, str(tmp_path / "other"), str(tmp_path / "tfds"))
