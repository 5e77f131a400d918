"""Hugging Face SigLIP in and out: a `transformers.SiglipModel` folder (config.json and model.safetensors; e.g.
google/siglip-base-patch16-224) <-> a vlrep SigLIP run (vlrep.models.clip with the sigmoid loss) that computes
what the checkpoint computes.

  python -m vlrep.interop.import_run --format=hf_siglip --checkpoint=siglip-base-patch16-224/ --workdir=/runs/siglip
  python -m vlrep.interop.export --workdir=/runs/siglip --format=hf_siglip --out=siglip_hf

Image tower: vlrep's ViT with MAP pooling (`vision_model.head`: the probe, torch's MultiheadAttention whose fused
in_proj holds query, key and value, its LayerNorm and MLP), `post_layernorm` = the encoder's final LayerNorm, a patch
bias, no class token, tanh-approximated GELU (`gelu_pytorch_tanh`), LayerNorm epsilon 1e-6; its pooled vector is the
embedding (`image_projection=False`). Text tower: no mask, the last position's state (texts are padded to the full
length), `final_layer_norm`, then `head` (a projection with a bias: `text_projection_bias=True`). The loss is
SigLIP's sigmoid loss with t' = `logit_scale` and b = `logit_bias` (logits t * cos + b, t = exp(t')). The tokenizer
is SigLIP's SentencePiece model (vlrep.data.siglip_tokenizer, `tokenizer.kind='siglip'`): the folder's
spiece.model is copied into the run when it has one.

Folders are read and written as hf_clip's (config.json, safetensors only, no code hook).
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
from ml_collections import ConfigDict

from vlrep.errors import BadFile, UserError
from vlrep.interop import keymaps
from vlrep.interop.formats import hf_clip
from vlrep.interop.formats.hf_clip import linear, norm
from vlrep.interop.keymaps import ImportedRun, KeyMap, flatten, rule

DESCRIPTION = "Hugging Face SiglipModel folder (config.json + model.safetensors): a SigLIP run (ViT with MAP head)"
OUT_SUFFIXES = ()  # export writes a folder

# SigLIP's image normalisation (transformers' SiglipImageProcessor and big_vision: [-1, 1]).
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
VOCAB_FILE = "spiece.model"


def map_head_rules(vlrep: str, foreign: str) -> list:
  """vit.MAPHead <-> transformers' SiglipMultiheadAttentionPoolingHead (torch MultiheadAttention: in_proj_weight
  [3 * C, C] holds query, key and value)."""
  attention = f"{vlrep}/MultiHeadDotProductAttention_0"
  rules = [rule(f"{vlrep}/probe", f"{foreign}.probe")]
  for i, name in enumerate(("query", "key", "value")):
    rules += [
      rule(f"{attention}/{name}/kernel", f"{foreign}.attention.in_proj_weight", transform="heads_in", part=(i, 3)),
      rule(f"{attention}/{name}/bias", f"{foreign}.attention.in_proj_bias", transform="heads_bias", part=(i, 3)),
    ]
  return rules + [
    rule(f"{attention}/out/kernel", f"{foreign}.attention.out_proj.weight", transform="heads_out"),
    rule(f"{attention}/out/bias", f"{foreign}.attention.out_proj.bias"),
    *norm(f"{vlrep}/LayerNorm_0", f"{foreign}.layernorm"),
    *linear(f"{vlrep}/MlpBlock_0/Dense_0", f"{foreign}.mlp.fc1"),
    *linear(f"{vlrep}/MlpBlock_0/Dense_1", f"{foreign}.mlp.fc2"),
  ]


def siglip_rules() -> list:
  """vlrep's SigLIP variables <-> transformers' SiglipModel names (the position embeddings: `EMBEDDINGS`)."""
  b = "params/backbone"
  return [
    rule(f"{b}/embedding/kernel", "vision_model.embeddings.patch_embedding.weight", transform="conv"),
    rule(f"{b}/embedding/bias", "vision_model.embeddings.patch_embedding.bias"),
    *hf_clip.encoder_rules(f"{b}/Transformer", "vision_model.encoder", "vision_model.post_layernorm"),
    *map_head_rules(f"{b}/MAPHead_0", "vision_model.head"),
    *hf_clip.text_rules(),
    *linear("params/text_projection", "text_model.head"),
    # SiglipModel's scalars are [1] tensors (heads_bias: reshaped to vlrep's scalar and back).
    rule("params/t_prime", "logit_scale", transform="heads_bias"),
    rule("params/logit_bias", "logit_bias", transform="heads_bias"),
    rule(None, "vision_model.embeddings.position_ids", absent="dropped"),
  ]


VISION_POSITIONS = {"params/backbone/pos_embedding": "vision_model.embeddings.position_embedding.weight"}
POSITIONS = {**hf_clip.TEXT_POSITIONS, **VISION_POSITIONS}
EMBEDDINGS = tuple(POSITIONS.values())


def embeddings_in(sd: dict, expected: dict) -> dict:
  return {p: hf_clip.positions_in(sd, k, expected[p], p) for p, k in POSITIONS.items()}


def embeddings_out(flat: dict) -> dict:
  return {k: np.asarray(flat[p])[0] for p, k in POSITIONS.items()}


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  """How well a state dict's keys are a SiglipModel's (`keymaps` contract)."""
  rules = siglip_rules()
  return hf_clip.score_keys(keys, KeyMap("HF SigLIP", rules), hf_clip.needed_keys(rules, EMBEDDINGS), EMBEDDINGS)


def siglip_method(cfg: dict, where: str) -> tuple[dict, int, int]:
  """(the method section, vocabulary size, image size) of a SiglipConfig's config.json."""
  v, t = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
  if not v.get("vision_use_head", True):
    raise UserError(
      f"{where}: vision_use_head is false (a vision tower without its pooling head); a SigLIP run embeds images "
      "with the MAP head, which this checkpoint lacks."
    )
  try:
    width = int(v.get("hidden_size", 768))
    text_width = int(t.get("hidden_size", 768))
    embed_dim = int(t.get("projection_size") or text_width)
    if embed_dim != width:
      raise UserError(
        f"{where}: the text head projects to {embed_dim} dims but the image tower's MAP output has {width}: "
        "SigLIP compares them directly."
      )
    backbone = dict(
      arch="vit",
      width=width,
      depth=int(v.get("num_hidden_layers", 12)),
      mlp_dim=int(v.get("intermediate_size", 3072)),
      num_heads=int(v.get("num_attention_heads", 12)),
      patch_size=int(v.get("patch_size", 16)),
      pool_type="map",
      posemb="learn",
      pre_norm=False,
      mlp_act=hf_clip.activation(v.get("hidden_act", "gelu_pytorch_tanh"), f"{where} vision_config"),
      ln_eps=float(v.get("layer_norm_eps", 1e-6)),
      patch_bias=True,
    )
    text = dict(
      arch="transformer",
      width=text_width,
      depth=int(t.get("num_hidden_layers", 12)),
      num_heads=int(t.get("num_attention_heads", 12)),
      mlp_dim=int(t.get("intermediate_size", 3072)),
      max_len=int(t.get("max_position_embeddings", 64)),
      causal=False,
      pool="last",
      mlp_act=hf_clip.activation(t.get("hidden_act", "gelu_pytorch_tanh"), f"{where} text_config"),
      ln_eps=float(t.get("layer_norm_eps", 1e-6)),
    )
    method = dict(
      name="clip",
      loss="sigmoid",
      pool="avg",
      embed_dim=embed_dim,
      backbone=backbone,
      text_tower="scratch",
      text=text,
      image_projection=False,
      text_projection_bias=True,
      dtype="float32",
    )
    return method, int(t.get("vocab_size", 32000)), int(v.get("image_size", 224))
  except (TypeError, ValueError) as e:
    raise BadFile(f"{where}: a field has a value of the wrong type ({e}).") from e


def siglip_pp(image_size: int) -> str:
  return f"decode|resize({image_size})|normalize(mean={SIGLIP_MEAN}, std={SIGLIP_STD})"


def siglip_tokenizer(workdir: str | None, files: dict) -> dict:
  """The run's tokenizer section: SigLIP's SentencePiece model, copied into the run directory (`files`)."""
  path = os.path.join(os.path.abspath(workdir), VOCAB_FILE) if workdir and VOCAB_FILE in files else ""
  return dict(kind="siglip", path=path)


def read(
  checkpoint: str, vocab: str | None = None, *, config: ConfigDict | None = None, workdir: str | None = None
) -> ImportedRun:
  """A SigLIP run of a transformers SiglipModel folder (module docstring); `vocab`: a SentencePiece model when the
  folder has no spiece.model."""
  folder, cfg, sd = hf_clip.read_folder(checkpoint, "siglip")
  method, vocab_size, image_size = siglip_method(cfg, os.path.join(folder, "config.json"))
  expected = hf_clip.expected_shapes(method, vocab_size, image_size)
  km = KeyMap("Hugging Face SiglipModel", siglip_rules())
  params, converted = hf_clip.convert(sd, km, expected, embeddings_in, EMBEDDINGS, folder)
  files = {VOCAB_FILE: vocab} if vocab else hf_clip.copy_if_present(folder, (VOCAB_FILE,))
  note = {
    "format": "hf_siglip",
    "source": folder,
    "hf_config": hf_clip.hf_fields_kept(cfg),
    "vocab_size": vocab_size,
    "image_size": image_size,
    "dropped": {k: "a constant buffer (0, 1, 2, ...), not a parameter" for k in converted.dropped},
  }
  if not files:
    note["tokenizer"] = f"{folder} has no {VOCAB_FILE}: pass --vocab=spiece.model (SigLIP's SentencePiece model)"
  if hf_clip.code_hooks(cfg):
    note["code_hooks_ignored"] = hf_clip.code_hooks(cfg)
  run = hf_clip.run_config(config, method, siglip_tokenizer(workdir, files), siglip_pp(image_size))
  return ImportedRun(config=run, params=params, model_state={}, note=note, files=files)


def check_siglip(run) -> tuple[dict, dict]:
  """The run's ViT and text sections, or a refusal saying why the run is not a SiglipModel."""
  backbone, text = hf_clip.vit_and_text(run, "map")
  m = run.config.method
  why = []
  if m.get("loss") != "sigmoid" or m.get("image_projection", True) or not m.get("text_projection_bias"):
    why.append("the sigmoid loss, no image projection and a text projection with a bias")
  if backbone.get("pre_norm") or not backbone.get("patch_bias", True):
    why.append("a ViT without pre-norm and with a patch bias")
  if text.get("causal", True) or text.get("pool") != "last":
    why.append("a text tower without a causal mask pooled at its last position (pool='last')")
  if why:
    raise keymaps.NotExportable(f"{run.path} is not a transformers SiglipModel: it needs " + "; ".join(why) + ".")
  return backbone, text


def state_dict(run) -> tuple[OrderedDict, dict]:
  """(SiglipModel's state dict, config.json's object) of a SigLIP run."""
  backbone, text = check_siglip(run)
  m = run.config.method
  vocab_size, image_size = hf_clip.vocab_rows(run), hf_clip.image_size_of(run, int(backbone["patch_size"]))
  flat = {f"params/{k}": np.asarray(v) for k, v in flatten(run.params).items()}
  hf_clip.check_shapes(run, hf_clip.expected_shapes(dict(m), vocab_size, image_size), flat)
  sd = KeyMap("Hugging Face SiglipModel", siglip_rules()).to_foreign(
    {k: v for k, v in flat.items() if k not in POSITIONS}
  )
  sd.update(embeddings_out(flat))
  note = run.meta.get("import", {}) if run.meta.get("import", {}).get("format") == "hf_siglip" else {}
  config = hf_clip.hf_fields_kept(note.get("hf_config", {}))
  config.update(architectures=["SiglipModel"], model_type="siglip")
  config["text_config"] = {
    **dict(config.get("text_config") or {}),
    **hf_clip.hf_tower(text, "text"),
    "max_position_embeddings": int(text["max_len"]),
    "vocab_size": vocab_size,
    "projection_size": int(m["embed_dim"]),
  }
  config["vision_config"] = {
    **dict(config.get("vision_config") or {}),
    **hf_clip.hf_tower(backbone, "vision"),
    "patch_size": int(backbone["patch_size"]),
    "image_size": image_size,
    "vision_use_head": True,
  }
  return OrderedDict(sorted(sd.items())), config


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run as a folder `transformers.SiglipModel.from_pretrained(out)` loads with no missing or
  unexpected keys: config.json, model.safetensors, and the run's spiece.model when it keeps one."""
  sd, config = keymaps.refusal(state_dict, run)
  vocab = hf_clip.tokenizer_file(run, "siglip")
  info = hf_clip.write_folder(out, overwrite, sd, config, {VOCAB_FILE: vocab} if vocab else {})
  return {"keys": len(sd), "parameters": keymaps.parameter_count(sd), "step": run.step, "config": config, **info}
