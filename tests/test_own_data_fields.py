"""Your own image-text data (`image_text`) carrying Localized Narratives fields (narration, timed words, mouse
traces) and boxes: prepared with each bad input skipped and counted, the report's `fields` counts exact, and
LocTex's preprocessing reading the result as it reads localized_narratives."""

import json
import os
import tarfile

import numpy as np
from test_own_data import _add, _image

from vlrep.data import pipeline, prepare, records
from vlrep.data.builders import image_text

W, H = 40, 30  # every test image's size (test_own_data._image's default)
CAPTION = "In this picture a red square on the left."
UTTERANCES = ["In", "this", "picture", "a", "red", "square", "on", "the", "left."]


def _words(times=None, words=UTTERANCES):
  times = times or [(0.4 * k, 0.4 * (k + 1)) for k in range(len(words))]
  return [{"utterance": w, "start_time": s, "end_time": e} for w, (s, e) in zip(words, times, strict=True)]


def _trace(*segments):
  return [[{"x": x, "y": y, "t": t} for x, y, t in segment] for segment in segments]


GOOD_TRACE = _trace([(0.1, 0.1, 0.0), (0.2, 0.1, 1.0)], [(0.8, 0.9, 2.0), (0.9, 0.9, 3.6)])


def _row(image, caption=CAPTION, **fields):
  return {"image": image, "caption": caption, **fields}


def write_narrated_folder(root) -> None:
  """Four images and a captions.jsonl whose rows carry LN fields and boxes, good and bad (see each comment)."""
  os.makedirs(os.path.join(root, "imgs"))
  for name, color in (("a", "red"), ("b", "blue"), ("c", "green"), ("d", "white")):
    with open(os.path.join(root, "imgs", f"{name}.jpg"), "wb") as f:
      f.write(_image(color))
  a_words = _words()
  a_words[3] = {"utterance": "a", "start_time": 1.6, "end_time": 1.2}  # start > end: kept without times
  a_words[4] = {"utterance": "red", "start_time": "soon", "end_time": 2.0}  # not numeric: kept without times
  a_words[8] = {"utterance": "left.", "start_time": 3.7, "end_time": 4.0}  # after the last point: kept
  a_trace = _trace(
    [(-0.01, 0.5, 0.0), (0.2, 1.015, 0.5), (0, 0, 0)],  # clipped, clipped, (malformed below)
    [(1.5, 0.5, 1.0), (0, 0, 0), (0.5, 0.5, 2.0), (0.6, 0.4, 3.6)],  # far outside, (not a dict below), kept, kept
  )
  a_trace[0][2] = {"x": "left", "y": 0.1, "t": 0.7}  # x not a number
  a_trace[1][1] = 7  # not a dict
  rows = [
    # a: the narration with bad points and words (dropped / kept as the rules say), and boxes good and bad.
    _row(
      "imgs/a.jpg",
      tags=["red"],
      timed_caption=[*a_words, "not a word"],  # the last: malformed, dropped
      traces=a_trace,
      boxes=[
        [1, 2, 20, 25],  # good
        [-0.5, 0, 40.5, 30.75],  # within 1 pixel of the image: clipped
        [5, 5, 2, 10],  # x_min >= x_max
        [1, 2, 3],  # not 4 numbers
        [1, 2, 3, "4"],  # not numbers
        [30, 20, 45, 29],  # 5 pixels past the right edge
        [0, 0, 10, 10],  # good, no label
      ],
      labels=["square", "picture", "bad", "bad", "bad", "outside", None],
    ),
    # a again: a second narration (caption kept, trace not) and a second set of boxes (ignored).
    _row("imgs/a.jpg", "a red square again", timed_caption=_words(), traces=GOOD_TRACE, boxes=[[0, 0, 5, 5]]),
    # b: times decrease along the trace (dropped), then a good narration; labels of the wrong length (dropped).
    _row("imgs/b.jpg", traces=_trace([(0.1, 0.1, 1.0)], [(0.2, 0.2, 0.5)]), timed_caption=_words()),
    _row("imgs/b.jpg", "A blue field.", timed_caption=_words(words=["A", "blue", "field."]), traces=GOOD_TRACE),
    _row("imgs/b.jpg", "the blue one", boxes=[[0, 0, 40, 30]], labels=["one", "two"]),
    # c: no narration survives, no box.
    _row("imgs/c.jpg", traces=_trace([(1.2, 0.5, 0.0), (0.5, -0.3, 1.0)]), timed_caption=_words()),  # no point left
    _row("imgs/c.jpg", traces=GOOD_TRACE, timed_caption=_words([(9.0 + k, 9.5 + k) for k in range(9)])),  # clocks
    _row("imgs/c.jpg", traces="not a list"),
    _row("imgs/c.jpg", traces=GOOD_TRACE, timed_caption={"utterance": "In"}),
    _row("imgs/c.jpg", "green", boxes="0 0 10 10", labels=["green"]),  # boxes not a list
    _row("imgs/c.jpg", "green again", labels=["green"]),  # labels without boxes
    # d: timed words without traces (ignored), a narration whose caption is not a string; tags only.
    _row("imgs/d.jpg", "a white page", timed_caption=_words(), tags=["white"]),
    {"image": "imgs/d.jpg", "captions": ["a white page again"], "traces": GOOD_TRACE},
  ]
  with open(os.path.join(root, "captions.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))


def write_narrated_shard(root) -> None:
  """One webdataset shard: a member whose KEY.json carries LN fields, boxes and tags, one with a caption only,
  one whose narration (KEY.json's caption) sits beside a short KEY.txt caption, and one whose KEY.json is no
  JSON object."""
  os.makedirs(root)
  with tarfile.open(os.path.join(root, "00000.tar"), "w") as tar:
    _add(tar, "000.jpg", _image("red"))
    meta = {
      "caption": CAPTION,
      "timed_caption": _words(),
      "traces": GOOD_TRACE,
      "tags": ["red"],
      "boxes": [[4, 3, 36, 27.5]],
      "labels": ["square"],
    }
    _add(tar, "000.json", json.dumps(meta).encode())
    _add(tar, "001.jpg", _image("blue"))
    _add(tar, "001.txt", b"a blue field")
    _add(tar, "002.jpg", _image("green"))
    _add(tar, "002.txt", b"a green square")
    narration = {"caption": "A green one.", "timed_caption": _words(words=["A", "green", "one."]), "traces": GOOD_TRACE}
    _add(tar, "002.json", json.dumps(narration).encode())
    _add(tar, "003.jpg", _image("gray"))
    _add(tar, "003.txt", b"a gray square")
    _add(tar, "003.json", b"[1, 2]")  # JSON but not an object: counted, the KEY.txt caption kept


def _examples(data_dir):
  builder = pipeline.get_builder("image_text", str(data_dir))
  return builder, {e["key"].numpy().decode(): e for e in records.examples(builder, "train")}


def _text(values):
  return [v.decode() for v in values.numpy()]


def test_narrations_and_boxes_from_a_folder_are_checked_counted_and_stored(tmp_path):
  write_narrated_folder(tmp_path / "mine")
  report = prepare.prepare("image_text", str(tmp_path / "mine"), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 4}, report
  assert report["skipped"] == {
    "malformed trace point (point dropped)": 2,
    "trace point outside the image by more than 0.02 (point dropped)": 1 + 2,  # a's, and c's two
    "malformed timed word (word dropped)": 1,
    "timed word with start_time > end_time (word kept without times: it gets no trace)": 1,
    "timed word without numeric times (word kept without times: it gets no trace)": 1,
    "timed word outside the trace's time span (word kept; it gets no trace)": 1,
    "second narration of an image (its caption kept, its trace not)": 1,
    "second set of boxes of an image (its caption kept, its boxes not)": 1,
    "trace times decrease (narration dropped, caption kept)": 1,
    "labels not one string per box (labels dropped, boxes kept)": 1,
    "narration without usable trace points (narration dropped, caption kept)": 1,
    "no timed word within the trace's time span (narration dropped, caption kept)": 1,
    "traces not a list of segments (narration dropped, caption kept)": 1,
    "timed_caption not a list (narration dropped, caption kept)": 1,
    "boxes not a list (boxes ignored)": 1,
    "labels without boxes (labels ignored)": 1,
    "timed_caption without traces (timed words ignored)": 1,
    "narration without a caption (narration dropped)": 1,
    "box with x_min >= x_max or y_min >= y_max (box dropped)": 1,
    "box not 4 finite numbers (box dropped)": 2,
    "box outside the image by more than 1 pixel (box dropped)": 1,
  }, report["skipped"]
  fields = {"captions": 4, "tags": 2, "narration": 2, "timed_caption": 2, "traces": 2, "boxes": 2, "box_labels": 1}
  assert report["fields"] == fields
  with open(tmp_path / "tfds" / "image_text_prepare_report.json") as f:
    assert json.load(f)["fields"] == fields

  builder, ex = _examples(tmp_path / "tfds")
  assert builder.info.version == "1.1.0"
  from_data = {
    "captions": sum(e["captions"].shape[0] > 0 for e in ex.values()),
    "tags": sum(e["tags"].shape[0] > 0 for e in ex.values()),
    "narration": sum(e["narration"].numpy() != b"" for e in ex.values()),
    "timed_caption": sum(e["timed_caption"]["utterance"].shape[0] > 0 for e in ex.values()),
    "traces": sum(e["traces"].shape[0] > 0 for e in ex.values()),
    "boxes": sum(e["boxes"].shape[0] > 0 for e in ex.values()),
    "box_labels": sum(any(e["box_labels"].numpy()) for e in ex.values()),
  }
  assert from_data == fields  # the report's counts are the stored data's
  a, b, c, d = (ex[f"imgs/{k}.jpg"] for k in "abcd")
  # a: the narrated row's caption is among the captions; the second narration's caption too.
  assert _text(a["captions"]) == [CAPTION, "a red square again"] and a["narration"].numpy().decode() == CAPTION
  words = a["timed_caption"]
  assert _text(words["utterance"]) == UTTERANCES  # the malformed entry dropped, the bad-time words kept
  start, end = words["start_time"].numpy(), words["end_time"].numpy()
  assert start.dtype == end.dtype == np.float32
  assert np.isnan(start[[3, 4]]).all() and np.isnan(end[[3, 4]]).all()
  assert (start[8], end[8]) == (np.float32(3.7), np.float32(4.0))
  np.testing.assert_allclose(start[:3], [0.0, 0.4, 0.8], atol=1e-6)
  traces = a["traces"].numpy()
  assert traces.dtype == np.float32
  np.testing.assert_allclose(traces, [[0.0, 0.5, 0.0], [0.2, 1.0, 0.5], [0.5, 0.5, 2.0], [0.6, 0.4, 3.6]], atol=1e-6)
  assert a["boxes"].numpy().dtype == np.float32
  np.testing.assert_array_equal(a["boxes"].numpy(), [[1, 2, 20, 25], [0, 0, W, H], [0, 0, 10, 10]])
  assert _text(a["box_labels"]) == ["square", "picture", ""]
  # b: the first usable narration (its second narrated row); boxes kept without their labels.
  assert b["narration"].numpy().decode() == "A blue field." and _text(b["timed_caption"]["utterance"]) == [
    "A",
    "blue",
    "field.",
  ]
  np.testing.assert_allclose(b["traces"].numpy()[:, 2], [0.0, 1.0, 2.0, 3.6], atol=1e-6)
  assert _text(b["captions"]) == [CAPTION, "A blue field.", "the blue one"]
  np.testing.assert_array_equal(b["boxes"].numpy(), [[0, 0, W, H]])
  assert _text(b["box_labels"]) == [""]
  # c, d: captions kept, no narration, no boxes (empty fields of the right shapes).
  for e in (c, d):
    assert e["narration"].numpy() == b"" and e["traces"].numpy().shape == (0, 3) and e["boxes"].numpy().shape == (0, 4)
    assert e["timed_caption"]["utterance"].numpy().size == 0 and e["box_labels"].numpy().size == 0
  # c's four rows with the default caption give it once (issue 77: identical captions of one image kept once,
  # counted), beside its two other captions.
  assert _text(c["captions"]) == [CAPTION, "green", "green again"] and _text(d["tags"]) == ["white"]
  assert report["merged"] == {image_text.DUPLICATE_CAPTION: 3}, report.get("merged")

  # The counts live with the dataset: a prepare that finds it ready reports the same fields.
  again = prepare.prepare("image_text", str(tmp_path / "mine"), str(tmp_path / "tfds"))
  assert again["fields"] == fields and again["skipped"] == {}


def test_narrations_and_boxes_in_a_shards_json(tmp_path):
  write_narrated_shard(tmp_path / "shards")
  report = prepare.prepare("image_text", str(tmp_path / "shards"), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 4} and report["skipped"] == {"metadata not a JSON object": 1}, report
  assert report["fields"] == {
    "captions": 4,
    "tags": 1,
    "narration": 2,
    "timed_caption": 2,
    "traces": 2,
    "boxes": 1,
    "box_labels": 1,
  }
  _, ex = _examples(tmp_path / "tfds")
  first = ex["00000.tar/000"]
  assert first["narration"].numpy().decode() == CAPTION and _text(first["captions"]) == [CAPTION]
  assert _text(first["timed_caption"]["utterance"]) == UTTERANCES and _text(first["tags"]) == ["red"]
  expected = np.asarray([[x, y, t] for segment in GOOD_TRACE for x, y, t in (p.values() for p in segment)])
  np.testing.assert_allclose(first["traces"].numpy(), expected.astype(np.float32))
  np.testing.assert_array_equal(first["boxes"].numpy(), np.asarray([[4, 3, 36, 27.5]], np.float32))
  assert _text(first["box_labels"]) == ["square"]
  assert ex["00000.tar/001"]["narration"].numpy() == b"" and ex["00000.tar/001"]["traces"].numpy().shape == (0, 3)
  # KEY.json's caption is the narration; KEY.txt's caption and the narration's are both in `captions` (issue 77:
  # no caption dropped; a narration's caption is among the captions, as in captions.jsonl).
  green = ex["00000.tar/002"]
  assert green["narration"].numpy().decode() == "A green one."
  assert _text(green["captions"]) == ["a green square", "A green one."]
  assert _text(ex["00000.tar/003"]["captions"]) == ["a gray square"]


def test_loctex_preprocessing_runs_on_your_own_narrations(tmp_path, tiny_tokenizer):
  from configs import loctex as loctex_config

  write_narrated_shard(tmp_path / "shards")
  prepare.prepare("image_text", str(tmp_path / "shards"), str(tmp_path / "tfds"))
  builder = pipeline.get_builder("image_text", str(tmp_path / "tfds"))
  config = loctex_config.get_config("runlocal")
  sizes = config.method.grid_sizes
  fields = ("key", "image", "tokens", *(f"trace_mask_{s}" for s in sizes))
  batch = next(
    pipeline.eval_batches(builder, "train", config.data.pp, fields, 4, context={"tokenizer": tiny_tokenizer})
  )
  assert batch["image"].shape == (4, 64, 64, 3) and batch["tokens"].shape == (4, 60)
  for s in sizes:
    assert batch[f"trace_mask_{s}"].shape == (4, 60, s, s)
  row = {k.decode(): i for i, k in enumerate(batch["key"])}
  narrated, plain = [row["00000.tar/000"], row["00000.tar/002"]], [row["00000.tar/001"], row["00000.tar/003"]]
  # The narrated members' words carry their traces; the caption-only members' masks are empty.
  masks = batch[f"trace_mask_{sizes[0]}"]
  assert all(masks[i].sum() > 0 for i in narrated) and all(masks[i].sum() == 0 for i in plain)
  for stat in ("stat_trace_empty", "stat_trace_mismatch"):
    assert not batch[stat][narrated].any() and batch[stat][plain].all(), stat
  assert not batch["stat_trace_points_outside"].any()
