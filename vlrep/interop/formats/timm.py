r"""timm's VisionTransformer <-> a run's ViT backbone (vlrep.models.vit, big_vision's layout), both ways.

  python -m vlrep.interop.export --workdir=RUN --format=timm --out=vit.safetensors
  python -m vlrep.interop.import_run --format=timm --checkpoint=vit.safetensors --workdir=/runs/timm_vit

Export writes the backbone as timm's `VisionTransformer` state dict (`patch_embed.proj`, `cls_token`, `pos_embed`,
`norm_pre`, `blocks.{i}.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}`, `norm`, `attn_pool`; safetensors)
and prints the `timm.create_model` call that builds the model it loads into with strict=True (num_classes=0: no
classifier head; `export(...)['timm_code']`). The call's keyword arguments are also in the file's metadata
(`timm_kwargs`, JSON), which this importer reads back.

What maps: big_vision's pooling 'tok' is timm's global_pool='token' (class token), 'gap' is 'avg' with fc_norm=False
(the final LayerNorm before the mean, as big_vision's), 'map' is 'map' (timm's AttentionPoolLatent is big_vision's
MAPHead: a latent query, one projection, LN and MLP). big_vision's class token has no position embedding; timm's
(no_embed_class=False, its default and its published ViTs') has one: exported as a zero row, and on import folded
into the class token (the class token is used nowhere else). `pre_norm` is timm's norm_pre, and timm builds the patch
embedding without a bias exactly when pre_norm is set (CLIP's towers), so a ViT with pre_norm and a patch bias, or
neither, is refused. The MLP activation is timm's act_layer ('gelu_tanh', 'gelu', 'quick_gelu'), the LayerNorm
epsilon its norm_layer. Refused (NotExportable, before anything is written): fixed sin-cos position embeddings
(timm's VisionTransformer learns them), and any backbone other than a ViT.

Import reads the sizes from the tensors' shapes. Three settings are not in a state dict: the number of heads, the
activation and the LayerNorm epsilon; they come from the file's `timm_kwargs` metadata when this exporter wrote it,
else from the --config recipe's ViT section, else timm's defaults (64-wide heads as every timm ViT has, exact GELU,
epsilon 1e-6), and the run's note says which.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict
from safetensors import safe_open
from safetensors.numpy import save_file

from vlrep import runs, safe_files
from vlrep.errors import BadFile, UserError
from vlrep.interop import keymaps
from vlrep.interop.formats import torchvision as tv
from vlrep.interop.keymaps import ImportedRun, KeyMap, flatten, rule
from vlrep.models import vit

DESCRIPTION = "timm VisionTransformer state dict of a ViT backbone (.safetensors; create_model kwargs printed)"
OUT_SUFFIXES = (".safetensors",)
ANCHORS = ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight")
POOLS = {"tok": "token", "gap": "avg", "map": "map"}  # big_vision's pool_type -> timm's global_pool
METADATA_KEY = "timm_kwargs"
# timm's defaults for what a state dict does not hold.
TIMM_HEAD_DIM = 64
TIMM_ACT = "gelu"
TIMM_LN_EPS = 1e-6
# timm's names of the standard sizes (width, depth, heads, mlp_dim), and the models timm 1.0 registers of them: the
# model name printed with the kwargs.
TIMM_NAMES = frozenset(
  {"vit_tiny_patch16_224", "vit_small_patch8_224", "vit_base_patch8_224", "vit_large_patch14_224"}
  | {f"vit_{s}_patch{p}_224" for s in ("small", "base", "large") for p in (16, 32)}
)
TIMM_SIZES = {
  (192, 12, 3, 768): "tiny",
  (384, 12, 6, 1536): "small",
  (768, 12, 12, 3072): "base",
  (1024, 24, 16, 4096): "large",
}


def vit_rules(root: str = "backbone") -> list:
  """timm's names <-> the ViT's variables under params/<root> (the class token and position embedding apart:
  `_cls_and_posemb`)."""
  p = f"params/{root}"
  block, tb = f"{p}/Transformer/encoderblock_{{}}", "blocks.{}"
  attn = f"{block}/MultiHeadDotProductAttention_0"

  def norm(v, f):
    return [rule(f"{v}/scale", f"{f}.weight"), rule(f"{v}/bias", f"{f}.bias")]

  def dense(v, f):
    return [rule(f"{v}/kernel", f"{f}.weight", transform="linear"), rule(f"{v}/bias", f"{f}.bias")]

  def heads(v, f, part):
    return [
      rule(f"{v}/kernel", f"{f}.weight", transform="heads_in", part=part),
      rule(f"{v}/bias", f"{f}.bias", transform="heads_bias", part=part),
    ]

  def heads_out(v, f):
    return [rule(f"{v}/kernel", f"{f}.weight", transform="heads_out"), rule(f"{v}/bias", f"{f}.bias")]

  head = f"{p}/MAPHead_0"
  return [
    rule(f"{p}/embedding/kernel", "patch_embed.proj.weight", transform="conv"),
    rule(f"{p}/embedding/bias", "patch_embed.proj.bias"),
    *norm(f"{p}/pre_norm", "norm_pre"),
    *norm(f"{block}/LayerNorm_0", f"{tb}.norm1"),
    *heads(f"{attn}/query", f"{tb}.attn.qkv", (0, 3)),
    *heads(f"{attn}/key", f"{tb}.attn.qkv", (1, 3)),
    *heads(f"{attn}/value", f"{tb}.attn.qkv", (2, 3)),
    *heads_out(f"{attn}/out", f"{tb}.attn.proj"),
    *norm(f"{block}/LayerNorm_1", f"{tb}.norm2"),
    *dense(f"{block}/MlpBlock_0/Dense_0", f"{tb}.mlp.fc1"),
    *dense(f"{block}/MlpBlock_0/Dense_1", f"{tb}.mlp.fc2"),
    *norm(f"{p}/Transformer/encoder_norm", "norm"),
    rule(f"{head}/probe", "attn_pool.latent"),
    *heads(f"{head}/MultiHeadDotProductAttention_0/query", "attn_pool.q", (0, 1)),
    *heads(f"{head}/MultiHeadDotProductAttention_0/key", "attn_pool.kv", (0, 2)),
    *heads(f"{head}/MultiHeadDotProductAttention_0/value", "attn_pool.kv", (1, 2)),
    *heads_out(f"{head}/MultiHeadDotProductAttention_0/out", "attn_pool.proj"),
    *norm(f"{head}/LayerNorm_0", "attn_pool.norm"),
    *dense(f"{head}/MlpBlock_0/Dense_0", "attn_pool.mlp.fc1"),
    *dense(f"{head}/MlpBlock_0/Dense_1", "attn_pool.mlp.fc2"),
    rule(None, "head.weight", absent="dropped"),
    rule(None, "head.bias", absent="dropped"),
  ]


KEY_MAP = KeyMap("timm VisionTransformer", vit_rules())
# Kept out of the key map: timm's class token and position embedding are two tensors whose split differs from
# big_vision's (`_cls_and_posemb`).
SPECIAL = ("cls_token", "pos_embed")


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  keys = set(keys)
  if not keys:
    return 0.0, list(ANCHORS), []
  matched = {k for k in keys if KEY_MAP.matches(k) or k in SPECIAL}
  missing = [a for a in ANCHORS if a not in keys]
  return len(matched) / len(keys) * (1 - len(missing) / len(ANCHORS)), missing, sorted(keys - matched)


# ------------------------------------------------------------------------------------------------------------------
# The architecture: vlrep's ViT section <-> timm's keyword arguments.
# ------------------------------------------------------------------------------------------------------------------
def timm_kwargs(section: dict, grid: int) -> dict:
  """timm's VisionTransformer keyword arguments (JSON values; the LayerNorm epsilon as `ln_eps`, see `timm_code`)
  of a ViT backbone section (`runs.backbone_architecture`) trained with a `grid` x `grid` position embedding; a
  ValueError saying why for a ViT timm cannot express."""
  a = runs.backbone_architecture(section)
  if a["arch"] != "vit":
    raise ValueError(f"--format=timm exports ViT backbones; this run's backbone is {a['arch']!r}.")
  if a["posemb"] != "learn":
    raise ValueError(
      f"The ViT's position embedding is {a['posemb']!r} (fixed sin-cos); timm's VisionTransformer learns its "
      "position embedding, so the exported model would compute something else."
    )
  if bool(a["patch_bias"]) == bool(a["pre_norm"]):
    raise ValueError(
      f"The ViT has pre_norm={a['pre_norm']} and patch_bias={a['patch_bias']}; timm builds the patch embedding with "
      "a bias exactly when there is no norm_pre (bias=not pre_norm), so it cannot hold this combination."
    )
  if a["pool_type"] not in POOLS:
    raise ValueError(f"The ViT's pool_type {a['pool_type']!r} has no timm global_pool; timm takes {sorted(POOLS)}.")
  if a["mlp_act"] not in vit.MLP_ACTS:
    raise ValueError(f"The ViT's activation {a['mlp_act']!r} is not one of {vit.MLP_ACTS}.")
  width = int(a["width"])
  kwargs = dict(
    img_size=grid * int(a["patch_size"]),
    patch_size=int(a["patch_size"]),
    embed_dim=width,
    depth=int(a["depth"]),
    num_heads=int(a["num_heads"]),
    mlp_ratio=(a["mlp_dim"] or 4 * width) / width,
    class_token=a["pool_type"] == "tok",
    global_pool=POOLS[a["pool_type"]],
    pre_norm=bool(a["pre_norm"]),
    act_layer=a["mlp_act"],
    ln_eps=float(a["ln_eps"]),
    num_classes=0,
  )
  if a["pool_type"] == "gap":
    kwargs["fc_norm"] = False  # big_vision normalises the tokens, then averages; timm's 'avg' default is the reverse
  return kwargs


def timm_code(kwargs: dict) -> str:
  """The Python that builds the model `kwargs` (`timm_kwargs`) describes: `timm.create_model(name, **kwargs)`
  (the name of timm's model of those sizes, each argument given anyway), `ln_eps` as timm's norm_layer."""
  kw = dict(kwargs)
  eps = kw.pop("ln_eps")
  size = TIMM_SIZES.get((kw["embed_dim"], kw["depth"], kw["num_heads"], round(kw["mlp_ratio"] * kw["embed_dim"])))
  name = f"vit_{size}_patch{kw['patch_size']}_224"
  if name not in TIMM_NAMES:  # every argument is given: the name only picks timm's ViT builder
    name = "vit_base_patch16_224"
  args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
  norm = "" if eps == TIMM_LN_EPS else f", norm_layer=functools.partial(timm.layers.LayerNorm, eps={eps!r})"
  return f"timm.create_model({name!r}, pretrained=False, {args}{norm})"


def section_of(kwargs: dict, base: dict | None = None) -> dict:
  """A run's ViT backbone section from timm keyword arguments (`timm_kwargs`' form); `base`'s training keys (remat,
  dropout) kept."""
  pool = {v: k for k, v in POOLS.items()}[kwargs["global_pool"]]
  section = {k: v for k, v in dict(base or {}).items() if k in ("dropout",)}
  section.update(
    arch="vit",
    width=int(kwargs["embed_dim"]),
    depth=int(kwargs["depth"]),
    mlp_dim=int(round(kwargs["mlp_ratio"] * kwargs["embed_dim"])),
    num_heads=int(kwargs["num_heads"]),
    patch_size=int(kwargs["patch_size"]),
    pool_type=pool,
    posemb="learn",
    pre_norm=bool(kwargs["pre_norm"]),
    mlp_act=kwargs["act_layer"],
    ln_eps=float(kwargs["ln_eps"]),
    patch_bias=not kwargs["pre_norm"],
  )
  return section


# ------------------------------------------------------------------------------------------------------------------
# Export.
# ------------------------------------------------------------------------------------------------------------------
def state_dict(backbone_params: dict, pool_type: str) -> dict[str, np.ndarray]:
  """A ViT's parameters -> timm's names and layout (float32): the class token's position a zero row of
  pos_embed (timm's no_embed_class=False)."""
  flat = {f"params/backbone/{k}": np.asarray(v, np.float32) for k, v in flatten(backbone_params).items()}
  pe = flat.pop("params/backbone/pos_embedding")
  cls = flat.pop("params/backbone/cls", None)
  sd = KEY_MAP.to_foreign(flat)
  if pool_type == "tok":
    sd["cls_token"] = cls
    pe = np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)
  sd["pos_embed"] = pe
  return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run's ViT backbone as timm's VisionTransformer state dict to `out` (.safetensors); returns {'keys',
  'parameters', 'step', 'timm_kwargs', 'timm_code', 'official_config'} (the last printed by the export command)."""
  del overwrite  # one file, replaced atomically
  section = dict(run.config.method.get("backbone", {}))
  if section.get("arch", "resnet") != "vit":
    raise keymaps.NotExportable(
      f"{run.path}: --format=timm exports ViT backbones; this run's is {section.get('arch', 'resnet')!r} (export a "
      "ResNet with --format=torchvision: timm's ResNets use torchvision's names)."
    )
  _, variables = keymaps.refusal(runs.backbone_of, run)
  params = jax.device_get(variables["params"])
  if "pos_embedding" not in params:
    raise keymaps.NotExportable(
      f"{run.path}: the ViT has no learned position embedding (posemb={section.get('posemb')!r}); timm's "
      "VisionTransformer learns its position embedding."
    )
  n = int(np.shape(params["pos_embedding"])[1])
  grid = math.isqrt(n)
  kwargs = keymaps.refusal(timm_kwargs, section, grid)
  sd = state_dict(params, runs.backbone_architecture(section)["pool_type"])
  root = keymaps.out_root(out)
  safe_files.make_dirs(root)
  with safe_files.atomic_path(out, ".safetensors", root=root) as tmp:
    save_file(sd, tmp, metadata={"format": "pt", "source": run.path, METADATA_KEY: json.dumps(kwargs)})
  code = timm_code(kwargs)
  return {
    "keys": len(sd),
    "parameters": keymaps.parameter_count(sd),
    "step": run.step,
    "timm_kwargs": kwargs,
    "timm_code": code,
    "official_config": {"timm": f"import functools, timm; model = {code}; model.load_state_dict(sd, strict=True)"},
  }


# ------------------------------------------------------------------------------------------------------------------
# Import.
# ------------------------------------------------------------------------------------------------------------------
def file_kwargs(path: str) -> dict | None:
  """The `timm_kwargs` metadata of a .safetensors file this exporter wrote (its header only), or None."""
  if not path.endswith(".safetensors"):
    return None
  try:
    with safe_open(path, framework="numpy") as f:
      meta = f.metadata() or {}
  except Exception:  # noqa: BLE001 -- a header the reader refuses: the file's tensors are read (and refused) below
    return None
  if METADATA_KEY not in meta:
    return None
  try:
    kwargs = json.loads(meta[METADATA_KEY])
  except ValueError as e:
    raise BadFile(f"{path}: its {METADATA_KEY} metadata is not JSON ({e}).") from e
  if not isinstance(kwargs, dict):
    raise BadFile(f"{path}: its {METADATA_KEY} metadata is not an object of keyword arguments.")
  return kwargs


def architecture(sd: dict, given: dict) -> tuple[dict, dict]:
  """(timm kwargs, where the settings a state dict lacks came from) of a timm ViT state dict: sizes from the shapes,
  num_heads / act_layer / ln_eps from `given` (the file's metadata or the recipe's section) or timm's defaults."""
  w = sd["patch_embed.proj.weight"]
  if np.ndim(w) != 4 or w.shape[1] != 3 or w.shape[2] != w.shape[3]:
    raise ValueError(f"patch_embed.proj.weight is {tuple(np.shape(w))}; a ViT's is (width, 3, patch, patch).")
  width, patch = int(w.shape[0]), int(w.shape[2])
  depth = 0
  while f"blocks.{depth}.attn.qkv.weight" in sd:
    depth += 1
  mlp_dim = int(sd["blocks.0.mlp.fc1.weight"].shape[0])
  class_token = "cls_token" in sd
  pool = "map" if "attn_pool.latent" in sd else "token" if class_token else "avg"
  if "fc_norm.weight" in sd:
    raise ValueError(
      "The model has fc_norm (timm's 'avg' pooling normalises after the mean); vlrep's ViT (big_vision's) normalises "
      "the tokens before it. Build it with fc_norm=False to export it here."
    )
  if class_token and pool != "token":
    raise ValueError("The model has a class token but pools otherwise (global_pool='avg' or 'map' with a class token).")
  rows = int(sd["pos_embed"].shape[1])
  no_embed_class = not class_token or math.isqrt(rows) ** 2 == rows  # timm's no_embed_class=True: patches' only
  n = rows if no_embed_class else rows - 1
  grid = math.isqrt(n)
  if grid * grid != n:
    raise ValueError(f"pos_embed has {rows} rows, neither a square grid nor one with a class token's row.")
  source = {}
  defaults = {"num_heads": max(width // TIMM_HEAD_DIM, 1), "act_layer": TIMM_ACT, "ln_eps": TIMM_LN_EPS}
  settings = {}
  for key, default in defaults.items():
    settings[key] = given.get(key, default)
    source[key] = "given" if key in given else "timm's default"
  if width % settings["num_heads"]:
    raise ValueError(f"width {width} is not divisible by num_heads={settings['num_heads']}.")
  kwargs = dict(
    img_size=grid * patch,
    patch_size=patch,
    embed_dim=width,
    depth=depth,
    num_heads=int(settings["num_heads"]),
    mlp_ratio=mlp_dim / width,
    class_token=class_token,
    global_pool=pool,
    pre_norm="norm_pre.weight" in sd,
    act_layer=settings["act_layer"],
    ln_eps=float(settings["ln_eps"]),
    num_classes=0,
  )
  if class_token and no_embed_class:
    kwargs["no_embed_class"] = True
  return kwargs, source


def _cls_and_posemb(sd: dict, kwargs: dict) -> dict[str, np.ndarray]:
  """big_vision's `cls` (timm's class token plus its position embedding, which is added to it alone) and
  `pos_embedding` (the patches' rows)."""
  pe = np.asarray(sd["pos_embed"], np.float32)
  if not kwargs["class_token"]:
    return {"params/backbone/pos_embedding": pe}
  if kwargs.get("no_embed_class"):
    return {"params/backbone/cls": np.asarray(sd["cls_token"], np.float32), "params/backbone/pos_embedding": pe}
  cls = np.asarray(sd["cls_token"], np.float32) + pe[:, :1]
  return {"params/backbone/cls": cls, "params/backbone/pos_embedding": pe[:, 1:]}


def expected_shapes(section: dict, image_size: int) -> dict[str, tuple]:
  net = vit.from_config(section)
  shapes = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros((1, image_size, image_size, 3))))
  return {f"params/backbone/{k}": tuple(s.shape) for k, s in flatten(shapes["params"]).items()}


def read(
  checkpoint: str,
  vocab: str | None = None,
  *,
  contents: Any = None,
  config: ConfigDict | None = None,
  workdir: str | None = None,
) -> ImportedRun:
  """A backbone-only run of a timm VisionTransformer state dict (its head, if any, dropped and named)."""
  del workdir  # the run keeps no files besides its checkpoints
  if vocab:
    raise UserError("--vocab applies to text models; a timm ViT checkpoint is a backbone alone.")
  sd = tv.read_state_dict(checkpoint, contents)
  _, missing, _ = score(set(sd))
  if missing:
    raise tv.no_format(checkpoint, set(sd))
  base = dict(config.method.get("backbone", {})) if config is not None and "method" in config else {}
  given = file_kwargs(checkpoint) or (
    {"num_heads": base["num_heads"], "act_layer": base.get("mlp_act", TIMM_ACT), "ln_eps": base.get("ln_eps", 1e-6)}
    if base.get("arch") == "vit" and "num_heads" in base
    else {}
  )
  with tv.tensors_of(checkpoint, "timm VisionTransformer"):
    kwargs, source = architecture(sd, given)
    section = section_of(kwargs, base)
    special = _cls_and_posemb(sd, kwargs)
    shapes = expected_shapes(section, kwargs["img_size"])
    expected = {k: v for k, v in shapes.items() if k not in special}
    rest = {k: v for k, v in sd.items() if k not in SPECIAL}
    converted = KEY_MAP.to_vlrep(rest, expected)
    for k, v in special.items():
      want = shapes[k]
      if v.shape != want:
        raise ValueError(f"{k} is {v.shape} from the checkpoint's cls_token/pos_embed; the ViT needs {want}.")
  params = runs.unflatten({**converted.variables, **special})["params"]
  c = ConfigDict((config if config is not None else default_config(kwargs["img_size"])).to_dict())
  method = dict(c.get("method", default_config(kwargs["img_size"]).method))
  method["backbone"] = section
  method["dtype"] = "float32"
  c.method = method
  if "init_from" in c:
    c.init_from = ""
  note = {
    "format": "timm",
    "source": checkpoint,
    "timm_kwargs": kwargs,
    "settings_not_in_the_state_dict": source,
    "dropped": {k: f"shape {v}: the classifier head, not part of a backbone run" for k, v in converted.dropped.items()},
  }
  return ImportedRun(config=c, params=params, model_state={}, note=note)


def default_config(image_size: int) -> ConfigDict:
  """An imported timm ViT's config when no --config names a recipe: an ImageNet classifier at the size its
  position embedding was trained for (resize to 8/7 of it, centre crop), as torchvision's format builds one."""
  c = tv.default_config()
  c.data.pp = f"decode|resize_small({image_size * 8 // 7})|central_crop({image_size})|normalize"
  return c
