"""vlrep.tools.features: a run's backbone features of image files, as a command and as one Python call.

Checked against the real things: an imported torchvision.models ResNet-18 (random weights and BatchNorm statistics,
saved by torch.save as torchvision's state dict) against torchvision's own model fed by torchvision's own
preprocessing (transforms.Resize + CenterCrop + ToTensor + Normalize, bicubic), and a vlrep-trained run (the
session's tiny VirTex run) against its backbone called directly; the command's files against the Python call; and
each bad input (missing or unreadable image, a directory that is not a run, a .npy for two arrays, an existing
output) exits 2 naming what was wrong, writing nothing.
"""

import json
import os

import numpy as np
import pytest
from conftest import imported_resnet18, run_module
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import load_file

from vlrep import inference, runs, visualize
from vlrep.data.ops import IMAGENET_MEAN, IMAGENET_STD
from vlrep.errors import UserError
from vlrep.interop import import_run
from vlrep.tools import features

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from torchvision import transforms  # noqa: E402
from torchvision.models.feature_extraction import create_feature_extractor  # noqa: E402


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
  """Three image files: landscape and portrait RGB (JPEG, PNG) and a greyscale PNG."""
  root = tmp_path_factory.mktemp("photos")
  rng = np.random.default_rng(0)
  paths = [str(root / "wide.jpg"), str(root / "tall.png"), str(root / "grey.png")]
  Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(paths[0])
  Image.fromarray(rng.integers(0, 255, (360, 240, 3), dtype=np.uint8)).save(paths[1])
  Image.fromarray(rng.integers(0, 255, (250, 250), dtype=np.uint8)).save(paths[2])
  return paths


@pytest.fixture(scope="module")
def resnet18(tmp_path_factory):
  """(torchvision's ResNet-18 with random weights and statistics, its run imported as documented)."""
  return imported_resnet18(str(tmp_path_factory.mktemp("in1k_r18")))


def _torchvision_features(model, paths, resize, size):
  """torchvision's preprocessing and model: (pooled [N, 512], grid [N, h, w, 512] NHWC)."""
  prep = transforms.Compose(
    [
      transforms.Resize(resize, interpolation=transforms.InterpolationMode.BICUBIC),
      transforms.CenterCrop(size),
      transforms.ToTensor(),
      transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]
  )
  images = torch.stack([prep(Image.open(p).convert("RGB")) for p in paths])
  with torch.no_grad():
    out = create_feature_extractor(model, {"flatten": "pooled", "layer4": "grid"})(images)
  return out["pooled"].numpy(), out["grid"].numpy().transpose(0, 2, 3, 1)


def test_imported_torchvision_features_are_torchvisions(resnet18, photos):
  model, workdir = resnet18
  got = features.extract(workdir, photos)  # the default preprocessing: the run's config's crop size (224)
  assert got["preprocessing"] == {
    "transform": "resize_crop",
    "size": 224,
    "size_from": "the run's training image size",
    "resize_shorter_side": 224,
    "resampling": "bicubic",
    "mean": list(IMAGENET_MEAN),
    "std": list(IMAGENET_STD),
    "normalization": "ImageNet mean/std",
  }
  assert got["paths"] == photos and got["step"] == 0
  pooled_t, grid_t = _torchvision_features(model, photos, 224, 224)
  assert got["pooled"].shape == (3, 512) and got["grid"].shape == (3, 7, 7, 512)
  assert got["pooled"].dtype == got["grid"].dtype == np.float32
  figures = {"pooled": _rel(got["pooled"], pooled_t), "grid": _rel(got["grid"], grid_t)}
  # The ImageNet evaluation transform (shorter side 256, centre crop 224), the pooled features alone.
  official = features.extract(workdir, photos, features=("pooled",), resize=256, size=224)
  assert set(official) - {"paths", "preprocessing", "run", "step"} == {"pooled"}
  figures["pooled, resize 256 crop 224"] = _rel(official["pooled"], _torchvision_features(model, photos, 256, 224)[0])
  print(
    "vlrep.tools.features vs torchvision (preprocessing and model): "
    + ", ".join(f"{k} {v:.2e}" for k, v in figures.items())
  )
  # float32 rounding (the same pixels: PIL's bicubic on both sides; then 20 convolutions summed in other orders).
  assert all(v < 1e-5 for v in figures.values()), figures
  # The comparison can fail: other pixels (the 256 crop) are far off.
  assert _rel(official["pooled"], pooled_t) > 1e-2


def test_features_of_a_trained_run_are_its_backbones(tiny_virtex_run, photos, tmp_path):
  """The Python call and the command on a vlrep-trained run: the backbone called directly on the same pixels; the
  command's .safetensors and .npy hold the call's values, the paths in order and the preprocessing."""
  workdir = str(tiny_virtex_run.workdir)
  got = features.extract(workdir, photos, batch_size=2)  # two batches, the second padded
  prep = got["preprocessing"]
  # tests/tiny_virtex.py's preprocessing names no crop: its images are synthetic_scenes' tiny config's, 32 px.
  assert prep["size"] == 32 and prep["transform"] == "resize_crop"
  run = runs.load_run(workdir)
  module, variables = runs.backbone_of(run)
  pixels = visualize.normalize(np.stack([inference.load_image(p, prep) for p in photos]))
  grid, aux = module.apply(variables, pixels, False)
  # Compiled (jit, in batches of 2) against op by op: float32 rounding.
  assert _rel(got["grid"], np.asarray(grid)) < 1e-5 and _rel(got["pooled"], np.asarray(aux["pre_logits"])) < 1e-5
  assert got["grid"].shape[0] == 3 and not np.allclose(got["pooled"][0], got["pooled"][1])

  out = tmp_path / "features.safetensors"
  # The same batches as the call above (a batch of another shape may round the last bit differently).
  proc = run_module("vlrep.tools.features", f"--workdir={workdir}", *photos, f"--out={out}", "--batch_size=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Preprocessing: shorter side resized to 32, centre crop 32x32 (bicubic" in proc.stdout
  saved = load_file(str(out))
  assert sorted(saved) == ["grid", "pooled"]
  np.testing.assert_allclose(saved["pooled"], got["pooled"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(saved["grid"], got["grid"], rtol=1e-6, atol=1e-7)
  with safe_open(str(out), "numpy") as f:
    meta = f.metadata()
  assert json.loads(meta["paths"]) == photos and json.loads(meta["preprocessing"]) == prep
  assert meta["step"] == str(run.step) and meta["run"] == run.path

  npy = tmp_path / "pooled.npy"
  proc = run_module("vlrep.tools.features", f"--workdir={workdir}", photos[1], f"--out={npy}", "--transform=squash")
  assert proc.returncode == 0, proc.stderr[-3000:]
  sidecar = json.loads((tmp_path / "pooled.npy.json").read_text())
  assert sidecar["array"] == "pooled" and sidecar["paths"] == [photos[1]]
  assert sidecar["preprocessing"]["transform"] == "squash" and sidecar["shape"] == [1, got["pooled"].shape[1]]
  squashed = features.extract(workdir, [photos[1]], features=("pooled",), transform="squash")
  np.testing.assert_allclose(np.load(npy), squashed["pooled"], rtol=1e-6, atol=1e-7)
  assert not os.path.exists(str(npy) + ".writing.npy")


def _refused(*args):
  proc = run_module("vlrep.tools.features", *args)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr
  return proc.stderr


def test_bad_inputs_exit_2_naming_what_was_wrong(tiny_virtex_run, photos, tmp_path):
  workdir = f"--workdir={tiny_virtex_run.workdir}"
  out = tmp_path / "f.safetensors"
  assert "No such image file(s): ['nope.jpg']" in _refused(workdir, photos[0], "nope.jpg", f"--out={out}")
  text = tmp_path / "notes.jpg"
  text.write_text("not an image")
  assert f"{text} is not a readable image file" in _refused(workdir, str(text), f"--out={out}")
  truncated = tmp_path / "truncated.png"
  truncated.write_bytes(open(photos[1], "rb").read()[:2000])
  assert f"{truncated} is not a readable image file" in _refused(workdir, str(truncated), f"--out={out}")
  (tmp_path / "empty").mkdir()
  message = _refused(f"--workdir={tmp_path / 'empty'}", photos[0], f"--out={out}")
  assert "is not a vlrep run directory" in message and "has no checkpoint" in message
  assert "a .npy file holds one array" in _refused(
    workdir, photos[0], f"--out={tmp_path / 'f.npy'}", "--features=pooled,grid"
  )
  assert "the extension chooses the format" in _refused(workdir, photos[0], f"--out={tmp_path / 'f.h5'}")
  assert not os.listdir(tmp_path / "empty") and not out.exists() and not (tmp_path / "f.npy").exists()
  # A run without a visual backbone (e.g. an imported VisualBERT, which reads region features).
  from ml_collections import ConfigDict

  from vlrep.interop.keymaps import ImportedRun

  text_only = ImportedRun(
    ConfigDict({"method": {"name": "vlbert"}}), {"bert": {"w": np.ones((2, 2), np.float32)}}, {}, {}
  )
  import_run.write_run(str(tmp_path / "vb"), text_only, False)
  message = _refused(f"--workdir={tmp_path / 'vb'}", photos[0], f"--out={out}")
  assert "has no visual backbone (its parameters: ['bert'])" in message
  # An existing output is not replaced without --overwrite.
  out.write_text("mine")
  assert "exists; pass --overwrite" in _refused(workdir, photos[0], f"--out={out}")
  assert out.read_text() == "mine"
  # The Python call raises the same errors (UserError, a ValueError).
  with pytest.raises(UserError, match="--resize=200 is smaller than the --size=224 crop"):
    features.extract(str(tiny_virtex_run.workdir), photos, size=224, resize=200)
  with pytest.raises(UserError, match="choose from pooled, grid"):
    features.extract(str(tiny_virtex_run.workdir), photos, features=("logits",))
