"""Your own labelled images (`vlrep.data.prepare --dataset=image_folder`) for the linear probe, the SVM probe and
zero-shot classification: a folder per class of real photographs (tests/labelled_photos.py: scikit-image's sample
photos, mixed sizes, crops and mirrors, JPEG and PNG, grayscale and RGBA), a corrupt image and an empty class
folder among them, prepared by the real command; each evaluator run on it through `vlrep.evaluate` on the tiny
VirTex run; the probes' wiring (splits, labels, class count) checked with features that know the classes; each
whole-file mistake exits 2 naming what was found and what was expected."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import labelled_photos
import numpy as np
import pytest
from conftest import run_module
from PIL import Image
from test_zero_shot import NUM_CLASSES, Towers, looked_up

from vlrep.config_utils import config_module
from vlrep.data import pipeline, prepare, records
from vlrep.data.builders import image_folder
from vlrep.errors import DatasetNotPrepared, UserError
from vlrep.evaluators import EvalInputs, Model, linear_probe, voc07_svm, zero_shot
from vlrep.models.special_tokens import EOS_ID, NUM_SPECIAL, PAD_ID, SOS_ID

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = sorted(labelled_photos.CLASSES)  # the empty class folder is left out
SIZE = 32  # the tiny run's resolution


def eval_config(name: str, data_dir: str):
  """configs/eval/NAME.py:data=DATA_DIR,size=32, as `vlrep.evaluate` loads it."""
  return config_module(os.path.join(ROOT, "configs", "eval", "x"), f"{name}.py").get_config(
    f"data={data_dir},size={SIZE}"
  )


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
  """(manual_dir, data_dir, the prepare command's report): the photos, a corrupt JPEG, an empty class folder and
  a note beside the photos, prepared by `python -m vlrep.data.prepare --dataset=image_folder`."""
  tmp = tmp_path_factory.mktemp("labelled")
  manual, data = tmp / "mine", tmp / "tfds"
  labelled_photos.write_labelled_folder(str(manual))
  with open(manual / "coffee_cup" / "coffee_cup_0.jpg", "rb") as f:
    (manual / "tabby_cat" / "torn.jpg").write_bytes(f.read()[:300])  # a download cut off: no image data
  (manual / "empty_class").mkdir()
  (manual / "rocket" / "notes.txt").write_text("shot at the museum")
  proc = run_module("vlrep.data.prepare", "--dataset=image_folder", f"--manual_dir={manual}", f"--data_dir={data}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return str(manual), str(data), json.loads(proc.stdout[proc.stdout.index("{") :])


def test_prepare_counts_the_corrupt_image_and_the_empty_class_and_holds_out_each_class(labelled):
  manual, data, report = labelled
  assert report["skipped"] == {
    "undecodable image (OSError)": 1,  # PIL: "image file is truncated"
    "class folder without an image (class left out)": 1,
    "not an image file (by its suffix)": 1,
  }, report
  assert sorted(report["classes"]) == CLASSES
  per_class = labelled_photos.PER_CLASS
  for name, splits in report["classes"].items():
    # 15% of 6 (or 7, the torn one listed) rounds to 1 each for test and val; the torn image is in one of them.
    assert sum(splits.values()) == per_class and splits["train"] >= per_class - 2, (name, splits)
    assert splits["test"] + splits["val"] >= 1 and splits["test"] <= 1 and splits["val"] <= 1, (name, splits)
  assert sum(report["splits"].values()) == per_class * len(CLASSES)

  builder = pipeline.get_builder("image_folder", data)
  assert builder.info.features["label"].names == CLASSES
  assert zero_shot.class_names(builder, "label") == [c.replace("_", " ") for c in CLASSES]  # the prompts' names
  keys = {}
  for split in image_folder.SPLITS:
    keys[split] = set()
    for example in records.examples(builder, split, decode_images=True):
      key, label = example["key"].numpy().decode(), int(example["label"].numpy())
      assert key.split("/")[0] == CLASSES[label]  # the label is its folder's
      image = example["image"].numpy()
      assert image.ndim == 3 and image.shape[2] == 3 and min(image.shape[:2]) >= 8, (key, image.shape)
      keys[split].add(key)
  assert not (keys["train"] & keys["val"] or keys["train"] & keys["test"] or keys["val"] & keys["test"])
  # The grayscale coins and the RGBA logo were converted to RGB; a logo decodes with its colours, not black.
  logo = next(e for e in records.examples(builder, "train", decode_images=True) if b"logo" in e["key"].numpy())
  assert logo["image"].numpy().std(axis=(0, 1)).max() > 10
  # Deterministic: the same listing gives the same splits (assigned from the file names).
  listing = image_folder.read_listing(manual)
  assert listing == image_folder.read_listing(manual)
  assert {p for p, _, s in listing if s == "test" and p != "tabby_cat/torn.jpg"} == keys["test"]


def known_images(run: EvalInputs, cfg, builder) -> tuple[np.ndarray, np.ndarray]:
  """(pixel sums [N], class ids [N]) of every split under the evaluator's preprocessing."""
  sums, labels = [], []
  for split in image_folder.SPLITS:
    for batch in run.batches(builder, split, cfg.get("pp") or cfg.pp_eval, ("image", "label"), 16):
      m = batch["_mask"].astype(bool)
      sums.append(batch["image"][m].reshape(m.sum(), -1).sum(1))
      labels.append(batch["label"][m])
  return np.concatenate(sums), np.concatenate(labels)


def knowing_model(sums: np.ndarray, labels: np.ndarray, wrong: bool = False) -> Model:
  """A Model whose features are each image's class, one-hot (found by its pixel sum): a probe on them scores 100;
  with `wrong`, the next class's (a probe still learns the mapping; zero-shot would not)."""

  def features(local_batch, key):
    del key
    images = local_batch["image"]
    found = labels[np.argmin(np.abs(images.reshape(len(images), -1).sum(1)[:, None] - sums), axis=1)]
    return np.eye(len(CLASSES), dtype=np.float32)[(found + wrong) % len(CLASSES)], dict(local_batch)

  return Model(variables={}, features=features)


def test_the_probes_read_the_splits_labels_and_class_count_of_your_classes(labelled):
  _, data, _ = labelled
  run = EvalInputs()
  probe_cfg = eval_config("linear_probe", data).evals.linear_probe_virtex
  probe = linear_probe.Evaluator(probe_cfg, run)
  assert probe.num_classes == len(CLASSES)  # counted from the dataset (num_classes=0 in the config)
  sums, labels = known_images(run, probe_cfg, probe.builder)
  assert len(np.unique(np.round(sums, 1))) == len(sums)  # each image found by its pixel sum
  got = probe.evaluate(knowing_model(sums, labels, wrong=True))
  assert got["top1"] == 100.0 and got["top1_val"] == 100.0, got
  assert 0.01 <= got["lr"] <= 10.0 and got["weight_decay"] == 0.0, got

  svm_cfg = eval_config("voc07_svm", data).evals.voc07_svm
  svm = voc07_svm.Evaluator(svm_cfg, run)
  got = svm.evaluate(knowing_model(sums, labels))
  assert got["map"] == pytest.approx(100.0) and got["map_val"] == pytest.approx(100.0), got
  assert got["map_cv"] == pytest.approx(100.0), got


def test_one_vs_rest_targets():
  np.testing.assert_array_equal(voc07_svm.one_vs_rest(np.array([2, 0]), 3), [[-1, -1, 1], [1, -1, -1]])
  with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
    voc07_svm.one_vs_rest(np.array([3]), 3)


@pytest.mark.parametrize(
  "config, name, metrics",
  [
    ("linear_probe", "linear_probe_virtex", {"top1": 100, "top5": 100, "top1_val": 100}),
    ("voc07_svm", "voc07_svm", {"map": 100, "map_val": 100, "map_cv": 100}),
    ("zero_shot", "zero_shot", {"top1": 100, "chance": 100}),
  ],
)
def test_each_evaluator_runs_on_your_classes_through_vlrep_evaluate(
  labelled, tiny_virtex_run, tmp_path, config, name, metrics
):
  _, data, _ = labelled
  workdir = tmp_path / "run"
  shutil.copytree(tiny_virtex_run.workdir, workdir)
  proc = run_module(
    "vlrep.evaluate", f"--config=configs/eval/{config}.py:data={data},size={SIZE}", f"--workdir={workdir}"
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  for metric, top in metrics.items():
    value = summary[f"{name}/{metric}"]
    assert math.isfinite(value) and 0 <= value <= top, (metric, value)
  if config == "zero_shot":
    assert summary["zero_shot/chance"] == pytest.approx(100 / len(CLASSES))  # the 6 classes, the empty one left out


def _image(path, size=(20, 14)):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  rng = np.random.default_rng(len(str(path)))
  Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def _folders(root, layout: dict[str, int]):
  for folder, n in layout.items():
    os.makedirs(os.path.join(root, folder), exist_ok=True)
    for i in range(n):
      _image(os.path.join(root, folder, f"{i}.jpg"))


def _csv(root, text: str):
  with open(os.path.join(root, "labels.csv"), "w", encoding="utf-8") as f:
    f.write(text)


# (case, how manual_dir is made, the message expected on stderr)
WHOLE_FILE_CASES = {
  "one_class": (
    lambda r: _folders(r, {"cats": 4}),
    r"1 class with images \('cats' \(4 images\)\); a classifier needs at least 2: expected a folder per class",
  ),
  "no_class_folder": (
    lambda r: [_image(os.path.join(r, f"{i}.jpg")) for i in range(2)],
    r"holds no class folder and no labels.csv \(found 2 image files and no folder at its top\); expected a folder "
    r"per class",
  ),
  "only_empty_class_folders": (
    lambda r: _folders(r, {"cats": 0, "dogs": 0}),
    r"0 classes with images \(no class with an image\); a classifier needs at least 2",
  ),
  "too_few_to_hold_out": (
    lambda r: _folders(r, {"cats": 2, "dogs": 2}),
    r"no image for the val and test splits \(images per class: 'cats' \(2\), 'dogs' \(2\)\); expected at least 3 "
    r"images in a class",
  ),
  "split_folders_mixed_with_classes": (
    lambda r: _folders(r, {"train/cats": 3, "train/dogs": 3, "birds": 3}),
    r"mixes split folders \(train\) with other folders \(birds\); expected either only split folders",
  ),
  "split_folders_without_train": (
    lambda r: _folders(r, {"val/cats": 3, "test/dogs": 3}),
    r"split folders test, val but no train/; expected train/<class>/\*.jpg",
  ),
  "split_named_twice": (
    lambda r: _folders(r, {"train/cats": 3, "val/cats": 1, "validation/dogs": 1}),
    r"split folders train, val, validation name a split twice; expected one folder per split",
  ),
  "csv_without_label": (
    lambda r: _csv(r, "file,class\na.jpg,x\n"),
    r"labels.csv: header 'file,class' has no image and label fields; expected a header image,label\[,split\]",
  ),
  "csv_unknown_field": (
    lambda r: _csv(r, "image;label;fold\na.jpg;x;1\n"),
    r"header 'image;label;fold' has unknown or repeated fields \['fold'\]; expected a header image,label\[,split\]",
  ),
  "csv_header_only": (
    lambda r: _csv(r, "\ufeffimage,label\n"),
    r"labels.csv: no row with an image and a label: 0 rows below the header; expected rows image,label\[,split\]",
  ),
  "csv_one_label": (
    lambda r: _csv(r, "image,label\na.jpg,cat\nb.jpg,cat\n"),
    r"1 class with images \('cat' \(2 images\)\)",
  ),
  "empty_folder": (lambda r: None, r"--manual_dir='.*mine' is not a folder or is empty \(the folder is empty\)"),
}


def test_whole_file_problems_exit_2_naming_what_was_found_and_expected(tmp_path):
  for case, (make, message) in WHOLE_FILE_CASES.items():
    root = tmp_path / case / "mine"
    root.mkdir(parents=True)
    make(str(root))
    data = tmp_path / case / "tfds"
    proc = run_module("vlrep.data.prepare", "--dataset=image_folder", f"--manual_dir={root}", f"--data_dir={data}")
    assert proc.returncode == 2, (case, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, (case, proc.stderr[-3000:])
    assert re.search(message, proc.stderr), (case, message, proc.stderr[-2000:])
    assert not data.exists(), case  # checked before anything is written


def test_labels_csv_with_a_bom_semicolons_and_a_split_column(tmp_path):
  root = tmp_path / "mine"
  for i in range(5):
    _image(root / "photos" / f"cat{i}.jpg", (20 + i, 14))
    _image(root / "photos" / f"dog{i}.png", (14, 20 + i))
  rows = ["Image ; Label ; Split"]  # spaces and capitals, as a spreadsheet may write them
  rows += [f"photos/cat{i}.jpg;tabby cat;{'test' if i == 0 else ''}" for i in range(5)]
  rows += [f"photos/dog{i}.png;dog;{'validation' if i == 0 else 'train'}" for i in range(5)]
  rows += ["photos/cat1.jpg;dog;", "photos/missing.jpg;dog;train", "photos/dog1.png;dog;holdout", ";dog;"]
  (root / "labels.csv").write_text("\r\n".join(rows) + "\r\n", encoding="utf-8-sig")
  report = prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"))
  assert report["skipped"] == {
    "image listed a second time (its first row kept)": 1,
    "missing image file": 1,
    "unknown split (expected train, val or test)": 1,
    "row without an image or a label": 1,
  }, report
  # The dogs' splits as given (no test image among them); cat0 in test as given, the 4 other cats (no split given)
  # held out as a class folder's images are: 1 to test, 1 to val, 2 to train.
  assert report["classes"] == {"dog": {"train": 4, "val": 1, "test": 0}, "tabby cat": {"train": 2, "val": 1, "test": 2}}
  builder = pipeline.get_builder("image_folder", str(tmp_path / "tfds"))
  test = {e["key"].numpy().decode() for e in records.examples(builder, "test", decode_images=False)}
  assert "photos/cat0.jpg" in test and len(test) == 2

  # Re-preparing: unchanged is reused; a changed label is rebuilt, never silently kept.
  assert prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"))["source"].startswith("reused")
  (root / "labels.csv").write_text(
    "\r\n".join(rows).replace("photos/dog4.png;dog;train", "photos/dog4.png;wolf;train"), encoding="utf-8-sig"
  )
  fixed = prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"))
  assert fixed["source"].startswith("rebuilt: labels.csv changed"), fixed["source"]
  assert sorted(fixed["classes"]) == ["dog", "tabby cat", "wolf"]


def test_split_folders_are_kept_and_a_missing_val_is_taken_from_train(tmp_path):
  root = tmp_path / "mine"
  _folders(root, {"train/cats": 7, "train/dogs": 7, "test/cats": 2, "test/dogs": 1})
  listing = image_folder.read_listing(str(root))
  by_split = {s: sorted(p for p, _, x in listing if x == s) for s in image_folder.SPLITS}
  assert by_split["test"] == ["test/cats/0.jpg", "test/cats/1.jpg", "test/dogs/0.jpg"]
  assert len(by_split["val"]) == 2 and all(p.startswith("train/") for p in by_split["val"])  # one per class
  assert len(by_split["train"]) == 12
  with pytest.raises(UserError, match="mixes split folders"):
    _folders(root, {"birds": 3})
    image_folder.read_listing(str(root))


def test_a_split_whose_images_all_fail_to_decode_stops_naming_the_split(tmp_path):
  root = tmp_path / "mine"
  _folders(root, {"train/cats": 3, "train/dogs": 3, "test/cats": 1, "test/dogs": 1})
  (root / "val" / "cats").mkdir(parents=True)
  (root / "val" / "cats" / "0.jpg").write_bytes(b"saved as text, not a JPEG")
  with pytest.raises(UserError, match=r"no usable image in split 'val' \(1 listed\); skipped: \{'undecodable image"):
    prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"))


def test_eval_configs_on_classes_not_prepared_name_the_prepare_command(tmp_path):
  cfg = eval_config("voc07_svm", str(tmp_path)).evals.voc07_svm
  with pytest.raises(DatasetNotPrepared, match="--dataset=image_folder"):
    voc07_svm.Evaluator(cfg, EvalInputs())
  module = config_module(os.path.join(ROOT, "configs", "eval", "x"), "linear_probe.py")
  with pytest.raises(ValueError, match="use variant=virtex or variant=icmlm, mode=features"):
    module.get_config(f"data={tmp_path},variant=mct")
  assert module.get_config(f"data={tmp_path},variant=icmlm").evals.linear_probe_icmlm.trials == 25


class PhraseTokenizer:
  """One id per class name a prompt holds as written (` tabby cat.`: a name with an underscore matches nothing):
  NUM_SPECIAL + its index among `names`."""

  def __init__(self, names):
    self.names = list(names)

  def encode(self, text, max_len):
    ids = [SOS_ID, *(NUM_SPECIAL + i for i, n in enumerate(self.names) if f" {n}." in text), EOS_ID]
    out = np.full((max_len,), PAD_ID, np.int32)
    out[: len(ids)] = ids
    return out, False


def test_zero_shot_prompts_name_the_class_folders_with_spaces_in_label_order(labelled):
  """Towers that point each image at its class's prompt (toy, test_zero_shot.Towers) score 100 only if the prompts
  name the folders with spaces for underscores and class id k is the k-th sorted folder."""
  _, data, _ = labelled
  cfg = eval_config("zero_shot", data).evals.zero_shot
  run = EvalInputs()
  builder = pipeline.get_builder("image_folder", data)
  sums, labels = known_images(run, cfg, builder)
  spaced = [c.replace("_", " ") for c in CLASSES]
  towers = Towers(looked_up(sums, np.eye(NUM_CLASSES)[labels]))  # test_zero_shot's 10-d class space
  evaluator = zero_shot.Evaluator(cfg, EvalInputs(tokenizer=PhraseTokenizer(spaced), method=towers))
  assert evaluator.class_names == spaced
  assert evaluator.evaluate(Model(variables={}, features=None)) == {"top1": 100.0, "chance": 100 / len(CLASSES)}
  # Looking for the folder names as written, those with an underscore are no prompt's: their test images tie over
  # all 6 classes (1/6 credit each), the others stay right.
  blind = zero_shot.Evaluator(cfg, EvalInputs(tokenizer=PhraseTokenizer(CLASSES), method=towers))
  test_labels = [int(e["label"].numpy()) for e in records.examples(builder, "test", decode_images=False)]
  credit = [1 / len(CLASSES) if "_" in CLASSES[k] else 1.0 for k in test_labels]
  assert 0 < sum(c < 1 for c in credit) < len(credit)
  expected = 100 * np.mean(credit)
  assert blind.evaluate(Model(variables={}, features=None))["top1"] == pytest.approx(expected)
