"""torchvision (and timm) ResNets: ResNet-18/50/101/152 and Wide ResNet-50-2 state dicts <-> a backbone-only run.

  python -m vlrep.interop.import_run --format=torchvision --checkpoint=resnet50-0676ba61.pth --workdir=/runs/in1k_r50
  python -m vlrep.evaluate --config=configs/eval/voc07_svm.py --workdir=/runs/in1k_r50
  python -m vlrep.interop.export --workdir=DIR --format=torchvision --out=backbone.safetensors   # or backbone.pth

Export: a ResNet state_dict with torchvision's names (`conv1.weight`, `layer1.0.bn1.running_mean`,
`layer1.0.downsample.0.weight`, ...) and no `fc`; load it with
`torchvision.models.resnet50().load_state_dict(sd, strict=False)` (the missing keys are exactly fc.weight and
fc.bias). Written as safetensors (`.safetensors`, no pickle) or with torch.save (`.pth`, needs torch).

The key map (`resnet_rules`) is the one `vlrep.interop.export --format=torchvision` writes with, so import -> export
is the identity, tensor for tensor (BatchNorm's `num_batches_tracked` counters are kept in the run's note and written
back). timm's ResNets (resnet50.a1_in1k, ...) use torchvision's names and load the same way.

Read from the tensors' shapes: the block type (bottleneck if `layer1.0.conv3` exists), the blocks per stage (the
depth: 3-4-6-3 is 50, 3-4-23-3 is 101, ...), the stem width (`conv1.weight`'s output channels) and the bottlenecks'
inner-width multiplier (2 for wide_resnet50_2). The ImageNet classifier (`fc`) is dropped, and named in the note:
a vlrep run holds the backbone that evaluators, `init_from` and export use.

The run's config (`default_config`, unless `--config` names a recipe to start from) is the model as published:
method 'classifier' (ImageNet's 1000 classes; the head itself is not imported) with the imported backbone in float32
and ImageNet's evaluation preprocessing. A fine-tuning run brings its own recipe
(`vlrep.main --config=configs/finetune.py --config.init_from=RUN`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from vlrep import runs, safe_files, torch_files
from vlrep.errors import BadFile, UserError, reading
from vlrep.interop import keymaps
from vlrep.interop.keymaps import (
  ImportedRun,
  KeyMap,
  closest_format,
  flatten,
  load_checkpoint,
  no_format_error,
  rule,
)
from vlrep.models import resnet
from vlrep.pytorch.handoff import HANDOFF_INFO, HANDOFF_WEIGHTS
from vlrep.runs import unflatten

DESCRIPTION = "torchvision/timm ResNet-18/50/101/152 or Wide ResNet-50-2 state dict (.pth, .safetensors)"
# What --out may end in (the file type is chosen by it).
OUT_SUFFIXES = (".safetensors", ".pth", ".pt")
ANCHORS = ("conv1.weight", "bn1.weight", "bn1.running_mean", "layer1.0.conv1.weight", "layer4.0.conv1.weight")
CHECKPOINT_HINT = (
  "Pass the checkpoint as published and whole (download it again if it may be truncated): a torch.save file "
  "(.pth, .pt, .bin) or a .safetensors file."
)
# ImageNet's evaluation preprocessing (torchvision's reference: resize to 256, centre crop 224).
IMAGENET_EVAL_PP = "decode|resize_small(256)|central_crop(224)|normalize"
FORMAT_HINT = "Check --format (--format=auto picks the one that fits) and that the file is the model's checkpoint."


def read_contents(path: str) -> Any:
  """`vlrep.interop.keymaps.load_checkpoint` of a file (what it holds, before any format reads it); a file that is not
  a readable checkpoint (missing, empty, truncated, random bytes, a malformed zip or safetensors header, a pickle
  nested too deep) is one BadFile naming it."""
  with reading(path, what="checkpoint (torch.save or safetensors)", hint=CHECKPOINT_HINT):
    return load_checkpoint(path)


def read_state_dict(path: str, contents: Any = None) -> dict:
  """The state dict of a checkpoint file (`vlrep.torch_files.as_state_dict`) from its `contents` when the caller
  read them already (`read_contents`), else read here; one BadFile naming the file when it is none."""
  if contents is None:
    contents = read_contents(path)
  with reading(path, what="checkpoint (torch.save or safetensors)", hint=CHECKPOINT_HINT):
    return torch_files.as_state_dict(contents, path)


@contextlib.contextmanager
def tensors_of(path: str, what: str):
  """Context for reading a state dict's tensors as a format's model: tensors that do not fit it (a shape that
  differs, keys missing, a tensor of another rank) are one BadFile naming the file, with the check's own words."""
  with reading(path, what=f"{what} checkpoint", hint=FORMAT_HINT):
    try:
      yield
    except UserError:
      raise
    except ValueError as e:  # the key map's and the format's checks, worded for the user: kept whole
      raise BadFile(f"{path} is not a {what} checkpoint as this format reads it: {e}") from e


def no_format(path: str, keys: set[str]) -> BadFile:
  """`vlrep.interop.keymaps.no_format_error` of a file (the closest format, how the keys differ) as the BadFile it
  is."""
  return BadFile(str(no_format_error(path, keys, *closest_format(keys))))


def resnet_rules(prefix: str = "", root: str = "backbone") -> list:
  """torchvision's ResNet names (under `prefix`, e.g. 'visual.cnn.' in VirTex checkpoints) <-> vlrep's ResNet
  variables (under `root` of the run's params and batch_stats)."""

  def conv(v, f):
    return [rule(f"params/{root}/{v}/kernel", f"{prefix}{f}.weight", transform="conv")]  # HWIO <-> OIHW

  def bn(v, f):
    return [
      rule(f"params/{root}/{v}/scale", f"{prefix}{f}.weight"),
      rule(f"params/{root}/{v}/bias", f"{prefix}{f}.bias"),
      rule(f"batch_stats/{root}/{v}/mean", f"{prefix}{f}.running_mean"),
      rule(f"batch_stats/{root}/{v}/var", f"{prefix}{f}.running_var"),
      rule(None, f"{prefix}{f}.num_batches_tracked", absent="counter"),
    ]

  block = "layer{}_block{}", "layer{}.{}"
  return [
    *conv("conv1", "conv1"),
    *bn("bn1", "bn1"),
    *conv(f"{block[0]}/conv{{}}", f"{block[1]}.conv{{}}"),
    *bn(f"{block[0]}/bn{{}}", f"{block[1]}.bn{{}}"),
    *conv(f"{block[0]}/downsample_conv", f"{block[1]}.downsample.0"),
    *bn(f"{block[0]}/downsample_bn", f"{block[1]}.downsample.1"),
    rule(None, f"{prefix}fc.weight", absent="dropped"),
    rule(None, f"{prefix}fc.bias", absent="dropped"),
  ]


KEY_MAP = KeyMap("torchvision ResNet", resnet_rules())


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  keys = set(keys)
  if not keys:
    return 0.0, list(ANCHORS), []
  matched = {k for k in keys if KEY_MAP.matches(k)}
  missing = [a for a in ANCHORS if a not in keys]
  return len(matched) / len(keys) * (1 - len(missing) / len(ANCHORS)), missing, sorted(keys - matched)


def architecture(sd: dict, prefix: str = "") -> dict:
  """vlrep's ResNet arguments (depth, width, inner_multiplier) read from a torchvision-named state dict's shapes."""
  stem = sd.get(f"{prefix}conv1.weight")
  if stem is None:
    raise ValueError(f"No {prefix}conv1.weight: not a torchvision ResNet.")
  if stem.ndim != 4 or tuple(stem.shape[1:]) != (3, 7, 7):
    raise ValueError(
      f"{prefix}conv1.weight is {tuple(stem.shape)}; torchvision's ResNet stem is (width, 3, 7, 7) (a 7x7 convolution "
      "of RGB images). Deep-stem variants (timm's resnet50d) are not torchvision's layout."
    )
  width = int(stem.shape[0])
  bottleneck = f"{prefix}layer1.0.conv3.weight" in sd
  blocks = []
  for stage in range(1, 5):
    n = 0
    while f"{prefix}layer{stage}.{n}.conv1.weight" in sd:
      n += 1
    blocks.append(n)
  depth = next(
    (d for d, sizes in resnet.DEPTHS.items() if tuple(sizes) == tuple(blocks) and (d not in (10, 18)) == bottleneck),
    None,
  )
  if depth is None:
    supported = ", ".join(
      f"{d} ({'-'.join(map(str, s))}, {'basic' if d in (10, 18) else 'bottleneck'})" for d, s in resnet.DEPTHS.items()
    )
    raise ValueError(
      f"The checkpoint's ResNet has {'-'.join(map(str, blocks))} {'bottleneck' if bottleneck else 'basic'} blocks per "
      f"stage, which no vlrep ResNet depth has; supported: {supported}."
    )
  inner = 1
  if bottleneck:
    inner_width = int(sd[f"{prefix}layer1.0.conv1.weight"].shape[0])
    if inner_width % width:
      raise ValueError(
        f"{prefix}layer1.0.conv1.weight has {inner_width} output channels, not a multiple of the stem width {width}."
      )
    inner = inner_width // width
  return {"depth": depth, "width": width, "inner_multiplier": inner}


def expected_shapes(arch: dict, root: str = "backbone") -> dict[str, tuple]:
  """{'params/<root>/...': shape, 'batch_stats/<root>/...': shape} of vlrep's ResNet of `arch` (shapes only)."""
  net = resnet.ResNet(depth=arch["depth"], width=arch["width"], inner_multiplier=arch["inner_multiplier"])
  shapes = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros((1, 64, 64, 3)), False))
  return {
    f"{collection}/{root}/{path}": tuple(s.shape)
    for collection in ("params", "batch_stats")
    for path, s in flatten(shapes[collection]).items()
  }


def backbone_section(base: dict | None, arch: dict) -> dict:
  """A config's `method.backbone` with the imported architecture (the base section's other keys, e.g. its
  BatchNorm group size, are kept for fine-tuning)."""
  section = {k: v for k, v in dict(base or {}).items() if k not in ("arch", "inner_multiplier", "stem_stride")}
  section.update(depth=arch["depth"], width=arch["width"], stem="imagenet")
  if arch["inner_multiplier"] != 1:
    section["inner_multiplier"] = arch["inner_multiplier"]
  return section


def read_backbone(sd: dict, prefix: str = "", root: str = "backbone", path: str = "the checkpoint"):
  """(arch, vlrep.interop.keymaps.Converted) of the ResNet under `prefix` of a state dict (the other keys ignored); what
  does not fit a ResNet is a BadFile naming `path`."""
  with tensors_of(path, "torchvision ResNet"):
    arch = architecture(sd, prefix)
  part = {k: v for k, v in sd.items() if k.startswith(prefix)} if prefix else sd
  expected = expected_shapes(arch, root)
  with tensors_of(path, "torchvision ResNet"):
    converted = KeyMap("torchvision ResNet", resnet_rules(prefix, root)).to_vlrep(part, expected)
  return arch, converted


def read(
  checkpoint: str,
  vocab: str | None = None,
  *,
  contents: Any = None,
  config: ConfigDict | None = None,
  workdir: str | None = None,
) -> ImportedRun:
  """A backbone-only run of a torchvision-named ResNet state dict; `config` is the base config (its method gets the
  imported backbone section)."""
  del workdir  # the run keeps no files besides its checkpoints
  if vocab:
    raise UserError("--vocab applies to text models; a torchvision checkpoint is a backbone alone.")
  sd = read_state_dict(checkpoint, contents)
  s, missing, unexpected = score(set(sd))
  if missing:
    raise no_format(checkpoint, set(sd))
  arch, converted = read_backbone(sd, path=checkpoint)
  return backbone_run(checkpoint, "torchvision", arch, converted, config)


def default_config() -> ConfigDict:
  """An imported backbone's config when no --config names a recipe: an ImageNet classifier as torchvision publishes
  it (trained on ImageNet's 1000 classes, images resized to 256 and centre-cropped to 224 for evaluation), what
  rebuilds and applies the backbone; nothing about training it further (the dataset is named, never read)."""
  return ConfigDict(
    dict(
      method=dict(name="classifier", num_classes=1000),
      data=dict(name="imagenet2012", split="train", data_dir="", config_name="", pp=IMAGENET_EVAL_PP),
    )
  )


def backbone_run(checkpoint: str, fmt: str, arch: dict, converted, config: ConfigDict | None, extra_note=None):
  """The ImportedRun of a backbone alone (this format's, and VirTex's hub backbones)."""
  c = ConfigDict((config if config is not None else default_config()).to_dict())
  method = dict(c.get("method", default_config().method))
  method["backbone"] = backbone_section(method.get("backbone"), arch)
  method["dtype"] = "float32"
  c.method = method
  if "init_from" in c:
    c.init_from = ""
  variables = unflatten(converted.variables)
  note = {
    "format": fmt,
    "source": checkpoint,
    "architecture": arch,
    "dropped": {
      k: f"shape {v}: the ImageNet classifier head, not part of a backbone run" for k, v in converted.dropped.items()
    },
    "counters": converted.counters,
    **(extra_note or {}),
  }
  return ImportedRun(
    config=c, params=variables["params"], model_state={"batch_stats": variables["batch_stats"]}, note=note
  )


def state_dict(backbone_params: dict, backbone_stats: dict, counters: dict | None = None, prefix: str = "") -> dict:
  """A backbone's variables -> torchvision's names and layout (float32; each BatchNorm's `num_batches_tracked`
  from `counters` when the run was imported with them, else 0). What `vlrep.interop.export --format=torchvision`
  writes."""
  flat = {f"params/backbone/{k}": np.asarray(v) for k, v in flatten(backbone_params).items()}
  flat.update({f"batch_stats/backbone/{k}": np.asarray(v) for k, v in flatten(backbone_stats).items()})
  sd = KeyMap("torchvision ResNet", resnet_rules(prefix)).to_foreign(flat)
  out = {}
  for key, value in sd.items():
    out[key] = value.astype(np.float32)
    if key.endswith(".running_var"):
      counter = key[: -len("running_var")] + "num_batches_tracked"
      out[counter] = np.array((counters or {}).get(counter, 0), np.int64)
  return out


def torch_architecture(method_config) -> dict:
  """The keyword arguments of `vlrep.pytorch.resnet.ResNet` that rebuild a run's backbone (its method config's
  `backbone` section; an omitted key means what `runs.BACKBONE_ARCHITECTURE` says); a clear error for a backbone
  PyTorch's twin cannot build (VGG16)."""
  section = dict(method_config.get("backbone", {}) or {})
  arch = section.get("arch", runs.BACKBONE_ARCHITECTURE["arch"])
  if arch != "resnet":
    raise UserError(
      f"Only ResNet backbones are converted to PyTorch; this run's backbone is {arch!r}. Evaluate it with the probes "
      "(configs/eval/voc07_svm.py, linear_probe.py) instead."
    )
  return {k: section.get(k, default) for k, default in runs.BACKBONE_ARCHITECTURE.items() if k != "arch"}


def write_backbone(
  variables: dict, method_config, folder: str, *, counters: dict | None = None, source: str = "in-process variables"
) -> dict:
  """Writes the PyTorch hand-off of a backbone into `folder`: HANDOFF_WEIGHTS (its variables {'params', 'batch_stats'},
  as `runs.backbone_of` and `Model.backbone()` give them, in torchvision's names and layout: float32, each
  BatchNorm's `num_batches_tracked` from `counters` or 0; safetensors, no pickle) and HANDOFF_INFO
  ({"architecture": `torch_architecture(method_config)`, "source": source}). Both are written atomically through
  vlrep.safe_files inside `folder` (created if missing). Returns the info dict."""
  info = {"architecture": torch_architecture(method_config), "source": str(source)}
  if "params" in variables and "backbone" in variables["params"]:
    raise ValueError(
      "write_backbone takes the backbone's variables ({'params': backbone params, 'batch_stats': ...}); these are a "
      "whole model's (params has a 'backbone' entry): pass its backbone's (runs.backbone_of, Model.backbone())."
    )
  if "batch_stats" not in variables:
    raise UserError("The backbone has no BatchNorm statistics (batch_stats): it cannot be converted to PyTorch.")
  host = jax.device_get(dict(variables))
  sd = state_dict(host["params"], host["batch_stats"], counters)
  root = os.path.abspath(folder)
  safe_files.make_dirs(root)
  with safe_files.atomic_path(os.path.join(root, HANDOFF_WEIGHTS), ".safetensors", root=root) as tmp:
    # np.ascontiguousarray makes a 0-d array 1-d: num_batches_tracked keeps torch's shape () by the reshape.
    save_file({k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in sd.items()}, tmp, metadata={"format": "pt"})
  safe_files.write_json(os.path.join(root, HANDOFF_INFO), info, root=root)
  return info


def imported_counters(run) -> dict:
  """BatchNorm `num_batches_tracked` values an imported run kept (vlrep.interop.import_run), under torchvision's
  names."""
  note = run.meta.get("import", {})
  counters, prefix = note.get("counters", {}), note.get("backbone_prefix", "")
  return {k[len(prefix) :]: v for k, v in counters.items() if k.startswith(prefix)}


def require_resnet(arch: str, where: str, fmt: str) -> None:
  """A NotExportable for a backbone of `arch` that `fmt` (torchvision's, Detectron2's or the PyTorch hand-off's
  ResNet layout) cannot hold, saying where it can go instead."""
  if arch == "resnet":
    return
  if arch == "vit":
    raise keymaps.NotExportable(
      f"{where}: export to {fmt} supports ResNet backbones only, and this run's is a ViT (no ResNet stages or "
      "BatchNorm to write in that layout). Export the ViT to timm's VisionTransformer with --format=timm "
      "(docs/interop.md); detection transfer, which reads this layout, takes ResNets only."
    )
  raise keymaps.NotExportable(
    f"{where}: export to {fmt} supports ResNet backbones only (this run's is {arch!r}): a layout of torchvision's "
    "ResNet has no place for it."
  )


def exportable_backbone(run) -> dict:
  """The variables of a run's backbone in the form torchvision's (and Detectron2's) ResNet has: a ResNet with the
  ImageNet stem and BatchNorm statistics; anything else is a NotExportable saying why."""
  backbone = run.config.method.get("backbone", {})
  require_resnet(backbone.get("arch", "resnet"), run.path, "torchvision/Detectron2")
  stem = backbone.get("stem", "imagenet")
  if stem != "imagenet":
    # torchvision's and Detectron2's ResNets build the 7x7 stride-2 stem and max-pool in code: a 3x3 stem's weights
    # would load under conv1's name only to fail on its shape, or (strict=False) be silently dropped.
    raise keymaps.NotExportable(
      f"{run.path}: the backbone uses stem={stem!r} (a 3x3 convolution, no max-pool), which neither torchvision's "
      "nor Detectron2's ResNet has; only stem='imagenet' backbones (every paper recipe) export. Inspect it with "
      "vlrep.evaluate or load its checkpoint in JAX instead."
    )
  _, variables = keymaps.refusal(runs.backbone_of, run)
  if variables.get("batch_stats") is None:
    raise keymaps.NotExportable("The backbone has no BatchNorm statistics (batch_stats); it cannot be exported.")
  return variables


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run's backbone in torchvision's names to `out` (.safetensors, or .pth with torch.save); returns
  {'keys', 'parameters', 'step'}."""
  del overwrite  # one file, replaced atomically
  variables = exportable_backbone(run)
  sd = state_dict(variables["params"], variables["batch_stats"], imported_counters(run))
  root = keymaps.out_root(out)
  safe_files.make_dirs(root)
  if out.endswith(".safetensors"):
    with safe_files.atomic_path(out, ".safetensors", root=root) as tmp:
      save_file(dict(sd), tmp, metadata={"format": "pt", "source": run.path})
  else:
    torch = keymaps.require_torch("Writing .pth needs PyTorch; install torch or export to .safetensors instead.")
    with safe_files.atomic_path(out, ".pth", root=root) as tmp:
      torch.save({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, tmp)
  return {"keys": len(sd), "parameters": keymaps.parameter_count(sd), "step": run.step}
