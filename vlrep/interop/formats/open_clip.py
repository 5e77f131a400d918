"""open_clip and OpenAI CLIP checkpoints <-> vlrep CLIP runs: ViT and ModifiedResNet (RN50, ...) image towers, CLIP's
text transformer, the projections and `logit_scale`.

  python -m vlrep.interop.import_run --format=open_clip --checkpoint=ViT-B-32.safetensors --workdir=/runs/clip_b32
  python -m vlrep.interop.import_run --format=auto --checkpoint=RN50.pt --workdir=/runs/clip_rn50   # OpenAI's .pt
  python -m vlrep.interop.export --workdir=/runs/clip_b32 --format=open_clip --out=ViT-B-32.safetensors

What is read: `model.state_dict()` of an `open_clip.create_model(name)` CLIP (saved with torch.save, or as
safetensors; `{"state_dict": ...}` wrappers and a 'module.' prefix are accepted), and OpenAI's own `.pt` files, which
are TorchScript archives: their tensors are read as data through vlrep.torch_files' restricted unpickler (the
archive's classes are stand-ins that only hold attributes; its code/ folder is never read or run), and the
attributes OpenAI's model keeps beside its weights (`input_resolution`, `context_length`, `vocab_size`, each
block's `attn_mask`) are dropped and named in the note.

Every size comes from the tensors' shapes: the image tower (a ViT if `visual.class_embedding` exists: width, depth,
MLP width, patch size, the image size from the position embeddings; a ModifiedResNet if `visual.layer1.0.conv1`
does: blocks per stage, stem width, the image size from the attention pool's position embeddings), the text tower
(width, depth, MLP width, context length, vocabulary) and the joint embedding width. Attention heads are width / 64
in both towers, as in every open_clip and OpenAI CLIP config. What the tensors cannot tell is the MLPs' activation:
open_clip's configs use nn.GELU (exact), OpenAI's models and open_clip's `-quickgelu` configs QuickGELU. `quick_gelu`
(`--quick_gelu`) says it; unset, it is QuickGELU for an OpenAI TorchScript archive or a file whose name says
'quickgelu' or 'openai', else GELU; the note records which and why.

The run: method 'clip' (softmax loss) whose image tower is vlrep's ViT (pool_type 'tok', CLIP's `ln_pre` as
pre_norm, no patch bias, LayerNorm epsilon 1e-5; the class token's position embedding folded into `cls`, so the
position embeddings are the patches' only) projected by `visual_projection` (open_clip's `visual.proj`), or the
ModifiedResNet (`arch='modified_resnet'`) with CLIPModel's attention pooling (`pool='attention'`: open_clip's
`visual.attnpool`, its output projection `c_proj` the embedding); its text tower vlrep.models.text_transformer
(causal, pooled at the highest token id: <end_of_text>); `text_projection`, `logit_scale`. The tokenizer is CLIP's
BPE (vlrep.data.clip_bpe, `tokenizer.kind='clip_bpe'`): the merges file (`--vocab`, else the one inside an
installed open-clip-torch) is copied into the run. The preprocessing is CLIP's: shorter side resized to the image
size, centre crop, OpenAI's mean and std. Compute in float32.

Export writes every key `open_clip.create_model(name)` has (`load_state_dict(sd, strict=True)`): the name is
reported (`ViT-B-32`, `RN50`, with `-quickgelu` for QuickGELU). The folded class token is written as
`visual.class_embedding` with a zero position embedding in `visual.positional_embedding[0]`: the same function (the
split of the sum is not kept). BatchNorm counters imported are written back.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from vlrep import safe_files, torch_files
from vlrep.data import clip_bpe
from vlrep.errors import BadFile, UserError
from vlrep.interop import keymaps
from vlrep.interop.formats import torchvision as tv
from vlrep.interop.keymaps import ImportedRun, KeyMap, flatten, rule
from vlrep.methods import clip as clip_method
from vlrep.models import modified_resnet
from vlrep.runs import unflatten

DESCRIPTION = "open_clip CLIP state dict (ViT or ModifiedResNet; .pth/.pt/.bin/.safetensors) or OpenAI's CLIP .pt"
OUT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
ANCHORS = ("visual.conv1.weight", "token_embedding.weight", "positional_embedding", "text_projection", "logit_scale")
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, every LayerNorm of open_clip's and OpenAI's CLIP
HEAD_WIDTH = 64  # attention heads = width / 64 in every open_clip and OpenAI CLIP config
# OpenAI's preprocessing (open_clip.constants.OPENAI_DATASET_MEAN / _STD), bicubic resize of the shorter side.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# What OpenAI's TorchScript model keeps beside its weights: hyper-parameters as 0-d tensors, the causal mask.
OPENAI_EXTRAS = ("input_resolution", "context_length", "vocab_size")
# open_clip's config names of the towers (their state dict shapes), for export's message.
VIT_NAMES = {(768, 12, 32): "ViT-B-32", (768, 12, 16): "ViT-B-16", (1024, 24, 14): "ViT-L-14"}
RESNET_NAMES = {(layers, width): name for name, (layers, width) in modified_resnet.VARIANTS.items()}


# ------------------------------------------------------------------------------------------------------------------
# The key map.
# ------------------------------------------------------------------------------------------------------------------
def encoder_rules(ours: str, theirs: str) -> list:
  """open_clip's `Transformer` (`resblocks.{i}`: ln_1, attn, ln_2, mlp.c_fc, mlp.c_proj) <-> vit.Encoder's blocks
  (the final LayerNorm is the caller's: ln_post or ln_final)."""
  v, f = f"{ours}/encoderblock_{{}}", f"{theirs}.resblocks.{{}}"
  a, b = f"{v}/MultiHeadDotProductAttention_0", f"{f}.attn"
  out = []
  for i, name in enumerate(("query", "key", "value")):
    out += [
      rule(f"{a}/{name}/kernel", f"{b}.in_proj_weight", transform="heads_in", part=(i, 3)),
      rule(f"{a}/{name}/bias", f"{b}.in_proj_bias", transform="heads_bias", part=(i, 3)),
    ]
  out += [
    rule(f"{a}/out/kernel", f"{b}.out_proj.weight", transform="heads_out"),
    rule(f"{a}/out/bias", f"{b}.out_proj.bias"),
    rule(None, f"{f}.attn_mask", absent="dropped"),  # OpenAI's TorchScript: the causal mask as an attribute
  ]
  for ln, their_ln in (("LayerNorm_0", "ln_1"), ("LayerNorm_1", "ln_2")):
    out += [rule(f"{v}/{ln}/scale", f"{f}.{their_ln}.weight"), rule(f"{v}/{ln}/bias", f"{f}.{their_ln}.bias")]
  for dense, their_dense in (("Dense_0", "c_fc"), ("Dense_1", "c_proj")):
    out += [
      rule(f"{v}/MlpBlock_0/{dense}/kernel", f"{f}.mlp.{their_dense}.weight", transform="linear"),
      rule(f"{v}/MlpBlock_0/{dense}/bias", f"{f}.mlp.{their_dense}.bias"),
    ]
  return out


def layer_norm(ours: str, theirs: str) -> list:
  return [rule(f"{ours}/scale", f"{theirs}.weight"), rule(f"{ours}/bias", f"{theirs}.bias")]


def text_rules() -> list:
  t = "params/textual"
  return [
    rule(f"{t}/Embed_0/embedding", "token_embedding.weight"),
    rule(f"{t}/pos_embedding", "positional_embedding"),  # [1, L, W] <- [L, W] (`_prepared`)
    *encoder_rules(f"{t}/Transformer", "transformer"),
    *layer_norm(f"{t}/Transformer/encoder_norm", "ln_final"),
    rule("params/text_projection/kernel", "text_projection"),  # x @ text_projection: a Dense kernel as it is
    rule("params/logit_scale", "logit_scale"),
    *(rule(None, name, absent="dropped") for name in OPENAI_EXTRAS),
    rule(None, "attn_mask", absent="dropped"),  # a TorchScript archive's causal mask (open_clip's, unsaved buffer)
  ]


def vit_rules() -> list:
  v = "params/backbone"
  return [
    rule(f"{v}/embedding/kernel", "visual.conv1.weight", transform="conv"),
    rule(f"{v}/cls", "visual.class_embedding"),  # [1, 1, C] <- class embedding + its position embedding
    rule(f"{v}/pos_embedding", "visual.positional_embedding"),  # [1, N, C] <- the patches' rows
    *layer_norm(f"{v}/pre_norm", "visual.ln_pre"),
    *encoder_rules(f"{v}/Transformer", "visual.transformer"),
    *layer_norm(f"{v}/Transformer/encoder_norm", "visual.ln_post"),
    rule("params/visual_projection/kernel", "visual.proj"),
  ]


def resnet_rules() -> list:
  """open_clip's ModifiedResNet and AttentionPool2d <-> vlrep.models.modified_resnet and clip.AttentionPool."""

  def conv(ours, theirs):
    return [rule(f"params/backbone/{ours}/kernel", f"visual.{theirs}.weight", transform="conv")]

  def bn(ours, theirs):
    return [
      rule(f"params/backbone/{ours}/scale", f"visual.{theirs}.weight"),
      rule(f"params/backbone/{ours}/bias", f"visual.{theirs}.bias"),
      rule(f"batch_stats/backbone/{ours}/mean", f"visual.{theirs}.running_mean"),
      rule(f"batch_stats/backbone/{ours}/var", f"visual.{theirs}.running_var"),
      rule(None, f"visual.{theirs}.num_batches_tracked", absent="counter"),
    ]

  block = "layer{}_block{}", "layer{}.{}"
  p, f = "params/attention_pool", "visual.attnpool"
  out = [
    *conv("conv{}", "conv{}"),
    *bn("bn{}", "bn{}"),
    *conv(f"{block[0]}/conv{{}}", f"{block[1]}.conv{{}}"),
    *bn(f"{block[0]}/bn{{}}", f"{block[1]}.bn{{}}"),
    *conv(f"{block[0]}/downsample_conv", f"{block[1]}.downsample.0"),
    *bn(f"{block[0]}/downsample_bn", f"{block[1]}.downsample.1"),
    rule(f"{p}/position_embedding", f"{f}.positional_embedding"),
  ]
  for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
    out += [
      rule(f"{p}/{ours}/kernel", f"{f}.{theirs}.weight", transform="heads_in"),
      rule(f"{p}/{ours}/bias", f"{f}.{theirs}.bias", transform="heads_bias"),
    ]
  return out + [
    rule(f"{p}/out/kernel", f"{f}.c_proj.weight", transform="heads_out"),
    rule(f"{p}/out/bias", f"{f}.c_proj.bias"),
  ]


def key_map(tower: str) -> KeyMap:
  return KeyMap(f"open_clip CLIP ({tower})", (vit_rules() if tower == "vit" else resnet_rules()) + text_rules())


_MATCHING = KeyMap("open_clip CLIP", vit_rules() + resnet_rules() + text_rules())


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  keys = set(keys)
  if not keys:
    return 0.0, list(ANCHORS), []
  matched = {k for k in keys if _MATCHING.matches(k)}
  missing = [a for a in ANCHORS if a not in keys]
  return len(matched) / len(keys) * (1 - len(missing) / len(ANCHORS)), missing, sorted(keys - matched)


# ------------------------------------------------------------------------------------------------------------------
# Sizes from the tensors.
# ------------------------------------------------------------------------------------------------------------------
def _count(sd: dict, pattern: str) -> int:
  n = 0
  while pattern.format(n) in sd:
    n += 1
  return n


def _shape(sd: dict, key: str, ndim: int) -> tuple[int, ...]:
  if key not in sd:
    raise ValueError(f"No {key}: the checkpoint lacks a tensor every CLIP of this kind has.")
  shape = tuple(int(s) for s in np.shape(sd[key]))
  if len(shape) != ndim:
    raise ValueError(f"{key} is {shape}; a CLIP's has {ndim} dimensions.")
  return shape


def _heads(width: int, where: str) -> int:
  if width % HEAD_WIDTH:
    raise ValueError(f"The {where} is {width} wide, not a multiple of CLIP's attention head width {HEAD_WIDTH}.")
  return width // HEAD_WIDTH


def image_tower(sd: dict) -> tuple[str, dict, int]:
  """('vit' | 'modified_resnet', the backbone config section (no activation yet), the image size)."""
  if "visual.class_embedding" in sd:
    width, channels, patch, patch_w = _shape(sd, "visual.conv1.weight", 4)
    positions = _shape(sd, "visual.positional_embedding", 2)[0] - 1
    side = math.isqrt(positions)
    if channels != 3 or patch != patch_w or side * side != positions:
      raise ValueError(
        f"visual.conv1.weight {(width, channels, patch, patch_w)} and {positions + 1} position embeddings: not a "
        "ViT of square RGB patches on a square grid (with its class token)."
      )
    depth = _count(sd, "visual.transformer.resblocks.{}.ln_1.weight")
    mlp_dim = _shape(sd, "visual.transformer.resblocks.0.mlp.c_fc.weight", 2)[0]
    section = dict(
      arch="vit",
      width=width,
      depth=depth,
      mlp_dim=mlp_dim,
      num_heads=_heads(width, "ViT"),
      patch_size=patch,
      pool_type="tok",
      posemb="learn",
      pre_norm=True,
      ln_eps=LN_EPS,
      patch_bias=False,
    )
    return "vit", section, side * patch
  if "visual.layer1.0.conv1.weight" in sd:
    layers = tuple(_count(sd, f"visual.layer{s}.{{}}.conv1.weight") for s in range(1, 5))
    width = _shape(sd, "visual.conv3.weight", 4)[0]
    positions = _shape(sd, "visual.attnpool.positional_embedding", 2)[0] - 1
    side = math.isqrt(positions)
    if side * side != positions:
      raise ValueError(f"visual.attnpool.positional_embedding has {positions + 1} rows: not 1 + a square grid.")
    _heads(width * 32, "attention pool")
    return "modified_resnet", dict(arch="modified_resnet", layers=list(layers), width=width), side * 32
  raise ValueError("Neither visual.class_embedding (a ViT) nor visual.layer1.0.conv1.weight (a ModifiedResNet).")


def text_tower(sd: dict) -> dict:
  """The text section (text_transformer.TextTransformer's fields, no activation yet)."""
  vocab, width = _shape(sd, "token_embedding.weight", 2)
  del vocab
  return dict(
    arch="transformer",
    width=width,
    depth=_count(sd, "transformer.resblocks.{}.ln_1.weight"),
    num_heads=_heads(width, "text transformer"),
    mlp_dim=_shape(sd, "transformer.resblocks.0.mlp.c_fc.weight", 2)[0],
    max_len=_shape(sd, "positional_embedding", 2)[0],
    causal=True,
    pool="argmax",
    ln_eps=LN_EPS,
  )


def embed_dim(sd: dict, tower: str) -> int:
  text = _shape(sd, "text_projection", 2)[1]
  image = _shape(sd, "visual.proj", 2)[1] if tower == "vit" else _shape(sd, "visual.attnpool.c_proj.weight", 2)[0]
  if image != text:
    raise ValueError(f"The image embedding is {image} wide and the text embedding {text}: not one joint space.")
  return text


def activation(checkpoint: str, quick_gelu: bool | None, torchscript: bool) -> tuple[str, str]:
  """(mlp_act, why) of the MLPs (module docstring)."""
  if quick_gelu is not None:
    return ("quick_gelu" if quick_gelu else "gelu"), "--quick_gelu" if quick_gelu else "--noquick_gelu"
  if torchscript:
    return "quick_gelu", "an OpenAI TorchScript archive (OpenAI's models use QuickGELU)"
  name = os.path.basename(checkpoint).lower()
  if "quickgelu" in name or "openai" in name:
    return "quick_gelu", f"the file name {os.path.basename(checkpoint)!r} (QuickGELU: OpenAI's / -quickgelu)"
  return "gelu", "open_clip's default nn.GELU (pass --quick_gelu for OpenAI's weights or a -quickgelu config)"


# ------------------------------------------------------------------------------------------------------------------
# Import.
# ------------------------------------------------------------------------------------------------------------------
def _prepared(sd: dict, tower: str) -> dict:
  """The state dict with the tensors whose layout differs beyond the key map's transforms in vlrep's: the class
  token with its position embedding folded in [1, 1, C], the patches' position embeddings [1, N, C], the text's
  [1, L, W]."""
  sd = dict(sd)
  if tower == "vit":
    pos = np.asarray(sd["visual.positional_embedding"], np.float32)
    cls = np.asarray(sd["visual.class_embedding"], np.float32)
    if cls.shape != pos.shape[1:]:
      raise ValueError(f"visual.class_embedding is {cls.shape}; position embeddings {pos.shape} need {pos.shape[1:]}.")
    sd["visual.class_embedding"] = (cls + pos[0])[None, None]
    sd["visual.positional_embedding"] = pos[1:][None]
  sd["positional_embedding"] = np.asarray(sd["positional_embedding"])[None]
  return sd


def default_config(image_size: int, max_len: int) -> ConfigDict:
  """An imported CLIP run's data section when no --config names a recipe: the model as published (CLIP's
  evaluation preprocessing at its image size, texts of its context length); nothing about training it further."""
  normalize = f"normalize(mean={CLIP_MEAN}, std={CLIP_STD})"
  pp = f"decode|resize_small({image_size})|central_crop({image_size})|{normalize}|choose_caption(5)|tokenize({max_len})"
  return ConfigDict(dict(data=dict(name="coco_captions2017", split="train", data_dir="", config_name="", pp=pp)))


def run_config(base: ConfigDict | None, backbone: dict, text: dict, dim: int, tower: str, image_size: int, vocab: str):
  c = ConfigDict((base if base is not None else default_config(image_size, text["max_len"])).to_dict())
  method = dict(c.get("method", {}))
  for key in ("text_tower", "bert_path", "bert_layers", "bert_dropout", "image_projection", "text_projection_bias"):
    method.pop(key, None)
  method.update(
    name="clip",
    backbone=backbone,
    text=text,
    embed_dim=dim,
    pool="attention" if tower == "modified_resnet" else "avg",
    loss="softmax",
    dtype="float32",
  )
  c.method = method
  c.tokenizer = dict(kind="clip_bpe", path=vocab)
  if "init_from" in c:
    c.init_from = ""
  return c


def expected_shapes(config: ConfigDict, vocab_size: int, image_size: int) -> dict[str, tuple]:
  method = clip_method.Method(config.method, vocab_size)
  batch = {
    "image": jnp.zeros((1, image_size, image_size, 3)),
    "tokens": jnp.zeros((1, config.method.text["max_len"]), jnp.int32),
  }
  shapes = jax.eval_shape(method.init, jax.random.PRNGKey(0), batch)
  return {f"{coll}/{p}": tuple(s.shape) for coll in shapes for p, s in flatten(shapes[coll]).items()}


def vocabulary(vocab: str | None) -> str:
  """The merges file to copy into the run: --vocab, else the one inside an installed open-clip-torch."""
  if vocab:
    clip_bpe.read_merges(vocab)  # a file that is not one is refused before the checkpoint is read
    return vocab
  found = clip_bpe.installed_vocabulary()
  if found is None:
    raise UserError(
      f"A CLIP run needs CLIP's tokenizer: pass --vocab={clip_bpe.VOCAB_FILE} (inside the open-clip-torch package, "
      "or OpenAI's clip package), or install open-clip-torch, whose copy is then used."
    )
  return found


def read(
  checkpoint: str,
  vocab: str | None = None,
  *,
  contents: Any = None,
  config: ConfigDict | None = None,
  workdir: str | None = None,
  quick_gelu: bool | None = None,
) -> ImportedRun:
  """An open_clip state dict or OpenAI CLIP .pt as a vlrep CLIP run (module docstring). `config`: a recipe to start
  the run's config from; `workdir`: where the run goes (the vocabulary is copied to WORKDIR/vocab/);
  `quick_gelu`: the MLPs' activation (None: detected, see `activation`)."""
  vocab = vocabulary(vocab)
  sd = tv.read_state_dict(checkpoint, contents)
  keys = set(sd)
  _, missing, _ = score(keys)
  if missing:
    raise tv.no_format(checkpoint, keys)
  torchscript = torch_files.is_torchscript(checkpoint)
  act, why = activation(checkpoint, quick_gelu, torchscript)
  with tv.tensors_of(checkpoint, "open_clip CLIP"):
    tower, backbone, image_size = image_tower(sd)
    text = text_tower(sd)
    dim = embed_dim(sd, tower)
    if tower == "vit":
      backbone["mlp_act"] = act
    text["mlp_act"] = act
    vocab_size = int(sd["token_embedding.weight"].shape[0])
    if vocab_size != clip_bpe.VOCAB_SIZE:
      raise BadFile(
        f"{checkpoint}: token_embedding.weight has {vocab_size} rows; CLIP's BPE vocabulary has {clip_bpe.VOCAB_SIZE} "
        "ids. A CLIP with another tokenizer (an open_clip model with a Hugging Face text tower) is not this format."
      )
  run_vocab = os.path.join(os.path.abspath(workdir), "vocab", clip_bpe.VOCAB_FILE) if workdir else vocab
  c = run_config(config, backbone, text, dim, tower, image_size, run_vocab)
  expected = expected_shapes(c, vocab_size, image_size)
  with tv.tensors_of(checkpoint, "open_clip CLIP"):
    converted = key_map(tower).to_vlrep(_prepared(sd, tower), expected)
  variables = unflatten(converted.variables)
  dropped = {k: f"shape {v}: OpenAI's TorchScript attribute, not a weight" for k, v in converted.dropped.items()}
  note = {
    "format": "open_clip",
    "source": checkpoint,
    "torchscript": torchscript,
    "vocabulary": vocab,
    "image_tower": tower,
    "image_size": image_size,
    "mlp_act": act,
    "mlp_act_from": why,
    "counters": converted.counters,
    "dropped": dropped,
    "class_token": "visual.class_embedding + visual.positional_embedding[0] folded into backbone/cls"
    if tower == "vit"
    else "",
  }
  model_state = {"batch_stats": variables["batch_stats"]} if "batch_stats" in variables else {}
  return ImportedRun(
    config=c,
    params=variables["params"],
    model_state=model_state,
    note=note,
    files={os.path.join("vocab", clip_bpe.VOCAB_FILE): vocab} if workdir else {},
  )


# ------------------------------------------------------------------------------------------------------------------
# Export.
# ------------------------------------------------------------------------------------------------------------------
def _exportable(run) -> str:
  """The run's image tower ('vit' or 'modified_resnet') when open_clip's CLIP holds it; else a ValueError saying why
  (turned into a NotExportable by keymaps.refusal)."""
  m = run.config.method
  if m.get("name") != "clip" or m.get("loss", "softmax") != "softmax":
    raise ValueError(f"{run.path}: --format=open_clip exports CLIP runs (method 'clip', softmax loss).")
  text = dict(m.get("text", {}))
  if text.get("arch") != "transformer" or not text.get("causal", True) or text.get("pool", "argmax") != "argmax":
    raise ValueError(
      f"{run.path}: the text tower is not open_clip's (text.arch='transformer', causal, pooled at the highest id); "
      "vlrep's own text towers have other layers."
    )
  if m.get("text_projection_bias", False) or not m.get("image_projection", True):
    raise ValueError(f"{run.path}: open_clip's CLIP has unbiased projections of both towers.")
  b = dict(m.get("backbone", {}))
  arch = b.get("arch", "resnet")
  if arch == "vit":
    wanted = {"pool_type": "tok", "posemb": "learn", "pre_norm": True, "patch_bias": False, "ln_eps": LN_EPS}
    bad = {k: b.get(k) for k, v in wanted.items() if b.get(k) != v}
    if bad or m.get("pool", "avg") != "avg" or b.get("mlp_act") not in ("gelu", "quick_gelu"):
      raise ValueError(
        f"{run.path}: the ViT differs from open_clip's ({bad or b.get('mlp_act')}); open_clip's has {wanted} and a "
        "GELU or QuickGELU MLP."
      )
  elif arch == "modified_resnet":
    if m.get("pool") != "attention":
      raise ValueError(f"{run.path}: a ModifiedResNet exports with CLIP's attention pool (method.pool='attention').")
  else:
    raise ValueError(f"{run.path}: open_clip's CLIP image towers are a ViT or a ModifiedResNet; this one is {arch!r}.")
  if text.get("ln_eps", LN_EPS) != LN_EPS or text.get("mlp_act") not in ("gelu", "quick_gelu"):
    raise ValueError(f"{run.path}: the text tower's LayerNorm epsilon or activation is not open_clip's.")
  return arch


def state_dict(run) -> tuple[dict, str]:
  """(open_clip's state dict as numpy arrays, the open_clip model name that loads it strictly) of a run."""
  tower = keymaps.refusal(_exportable, run)
  flat = {f"params/{k}": np.asarray(v) for k, v in flatten(run.params).items()}
  flat.update({f"batch_stats/{k}": np.asarray(v) for k, v in flatten(run.model_state.get("batch_stats", {})).items()})
  sd = key_map("vit" if tower == "vit" else "modified_resnet").to_foreign(flat)
  sd["positional_embedding"] = sd["positional_embedding"][0]
  m = run.config.method
  if tower == "vit":
    cls = sd["visual.class_embedding"].reshape(-1)
    patches = sd["visual.positional_embedding"][0]
    sd["visual.class_embedding"] = cls
    sd["visual.positional_embedding"] = np.concatenate([np.zeros_like(cls)[None], patches])
    b = m.backbone
    name = VIT_NAMES.get((b["width"], b["depth"], b["patch_size"]), f"a ViT of width {b['width']}")
  else:
    b = m.backbone
    name = RESNET_NAMES.get((tuple(b.get("layers", (3, 4, 6, 3))), b.get("width", 64)), "a ModifiedResNet")
  if m.text.get("mlp_act") == "quick_gelu":
    name += "-quickgelu"
  counters = run.meta.get("import", {}).get("counters", {})
  out = {}
  for key, value in sd.items():
    out[key] = np.array(value, np.float32)  # a C-contiguous copy (a 0-d tensor stays 0-d: logit_scale)
    if key.endswith(".running_var"):
      counter = key[: -len("running_var")] + "num_batches_tracked"
      out[counter] = np.array(counters.get(counter, 0), np.int64)
  return out, name


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run as open_clip's state dict to `out` (.safetensors, or .pth/.pt/.bin with torch.save); returns
  {'keys', 'parameters', 'step', 'open_clip_model', 'notes'} (the export command prints the notes: how to load it)."""
  del overwrite  # one file, replaced atomically
  sd, name = state_dict(run)
  root = keymaps.out_root(out)
  safe_files.make_dirs(root)
  if out.endswith(".safetensors"):
    with safe_files.atomic_path(out, ".safetensors", root=root) as tmp:
      save_file(sd, tmp, metadata={"format": "pt", "open_clip": name})
  else:
    torch = keymaps.require_torch("Writing .pth needs PyTorch; install torch or export to .safetensors instead.")
    with safe_files.atomic_path(out, os.path.splitext(out)[1], root=root) as tmp:
      torch.save({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, tmp)
  load = f"open_clip.create_model({name!r}, pretrained=None).load_state_dict(sd, strict=True) loads it"
  return {
    "keys": len(sd),
    "parameters": keymaps.parameter_count(sd),
    "step": run.step,
    "open_clip_model": name,
    "notes": [load],
  }
