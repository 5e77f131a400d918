"""vlrep/pytorch/ runs under PyTorch and imports neither JAX nor TensorFlow (issue 78): every module of the package,
imported in a fresh interpreter with Detectron2 hidden (it is optional and CI has none), leaves none of the JAX or
TensorFlow packages in sys.modules; and the check does see a module that pulls one in."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from conftest import ROOT

from vlrep.pytorch import detectron2_heads

FORBIDDEN = ("jax", "jaxlib", "flax", "optax", "orbax", "tensorflow", "tensorflow_datasets")

# Imports every module of PACKAGE one by one (Detectron2 hidden: a module must import without it) and prints
# {module: [forbidden packages first present after importing it]} and the import errors.
CHECK = """
import importlib, json, pkgutil, sys
sys.modules["detectron2"] = None
package, forbidden = sys.argv[1], sys.argv[2].split(",")
present = lambda: sorted(n for n in forbidden if n in sys.modules)
root = importlib.import_module(package)
pulled, failed, seen = {}, {}, present()
for info in pkgutil.iter_modules(root.__path__, package + "."):
  try:
    importlib.import_module(info.name)
  except Exception as e:
    failed[info.name] = f"{type(e).__name__}: {e}"
  now = present()
  if now != seen:
    pulled[info.name] = sorted(set(now) - set(seen))
  seen = now
print(json.dumps({"modules": sorted(i.name for i in pkgutil.iter_modules(root.__path__)), "pulled": pulled,
                  "failed": failed, "present": seen}))
"""


def _check(package: str, path: str = "") -> dict:
  env_path = [p for p in (path, ROOT) if p]
  code = f"import sys; sys.path[:0] = {env_path!r}\n{CHECK}"
  proc = subprocess.run(
    [sys.executable, "-c", code, package, ",".join(FORBIDDEN)], capture_output=True, text=True, timeout=300, cwd=ROOT
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_module_of_vlrep_pytorch_imports_jax_or_tensorflow():
  out = _check("vlrep.pytorch")
  # The wing as the issue names it: the worker, the torch ResNet, the Detectron2 driver and what they share.
  assert {"detection_worker", "resnet", "detectron2_transfer", "detection_spec", "handoff"} <= set(out["modules"])
  assert out["failed"] == {}, out["failed"]  # every module imports, Detectron2 or not
  assert out["pulled"] == {} and out["present"] == [], out


def test_the_check_sees_a_module_that_pulls_jax_in(tmp_path):
  # A crafted wing whose one module reaches JAX through a vlrep module (vlrep.runs reads checkpoints with orbax).
  package = tmp_path / "crafted_wing"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "clean.py").write_text("import json\n")
  (package / "through_runs.py").write_text("from vlrep import runs  # noqa: F401\n")
  out = _check("crafted_wing", str(tmp_path))
  assert out["failed"] == {} and set(out["pulled"]) == {"crafted_wing.through_runs"}, out
  assert {"jax", "flax", "orbax"} <= set(out["pulled"]["crafted_wing.through_runs"])


def test_the_configs_read_the_workers_spec_without_torch_or_jax():
  # configs/eval/detection.py builds its detector entry from vlrep.pytorch.detection_spec: torch-free too.
  code = (
    "import sys\n"
    "from vlrep.pytorch import detection_spec, handoff\n"
    "spec = detection_spec.full_spec({'backbone': 'B'})\n"
    f"print(sorted(n for n in ('torch', *{FORBIDDEN!r}) if n in sys.modules))"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_the_loctex_head_registers_once_from_the_package(monkeypatch):
  """vlrep.pytorch.detectron2_heads against stand-ins for the two Detectron2 names it uses (Detectron2 is not
  installed in CI): registered once per process however often the driver asks, its res5 block ending with the
  extra norm (MoCo's Res5ROIHeadsExtraNorm), built as a classmethod (Detectron2 >= 0.3) and on an instance."""
  torch = pytest.importorskip("torch")
  registered, norms = [], []

  class Registry:
    def register(self):
      def add(cls):
        registered.append(cls.__name__)
        return cls

      return add

  class Res5ROIHeads:
    @classmethod
    def _build_res5_block(cls, cfg):
      return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 1), torch.nn.Conv2d(8, 8, 1)), 8

  def get_norm(norm, channels):
    norms.append((norm, channels))
    return torch.nn.BatchNorm2d(channels)

  names = ("detectron2", "detectron2.layers", "detectron2.modeling", "detectron2.modeling.roi_heads")
  modules = {n: types.ModuleType(n) for n in names}
  modules["detectron2.layers"].get_norm = get_norm
  modules["detectron2.modeling.roi_heads"].ROI_HEADS_REGISTRY = Registry()
  modules["detectron2.modeling.roi_heads"].Res5ROIHeads = Res5ROIHeads
  for name, module in modules.items():
    monkeypatch.setitem(sys.modules, name, module)
  monkeypatch.setattr(detectron2_heads, "_REGISTERED", {})

  head = detectron2_heads.register_loctex_extra_norm()
  assert detectron2_heads.register_loctex_extra_norm() is head  # the driver's second job in a process
  assert registered == [detectron2_heads.LOCTEX_EXTRA_NORM] == ["Res5ROIHeadsExtraNorm"] == [head.__name__]
  cfg = types.SimpleNamespace(MODEL=types.SimpleNamespace(RESNETS=types.SimpleNamespace(NORM="SyncBN")))
  for build in (head._build_res5_block, object.__new__(head)._build_res5_block):
    res5, channels = build(cfg)
    assert channels == 8 and [n for n, _ in res5.named_children()] == ["0", "1", "norm"]
    with torch.no_grad():
      y = res5.train()(torch.randn(4, 4, 3, 3) * 5 + 3)
    assert float(y.mean(dim=(0, 2, 3)).abs().max()) < 1e-4  # the block's output is the norm's
  assert norms == [("SyncBN", 8)] * 2
