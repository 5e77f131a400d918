"""`python -m vlrep.predict`: its JSON lines are the values `vlrep.load(...)` gives in-process (the tiny VirTex and
CLIP runs, a shared folder, real photos), and every bad input is exit status 2 with a one-line message, nothing on
stdout and nothing written."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import ROOT, run_module
from PIL import Image
from skimage import data as skdata

import vlrep
from vlrep import predict
from vlrep.errors import UserError


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
  """Real photos of several sizes and modes: an RGB JPEG, an RGB PNG, a greyscale PNG."""
  folder = tmp_path_factory.mktemp("photos")
  Image.fromarray(skdata.chelsea()).save(folder / "chelsea.jpg", quality=90)
  Image.fromarray(skdata.coffee()[:200]).save(folder / "coffee.png")
  Image.fromarray(skdata.camera()[::2, ::3]).save(folder / "camera.png")
  return [str(folder / n) for n in ("chelsea.jpg", "coffee.png", "camera.png")]


@pytest.fixture(scope="module")
def virtex(tiny_virtex_run):
  return vlrep.load(str(tiny_virtex_run.workdir))


def listing(*folders) -> list:
  """Every path under the folders (and the repository's top level: the command's working directory), with sizes."""
  out = sorted(os.listdir(ROOT))
  for folder in folders:
    for dirpath, dirs, files in os.walk(folder):
      out += sorted(
        (os.path.relpath(os.path.join(dirpath, f), folder), os.path.getsize(os.path.join(dirpath, f))) for f in files
      )
      out += sorted(os.path.relpath(os.path.join(dirpath, d), folder) for d in dirs)
  return out


def predict_lines(*args, watch=()) -> list[dict]:
  """Runs the command; its stdout as JSON lines (every line one object). Nothing under `watch` may change."""
  before = listing(*watch)
  proc = run_module("vlrep.predict", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert listing(*watch) == before
  return [json.loads(line) for line in proc.stdout.splitlines()]


def test_caption_lines_are_vlrep_loads_captions(tiny_virtex_run, virtex, photos):
  workdir = str(tiny_virtex_run.workdir)
  lines = predict_lines(f"--model={workdir}", "caption", *photos, watch=(workdir, os.path.dirname(photos[0])))
  assert lines == [{"image": p, "caption": c} for p, c in zip(photos, virtex.caption(photos), strict=True)]
  assert all(line["caption"] for line in lines)
  # Other decoding settings reach the decoder: greedy, 4 tokens at most, 2 images per batch.
  args = ("--decoding=greedy", "--max_len=4", "--batch_size=2")
  lines = predict_lines(f"--model={workdir}", "caption", *args, *photos)
  want = vlrep.load(workdir, batch_size=2).caption(photos, decoding="greedy", max_len=4)
  assert [line["caption"] for line in lines] == want
  assert want != virtex.caption(photos, decoding="greedy", max_len=30)  # the flags made a difference


def test_zero_shot_lines_are_vlrep_loads(tiny_virtex_run, virtex, photos, tmp_path):
  labels = ["cat", "cup of coffee", "man with a camera"]
  (tmp_path / "classes.txt").write_text("\n".join(labels) + "\n\n")
  templates = ("a photo of a {}.", "a drawing of a {}.", "{} in the picture.")
  args = (f"--labels_file={tmp_path / 'classes.txt'}", f"--templates={templates[0]}|{templates[1]}")
  args += (f"--templates={templates[2]}", "--top_k=2")
  lines = predict_lines(f"--model={tiny_virtex_run.workdir}", "zero-shot", *args, *photos, watch=(tmp_path,))
  want = virtex.zero_shot(photos, labels, templates, top_k=2)["top"]
  assert lines == [
    {"image": p, "top": [{"label": label, "score": s} for label, s in top]} for p, top in zip(photos, want, strict=True)
  ]
  # The templates given are the ones scored: the evaluator's default ones give other scores.
  assert want != virtex.zero_shot(photos, labels, top_k=2)["top"]


def test_embed_lines_are_vlrep_loads_features(tiny_virtex_run, virtex, photos):
  lines = predict_lines(f"--model={tiny_virtex_run.workdir}", "embed", "--features=pooled,grid", *photos)
  want = virtex.encode_images(photos, ("pooled", "grid"))
  assert [line["image"] for line in lines] == photos
  for i, line in enumerate(lines):
    assert sorted(line) == ["grid", "image", "pooled"]
    for name in ("pooled", "grid"):
      got = np.asarray(line[name], np.float32)
      assert got.shape == want[name][i].shape and np.array_equal(got, want[name][i]), name
  assert not np.array_equal(want["pooled"][0], want["pooled"][1])  # each image its own features


def test_a_shared_folder_predicts_as_its_run(tiny_virtex_run, virtex, photos, tmp_path):
  from vlrep.interop import export

  folder = str(tmp_path / "shared")
  export.export(str(tiny_virtex_run.workdir), "vlrep", folder)
  lines = predict_lines(f"--model={folder}", "caption", photos[0], watch=(folder,))
  assert lines == [{"image": photos[0], "caption": virtex.caption(photos[:1])[0]}]
  # The same folder with its weights a link to a file outside it: refused (a crafted download).
  outside = tmp_path / "outside.safetensors"
  shutil.move(os.path.join(folder, "model.safetensors"), outside)
  os.symlink(outside, os.path.join(folder, "model.safetensors"))
  refused(f"--model={folder}", "caption", photos[0], message="outside the folder", watch=(tmp_path,))


def test_clip_zero_shot_and_text_embeddings_are_vlrep_loads(tiny_clip_run, photos):
  assert tiny_clip_run.returncode == 0, tiny_clip_run.stderr[-3000:]
  workdir = str(tiny_clip_run.workdir)
  clip = vlrep.load(workdir)
  labels = ["cat", "coffee", "camera"]
  lines = predict_lines(f"--model={workdir}", "zero-shot", "--labels=" + ",".join(labels), "--top_k=3", *photos)
  want = clip.zero_shot(photos, labels, top_k=3)["top"]
  assert [[(t["label"], t["score"]) for t in line["top"]] for line in lines] == want
  assert sorted(t["label"] for t in lines[0]["top"]) == sorted(labels)  # every label, best first
  texts = ["a cat on a sofa.", "a cup of coffee."]
  lines = predict_lines(
    f"--model={workdir}", "embed", "--features=embedding", f"--texts={texts[0]}", f"--texts={texts[1]}", photos[0]
  )
  assert [sorted(line) for line in lines] == [["embedding", "image"], ["embedding", "text"], ["embedding", "text"]]
  assert np.array_equal(
    np.asarray(lines[0]["embedding"], np.float32), clip.encode_images(photos[:1], "embedding")["embedding"][0]
  )
  got = np.asarray([line["embedding"] for line in lines[1:]], np.float32)
  assert [line["text"] for line in lines[1:]] == texts and np.array_equal(got, clip.encode_text(texts))
  assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
  refused(f"--model={workdir}", "caption", photos[0], message="Captioning needs a model with a forward captioning head")


# -- bad input -------------------------------------------------------------------------------------------------------
def refused(*args, message: str, watch=()):
  before = listing(*watch)
  proc = run_module("vlrep.predict", *args, timeout=300)
  assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
  assert proc.stdout == "", proc.stdout[:2000]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]
  assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert listing(*watch) == before


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, photos):
  folder = tmp_path_factory.mktemp("bad")
  (folder / "notes.jpg").write_text("not an image\n")
  whole = open(photos[0], "rb").read()
  (folder / "truncated.jpg").write_bytes(whole[: len(whole) // 3])  # its header reads; its pixels do not
  (folder / "empty_labels.txt").write_text("\n \n")
  crafted = folder / "crafted_shared"
  crafted.mkdir()
  config = {"format": "vlrep", "method": {"name": "virtex"}, "data": {"name": "/etc/passwd"}, "tokenizer": None}
  (crafted / "config.json").write_text(json.dumps(config))
  (crafted / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
  (folder / "not_a_run").mkdir()
  return folder


# (arguments after --model=the tiny VirTex run, the message): no image read, no model opened for most.
BAD = [
  ((), "Say what to do"),
  (("describe", "{photo}"), "Unknown subcommand 'describe'"),
  (("caption",), "Give at least one image file"),
  (("caption", "{bad}/missing.jpg"), "No such image file"),
  (("caption", "{bad}/notes.jpg"), "notes.jpg is not a readable image file"),
  (("caption", "{photo}", "{bad}/truncated.jpg"), "truncated.jpg"),
  (("--checkpoint=999", "caption", "{photo}"), "no checkpoint of step 999"),
  (("caption", "{bad}"), "is a folder"),
  (("caption", "--labels=cat", "{photo}"), "--labels: not a flag of 'caption'"),
  (("caption", "--beam_size=0", "{photo}"), "--beam_size=0: at least 1"),
  (("caption", "--lables=cat", "{photo}"), "Unknown command line flag 'lables'"),
  (("zero-shot", "{photo}"), "zero-shot needs the class names"),
  (("zero-shot", "--labels=", "{photo}"), "is empty"),
  (("zero-shot", "--labels=cat,,dog", "{photo}"), "name 2 is empty"),
  (("zero-shot", "--labels=cat,dog,cat", "{photo}"), "'cat' is given twice"),
  (("zero-shot", "--labels_file={bad}/empty_labels.txt", "{photo}"), "no class names"),
  (("zero-shot", "--labels_file={bad}/none.txt", "{photo}"), "no such file"),
  (("zero-shot", "--labels=cat", "--templates=a photo of a cat.", "{photo}"), "has no '{}'"),
  (("zero-shot", "--labels=cat", "--templates=a {} of {kind}.", "{photo}"), "braces other than"),
  (("embed",), "embed needs image files, --texts, or both"),
  (("embed", "--features=pooled,logits", "{photo}"), "--features='pooled,logits'"),
  (("embed", "--texts=a dog.", "{photo}"), "VirTex's text side is a caption decoder"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_exits_2_saying_what(args, message, tiny_virtex_run, photos, bad_files):
  fill = {"{photo}": photos[0], "{bad}": str(bad_files)}
  for key, value in fill.items():
    args = tuple(a.replace(key, value) for a in args)
  workdir = str(tiny_virtex_run.workdir)
  refused(f"--model={workdir}", *args, message=message, watch=(bad_files, workdir))


@pytest.mark.parametrize(
  "model, message",
  [
    ("", "Give --model=DIR"),
    ("{bad}/not_a_run", "--model={bad}/not_a_run is not a vlrep run directory"),
    ("{bad}/nowhere", "No run directory"),
    ("{bad}/crafted_shared", "a path; a shared folder's config.json holds data only"),
  ],
)
def test_a_model_folder_that_is_no_model_exits_2(model, message, photos, bad_files):
  model, message = (x.replace("{bad}", str(bad_files)) for x in (model, message))
  refused(*([f"--model={model}"] if model else []), "caption", photos[0], message=message, watch=(bad_files,))


def test_labels_and_templates_are_read_as_documented(tmp_path):
  assert predict.read_labels(" cat , dog ,boat", None) == ["cat", "dog", "boat"]
  (tmp_path / "l.txt").write_text("a cat, sitting\n\ndog\n")
  assert predict.read_labels(None, str(tmp_path / "l.txt")) == ["a cat, sitting", "dog"]  # a comma in a file's name
  with pytest.raises(UserError, match="one of them"):
    predict.read_labels("cat", str(tmp_path / "l.txt"))
  assert predict.read_templates(["a {}.|the {}.", "{} here"]) == ("a {}.", "the {}.", "{} here")
  assert predict.read_templates([]) == predict.zero_shot_eval.DEFAULT_TEMPLATES
  assert predict.read_features("pooled, grid") == ("pooled", "grid")
