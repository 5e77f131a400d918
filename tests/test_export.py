"""Export of a checkpoint's backbone to torchvision and Detectron2 names, checked against torchvision.models'
ResNets themselves (the exported file loaded into them with strict=True, their forward compared)."""

import json
import os
import pickle
import re
import sys

import jax
import numpy as np
import pytest
import torch
import torchvision
from conftest import ROOT
from ml_collections import ConfigDict
from safetensors.torch import load_file as load_torch_file
from torchvision.models.feature_extraction import create_feature_extractor

from vlrep import checkpoint as ckpt_lib
from vlrep import runs
from vlrep.errors import UserError
from vlrep.interop import export
from vlrep.interop.formats import torchvision as tv_format
from vlrep.models import resnet
from vlrep.pytorch import resnet as torch_resnet


def _write_run(workdir, depth=50, width=64, with_backbone=True, seed=0, stem="imagenet", inner_multiplier=1):
  """A checkpoint in vlrep's layout holding a ResNet with non-trivial BatchNorm parameters and statistics."""
  net = resnet.ResNet(depth=depth, width=width, stem=stem, inner_multiplier=inner_multiplier)
  variables = net.init(jax.random.PRNGKey(seed), np.zeros((1, 64, 64, 3), np.float32), False)
  rng = np.random.default_rng(seed)

  def perturb(path, x):
    name = jax.tree_util.keystr(path)
    if "scale" in name or "var" in name:
      return np.asarray(x) * rng.uniform(0.5, 1.5, x.shape).astype(np.float32)
    if "bias" in name or "mean" in name:
      return rng.normal(0, 0.1, x.shape).astype(np.float32)
    return np.asarray(x)

  variables = jax.tree_util.tree_map_with_path(perturb, variables)
  params = {"backbone": variables["params"]} if with_backbone else {"head": {"w": np.ones((3, 3), np.float32)}}
  stats = {"backbone": variables["batch_stats"]} if with_backbone else {}
  state = {"step": np.int32(7), "params": params, "model_state": {"batch_stats": stats}}
  backbone = {"depth": depth, "width": width, "stem": stem, "inner_multiplier": inner_multiplier}
  config = ConfigDict({"method": {"name": "virtex", "backbone": backbone}})
  ck = ckpt_lib.Checkpointer(str(workdir), async_save=False)
  ck.save(7, state, {"signature": ckpt_lib.signature(params), "config": config.to_dict(), "summary": {}})
  ck.close()
  return net, variables


def _jax_features(net, variables, images):
  grid, aux = net.apply(variables, images, False)
  return np.asarray(grid), np.asarray(aux["pre_logits"])


def _torch_features(state_dict, images, build=torchvision.models.resnet50):
  """(grid NHWC, pooled) of torchvision's model `build` holding the exported state dict: every key of the model but
  its ImageNet classifier (`fc`, which a backbone export has not) loaded, nothing unexpected."""
  model = build().eval()
  result = model.load_state_dict({k: torch.as_tensor(np.array(v)) for k, v in state_dict.items()}, strict=False)
  assert result.missing_keys == ["fc.weight", "fc.bias"] and not result.unexpected_keys
  extractor = create_feature_extractor(model, {"layer4": "grid", "flatten": "pooled"})
  with torch.no_grad():
    out = extractor(torch.from_numpy(np.transpose(images, (0, 3, 1, 2)).copy()))
  return np.transpose(out["grid"].numpy(), (0, 2, 3, 1)), out["pooled"].numpy()


@pytest.mark.parametrize(
  "arch",
  [
    dict(depth=10, width=8, stem="small"),  # runlocal's: torchvision's ResNet has no such stem, vlrep's twin has
    dict(depth=26, width=8, stem="imagenet"),  # every paper recipe's stem, bottleneck blocks
  ],
)
def test_backbone_handoff_rebuilds_the_flax_backbone_in_pytorch(tmp_path, arch):
  """--format=backbone writes backbone.safetensors + backbone.json: the architecture in backbone.json builds
  vlrep.pytorch.resnet.ResNet, the weights load into it with strict=True (every key, BatchNorm counters included,
  nothing more), and its features equal the Flax backbone's; write_backbone (the detection evaluator's call)
  writes the same two files."""
  net, variables = _write_run(tmp_path / "run", **arch)
  out = tmp_path / "handoff"
  info = export.export(str(tmp_path / "run"), "backbone", str(out), "latest")
  assert sorted(os.listdir(out)) == ["backbone.json", "backbone.safetensors"] and info["step"] == 7
  meta = json.loads((out / tv_format.HANDOFF_INFO).read_text())
  assert meta == {
    "architecture": {**arch, "inner_multiplier": 1, "stem_stride": 2},
    "source": str(tmp_path / "run" / "checkpoints" / "7"),
  }
  model = torch_resnet.ResNet(**meta["architecture"]).eval()
  sd = load_torch_file(str(out / tv_format.HANDOFF_WEIGHTS))
  assert info["keys"] == len(sd) == len(model.state_dict())
  model.load_state_dict(sd, strict=True)
  images = np.random.default_rng(1).normal(size=(2, 64, 48, 3)).astype(np.float32)
  grid, pooled = _jax_features(net, variables, images)
  with torch.no_grad():
    grid_t, pooled_t = model(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))
  assert _rel(grid_t.numpy().transpose(0, 2, 3, 1), grid) < 1e-5 and _rel(pooled_t.numpy(), pooled) < 1e-5
  direct = tmp_path / "direct"
  method = ConfigDict({"backbone": arch})
  assert tv_format.write_backbone(variables, method, str(direct), source="test") == {**meta, "source": "test"}
  assert (direct / tv_format.HANDOFF_WEIGHTS).read_bytes() == (out / tv_format.HANDOFF_WEIGHTS).read_bytes()


def test_backbone_handoff_refusals(tmp_path):
  """A whole model's variables, a VGG16 backbone and a backbone without BatchNorm statistics are refused by name;
  nothing is written."""
  net, variables = _write_run(tmp_path / "run", depth=10, width=8, stem="small")
  method = ConfigDict({"backbone": {"depth": 10, "width": 8, "stem": "small"}})
  whole = {"params": {"backbone": variables["params"]}, "batch_stats": {"backbone": variables["batch_stats"]}}
  with pytest.raises(ValueError, match="whole model's"):
    tv_format.write_backbone(whole, method, str(tmp_path / "a"))
  with pytest.raises(UserError, match="'vgg16'.*probes"):
    tv_format.write_backbone(variables, ConfigDict({"backbone": {"arch": "vgg16"}}), str(tmp_path / "a"))
  with pytest.raises(UserError, match="no BatchNorm statistics"):
    tv_format.write_backbone({"params": variables["params"]}, method, str(tmp_path / "a"))
  assert not (tmp_path / "a").exists()
  (tmp_path / "file").write_text("x")
  with pytest.raises(UserError, match="writes a folder"):
    export.export(str(tmp_path / "run"), "backbone", str(tmp_path / "file"), "latest")


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_torchvision_export_computes_the_same_features(tmp_path, suffix):
  net, variables = _write_run(tmp_path / "run")
  out = str(tmp_path / f"backbone{suffix}")
  info = export.export(str(tmp_path / "run"), "torchvision", out, "latest")
  assert info["step"] == 7 and info["parameters"] == 23_508_032  # torchvision's ResNet-50 without fc
  if suffix == ".safetensors":
    from safetensors.numpy import load_file

    sd = load_file(out)
  else:
    sd = {k: v.numpy() for k, v in torch.load(out).items()}
  images = np.random.default_rng(1).normal(size=(2, 64, 64, 3)).astype(np.float32)
  grid_j, pooled_j = _jax_features(net, variables, images)
  grid_t, pooled_t = _torch_features(sd, images)
  assert grid_j.shape == grid_t.shape == (2, 2, 2, 2048)
  assert _rel(grid_t, grid_j) < 1e-4 and _rel(pooled_t, pooled_j) < 1e-4
  # The comparison can fail: a wrong transpose or a swapped BatchNorm statistic is far off.
  bad = dict(sd)
  bad["layer1.0.bn1.running_mean"] = bad["layer1.0.bn1.running_mean"] + 1.0
  assert _rel(_torch_features(bad, images)[1], pooled_j) > 1e-3


def test_resnet50_w2x_is_wide_resnet50_2_and_exports_to_its_layout(tmp_path):
  """VirTex's "ResNet-50 w2x" is Wide ResNet-50-2: the bottlenecks' inner width doubles, the stem and the 2048-d
  features do not (torchvision's wide_resnet50_2, 68,883,240 parameters with its 1000-way fc)."""
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import virtex

  assert virtex.get_config("backbone=r50w2x").method.backbone.to_dict() == dict(
    depth=50,
    width=64,
    bn_group_size=32,
    zero_init_last_bn=True,
    inner_multiplier=2,
  )
  net, variables = _write_run(tmp_path / "run", inner_multiplier=2)
  out = str(tmp_path / "w2x.safetensors")
  info = export.export(str(tmp_path / "run"), "torchvision", out, "latest")
  assert info["parameters"] == 68_883_240 - (2048 * 1000 + 1000)
  from safetensors.numpy import load_file

  sd = load_file(out)
  # wide_resnet50_2's shapes (OIHW): stem 64, inner widths 128..1024, outputs 256..2048.
  assert sd["conv1.weight"].shape == (64, 3, 7, 7)
  assert sd["layer1.0.conv1.weight"].shape == (128, 64, 1, 1) and sd["layer1.0.conv3.weight"].shape == (256, 128, 1, 1)
  assert sd["layer4.2.conv2.weight"].shape == (1024, 1024, 3, 3) and sd["layer4.2.bn3.weight"].shape == (2048,)
  images = np.random.default_rng(1).normal(size=(2, 64, 64, 3)).astype(np.float32)
  grid_j, pooled_j = _jax_features(net, variables, images)
  grid_t, pooled_t = _torch_features(sd, images, torchvision.models.wide_resnet50_2)
  assert pooled_j.shape == (2, 2048) and _rel(grid_t, grid_j) < 1e-4 and _rel(pooled_t, pooled_j) < 1e-4


def _detectron2_r50_expected() -> dict[str, tuple]:
  """Detectron2's ResNet-50 (BottleneckBlock, stride_in_1x1=False as for torchvision weights) keys and shapes."""
  expected = {"stem.conv1.weight": (64, 3, 7, 7)}
  norm = lambda prefix, c: {f"{prefix}.norm.{n}": (c,) for n in ("weight", "bias", "running_mean", "running_var")}
  expected.update(norm("stem.conv1", 64))
  cin = 64
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
    for b in range(blocks):
      p = f"res{stage + 2}.{b}"
      expected[f"{p}.conv1.weight"] = (width, cin, 1, 1)
      expected[f"{p}.conv2.weight"] = (width, width, 3, 3)
      expected[f"{p}.conv3.weight"] = (width * 4, width, 1, 1)
      for i, c in ((1, width), (2, width), (3, width * 4)):
        expected.update(norm(f"{p}.conv{i}", c))
      if b == 0:
        expected[f"{p}.shortcut.weight"] = (width * 4, cin, 1, 1)
        expected.update(norm(f"{p}.shortcut", width * 4))
      cin = width * 4
  return expected


def test_detectron2_export_has_exactly_detectron2_keys(tmp_path):
  net, variables = _write_run(tmp_path / "run")
  out = tmp_path / "d2.pkl"
  export.export(str(tmp_path / "run"), "detectron2", str(out), "latest")
  with open(out, "rb") as f:
    obj = pickle.load(f)
  assert obj["matching_heuristics"] is True and "__author__" in obj
  model = obj["model"]
  expected = _detectron2_r50_expected()
  assert len(expected) == 265
  assert sorted(model) == sorted(expected)
  assert {k: tuple(v.shape) for k, v in model.items()} == expected
  assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in model.values())
  # Renaming only: the stem conv is the Flax kernel transposed.
  np.testing.assert_array_equal(
    model["stem.conv1.weight"], np.transpose(np.asarray(variables["params"]["conv1"]["kernel"]), (3, 2, 0, 1))
  )


def test_export_bad_inputs(tmp_path):
  _write_run(tmp_path / "nobackbone", with_backbone=False)
  with pytest.raises(ValueError, match="no visual backbone"):
    export.export(str(tmp_path / "nobackbone"), "torchvision", str(tmp_path / "x.safetensors"), "latest")
  with pytest.raises(FileNotFoundError, match="No run directory"):
    export.export(str(tmp_path / "missing"), "torchvision", str(tmp_path / "x.safetensors"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="has no checkpoint"):
    runs.load_run(str(tmp_path / "empty"))
  _write_run(tmp_path / "run", depth=10, width=8)
  with pytest.raises(ValueError, match="Unknown export format"):
    export.export(str(tmp_path / "run"), "onnx", str(tmp_path / "x.onnx"))
  with pytest.raises(ValueError, match="must end in"):
    export.export(str(tmp_path / "run"), "torchvision", str(tmp_path / "x.bin"))
  with pytest.raises(FileNotFoundError, match="no checkpoint of step 3"):
    runs.load_run(str(tmp_path / "run"), "3")
  # A small-stem backbone (runlocal's) has no torchvision/Detectron2 layout: a clear error, no file written.
  _write_run(tmp_path / "small", depth=10, width=8, stem="small")
  for fmt, out in (("torchvision", "x.safetensors"), ("detectron2", "x.pkl")):
    with pytest.raises(ValueError, match="stem='small'.*only stem='imagenet' backbones"):
      export.export(str(tmp_path / "small"), fmt, str(tmp_path / out))
    assert not (tmp_path / out).exists()
  # ... but evaluation rebuilds it with its stem and reads its checkpoint.
  module, variables = runs.backbone_of(runs.load_run(str(tmp_path / "small")))
  assert module.stem == "small" and variables["params"]["conv1"]["kernel"].shape == (3, 3, 3, 8)


def test_export_writes_through_no_planted_link(tmp_path):
  """A link planted at --out or at the name the export used to write first (`--out.tmp`) is replaced, not
  followed: the file it points to is untouched."""
  _write_run(tmp_path / "run", depth=50, width=8)
  folder = tmp_path / "out"
  folder.mkdir()
  for fmt, name in (("torchvision", "b.safetensors"), ("torchvision", "b.pth"), ("detectron2", "b.pkl")):
    out = folder / name
    victims = {out.name + ".tmp": tmp_path / f"bashrc_tmp_{name}", out.name: tmp_path / f"bashrc_{name}"}
    for link, victim in victims.items():
      victim.write_text("keep me")
      os.symlink(victim, folder / link)
    export.export(str(tmp_path / "run"), fmt, str(out), "latest")
    assert all(v.read_text() == "keep me" for v in victims.values()), fmt
    assert out.is_file() and not out.is_symlink() and out.stat().st_size > 1000
  # Nothing but the files and the planted links is left in the folder (no temporary file).
  assert sorted(p.name for p in folder.iterdir()) == sorted(
    n for name in ("b.safetensors", "b.pth", "b.pkl") for n in (name, name + ".tmp")
  )


def test_export_refusals_are_one_message_and_exit_2(tmp_path):
  from conftest import run_module

  _write_run(tmp_path / "small", depth=10, width=8, stem="small")
  commands = {
    "stem='small'.*only stem='imagenet' backbones": ("--format=detectron2", f"--workdir={tmp_path / 'small'}"),
    "No run directory": ("--format=detectron2", f"--workdir={tmp_path / 'missing'}"),
    "must end in .pkl": ("--format=detectron2", f"--workdir={tmp_path / 'small'}", f"--out={tmp_path / 'x.pth'}"),
  }
  for message, args in commands.items():
    proc = run_module("vlrep.interop.export", f"--out={tmp_path / 'x.pkl'}", *args)  # (a later --out wins)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(message, proc.stderr) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("ERROR: ") == 1 and not (tmp_path / "x.pkl").exists() and not (tmp_path / "x.pth").exists()


def test_visual_bert_export_writes_no_code_hook(tmp_path):
  """A run's saved Hugging Face fields (an imported run's `import.hf_config`, from a run folder anyone may have
  edited) holding `auto_map` / `trust_remote_code`: the exported config.json has neither, and a note says so."""
  import json

  transformers = pytest.importorskip("transformers")
  from vlrep.interop.formats import visual_bert

  config = transformers.VisualBertConfig(
    vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
    max_position_embeddings=12, visual_embedding_dim=8,
  )  # fmt: skip
  folder = tmp_path / "hf"
  transformers.VisualBertForPreTraining(config).save_pretrained(str(folder))
  (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]) + "\n")
  imported = visual_bert.read(str(folder))
  note = json.loads(json.dumps(imported.note))
  hooks = {"auto_map": {"AutoModel": "payload.Model"}, "trust_remote_code": True, "custom_pipelines": {"x": {}}}
  note["hf_config"] = {**note.get("hf_config", {}), **hooks}
  run = runs.Run(
    config=imported.config, params=imported.params, model_state={}, step=0, path="r", meta={"import": note}
  )
  info = visual_bert.export(run, str(tmp_path / "exported"), False)
  written = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert not set(hooks) & set(written) and written["model_type"] == "visual_bert"
  assert any("auto_map" in n and "trust_remote_code" in n for n in info["notes"]), info["notes"]


def test_coco_subset_is_seeded_nested_and_keeps_annotations():
  from vlrep.tools import coco_subset

  data = {
    "info": {"year": 2017},
    "categories": [{"id": 1, "name": "cat"}],
    "images": [{"id": i, "file_name": f"{i:012d}.jpg"} for i in range(1, 101)],
    "annotations": [{"id": 1000 + k, "image_id": 1 + k % 100, "category_id": 1} for k in range(250)],
  }
  ten = coco_subset.subset(data, 10)
  twenty = coco_subset.subset(data, 20)
  ids10 = {im["id"] for im in ten["images"]}
  assert len(ids10) == 10 and ids10 <= {im["id"] for im in twenty["images"]}
  assert ten["categories"] == data["categories"] and ten["info"] == data["info"]
  assert sorted(a["id"] for a in ten["annotations"]) == sorted(
    a["id"] for a in data["annotations"] if a["image_id"] in ids10
  )
  assert coco_subset.subset(data, 10) == ten and coco_subset.subset(data, 10, seed=1) != ten
  with pytest.raises(ValueError, match="percent"):
    coco_subset.subset(data, 0)
  with pytest.raises(ValueError, match="Not a COCO instances file"):
    coco_subset.subset({"images": []}, 10)
