"""README's and docs/interop.md's import commands, then every documented follow-up command, on imported runs and
with no training dataset prepared (TFDS_DATA_DIR is an empty folder: the imported runs' recipe data, COCO, is not
there). Each command is the documented one (checked to be in the docs) with its paths moved under a temp folder;
an evaluation or a fine-tuning run reads the tiny embedded dataset (its runlocal form and the tiny overrides),
since those commands need data of their own.

The checkpoints are written here in their real formats: a ResNet-50 (width 8) in torchvision's layout as torch.save
writes it, and a VirTex bicaptioning model in the official layout (test_import_run's torch.nn reference; H = 64 with
one head, so the import needs no --heads, as the documented command) with an official-layout vocabulary.
"""

import os
import re

import numpy as np
import pytest
import torch
from conftest import ROOT
from PIL import Image
from test_import_run import OfficialVirTex, _official_vocab, _randomize

from vlrep.bench.forkserver import Server
from vlrep.pytorch.resnet import ResNet as TorchResNet

DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "interop.md")]
D = os.environ.get("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
TINY_EVAL = lambda name: (f"--config.evals.{name}.data_dir={D}", f"--config.evals.{name}.config_name=tiny")
TINY_DETECTION = (
  *TINY_EVAL("detection"),
  *(
    f"--config.evals.detection.{k}"
    for k in ("train_limit=8", "test_limit=4", "detector.iterations=2", "detector.batch_size=2")
  ),
  *(f"--config.evals.detection.detector.{k}" for k in ("min_size=32", "max_size=32", "threads=1")),
)
IMPORT_TORCHVISION = (
  "python -m vlrep.interop.import_run --format=torchvision --checkpoint=resnet50-0676ba61.pth --workdir=/runs/in1k_r50"
)
IMPORT_VIRTEX = (
  "python -m vlrep.interop.import_run --format=virtex --checkpoint=bicaptioning_R_50_L1_H2048.pth "
  "--vocab=coco_10k.model "
  "--workdir=/runs/virtex_zoo"
)
# (documented command, extra flags for its smallest real form, text its output must show), in order.
COMMANDS = [
  (IMPORT_TORCHVISION, (), "Imported"),
  (
    "python -m vlrep.evaluate --config=configs/eval/voc07_svm.py --workdir=/runs/in1k_r50",
    (":runlocal", *TINY_EVAL("voc07_svm"), "--config.evals.voc07_svm.batch_size=8"),
    "voc07_svm/map",
  ),
  (IMPORT_VIRTEX, (), "Imported"),
  ("python -m vlrep.tools.caption --workdir=/runs/virtex_zoo photo.jpg", ("--max_len=6",), "photo.jpg: "),
  (
    "python -m vlrep.tools.caption --workdir=/runs/virtex_zoo --decoding=virtex_official "
    "--preprocess=virtex_official photo.jpg",
    ("--max_len=6",),
    "photo.jpg: ",
  ),
  (
    "python -m vlrep.evaluate --config=configs/eval/captioning.py --workdir=/runs/virtex_zoo",
    (":runlocal", *TINY_EVAL("captioning_beam"), "--config.evals.captioning_beam.limit=4"),
    "captioning_beam/cider",
  ),
  (
    "python -m vlrep.evaluate --config=configs/eval/captioning.py:official --workdir=/runs/virtex_zoo",
    (
      ",runlocal",
      *TINY_EVAL("captioning_virtex_official"),
      "--config.evals.captioning_virtex_official.limit=4",
      "--config.evals.captioning_virtex_official.max_len=6",
    ),
    "captioning_virtex_official/cider",
  ),
  (
    "python -m vlrep.main --config=configs/finetune.py --config.init_from=/runs/virtex_zoo --workdir=/runs/inat_ft",
    (),
    "the backbone takes the architecture of",
  ),
  ("python -m vlrep.interop.export --workdir=/runs/virtex_zoo --format=virtex --out=bicaptioning.pth", (), ""),
  ("python -m vlrep.interop.import_run --format=auto --checkpoint=FILE --workdir=RUN", (), "Imported"),
  # The detection worker (torch, a process of its own) fine-tunes the imported ResNet-50s for 2 iterations.
  *(
    (
      f"python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/runs/{run}",
      TINY_DETECTION,
      "detection/mask_ap",
    )
    for run in ("in1k_r50", "virtex_zoo")
  ),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("imported_commands")
  torch.manual_seed(0)
  torch.save(_randomize(TorchResNet(50, 8)).state_dict(), tmp / "resnet50-0676ba61.pth")
  sp = _official_vocab(tmp / "coco_10k.model")
  ref = _randomize(OfficialVirTex(width=4, vocab=sp.get_piece_size(), hidden=64, layers=1, heads=1, ff=128))
  torch.save({"model": ref.state_dict(), "iteration": 1}, tmp / "bicaptioning_R_50_L1_H2048.pth")
  rng = np.random.default_rng(0)
  Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(tmp / "photo.jpg")
  (tmp / "tfds_empty").mkdir()
  (tmp / "home").mkdir()
  env = {**os.environ, "TFDS_DATA_DIR": str(tmp / "tfds_empty"), "HOME": str(tmp / "home"), "PYTHONPATH": ROOT}
  with Server(env, cwd=ROOT) as runner:
    yield tmp, runner


def _argv(command: str, extra: tuple, tmp) -> list[str]:
  """The documented command in this test's world: /runs/X -> tmp/runs/X, the checkpoint, vocabulary and photo
  names -> the files written here, the runlocal/tiny forms of configs that read data."""
  words = command.split()[2:]  # after 'python -m'
  out = []
  for w in words:
    w = w.replace("/runs/", f"{tmp}/runs/")
    for name in ("resnet50-0676ba61.pth", "bicaptioning_R_50_L1_H2048.pth", "coco_10k.model", "photo.jpg"):
      w = re.sub(rf"(^|=){re.escape(name)}$", rf"\g<1>{tmp}/{name}", w)
    w = w.replace("--out=bicaptioning.pth", f"--out={tmp}/bicaptioning.pth")
    w = w.replace("--checkpoint=FILE", f"--checkpoint={tmp}/resnet50-0676ba61.pth")
    w = w.replace("--workdir=RUN", f"--workdir={tmp}/runs/auto")
    w = w.replace("configs/finetune.py", "tests/tiny_finetune.py")
    out.append(w)
  config_arg = [e for e in extra if e.startswith((":", ","))]
  if config_arg:
    i = next(i for i, w in enumerate(out) if w.startswith("--config="))
    out[i] += config_arg[0]
  return out + [e for e in extra if not e.startswith((":", ","))]


def test_documented_commands_run_on_imported_runs_without_training_data(world):
  tmp, runner = world
  docs = " ".join(" ".join(open(p).read().replace("\\\n", " ").split()) for p in DOCS)
  for command, extra, expect in COMMANDS:
    assert command in docs, f"not documented (as written): {command}"
    argv = _argv(command, extra, tmp)
    log = str(tmp / f"log_{COMMANDS.index((command, extra, expect))}.txt")
    rc, seconds, text = runner.run(argv, log, timeout=240)
    print(f"{seconds:5.1f}s  {' '.join(argv)}")
    assert rc == 0 and expect in text, f"{' '.join(argv)} exited {rc}:\n{text[-3000:]}"
    assert "not prepared" not in text
  assert not os.listdir(tmp / "tfds_empty")  # nothing needed (or prepared) the training data
