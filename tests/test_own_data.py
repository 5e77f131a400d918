"""Your own image-text data (`image_text`): webdataset shards and a folder with a JSONL or CSV index, prepared
with their bad rows skipped and counted, then trained on end to end."""

import importlib
import io
import json
import os
import tarfile

import numpy as np
import pytest
from conftest import run_main
from PIL import Image
from test_evaluation import _load_config as load_config

from vlrep import train
from vlrep.data import pipeline, prepare, records
from vlrep.errors import MissingField


def _image(color, fmt="JPEG", size=(40, 30)) -> bytes:
  out = io.BytesIO()
  Image.new("RGB", size, color).save(out, fmt)
  return out.getvalue()


def _add(tar, name, data: bytes):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def write_shards(root) -> None:
  """Two img2dataset-style shards: good pairs (.txt, .json with tags), a corrupt JPEG, an image without a caption,
  a caption without an image, an empty caption, metadata that is not UTF-8, a caption that is not a string; and a
  third shard cut off mid-file (a download that died)."""
  os.makedirs(root)
  with tarfile.open(os.path.join(root, "00000.tar"), "w") as tar:
    _add(tar, "000.jpg", _image("red"))
    _add(tar, "000.txt", b"a red square")
    _add(tar, "001.jpg", _image("blue"))
    _add(tar, "001.json", json.dumps({"caption": "a blue field", "tags": ["blue", "field"]}).encode())
    _add(tar, "002.jpg", b"\xff\xd8 not a jpeg at all")
    _add(tar, "002.txt", b"broken image")
    _add(tar, "003.jpg", _image("green"))  # no caption: mismatched keys
  with tarfile.open(os.path.join(root, "00001.tar"), "w") as tar:
    _add(tar, "004.txt", b"a caption whose image is missing")
    _add(tar, "005.png", _image("white", "PNG"))  # PNG: stored as JPEG
    _add(tar, "005.txt", b"  a white page  ")
    _add(tar, "006.jpg", _image("black"))
    _add(tar, "006.txt", b"   ")  # empty caption
    _add(tar, "007.jpg", _image("gray"))
    _add(tar, "007.txt", b"caf\xe9 latin-1, not UTF-8")
    _add(tar, "008.jpg", _image("yellow"))
    _add(tar, "008.json", json.dumps({"caption": 42}).encode())
  with tarfile.open(os.path.join(root, "00002.tar"), "w") as tar:
    _add(tar, "009.jpg", _image("purple"))
    _add(tar, "009.txt", b"a purple square")
    _add(tar, "010.txt", b"cut off with its image")
    _add(tar, "010.jpg", _image("orange", size=(200, 200)))
  with tarfile.open(os.path.join(root, "00002.tar")) as tar:
    cut = tar.getmember("010.jpg").offset_data + 100
  with open(os.path.join(root, "00002.tar"), "r+b") as f:
    f.truncate(cut)  # inside 010.jpg's data


def write_folder(root, index="jsonl") -> None:
  """Images and an index: a grouped second caption, tags, a corrupt JPEG, a missing file, an empty caption, a
  line that is not UTF-8, a line that is not JSON, a row without a caption field."""
  os.makedirs(os.path.join(root, "imgs"))
  for name, color in (("a.jpg", "red"), ("b.jpg", "blue")):
    with open(os.path.join(root, "imgs", name), "wb") as f:
      f.write(_image(color))
  with open(os.path.join(root, "imgs", "c.jpg"), "wb") as f:
    f.write(b"\xff\xd8\xff garbage")
  rows = [
    ("imgs/a.jpg", "a red square", ["red"]),
    ("imgs/a.jpg", "the same red image", []),
    ("imgs/b.jpg", "a blue field", ["blue", "field"]),
    ("imgs/b.jpg", "", []),
    ("imgs/c.jpg", "a corrupt image", []),
    ("imgs/d.jpg", "a missing image", []),
  ]
  if index == "jsonl":
    lines = [json.dumps({"image": i, "caption": c, "tags": t}).encode() for i, c, t in rows]
    lines += [
      b'{"image": "imgs/a.jpg", "caption": "caf\xe9"}',
      b"not json",
      json.dumps({"image": "imgs/b.jpg"}).encode(),
    ]
    with open(os.path.join(root, "captions.jsonl"), "wb") as f:
      f.write(b"\n".join(lines) + b"\n")
  else:
    lines = [b"image,caption,tags"] + [f'{i},"{c}",{"|".join(t)}'.encode() for i, c, t in rows]
    lines += [b"imgs/a.jpg,caf\xe9,"]
    with open(os.path.join(root, "captions.csv"), "wb") as f:
      f.write(b"\n".join(lines) + b"\n")


def _examples(data_dir):
  builder = pipeline.get_builder("image_text", str(data_dir))
  assert records.is_array_record(builder)
  return builder, {e["key"].numpy().decode(): e for e in records.examples(builder, "train", decode_images=True)}


def test_webdataset_shards_prepare_with_bad_members_skipped_and_counted(tmp_path):
  write_shards(tmp_path / "shards")
  report = prepare.prepare("image_text", str(tmp_path / "shards"), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 4} and report["file_format"] == "array_record"
  assert report["skipped"] == {
    "undecodable image (UnidentifiedImageError)": 1,
    "image without a caption (mismatched keys)": 1,
    "caption without an image (mismatched keys)": 1,
    "empty caption": 1,
    "image without captions": 3,  # the images whose caption is empty, not UTF-8, not a string
    "caption not UTF-8": 1,
    "caption not a string": 1,
    "unreadable shard or shard tail (ReadError)": 1,
  }, report["skipped"]
  _, ex = _examples(tmp_path / "tfds")
  assert sorted(ex) == ["00000.tar/000", "00000.tar/001", "00001.tar/005", "00002.tar/009"]
  assert [c.decode() for c in ex["00000.tar/001"]["captions"].numpy()] == ["a blue field"]
  assert [t.decode() for t in ex["00000.tar/001"]["tags"].numpy()] == ["blue", "field"]
  assert [c.decode() for c in ex["00001.tar/005"]["captions"].numpy()] == ["a white page"]
  white = ex["00001.tar/005"]["image"].numpy()
  assert white.shape == (30, 40, 3) and white.min() > 240  # the PNG, re-encoded as JPEG
  red = ex["00000.tar/000"]["image"].numpy().reshape(-1, 3).mean(0)
  assert red[0] > 200 and red[1] < 40 and red[2] < 40


@pytest.mark.parametrize("index", ["jsonl", "csv"])
def test_a_folder_with_an_index_prepares_grouped_captions_and_counts_bad_rows(tmp_path, index):
  write_folder(tmp_path / "mine", index)
  report = prepare.prepare("image_text", str(tmp_path / "mine"), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 2}, report
  expected = {"undecodable image (UnidentifiedImageError)": 1, "missing image file": 1, "empty caption": 1}
  expected["line not UTF-8"] = 1
  if index == "jsonl":
    expected.update({"line not JSON": 1, "row without an image or caption field": 1})
  assert report["skipped"] == expected, report["skipped"]
  _, ex = _examples(tmp_path / "tfds")
  assert sorted(ex) == ["imgs/a.jpg", "imgs/b.jpg"]
  assert [c.decode() for c in ex["imgs/a.jpg"]["captions"].numpy()] == ["a red square", "the same red image"]
  assert [t.decode() for t in ex["imgs/b.jpg"]["tags"].numpy()] == ["blue", "field"]
  assert sorted(int(e["image_id"]) for e in ex.values()) == [0, 1]


def test_a_manual_dir_of_neither_format_is_a_clear_error(tmp_path):
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("hello")
  with pytest.raises(FileNotFoundError, match=r"neither webdataset shards \(\*\.tar\) nor captions\.jsonl"):
    prepare.prepare("image_text", str(tmp_path / "other"), str(tmp_path / "tfds"))


# ---------------------------------------------------------------------------------------------------- #
# Every method on your own data, one switch each (`configs/<method>.py:data=DIR`).
# ---------------------------------------------------------------------------------------------------- #
COLORS = ("red", "blue", "green", "yellow", "white", "black", "purple", "orange", "gray", "pink", "brown", "cyan")


def write_captioned_folder(root, tags=True, narrations=True) -> None:
  """Twelve images of one colour each with two captions (with `tags`, two tags; with `narrations`, the first
  caption spoken as a Localized Narrative with its mouse trace) per image in captions.jsonl: a user's own
  annotated photos, at test size."""
  os.makedirs(os.path.join(root, "imgs"))
  rows = []
  for i, color in enumerate(COLORS):
    with open(os.path.join(root, "imgs", f"{i:02d}.jpg"), "wb") as f:
      f.write(_image(color, size=(48, 40)))
    for k, caption in enumerate((f"a {color} square on a table", f"the photo shows a {color} thing")):
      row = {"image": f"imgs/{i:02d}.jpg", "caption": caption}
      if tags:
        row["tags"] = [color, "square" if i % 2 else "thing"]
      if narrations and k == 0:  # Localized Narratives' fields: a word every 0.5 s, pointed at along a diagonal
        words = caption.split()
        row["timed_caption"] = [
          {"utterance": w, "start_time": 0.5 * j, "end_time": 0.5 * j + 0.4} for j, w in enumerate(words)
        ]
        points = [{"x": 0.1 + 0.8 * t / 20, "y": 0.2 + 0.6 * t / 20, "t": 0.15 * t} for t in range(21)]
        row["traces"] = [points[:10], points[10:]]
      rows.append(row)
  with open(os.path.join(root, "captions.jsonl"), "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
  """The prepared folder (DATA_DIR) of write_captioned_folder's data, shared by the runs below."""
  root = tmp_path_factory.mktemp("own")
  write_captioned_folder(root / "mine")
  report = prepare.prepare("image_text", str(root / "mine"), str(root / "tfds"))
  assert report["splits"] == {"train": 12} and not report["skipped"], report
  assert report["fields"]["narration"] == 12 and report["fields"]["tags"] == 12, report["fields"]
  assert report["trace_mismatch"] == 0  # every narration's timed words spell its caption
  return root / "tfds"


# method -> (tiny config, its arguments besides data=, the metric its own-data evaluator reports)
OWN_DATA_RUNS = {
  "virtex": ("tests/tiny_virtex.py", "", "captioning/cider"),
  "loctex": ("tests/tiny_loctex.py", "", "retrieval/rsum"),
  "mct": ("tests/tiny_mct.py", "", "retrieval/rsum"),
  "icmlm_tp": ("tests/tiny_icmlm.py", "variant=tp", "held_out/loss"),
  "icmlm_tfm": ("tests/tiny_icmlm.py", "variant=tfm", "masked_tokens/top1"),
  "visual_bert": ("tests/tiny_vlbert.py", "arch=visual_bert,stage=pretrain", "mlm/"),
  "vilbert": ("tests/tiny_vlbert.py", "arch=vilbert,stage=pretrain", "mlm/"),
}


@pytest.mark.parametrize("name", list(OWN_DATA_RUNS))
def test_every_method_trains_and_evaluates_on_your_own_data_with_one_switch(tmp_path, own_data, name):
  config_file, args, metric = OWN_DATA_RUNS[name]
  tiny = importlib.import_module(os.path.basename(config_file)[: -len(".py")])  # tests/ is on sys.path
  config = tiny.get_config(",".join(a for a in (args, f"data={own_data}", "val=25") if a))
  config.total_steps, config.batch_size = 2, 4
  # In process (the `vlrep.main` path is run by the tests beside): the loop on the held-out split's complement.
  summary = train.train_and_evaluate(config, str(tmp_path / "run"))
  builder = pipeline.get_builder("image_text", str(own_data))
  # Training read the 9 images after the held-out first 25% (3 images), never those.
  assert config.data.split == "train[25%:]" and records.split_range(builder, config.data.split) == ("train", 3, 9)
  assert summary["steps"] == 2 and np.isfinite(summary["train/loss"])
  # Its evaluator read the held-out part of the same folder.
  assert any(k.startswith(metric) for k in summary), sorted(summary)
  if name == "icmlm_tp":  # its own loss on the 3 held-out images: one full batch of 3, no padded row counted
    assert (summary["held_out/batches"], summary["held_out/skipped"]) == (1.0, 0.0), summary
  held_out = [e for e in config.evals.values() if e.get("dataset") == "image_text"]
  splits = {e[k] for e in held_out for k in e if (k == "split" or k.endswith("_split")) and k != "train_split"}
  assert held_out and splits == {"train[:25%]"}, splits


def test_a_field_the_method_needs_is_a_clear_error_before_training(tmp_path):
  write_captioned_folder(tmp_path / "mine", tags=False, narrations=False)
  data_dir = tmp_path / "tfds"
  prepare.prepare("image_text", str(tmp_path / "mine"), str(data_dir))
  # MCT's tag loss (runlocal's default) on captions without tags: stops before training (vlrep.main exits 2 on a
  # UserError without a traceback: test_a_dataset_that_is_not_prepared_exits_2...).
  import tiny_mct

  with pytest.raises(MissingField) as caught:
    train.train_and_evaluate(tiny_mct.get_config(f"data={data_dir}"), str(tmp_path / "run"))
  said = str(caught.value)
  assert "mct needs 'tags' (MCT's tag loss J_tag (or train without it: configs/mct.py:data=DIR,tags=False))" in said
  assert '"tags": [...] on a captions.jsonl row' in said
  assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained
  # LocTex needs Localized Narratives' traces; captions alone are not enough.
  builder = pipeline.get_builder("image_text", str(data_dir))
  loctex = load_config("loctex", f"runlocal,data={data_dir}")
  with pytest.raises(MissingField, match=r"loctex needs 'narration' \(LocTex's localization loss .*timed_caption"):
    pipeline.check_required_fields(builder, loctex.data.split, loctex.data.requires, "loctex")
  # What the data has passes.
  virtex = load_config("virtex", f"runlocal,data={data_dir}")
  pipeline.check_required_fields(builder, virtex.data.split, virtex.data.requires, "virtex")


def test_a_dataset_that_is_not_prepared_exits_2_with_the_command_that_prepares_it(tmp_path):
  proc = run_main(tmp_path / "run", config=f"tests/tiny_virtex.py:data={tmp_path / 'nothing'}")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Dataset 'image_text' is not prepared" in proc.stderr and "python -m vlrep.data.prepare" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_data_dir_switches_training_and_the_held_out_evaluators_and_nothing_else():
  specs = [("virtex", ""), ("loctex", ""), ("mct", "tags=True"), ("icmlm", "variant=tp"), ("icmlm", "variant=tfm")]
  specs += [("vlbert", "arch=visual_bert,stage=pretrain"), ("vlbert", "arch=vilbert,stage=pretrain")]
  for name, arg in specs:
    for local in ("", "runlocal"):
      plain = load_config(name, ",".join(a for a in (arg, local) if a))
      c = load_config(name, ",".join(a for a in (arg, local, "data=/d/mine", "val=10") if a))
      assert (c.data.name, c.data.data_dir, c.data.split) == ("image_text", "/d/mine", "train[10%:]"), name
      if c.get("tokenizer") and "corpus_split" in c.tokenizer:
        assert c.tokenizer.corpus_split == "train[10%:]"  # the vocabulary never sees a held-out caption
      own = {k for k, e in c.evals.items() if e.get("dataset") == "image_text"}
      assert own, (name, arg, local)  # something validates on the user's data
      for k in own:
        e = c.evals[k]
        splits = {key: e[key] for key in e if key == "split" or key.endswith("_split")}
        assert set(splits.values()) <= {"train[:10%]", "train[10%:]"}, (name, k, splits)
        assert e.get("train_split", "train[10%:]") == "train[10%:]" and e.get("fold_size", 0) == 0
        assert any(v == "train[:10%]" for key, v in splits.items() if key != "train_split"), (name, k)
      # Evaluators on other data are untouched (the transfer probes); LocTex's mask evaluator is off.
      for k, e in c.evals.items():
        if k not in own:
          assert e.to_dict() == plain.evals[k].to_dict(), (name, k)
      assert "localization" not in c.evals
      assert c.get("best_metric") == plain.get("best_metric")
  with pytest.raises(ValueError, match="percentage"):
    load_config("virtex", "data=/d/mine,val=100")


def test_a_bad_config_value_exits_2_with_its_message_and_no_traceback(tmp_path):
  proc = run_main(tmp_path / "run", config="tests/tiny_virtex.py:data=/d/mine,val=100")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "val=100: the held-out share of your data must be a percentage in (0, 100)" in proc.stderr
  assert "Traceback" not in proc.stderr
