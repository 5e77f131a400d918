"""`vlrep.load`: a run or shared folder as a model from Python, checked against what vlrep's commands and evaluators
compute and against independent references.

1. Every method's tiny run: the image features are the backbone's (`runs.backbone_fn`) on pixels computed here
   with PIL alone; text towers (CLIP, LocTex, MCT) give unit, text-dependent embeddings whose cosines are
   `similarity` and whose class means are `zero_shot`'s scores; a captioner's `similarity` is its method's
   log p(text | image) and its `zero_shot` the class posterior of those; what a method does not have (a text
   embedding, captions) is a UserError saying why.
2. One code path: a run and its shared folder (`vlrep.interop.export --format=vlrep`) give bit-identical outputs;
   `encode_images` is the features tool's, `caption` the caption command's, `zero_shot` the zero_shot evaluator's
   (`vlrep.evaluate`), image for image, on the tiny synthetic scenes it reads.
3. Imported runs (an official-layout VirTex, a torchvision ResNet-18, a transformers VisualBERT) load and compute
   what the tools and torchvision compute.
4. Bad inputs are one UserError each, raised before the model computes anything; a crafted shared folder is refused
   and a Python file beside it never imported.
"""

import json
import os
import shutil
import types

import jax
import numpy as np
import pytest
from conftest import ROOT, imported_resnet18, run_main, run_module
from PIL import Image, ImageOps
from skimage import data as skdata

import vlrep
from vlrep import inference, runs, visualize
from vlrep.data.ops import IMAGENET_MEAN, IMAGENET_STD
from vlrep.errors import UserError
from vlrep.evaluators import EvalInputs
from vlrep.evaluators import zero_shot as zero_shot_eval
from vlrep.interop import import_run
from vlrep.tools import caption as caption_tool
from vlrep.tools import features

D = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
EVAL_CONFIG = os.path.join(ROOT, "configs", "eval", "zero_shot.py")
TEXTS = ["a red circle and a blue square.", "there is a green star.", "a red circle and a blue square."]


# -- runs and photos -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_siglip_run(tmp_path_factory):
  """tests/tiny_clip.py with SigLIP's sigmoid loss (no shared run of it: shared_run names runs by their file)."""
  workdir = tmp_path_factory.mktemp("siglip") / "run"
  proc = run_main(workdir, config="tests/tiny_clip.py:loss=sigmoid")
  return types.SimpleNamespace(workdir=workdir, returncode=proc.returncode, stderr=proc.stderr)


def _trained(run) -> str:
  assert run.returncode == 0, run.stderr[-3000:]
  return str(run.workdir)


def _save(image: Image.Image, path, **kwargs) -> str:
  image.save(path, **kwargs)
  return str(path)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
  """Real photographs (scikit-image's) as a user's files are: a JPEG, a portrait PNG, a greyscale JPEG, a phone's
  EXIF-rotated JPEG (orientation 6), a 16-bit PNG and a CMYK JPEG. Returns {name: path}."""
  root = tmp_path_factory.mktemp("photos")
  camera = skdata.camera()[100:356, 100:356]
  exif = Image.Exif()
  exif[ImageOps.ExifTags.Base.Orientation] = 6  # stored 451 wide x 300 high, shown 300 x 451
  return {
    "astronaut": _save(Image.fromarray(skdata.astronaut()), root / "astronaut.jpg", quality=90),
    "chelsea_tall": _save(Image.fromarray(skdata.chelsea()[:, :200]), root / "chelsea_tall.png"),
    "camera_grey": _save(Image.fromarray(camera), root / "camera_grey.jpg", quality=90),
    "exif6": _save(Image.fromarray(skdata.chelsea()), root / "portrait_exif6.jpg", quality=95, exif=exif),
    "sixteen_bit": _save(Image.fromarray(camera.astype(np.uint16) * 257), root / "sixteen_bit.png"),
    "cmyk": _save(Image.fromarray(skdata.coffee()[100:300, 150:450]).convert("CMYK"), root / "cmyk.jpg", quality=95),
  }


def _pil_pixels(path: str, size: int) -> np.ndarray:
  """A plain RGB file preprocessed with PIL and numpy alone: torchvision's Resize(size) (shorter side, the longer
  truncated) + CenterCrop(size) (offsets rounded), bicubic, ImageNet mean/std."""
  img = Image.open(path).convert("RGB")
  w, h = img.size
  w, h = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
  img = img.resize((w, h), Image.BICUBIC)
  left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
  rgb = np.asarray(img.crop((left, top, left + size, top + size)), np.float32) / 255.0
  return (rgb - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- 1. every method's tiny run ------------------------------------------------------------------------------------
def _check_image_features(model, photos) -> dict:
  """encode_images: shapes, the backbone's values on pixels computed here, every input form the same, images
  apart. Returns the features."""
  paths = list(photos.values())
  size = model.preprocessing["size"]
  pixels = model.pixels(paths)
  assert pixels.shape == (len(paths), size, size, 3) and pixels.dtype == np.float32
  # The plain RGB files' pixels as PIL computes them (torchvision's sizes).
  for i, name in enumerate(photos):
    if name in ("astronaut", "chelsea_tall"):
      np.testing.assert_allclose(pixels[i], _pil_pixels(photos[name], size), atol=1e-6)
  # A viewer's reading: the EXIF-rotated photo upright (portrait), the 16-bit one by its range, CMYK as PIL
  # converts it; each the same pixels as the uint8 array a viewer shows.
  names = list(photos)
  upright = np.asarray(ImageOps.exif_transpose(Image.open(photos["exif6"])).convert("RGB"))
  assert upright.shape[0] > upright.shape[1]
  np.testing.assert_array_equal(pixels[names.index("exif6")], model.pixels(upright)[0])
  np.testing.assert_array_equal(pixels[names.index("sixteen_bit")], model.pixels(skdata.camera()[100:356, 100:356])[0])
  cmyk_rgb = np.asarray(Image.open(photos["cmyk"]).convert("RGB"))
  np.testing.assert_array_equal(pixels[names.index("cmyk")], model.pixels(cmyk_rgb)[0])

  got = model.encode_images(paths)
  assert sorted(got) == ["grid", "pooled"]
  n, c = got["pooled"].shape
  assert n == len(paths) and got["grid"].shape[0] == n and got["grid"].shape[-1] == c and got["grid"].ndim == 4
  assert got["pooled"].dtype == got["grid"].dtype == np.float32
  # The backbone of the run, as every transfer evaluation calls it, on the same pixels.
  backbone = runs.backbone_fn(model.run)
  pooled, _ = backbone({"image": pixels}, "pre_logits")
  grid, _ = backbone({"image": pixels}, "grid")
  assert _rel(got["pooled"], pooled) < 1e-5 and _rel(got["grid"], grid) < 1e-5
  assert np.isfinite(got["grid"]).all()
  assert all(not np.allclose(got["pooled"][i], got["pooled"][j]) for i in range(n) for j in range(i))
  # A path, a PIL image and a uint8 array of the same pixels; one [N, H, W, 3] batch is N images.
  rgb = np.asarray(Image.open(photos["astronaut"]).convert("RGB"))
  forms = model.encode_images([photos["astronaut"], Image.open(photos["astronaut"]), rgb], features="pooled")
  assert list(forms) == ["pooled"]
  np.testing.assert_array_equal(forms["pooled"][0], forms["pooled"][1])
  np.testing.assert_array_equal(forms["pooled"][0], forms["pooled"][2])
  batch = model.encode_images(np.stack([rgb, rgb[:, ::-1]]), features=("pooled",))["pooled"]
  assert batch.shape == (2, c)
  np.testing.assert_allclose(batch[0], forms["pooled"][0], rtol=1e-5, atol=1e-6)
  return got


def _check_captioner_text(model, photos):
  """A captioner's similarity is its method's log p(text | image); zero_shot the class posterior of the template
  mean of those; caption one string per image."""
  images = [photos["astronaut"], photos["chelsea_tall"]]
  sim = model.similarity(images, TEXTS)
  assert sim.shape == (2, 3) and np.isfinite(sim).all() and (sim < 0).all()
  np.testing.assert_array_equal(sim[:, 0], sim[:, 2])  # the same text, the same score
  pixels, tokens = model.pixels(images), model.tokens(TEXTS)
  for i in range(2):
    ll = model.method.caption_log_likelihood(model.variables, np.repeat(pixels[i : i + 1], 3, 0), tokens)
    np.testing.assert_allclose(sim[i], np.asarray(ll), rtol=1e-4, atol=1e-4)
  labels, templates = ["circle", "square", "star"], ("there is a {}.", "a picture of a {}.")
  zs = model.zero_shot(images, labels, templates=templates, top_k=2)
  assert zs["labels"] == labels and zs["scores"].shape == (2, 3)
  np.testing.assert_allclose(np.exp(zs["scores"]).sum(1), 1.0, rtol=1e-5)  # a posterior over the classes
  prompt_sim = model.similarity(images, zero_shot_eval.prompts(labels, templates)).reshape(2, 3, 2).mean(-1)
  posterior = prompt_sim - np.log(np.exp(prompt_sim).sum(1, keepdims=True))
  np.testing.assert_allclose(zs["scores"], posterior, rtol=1e-4, atol=1e-4)
  for i, top in enumerate(zs["top"]):
    assert len(top) == 2 and top[0][0] == labels[int(np.argmax(zs["scores"][i]))] and top[0][1] >= top[1][1]
  with pytest.raises(UserError, match="caption decoder.*no text embedding.*CLIP, SigLIP, LocTex and MCT"):
    model.encode_text(TEXTS)


def test_virtex(tiny_virtex_run, photos):
  model = vlrep.load(_trained(tiny_virtex_run))
  assert model.method_name == "virtex" and "virtex" in repr(model)
  _check_image_features(model, photos)
  _check_captioner_text(model, photos)
  captions = model.caption([photos["astronaut"], photos["cmyk"]], max_len=6)
  assert len(captions) == 2 and all(isinstance(c, str) for c in captions)
  greedy = model.caption([photos["astronaut"]], decoding="greedy", max_len=6)
  assert isinstance(greedy[0], str)


def test_each_batch_shape_compiles_once(tiny_virtex_run, photos):
  """Batches are padded to a power of two: 3 then 4 images share a compile, 5 make one more; a second zero_shot
  with the same labels compiles nothing (its scorer and class prompts are kept)."""
  model = vlrep.load(_trained(tiny_virtex_run))
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
  )
  image = photos["astronaut"]
  counts = []
  for n in (3, 4, 5):
    model.encode_images([image] * n, features=("pooled",))
    counts.append(len(compiles))
  assert counts[0] > 0 and counts[1] == counts[0] and counts[2] > counts[1], counts
  model.zero_shot([image], ["circle", "square"])
  before = len(compiles)
  model.zero_shot([photos["chelsea_tall"]], ["circle", "square"])
  assert len(compiles) == before


def test_images_are_read_a_batch_at_a_time(tiny_virtex_run, photos, monkeypatch):
  """However many images, one batch of them is read before it is computed: reads and batches interleave."""
  model = vlrep.load(_trained(tiny_virtex_run), batch_size=2)
  log = []
  read, bucket = inference.read_item, inference._bucket
  monkeypatch.setattr(inference, "read_item", lambda item: log.append("read") or read(item))
  monkeypatch.setattr(inference, "_bucket", lambda n, b: log.append("batch") or bucket(n, b))
  out = model.encode_images([photos["astronaut"]] * 5, features=("pooled", "grid"))
  assert log == ["read", "read", "batch"] * 2 + ["read", "batch"]
  assert out["pooled"].shape[0] == 5
  np.testing.assert_allclose(out["pooled"][4], out["pooled"][0], rtol=1e-5, atol=1e-6)  # a batch of 1 vs of 2


def _check_tower(model, photos):
  emb = model.encode_text(TEXTS)
  assert emb.ndim == 2 and emb.shape[0] == 3 and emb.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(emb[0], emb[2])
  assert not np.allclose(emb[0], emb[1], atol=1e-3)
  images = [photos["astronaut"], photos["camera_grey"]]
  img = model.encode_images(images, features=("embedding", "pooled"))
  assert img["embedding"].shape == (2, emb.shape[1])
  np.testing.assert_allclose(np.linalg.norm(img["embedding"], axis=1), 1.0, rtol=1e-5)
  # similarity: the cosines of the two embeddings.
  np.testing.assert_allclose(model.similarity(images, TEXTS), img["embedding"] @ emb.T, atol=1e-5)
  # zero_shot: the cosine to each class's mean prompt embedding.
  labels, templates = ["circle", "square", "star", "heart"], ("there is a {}.", "a picture of a {}.")
  zs = model.zero_shot(images, labels, templates=templates, top_k=3)
  prompts = model.encode_text(zero_shot_eval.prompts(labels, templates)).reshape(4, 2, -1).mean(1)
  prompts /= np.linalg.norm(prompts, axis=1, keepdims=True)
  np.testing.assert_allclose(zs["scores"], img["embedding"] @ prompts.T, atol=1e-5)
  assert [t[0] for t in zs["top"][0]] == [labels[c] for c in np.argsort(-zs["scores"][0])[:3]]
  with pytest.raises(UserError, match=model.source):  # a tower has no caption decoder
    model.caption(images)


@pytest.mark.parametrize("name", ["clip", "siglip", "loctex", "mct"])
def test_text_towers(name, request, photos):
  model = vlrep.load(_trained(request.getfixturevalue(f"tiny_{name}_run")))
  assert model.method_name == {"siglip": "clip"}.get(name, name)
  _check_image_features(model, photos)
  _check_tower(model, photos)


@pytest.mark.parametrize(
  "name, why",
  [
    ("icmlm", "ICMLM's text side predicts masked caption tokens"),
    ("vlbert", "encode text and image jointly"),
    ("finetune", "a classifier has no text side"),
  ],
)
def test_methods_without_a_text_embedding(name, why, request, photos):
  model = vlrep.load(_trained(request.getfixturevalue(f"tiny_{name}_run")))
  if name == "vlbert":  # its ResNet embeds box crops (regions_embed): no backbone of whole images
    with pytest.raises(UserError, match=r"no visual backbone \(its parameters: \['bert', 'mlm_head', 'regions_em"):
      model.encode_images([photos["astronaut"]])
  else:
    _check_image_features(model, photos)
  with pytest.raises(UserError, match=f"{why}.*Text embeddings come from the text towers of CLIP"):
    model.encode_text(TEXTS)
  with pytest.raises(UserError):
    model.encode_images([photos["astronaut"]], features=("embedding",))
  with pytest.raises(UserError, match=model.source):
    model.caption([photos["astronaut"]])
  with pytest.raises(UserError, match="text side"):
    model.zero_shot([photos["astronaut"]], ["cat", "dog"])


# -- 2. one code path ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_folder(tmp_path_factory):
  """shared_folder(run) -> the run exported as `python -m vlrep.interop.export --format=vlrep` writes it (once)."""
  made = {}

  def export(workdir: str) -> str:
    if workdir not in made:
      out = tmp_path_factory.mktemp("shared") / "folder"
      proc = run_module("vlrep.interop.export", f"--workdir={workdir}", "--format=vlrep", f"--out={out}")
      assert proc.returncode == 0, proc.stderr[-3000:]
      made[workdir] = str(out)
    return made[workdir]

  return export


def _evaluator_images(tmp_path, **overrides):
  """The zero_shot evaluator's runlocal entry (single-label form: the biggest shape's class, top-1) on the tiny
  synthetic scenes, its first 16 images; those images written here as PNG files, in the evaluator's order, with
  their labels. Returns (entry, paths, labels)."""
  from vlrep.config_utils import config_module
  from vlrep.data import records

  module = config_module(os.path.join(ROOT, "configs", "eval", "x"), "zero_shot.py")
  cfg = module.get_config("runlocal,labels=single,limit=16").evals.zero_shot
  cfg.update(data_dir=D, config_name="tiny", batch_size=16, **overrides)
  inputs = EvalInputs()
  builder = inputs.builder(cfg)
  split = records.first_examples(builder, cfg.split, cfg.limit)
  # The evaluator's pp is "decode|normalize|largest_object_label": without normalize, the uint8 images it reads.
  pp = cfg.pp.replace("|normalize", "")
  assert pp != cfg.pp
  paths, labels = [], []
  for batch in inputs.batches(builder, split, pp, ("image", cfg.label_key), 16):
    for image, label, real in zip(batch["image"], batch[cfg.label_key], batch["_mask"], strict=True):
      if real:
        paths.append(_save(Image.fromarray(image), tmp_path / f"scene_{len(paths):02d}.png"))
        labels.append(int(label))
  assert len(paths) == 16 and len(set(labels)) > 2
  return cfg, paths, np.array(labels)


def _check_zero_shot_is_the_evaluators(model, workdir, tmp_path):
  """model.zero_shot on the evaluator's images (as PNG files) == the zero_shot evaluator, image for image, and its
  top-1 == `vlrep.evaluate`'s."""
  from vlrep import run_setup
  from vlrep.evaluators import Model, build

  cfg, paths, labels = _evaluator_images(tmp_path)
  # The same pixels on both sides: the evaluator's pp takes the 32 px scenes as they are (decode|normalize); the
  # model's resize_crop to 32 px is the identity on a 32 x 32 image (PIL returns a copy for its own size, the crop
  # is the whole image), and its normalisation is the pp's normalize (the same float32 operations).
  model.preprocessing = inference.preprocessing(model.run.config, "resize_crop", 32)
  scenes = np.stack([np.asarray(Image.open(p)) for p in paths])
  assert scenes.shape == (16, 32, 32, 3)
  np.testing.assert_array_equal(model.pixels(paths), visualize.normalize(scenes))

  # The evaluator as vlrep.evaluate builds it, its scorer's per-image scores recorded.
  run = runs.load_run(workdir)
  evaluator = build(cfg, run_setup.build_inputs(run.config, run.workdir))
  seen = []
  scores_fn = evaluator.scorer.scores
  evaluator.scorer.scores = lambda v, images, classes: seen.append(scores_fn(v, images, classes)) or seen[-1]
  metrics = evaluator.evaluate(Model(variables=run.variables, features=None))
  evaluator_scores = np.concatenate(seen)[:16]

  got = model.zero_shot(paths, evaluator.class_names, templates=cfg.templates, top_k=1)
  assert got["labels"] == evaluator.class_names and len(got["labels"]) == 10
  np.testing.assert_allclose(got["scores"], evaluator_scores, rtol=1e-5, atol=1e-5)
  assert np.array_equal(np.argmax(got["scores"], 1), np.argmax(evaluator_scores, 1))
  assert [t[0][0] for t in got["top"]] == [evaluator.class_names[c] for c in np.argmax(evaluator_scores, 1)]
  top1 = zero_shot_eval.zero_shot_metrics(got["scores"], labels)["top1"]
  assert top1 == metrics["top1"]

  # The command, on a copy of the run (it writes summary.json into the run folder).
  copy = tmp_path / "run_copy"
  shutil.copytree(workdir, copy)
  z = "--config.evals.zero_shot"
  proc = run_module(
    "vlrep.evaluate",
    f"--config={EVAL_CONFIG}:runlocal,labels=single,limit=16",
    f"--workdir={copy}",
    f"{z}.data_dir={D}",
    f"{z}.config_name=tiny",
    f"{z}.batch_size=16",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((copy / "summary.json").read_text())
  assert summary["zero_shot/top1"] == pytest.approx(top1, abs=1e-9)
  return got


@pytest.mark.parametrize("name", ["virtex", "clip"])
def test_one_code_path(name, request, photos, shared_folder, tmp_path):
  """The run and its shared folder: bit-identical outputs; encode_images is the features tool's, caption the caption
  command's, zero_shot the zero_shot evaluator's."""
  workdir = _trained(request.getfixturevalue(f"tiny_{name}_run"))
  run_model, folder_model = vlrep.load(workdir), vlrep.load(shared_folder(workdir))
  assert folder_model.method_name == run_model.method_name == name
  paths = [photos[k] for k in ("astronaut", "exif6", "sixteen_bit", "cmyk")]
  images = run_model.encode_images(paths)
  for key, value in folder_model.encode_images(paths).items():
    np.testing.assert_array_equal(value, images[key])
  tool = features.extract(workdir, paths)
  for key in ("pooled", "grid"):
    np.testing.assert_array_equal(tool[key], images[key])
  assert tool["preprocessing"] == run_model.preprocessing
  labels = ["circle", "square", "star"]
  zs = run_model.zero_shot(paths, labels)
  np.testing.assert_array_equal(folder_model.zero_shot(paths, labels)["scores"], zs["scores"])
  if name == "virtex":
    # Beam search, the defaults but 6 tokens: the tiny run's candidates are near ties after a dozen tokens.
    captions = run_model.caption(paths, max_len=6)
    assert folder_model.caption(paths, max_len=6) == captions
    out = tmp_path / "captions.json"
    proc = run_module("vlrep.tools.caption", f"--workdir={workdir}", *paths, "--max_len=6", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == dict(zip(paths, captions, strict=True))
  else:
    np.testing.assert_array_equal(folder_model.encode_text(TEXTS), run_model.encode_text(TEXTS))
  _check_zero_shot_is_the_evaluators(run_model, workdir, tmp_path)


# -- 3. imported runs ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def imported_virtex(tmp_path_factory):
  """A VirTex bicaptioning checkpoint in the official layout (test_import_run's torch.nn reference, ResNet-50 of
  width 4) with an official-layout vocabulary, imported as documented (no --config). As test_import_run's zoo,
  equal-norm word rows and a stronger visual projection make its captions depend on the image."""
  torch = pytest.importorskip("torch")
  from test_import_run import OfficialVirTex, _official_vocab, _randomize

  root = tmp_path_factory.mktemp("virtex_zoo")
  sp = _official_vocab(root / "coco_tiny.model")
  torch.manual_seed(0)
  ref = _randomize(OfficialVirTex(width=4, vocab=sp.get_piece_size(), hidden=64, layers=1, heads=1, ff=128))
  with torch.no_grad():
    words = ref.textual.embedding.words.weight
    words.copy_(6 * words / words.norm(dim=1, keepdim=True))
    ref.textual.visual_projection.weight.mul_(8)
    ref.textual.output.bias[[0, 1, 3]] = -30.0
  torch.save({"model": ref.state_dict(), "iteration": 1}, root / "bicaptioning.pth")
  vocab = str(root / "coco_tiny.model")
  import_run.import_run("virtex", str(root / "bicaptioning.pth"), str(root / "run"), vocab=vocab)
  return str(root / "run")


def test_imported_virtex(imported_virtex, photos):
  model = vlrep.load(imported_virtex)
  paths = [photos["astronaut"], photos["exif6"]]
  got = model.encode_images(paths)
  tool = features.extract(imported_virtex, paths)
  for key in ("pooled", "grid"):
    np.testing.assert_array_equal(got[key], tool[key])
  assert got["pooled"].shape == (2, 2048 // 16) and not np.allclose(got["pooled"][0], got["pooled"][1])
  captions = model.caption([*paths, photos["cmyk"]], max_len=8)
  assert all(isinstance(c, str) and c for c in captions) and len(set(captions)) > 1  # words that depend on the image
  # The official evaluation's decoding and preprocessing, as the caption tool runs them.
  official = inference.preprocessing(model.run.config, "virtex_official")
  assert official["size"] == 224 and official["resize_shorter_side"] == 256
  decoded = model.caption(paths, decoding="virtex_official", max_len=8, preprocessing=official)
  tool = caption_tool.caption_files(
    imported_virtex, paths, decoding_method="virtex_official", preprocess="virtex_official", max_len=8, beam_size=5
  )
  assert decoded == [tool[p]["caption"] for p in paths]
  assert all(isinstance(c, str) for c in decoded) and any(decoded)  # the official search may end at once: ''
  zs = model.zero_shot(paths, ["cat", "person"], max_len=16)  # the reference head's 16 positions
  np.testing.assert_allclose(np.exp(zs["scores"]).sum(1), 1.0, rtol=1e-5)
  with pytest.raises(UserError, match="caption decoder"):
    model.encode_text(["a cat."])


def test_imported_virtex_zero_shot_with_default_prompt_length(imported_virtex, photos):
  """zero_shot's default 24 tokens exceed this head's 16 positions: the prompts are cut to them (what max_len=16
  gives), not a transformer's ValueError."""
  model = vlrep.load(imported_virtex)
  zs = model.zero_shot([photos["astronaut"]], ["cat", "person"])
  assert zs["scores"].shape == (1, 2)
  np.testing.assert_array_equal(
    zs["scores"], model.zero_shot([photos["astronaut"]], ["cat", "person"], max_len=16)["scores"]
  )


def test_imported_torchvision_resnet18(photos, tmp_path):
  torch = pytest.importorskip("torch")
  pytest.importorskip("torchvision")
  from torchvision import transforms

  net, run = imported_resnet18(str(tmp_path))
  model = vlrep.load(run)
  paths = [photos["astronaut"], photos["chelsea_tall"]]
  got = model.encode_images(paths)
  assert got["pooled"].shape == (2, 512) and got["grid"].shape == (2, 7, 7, 512)
  tool = features.extract(run, paths)
  for key in ("pooled", "grid"):
    np.testing.assert_array_equal(got[key], tool[key])
  # torchvision's own preprocessing and model.
  prep = transforms.Compose(
    [
      transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
      transforms.CenterCrop(224),
      transforms.ToTensor(),
      transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]
  )
  with torch.no_grad():
    net.fc = torch.nn.Identity()
    want = net.eval()(torch.stack([prep(Image.open(p).convert("RGB")) for p in paths])).numpy()
  assert _rel(got["pooled"], want) < 1e-5
  with pytest.raises(UserError, match="Text embeddings come from the text towers"):
    model.encode_text(["a cat."])
  with pytest.raises(UserError):
    model.caption(paths)


@pytest.fixture(scope="module")
def imported_visual_bert(tmp_path_factory):
  """A tiny random transformers VisualBertForPreTraining, saved as save_pretrained writes it, imported as
  documented (`--format=visual_bert`, no options)."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  import transformers
  from test_import_visual_bert import _randomise, _tiny_config, _write_vocab

  root = tmp_path_factory.mktemp("visual_bert")
  torch.manual_seed(0)
  hf = _randomise(transformers.VisualBertForPreTraining(_tiny_config()))
  hf.save_pretrained(root / "hf")
  _write_vocab(str(root / "hf"))
  import_run.import_run("visual_bert", str(root / "hf"), str(root / "run"))
  return str(root / "run")


def test_imported_visual_bert(imported_visual_bert, photos):
  model = vlrep.load(imported_visual_bert)
  assert model.method_name == "vlbert" and model.step == 0
  # It reads region features, not pixels: no backbone to give image features.
  with pytest.raises(UserError, match="no visual backbone"):
    model.encode_images([photos["astronaut"]])


def test_imported_visual_bert_has_no_text_embedding_and_says_why(imported_visual_bert, photos):
  """No training data here (an imported run's recipe data is not prepared): the reason, not a missing dataset."""
  model = vlrep.load(imported_visual_bert)
  with pytest.raises(UserError, match="VisualBERT/ViLBERT encode text and image jointly.*text towers of CLIP"):
    model.encode_text(["a cat."])
  for call in (
    lambda: model.zero_shot([photos["astronaut"]], ["cat"]),
    lambda: model.similarity([photos["astronaut"]], ["a cat."]),
  ):
    with pytest.raises(UserError, match="needs a method with a text side .*this run's is vlbert"):
      call()
  with pytest.raises(UserError, match="Captioning needs a model with a forward captioning head .*method is vlbert"):
    model.caption([photos["astronaut"]])


# -- 4. bad inputs -------------------------------------------------------------------------------------------------
def _nothing_computed(model):
  """Neither the backbone nor the method was built: the error came before any compute."""
  assert "_backbone" not in model.__dict__ and "inputs" not in model.__dict__


def test_bad_inputs_are_refused_before_compute(tiny_virtex_run, photos, tmp_path):
  workdir = _trained(tiny_virtex_run)
  model = vlrep.load(workdir)
  text = tmp_path / "notes.jpg"
  text.write_text("not an image at all")
  good = photos["astronaut"]
  cases = [
    (np.zeros((32, 32, 3), np.float32), r"images\[0\]: an array must be uint8 RGB \[H, W, 3\].*float32 \[32, 32, 3\]"),
    (np.zeros((32, 32, 4), np.uint8), r"must be uint8 RGB \[H, W, 3\] or grey \[H, W\]; got uint8 \[32, 32, 4\]"),
    ([good, np.zeros((8, 8, 4), np.uint8)], r"images\[1\]: an array must be uint8"),
    ([], "Give at least one image"),
    ([good, str(tmp_path / "missing.jpg")], r"No such image file\(s\): \[.*missing\.jpg'\]"),
    ([good, str(text)], f"{text} is not a readable image file"),
    (np.zeros((0, 5, 3), np.uint8), "an empty array"),
    ([good, 3], "images\\[1\\]: a path, a PIL image or a uint8 array; got a int"),
  ]
  for images, message in cases:
    with pytest.raises(UserError, match=message):
      model.encode_images(images)
  _nothing_computed(model)
  with pytest.raises(UserError, match="No such image file"):
    model.caption([str(tmp_path / "missing.jpg")])
  with pytest.raises(UserError, match="must be uint8"):
    model.zero_shot(np.zeros((2, 8, 8, 3), np.float64), ["cat", "dog"])
  with pytest.raises(UserError, match="is not a readable image file"):
    model.similarity([str(text)], ["a cat."])
  with pytest.raises(UserError, match="labels: give at least one class name"):
    model.zero_shot([good], [])
  with pytest.raises(UserError, match="choose from pooled, grid, embedding"):
    model.encode_images([good], features=("logits",))
  _nothing_computed(model)
  model.similarity([good], ["a cat."])
  model.encode_images([good], features="pooled")
  assert "_backbone" in model.__dict__ and "inputs" in model.__dict__  # what _nothing_computed looks for, once built
  with pytest.raises(UserError, match="batch_size=0: at least 1"):
    vlrep.load(workdir, batch_size=0)
  # Folders that are not runs.
  (tmp_path / "empty").mkdir()
  (tmp_path / "photos_only").mkdir()
  shutil.copy(good, tmp_path / "photos_only")
  for folder in (tmp_path / "empty", tmp_path / "photos_only", tmp_path / "nowhere", text):
    with pytest.raises(UserError, match="is not a vlrep run directory"):
      vlrep.load(folder)
  assert os.listdir(tmp_path / "empty") == []


def test_a_crafted_shared_folder_is_refused_and_its_code_never_run(
  tiny_virtex_run, shared_folder, photos, tmp_path, monkeypatch
):
  """A shared folder is data: a config naming a module path is refused, and a Python file beside a good config is
  never imported, even with the folder as the working directory and on sys.path, through every call."""
  exported = shared_folder(_trained(tiny_virtex_run))
  marker = tmp_path / "payload_ran"
  for name in ("crafted", "beside"):
    shutil.copytree(exported, tmp_path / name)
    for payload in ("payload.py", "__init__.py", "config.py", "virtex.py"):
      (tmp_path / name / payload).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
  config = json.loads((tmp_path / "crafted" / "config.json").read_text())
  config["method"]["name"] = "payload.evil"
  (tmp_path / "crafted" / "config.json").write_text(json.dumps(config))
  monkeypatch.syspath_prepend(str(tmp_path / "crafted"))
  monkeypatch.chdir(tmp_path / "crafted")
  with pytest.raises(UserError, match="not the plain name"):
    vlrep.load(tmp_path / "crafted")
  assert not marker.exists()
  monkeypatch.syspath_prepend(str(tmp_path / "beside"))
  monkeypatch.chdir(tmp_path / "beside")
  model = vlrep.load(tmp_path / "beside")
  model.encode_images([photos["astronaut"]])
  model.caption([photos["astronaut"]], max_len=4)
  model.zero_shot([photos["astronaut"]], ["cat", "dog"])
  assert not marker.exists()
