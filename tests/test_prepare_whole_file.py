"""`vlrep.data.prepare --dataset=image_text` tells the truth about a source as a whole: an index saved with a BOM or
with ';' or tab delimiters is read; an index it cannot read a row from, or a missing or empty folder, stops before
anything is written with a message naming what was found and what was expected (exit status 2, no traceback);
re-preparing a changed source rebuilds the dataset, an unchanged one is reused, and the report says which;
narrations whose timed words do not spell their caption are counted."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from vlrep.data import pipeline, prepare, records
from vlrep.data.builders import image_text
from vlrep.errors import UserError

# Images of different sizes and aspect ratios (one PNG), with content (a gradient and noise), not flat colours.
SIZES = {"photos/wide.jpg": (64, 36), "photos/tall.jpg": (30, 52), "photos/square.png": (41, 41)}
CAPTIONS = [("photos/wide.jpg", "a wide view"), ("photos/tall.jpg", "a tall tower"), ("photos/square.png", "a box")]


def _write_images(root) -> None:
  rng = np.random.default_rng(0)
  os.makedirs(os.path.join(root, "photos"), exist_ok=True)
  for name, (width, height) in SIZES.items():
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = np.clip(ramp + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(os.path.join(root, name))


def _write_csv(root, text: str, encoding: str = "utf-8") -> None:
  _write_images(root)
  with open(os.path.join(root, "captions.csv"), "w", encoding=encoding, newline="") as f:
    f.write(text)


def _jsonl(*rows) -> str:
  return "".join(json.dumps(r) + "\n" for r in rows)


def _captions(data_dir) -> dict[str, list[str]]:
  builder = pipeline.get_builder("image_text", str(data_dir))
  return {
    e["key"].numpy().decode(): [c.decode() for c in e["captions"].numpy()]
    for e in records.examples(builder, "train", decode_images=False)
  }


@pytest.mark.parametrize(
  "text, encoding",
  [
    ("image,caption\n" + "".join(f"{i},{c}\n" for i, c in CAPTIONS), "utf-8-sig"),  # BOM, as spreadsheets save
    ("image;caption\r\n" + "".join(f"{i};{c}\r\n" for i, c in CAPTIONS), "utf-8"),  # ';', Windows line ends
    ("Image\t Caption\n" + "".join(f"{i}\t{c}\n" for i, c in CAPTIONS), "utf-8-sig"),  # tab, capitalised, BOM
  ],
  ids=["bom", "semicolon", "tab"],
)
def test_a_csv_with_a_bom_or_another_delimiter_is_read(tmp_path, text, encoding):
  _write_csv(tmp_path / "mine", text, encoding)
  report = prepare.prepare("image_text", str(tmp_path / "mine"), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 3} and report["skipped"] == {}, report
  assert _captions(tmp_path / "tfds") == {image: [caption] for image, caption in CAPTIONS}


def test_a_jsonl_with_a_bom_is_read(tmp_path):
  _write_images(tmp_path / "mine")
  text = _jsonl(*({"image": image, "caption": caption} for image, caption in CAPTIONS))
  (tmp_path / "mine" / "captions.jsonl").write_text(text, encoding="utf-8-sig")
  report = prepare.prepare("image_text", str(tmp_path / "mine"), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 3} and report["skipped"] == {}, report
  assert _captions(tmp_path / "tfds") == {image: [caption] for image, caption in CAPTIONS}


# (case, files written into manual_dir (None: no folder at all), the message expected)
WHOLE_FILE_CASES = {
  "csv_unknown_field": (
    {"captions.csv": "image,text\nphotos/wide.jpg,a wide view\n"},
    r"header 'image,text' has no image and caption fields; expected a header image,caption\[,tags\]",
  ),
  "csv_semicolon_unknown_field": (
    {"captions.csv": "image;caption;tag\nphotos/wide.jpg;a wide view;sky\n"},
    r"header 'image;caption;tag' has unknown or repeated fields \['tag'\]; expected a header image,caption\[,tags\]",
  ),
  "csv_header_only": (
    {"captions.csv": "image,caption\n"},
    r"no row with an image path: 0 rows below the header; expected rows image,caption\[,tags\]",
  ),
  "csv_empty": ({"captions.csv": ""}, r"captions.csv: no header on line 1; expected a header image,caption"),
  "jsonl_unknown_keys": (
    {"captions.jsonl": _jsonl({"file": "photos/wide.jpg", "text": "a wide view"}, {"file": "photos/tall.jpg"})},
    r"no row with both an image and a caption field \(2 JSON objects read; keys found: 'file' \(2 rows\), 'text' "
    r"\(1 rows\)\); expected one JSON object per line, \{\"image\": \"relative/path.jpg\", \"caption\"",
  ),
  "jsonl_no_json": (
    {"captions.jsonl": "photos/wide.jpg a wide view\n"},
    r"no row with both an image and a caption field \(0 JSON objects read; keys found: none\)",
  ),
  "empty_folder": ({}, r"--manual_dir='.*mine' is not a folder or is empty \(the folder is empty\)\. Expected layout:"),
  "missing_folder": (None, r"--manual_dir='.*mine' is not a folder or is empty \(no such folder\)\. Expected layout:"),
  "neither_layout": ({"notes.txt": "my photos"}, r"holds neither webdataset shards \(\*\.tar\) nor captions\.jsonl"),
}


@pytest.mark.parametrize("case", sorted(WHOLE_FILE_CASES))
def test_a_whole_file_problem_stops_before_anything_is_written(tmp_path, case):
  files, message = WHOLE_FILE_CASES[case]
  root = tmp_path / "mine"
  if files is not None:
    root.mkdir()
    for name, text in files.items():
      (root / name).write_text(text)
  with pytest.raises(UserError, match=message):
    prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))
  assert not (tmp_path / "tfds").exists()  # checked before TFDS writes anything


def test_no_manual_dir_given_is_a_user_error(tmp_path):
  with pytest.raises(UserError, match="--manual_dir is not given"):
    prepare.prepare("image_text", None, str(tmp_path / "tfds"))


def test_rows_that_all_fail_end_in_a_user_error_naming_the_skips(tmp_path):
  """A header that reads but no usable example (every image missing): a clear error, not TFDS's assertion."""
  root = tmp_path / "mine"
  root.mkdir()
  (root / "captions.csv").write_text("image,caption\nnot/there.jpg,a lost photo\n")
  with pytest.raises(UserError, match=r"no usable example: .*\{'missing image file': 1\}"):
    prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))


def test_the_cli_exits_2_with_the_header_found_and_no_traceback(tmp_path):
  _write_csv(tmp_path / "mine", "image,text\nphotos/wide.jpg,a wide view\n")
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  out = subprocess.run(
    [sys.executable, "-m", "vlrep.data.prepare", "--dataset=image_text", f"--manual_dir={tmp_path / 'mine'}"]
    + [f"--data_dir={tmp_path / 'tfds'}"],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
  )
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr and "row without an image or caption field" not in out.stderr
  assert "ERROR: " in out.stderr and "header 'image,text' has no image and caption fields" in out.stderr


def test_a_changed_source_is_rebuilt_an_unchanged_one_reused(tmp_path):
  root, data_dir = tmp_path / "mine", str(tmp_path / "tfds")
  _write_csv(root, "image,caption\n" + "".join(f"{i},{c}\n" for i, c in CAPTIONS))
  assert prepare.prepare("image_text", str(root), data_dir)["source"] == "prepared"

  again = prepare.prepare("image_text", str(root), data_dir)
  assert again["source"].startswith("reused: the source in") and again["splits"] == {"train": 3}

  # The user corrects a caption and drops an image: the new captions are what is read back.
  (root / "captions.csv").write_text("image,caption\nphotos/wide.jpg,a wide valley at dusk\nphotos/tall.jpg,a tower\n")
  fixed = prepare.prepare("image_text", str(root), data_dir)
  assert fixed["source"].startswith("rebuilt: captions.csv changed; image files or shards changed"), fixed["source"]
  assert fixed["splits"] == {"train": 2}
  assert _captions(data_dir) == {"photos/wide.jpg": ["a wide valley at dusk"], "photos/tall.jpg": ["a tower"]}
  with open(os.path.join(data_dir, "image_text_prepare_report.json")) as f:
    assert json.load(f)["source"] == fixed["source"]

  # A change that cannot be prepared (every image path wrong): the error, and the dataset prepared before is kept.
  (root / "captions.csv").write_text("image,caption\nwide.jpg,a wide valley at dusk\n")
  with pytest.raises(UserError, match=r"no usable example: .*\{'missing image file': 1\}"):
    prepare.prepare("image_text", str(root), data_dir)
  assert _captions(data_dir) == {"photos/wide.jpg": ["a wide valley at dusk"], "photos/tall.jpg": ["a tower"]}
  (root / "captions.csv").write_text("image,caption\nphotos/wide.jpg,a wide valley at dusk\nphotos/tall.jpg,a tower\n")

  # The same index, an image replaced by another photo: rebuilt from the new image.
  Image.new("RGB", (20, 10), "white").save(root / "photos" / "wide.jpg")
  replaced = prepare.prepare("image_text", str(root), data_dir)
  assert replaced["source"].startswith("rebuilt: image files or shards changed"), replaced["source"]
  builder = pipeline.get_builder("image_text", data_dir)
  shapes = {
    e["key"].numpy().decode(): e["image"].numpy().shape for e in records.examples(builder, "train", decode_images=True)
  }
  assert shapes == {"photos/wide.jpg": (10, 20, 3), "photos/tall.jpg": (52, 30, 3)}


def test_narrations_whose_words_do_not_spell_their_caption_are_counted(tmp_path):
  root = tmp_path / "mine"
  _write_images(root)
  trace = [[{"x": 0.1, "y": 0.2, "t": 0.0}, {"x": 0.5, "y": 0.5, "t": 2.0}]]

  def words(*utterances):
    return [{"utterance": w, "start_time": 0.5 * k, "end_time": 0.5 * (k + 1)} for k, w in enumerate(utterances)]

  (root / "captions.jsonl").write_text(
    _jsonl(
      {
        "image": "photos/wide.jpg",
        "caption": "A wide view.",
        "timed_caption": words("a", "Wide", "view"),
        "traces": trace,
      },
      {
        "image": "photos/tall.jpg",
        "caption": "A tall tower",
        "timed_caption": words("a", "short", "hut"),
        "traces": trace,
      },
      {"image": "photos/square.png", "caption": "A box", "timed_caption": [], "traces": trace},  # no words at all
    )
  )
  report = prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))
  assert report["fields"]["narration"] == 3 and report["trace_mismatch"] == 2, report
  again = prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))  # reused: the count lives with the data
  assert again["source"].startswith("reused") and again["trace_mismatch"] == 2
  assert image_text.words_spell_caption(words("Café", "au-lait"), "café au lait!")
