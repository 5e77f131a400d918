"""Hugging Face CLIP in and out: a `transformers.CLIPModel` folder (config.json and model.safetensors, as
`save_pretrained` writes it; e.g. openai/clip-vit-base-patch32) <-> a vlrep CLIP run with a ViT image tower and
CLIP's text transformer (vlrep.models.clip, `text.arch='transformer'`) that computes what the checkpoint computes.

  python -m vlrep.interop.import_run --format=hf_clip --checkpoint=clip-vit-base-patch32/ --workdir=/runs/clip_b32
  python -m vlrep.interop.export --workdir=/runs/clip_b32 --format=hf_clip --out=clip_b32_hf

The model is config.json's (nothing of the folder is run: no remote code, no code hook; the weights are read from
model.safetensors only, a pickled pytorch_model.bin is refused). Image tower: vlrep's ViT with class-token pooling,
CLIP's LayerNorm before the encoder (`pre_layrnorm` = `pre_norm`), no patch bias, `hidden_act` (quick_gelu or gelu)
and `layer_norm_eps`; the class token's position embedding is folded into `cls` (exported back as the class
embedding with a zero position embedding: the same sum). Text tower: causal, pooled at the end-of-text token as
transformers' CLIPTextTransformer pools (`eos_token_id` 2, the configs written before transformers PR 24773: the
highest id, `pool='argmax'`; else the first `eos_token_id`, `pool='eos'`). Projections without bias; `logit_scale`.
The tokenizer is CLIP's BPE (vlrep.data.clip_bpe, `tokenizer.kind='clip_bpe'`): the folder's vocab.json and
merges.txt, checked to be CLIP's 49408 ids in CLIP's order, become the merges file clip_bpe reads, kept in the run as
open_clip imports keep it (vocab/bpe_simple_vocab_16e6.txt.gz); `--vocab` names that file instead, and without
either the one inside an installed open_clip is used (a note says so). Exports write vocab.json and merges.txt back
(transformers' CLIPTokenizer reads them; it pads with <|endoftext|> where clip_bpe pads with 0, which CLIP's
end-of-text pooling under a causal mask never sees).

The key map is data (`clip_rules`, vlrep.interop.keymaps `rule`s read both ways); the ViT encoder's rows
(`encoder_rules`) and the folder handling (`read_folder`, `write_folder`) are shared with hf_siglip and big_vision.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import tempfile
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from vlrep import safe_files, torch_files
from vlrep.data import clip_bpe
from vlrep.errors import BadFile, UserError, reading
from vlrep.interop import keymaps
from vlrep.interop.formats.visual_bert import code_hooks, without_code_hooks
from vlrep.interop.keymaps import ImportedRun, KeyMap, flatten, rule
from vlrep.models.clip import CLIPModel
from vlrep.runs import unflatten

DESCRIPTION = (
  "Hugging Face CLIPModel folder (config.json + model.safetensors): a CLIP run with a ViT and CLIP's text transformer"
)
OUT_SUFFIXES = ()  # export writes a folder

# transformers' hidden_act -> vlrep.models.vit's mlp_act.
ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# CLIP's image normalisation (OpenAI's; transformers' CLIPImageProcessor's).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
LEGACY_EOS_ID = 2  # transformers' CLIPTextTransformer: eos_token_id == 2 means "pool at the highest id"
_MAX_JSON_BYTES = 1 << 20
RUN_VOCAB = os.path.join("vocab", clip_bpe.VOCAB_FILE)  # where an imported run keeps CLIP's merges (open_clip's too)
HF_START, HF_END = "<|startoftext|>", "<|endoftext|>"  # transformers' names of CLIP's two special tokens
MERGES_HEADER = "#version: 0.2"
FOLDER_HINT = "Pass the folder as `save_pretrained` wrote it (config.json and model.safetensors)."


class MissingFile(UserError, FileNotFoundError):
  """A file the folder should hold is not there."""


# ------------------------------------------------------------------------------------------------------------------
# Key maps: the ViT encoder's rows and CLIP's.
# ------------------------------------------------------------------------------------------------------------------
def linear(vlrep: str, foreign: str, bias: bool = True) -> list:
  out = [rule(f"{vlrep}/kernel", f"{foreign}.weight", transform="linear")]
  return out + ([rule(f"{vlrep}/bias", f"{foreign}.bias")] if bias else [])


def norm(vlrep: str, foreign: str) -> list:
  return [rule(f"{vlrep}/scale", f"{foreign}.weight"), rule(f"{vlrep}/bias", f"{foreign}.bias")]


def attention_rules(vlrep: str, foreign: str) -> list:
  """flax MultiHeadDotProductAttention <-> transformers' q_proj/k_proj/v_proj/out_proj."""
  rules = []
  for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
    rules += [
      rule(f"{vlrep}/{ours}/kernel", f"{foreign}.{theirs}.weight", transform="heads_in"),
      rule(f"{vlrep}/{ours}/bias", f"{foreign}.{theirs}.bias", transform="heads_bias"),
    ]
  return rules + [
    rule(f"{vlrep}/out/kernel", f"{foreign}.out_proj.weight", transform="heads_out"),
    rule(f"{vlrep}/out/bias", f"{foreign}.out_proj.bias"),
  ]


def encoder_rules(vlrep: str, foreign: str, final_norm: str) -> list:
  """vit.Encoder (`encoderblock_{i}`, `encoder_norm`) <-> transformers' CLIP/SigLIP encoder layers and the final
  LayerNorm named `final_norm`."""
  block, layer = f"{vlrep}/encoderblock_{{}}", f"{foreign}.layers.{{}}"
  return [
    *norm(f"{block}/LayerNorm_0", f"{layer}.layer_norm1"),
    *attention_rules(f"{block}/MultiHeadDotProductAttention_0", f"{layer}.self_attn"),
    *norm(f"{block}/LayerNorm_1", f"{layer}.layer_norm2"),
    *linear(f"{block}/MlpBlock_0/Dense_0", f"{layer}.mlp.fc1"),
    *linear(f"{block}/MlpBlock_0/Dense_1", f"{layer}.mlp.fc2"),
    *norm(f"{vlrep}/encoder_norm", final_norm),
  ]


def text_rules() -> list:
  """The text tower's rows both HF formats share (its position embedding is `EMBEDDINGS`')."""
  t = "params/textual"
  return [
    rule(f"{t}/Embed_0/embedding", "text_model.embeddings.token_embedding.weight"),
    *encoder_rules(f"{t}/Transformer", "text_model.encoder", "text_model.final_layer_norm"),
    rule(None, "text_model.embeddings.position_ids", absent="dropped"),  # a constant buffer older versions saved
  ]


def clip_rules() -> list:
  """vlrep's CLIP variables <-> transformers' CLIPModel names (the position embeddings and the class token:
  `embeddings_in` / `embeddings_out`)."""
  b = "params/backbone"
  return [
    rule(f"{b}/embedding/kernel", "vision_model.embeddings.patch_embedding.weight", transform="conv"),
    *norm(f"{b}/pre_norm", "vision_model.pre_layrnorm"),
    *encoder_rules(f"{b}/Transformer", "vision_model.encoder", "vision_model.post_layernorm"),
    *linear("params/visual_projection", "visual_projection", bias=False),
    *text_rules(),
    *linear("params/text_projection", "text_projection", bias=False),
    rule("params/logit_scale", "logit_scale"),
    rule(None, "vision_model.embeddings.position_ids", absent="dropped"),
  ]


# The tensors outside the key map (a layout change that is not one tensor's): {vlrep path: foreign key}.
TEXT_POSITIONS = {"params/textual/pos_embedding": "text_model.embeddings.position_embedding.weight"}
VISION_POSITIONS = "vision_model.embeddings.position_embedding.weight"
CLASS_EMBEDDING = "vision_model.embeddings.class_embedding"
CLIP_EMBEDDINGS = (*TEXT_POSITIONS.values(), VISION_POSITIONS, CLASS_EMBEDDING)


def positions_in(sd: dict, key: str, shape: tuple, path: str) -> np.ndarray:
  """A [L, C] position table -> vlrep's [1, L, C], its shape checked."""
  x = np.asarray(sd[key], np.float32)
  if (1, *x.shape) != tuple(shape):
    raise ValueError(f"Shape mismatch: {key} is {tuple(x.shape)}, but the model needs {tuple(shape[1:])} for {path}.")
  return x[None]


def clip_embeddings_in(sd: dict, expected: dict) -> dict:
  """The class token (CLIP's class embedding plus its position embedding: vlrep's ViT adds no position to `cls`)
  and the position embeddings in vlrep's layout."""
  out = {p: positions_in(sd, k, expected[p], p) for p, k in TEXT_POSITIONS.items()}
  pe, ce = np.asarray(sd[VISION_POSITIONS], np.float32), np.asarray(sd[CLASS_EMBEDDING], np.float32)
  want = expected["params/backbone/pos_embedding"]
  if pe.shape != (want[1] + 1, want[2]) or ce.shape != (want[2],):
    raise ValueError(
      f"Shape mismatch: {VISION_POSITIONS} is {pe.shape} and {CLASS_EMBEDDING} {ce.shape}, but the model needs "
      f"{(want[1] + 1, want[2])} and {(want[2],)} (a class token and {want[1]} patches of width {want[2]})."
    )
  out["params/backbone/cls"] = (ce + pe[0])[None, None]
  out["params/backbone/pos_embedding"] = pe[1:][None]
  return out


def clip_embeddings_out(flat: dict) -> dict:
  """`clip_embeddings_in` the other way: the class token as the class embedding, its position embedding 0."""
  out = {k: np.asarray(flat[p])[0] for p, k in TEXT_POSITIONS.items()}
  cls, pe = np.asarray(flat["params/backbone/cls"]), np.asarray(flat["params/backbone/pos_embedding"])
  out[CLASS_EMBEDDING] = cls.reshape(-1)
  out[VISION_POSITIONS] = np.concatenate([np.zeros_like(pe[0, :1]), pe[0]], 0)
  return out


def score_keys(keys: set[str], km: KeyMap, needed: list[str], extra: tuple) -> tuple[float, list[str], list[str]]:
  """(the fraction of `needed` present times the fraction of the keys the format reads, missing, unexpected)."""
  if not keys:
    return 0.0, needed[:5], []
  missing = [k for k in needed if k not in keys]
  unexpected = sorted(k for k in keys if not km.matches(k) and k not in extra)
  fraction = (len(needed) - len(missing)) / len(needed) * (1 - len(unexpected) / len(keys))
  return fraction, missing[:5], unexpected[:5]


def needed_keys(rules: list, extra: tuple) -> list[str]:
  """The names every checkpoint of the format has (layer 0 standing for all layers)."""
  return [r.foreign[0].replace("{}", "0") for r in rules if r.vlrep is not None] + list(extra)


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  """How well a state dict's keys are a CLIPModel's (`keymaps` contract)."""
  return score_keys(keys, KeyMap("HF CLIP", clip_rules()), needed_keys(clip_rules(), CLIP_EMBEDDINGS), CLIP_EMBEDDINGS)


# ------------------------------------------------------------------------------------------------------------------
# Folders: reading config.json and the weights, writing both.
# ------------------------------------------------------------------------------------------------------------------
def read_json(path: str, what: str = "Hugging Face config.json") -> dict:
  """A JSON object file (config.json, vocab.json); not JSON, too large or not an object: a BadFile naming it."""
  with reading(path, what=what, hint=FOLDER_HINT):
    if os.path.getsize(path) > _MAX_JSON_BYTES * (8 if "vocab" in os.path.basename(path) else 1):
      raise ValueError(f"{os.path.getsize(path)} bytes, more than such a file takes")
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  if not isinstance(raw, dict):
    raise BadFile(f"{path} holds a JSON {type(raw).__name__}, not an object: not a Hugging Face config.json.")
  return raw


def folder_of(checkpoint: str) -> str:
  """The folder a Hugging Face checkpoint names (the folder itself, or the folder of its model.safetensors)."""
  checkpoint = os.path.abspath(os.path.expanduser(checkpoint))
  return os.path.dirname(checkpoint) if os.path.isfile(checkpoint) else checkpoint


def model_type(checkpoint: str) -> str | None:
  """config.json's model_type of a Hugging Face folder (what --format=auto reads), None without one."""
  path = os.path.join(folder_of(checkpoint), "config.json")
  return read_json(path).get("model_type") if os.path.isfile(path) else None


def read_folder(checkpoint: str, model: str) -> tuple[str, dict, dict[str, np.ndarray]]:
  """(the folder, config.json's object, the weights {name: array}) of a transformers `model` folder (model_type
  'clip' / 'siglip'); pickled weights (pytorch_model.bin) and sharded ones are refused, a config.json of another
  model is an error naming its model_type."""
  folder = folder_of(checkpoint)
  if not os.path.isdir(folder):
    raise MissingFile(f"--checkpoint {checkpoint!r} does not exist.")
  config_path = os.path.join(folder, "config.json")
  if not os.path.isfile(config_path):
    raise MissingFile(
      f"{folder} has no config.json: a Hugging Face model folder has config.json and model.safetensors."
    )
  cfg = read_json(config_path)
  if cfg.get("model_type") != model:
    raise BadFile(
      f"{config_path} describes a {cfg.get('model_type')!r} model, not {model!r}"
      + (" (--format=hf_siglip reads SigLIP folders)" if cfg.get("model_type") == "siglip" else "")
      + (" (--format=hf_clip reads CLIP folders)" if cfg.get("model_type") == "clip" else "")
      + "."
    )
  if os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
    raise UserError(
      f"{folder} holds a sharded checkpoint; save it unsharded (save_pretrained(..., max_shard_size='100GB'))."
    )
  weights = os.path.join(folder, "model.safetensors")
  if not os.path.isfile(weights):
    pickled = [
      n for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack") if os.path.exists(os.path.join(folder, n))
    ]
    raise MissingFile(
      f"{folder} has no model.safetensors"
      + (
        f" (it has {pickled}: vlrep reads Hugging Face weights from safetensors only; convert them with "
        "transformers' `from_pretrained(...).save_pretrained(..., safe_serialization=True)` where you trust the file)."
        if pickled
        else "."
      )
    )
  return folder, cfg, torch_files.load_safetensors(weights)


def write_folder(out: str, overwrite: bool, sd: dict, config: dict, files: dict[str, str], texts=None) -> dict:
  """Writes config.json, model.safetensors, `files` ({name: source path}) and `texts` ({name: text}) into a fresh
  folder renamed into place (an existing non-empty `out` needs `overwrite`); code hooks are never written."""
  folder = os.path.abspath(os.path.expanduser(out)).rstrip(os.sep)
  if os.path.lexists(folder) and (not os.path.isdir(folder) or os.path.islink(folder)):
    raise keymaps.NotExportable(f"--out={out} is a file or a link; this format writes a folder.")
  if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
    raise keymaps.OutExists(
      f"--out={out} already exists and is not empty; pass --overwrite to replace it, or choose another folder."
    )
  if code_hooks(config):
    raise RuntimeError(f"config.json would carry code hooks {code_hooks(config)}; vlrep's export never writes them.")
  safe_files.make_dirs(keymaps.out_root(folder))
  with safe_files.atomic_dir(folder) as tmp:
    save_file(
      {k: np.array(v, np.float32, order="C") for k, v in sd.items()},  # (a scalar stays a scalar)
      os.path.join(tmp, "model.safetensors"),
      metadata={"format": "pt"},
    )
    safe_files.write_text(
      os.path.join(tmp, "config.json"), json.dumps(config, indent=2, sort_keys=True) + "\n", root=tmp
    )
    for name, src in files.items():
      with safe_files.open_atomic(os.path.join(tmp, name), "wb", root=tmp) as f, open(src, "rb") as s:
        shutil.copyfileobj(s, f)
    for name, text in (texts or {}).items():
      safe_files.write_text(os.path.join(tmp, name), text, root=tmp)
  return {"files": sorted(os.listdir(folder))}


# ------------------------------------------------------------------------------------------------------------------
# The run: its config and its variables' shapes.
# ------------------------------------------------------------------------------------------------------------------
def activation(act: str, where: str) -> str:
  if act not in ACTIVATIONS:
    raise UserError(f"{where}: hidden_act {act!r} has no vlrep counterpart (known: {sorted(ACTIVATIONS)}).")
  return ACTIVATIONS[act]


def model_of(method: dict, vocab_size: int) -> CLIPModel:
  return CLIPModel(
    vocab_size=vocab_size,
    backbone=dict(method["backbone"]),
    text=dict(method["text"]),
    embed_dim=method["embed_dim"],
    loss=method.get("loss", "softmax"),
    image_projection=method.get("image_projection", True),
    text_projection_bias=method.get("text_projection_bias", False),
  )


def expected_shapes(method: dict, vocab_size: int, image_size: int) -> dict[str, tuple]:
  """{'params/...': shape} of the CLIP model a method section builds, at `image_size` pixels."""
  model = model_of(method, vocab_size)
  images = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
  tokens = jnp.zeros((1, int(method["text"]["max_len"])), jnp.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), images, tokens))
  return {f"params/{k}": tuple(v.shape) for k, v in flatten(shapes["params"]).items()}


def clip_method(cfg: dict, where: str) -> tuple[dict, int, int]:
  """(the method section, vocabulary size, image size) of a CLIPConfig's config.json."""
  v, t = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
  try:
    eos = int(t.get("eos_token_id", LEGACY_EOS_ID))
    backbone = dict(
      arch="vit",
      width=int(v.get("hidden_size", 768)),
      depth=int(v.get("num_hidden_layers", 12)),
      mlp_dim=int(v.get("intermediate_size", 3072)),
      num_heads=int(v.get("num_attention_heads", 12)),
      patch_size=int(v.get("patch_size", 32)),
      pool_type="tok",
      posemb="learn",
      pre_norm=True,
      mlp_act=activation(v.get("hidden_act", "quick_gelu"), f"{where} vision_config"),
      ln_eps=float(v.get("layer_norm_eps", 1e-5)),
      patch_bias=False,
    )
    text = dict(
      arch="transformer",
      width=int(t.get("hidden_size", 512)),
      depth=int(t.get("num_hidden_layers", 12)),
      num_heads=int(t.get("num_attention_heads", 8)),
      mlp_dim=int(t.get("intermediate_size", 2048)),
      max_len=int(t.get("max_position_embeddings", 77)),
      causal=True,
      pool="argmax" if eos == LEGACY_EOS_ID else "eos",
      eos_id=-1 if eos == LEGACY_EOS_ID else eos,
      mlp_act=activation(t.get("hidden_act", "quick_gelu"), f"{where} text_config"),
      ln_eps=float(t.get("layer_norm_eps", 1e-5)),
    )
    method = dict(
      name="clip",
      loss="softmax",
      pool="avg",
      embed_dim=int(cfg.get("projection_dim", 512)),
      backbone=backbone,
      text_tower="scratch",
      text=text,
      image_projection=True,
      text_projection_bias=False,
      dtype="float32",
    )
    return method, int(t.get("vocab_size", 49408)), int(v.get("image_size", 224))
  except (TypeError, ValueError) as e:
    raise BadFile(f"{where}: a field has a value of the wrong type ({e}).") from e


def run_config(base: ConfigDict | None, method: dict, tokenizer: dict, pp: str) -> ConfigDict:
  """The imported run's config: `base` (a recipe's, --config) or a bare one naming the evaluation preprocessing,
  with the checkpoint's method and tokenizer."""
  if base is None:
    c = ConfigDict(dict(data=dict(name="imagenet2012", split="train", data_dir="", config_name="", pp=pp)))
  else:
    c = ConfigDict(base.to_dict())
    if c.get("method", {}).get("name") not in (None, "clip"):
      raise UserError("--config for a CLIP / SigLIP checkpoint must be a CLIP recipe (configs/clip.py).")
  c.method = method
  c.tokenizer = tokenizer
  if "init_from" in c:
    c.init_from = ""
  return c


def convert(sd: dict, km: KeyMap, expected: dict, embeddings_in, embeddings: tuple, path: str):
  """(the run's variables (nested), the key map's `Converted`) of a state dict: the tensors outside the key map by
  `embeddings_in`, the rest by `km`; every shape checked, missing and unexpected keys an error naming them."""
  missing = [k for k in embeddings if k not in sd]
  if missing:
    raise BadFile(f"{path} is not a complete {km.name} checkpoint: {missing} missing.")
  with reading(path, what=f"{km.name} checkpoint", hint=FOLDER_HINT):
    special = embeddings_in(sd, expected)
    rest = {k: v for k, v in sd.items() if k not in embeddings}
    converted = km.to_vlrep(rest, {p: s for p, s in expected.items() if p not in special})
  converted.variables.update(special)
  return unflatten(converted.variables)["params"], converted


def copy_if_present(folder: str, names: tuple[str, ...]) -> dict[str, str]:
  return {n: os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))}


def hf_fields_kept(cfg: dict) -> dict:
  """config.json's fields an export writes back as they were (code hooks and the file's own fields removed)."""
  drop = ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype")
  return {k: v for k, v in without_code_hooks(cfg).items() if k not in drop}


def hf_vocabulary(tokenizer: clip_bpe.ClipTokenizer) -> tuple[dict[str, int], list[str]]:
  """(vocab.json's object, merges.txt's lines) of CLIP's BPE vocabulary as transformers' CLIPTokenizer writes them
  (its special tokens spelled '<|startoftext|>' and '<|endoftext|>')."""
  names = {clip_bpe.START_OF_TEXT: HF_START, clip_bpe.END_OF_TEXT: HF_END}
  vocab = {names.get(piece, piece): i for i, piece in enumerate(tokenizer.decoder)}
  merges = [" ".join(m) for m, _ in sorted(tokenizer.ranks.items(), key=lambda kv: kv[1])]
  return vocab, [MERGES_HEADER, *merges]


def _folder_merges(folder: str) -> tuple[str | None, str]:
  """(a merges file in clip_bpe's format holding the folder's merges, or None; why not) of a folder's vocab.json
  and merges.txt: they must be CLIP's BPE vocabulary (49408 ids in CLIP's order), which is what clip_bpe reads."""
  vocab_json, merges_txt = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
  if not (os.path.isfile(vocab_json) and os.path.isfile(merges_txt)):
    return None, f"{folder} has no vocab.json and merges.txt"
  with reading(merges_txt, what="CLIP merges.txt", hint=FOLDER_HINT):
    if os.path.getsize(merges_txt) > 16 * _MAX_JSON_BYTES:
      raise ValueError(f"{os.path.getsize(merges_txt)} bytes, more than such a file takes")
    with open(merges_txt, encoding="utf-8") as f:
      lines = f.read().rstrip("\n").split("\n")
  body = lines[1:] if lines and lines[0].startswith("#version") else lines
  if len(body) != clip_bpe.NUM_MERGES:
    return None, f"{merges_txt} has {len(body)} merges, CLIP's BPE {clip_bpe.NUM_MERGES}: another tokenizer"
  installed = clip_bpe.installed_vocabulary()
  if installed and clip_bpe.read_merges(installed) == [tuple(line.split(" ")) for line in body]:
    merges = installed  # the same merges as open_clip's file: that file
  else:  # written in clip_bpe's format (a header line, then the merges) beside nothing: a temporary file to copy
    merges = os.path.join(tempfile.mkdtemp(prefix="vlrep_hf_clip_"), clip_bpe.VOCAB_FILE)
    with gzip.open(merges, "wt", encoding="utf-8") as f:
      f.write("\n".join([MERGES_HEADER, *body]) + "\n")
  want, _ = hf_vocabulary(clip_bpe.ClipTokenizer(merges))
  if read_json(vocab_json, what="CLIP vocab.json") != want:
    return None, f"{vocab_json} does not number CLIP's BPE pieces as CLIP does: another tokenizer"
  return merges, ""


def vocabulary(folder: str, vocab: str | None, vocab_size: int) -> tuple[str | None, dict]:
  """(CLIP's merges file for the run's tokenizer or None, notes): --vocab, else the folder's vocab.json and
  merges.txt (checked to be CLIP's), else the one inside an installed open_clip; a text tower of another size
  than CLIP's 49408 ids gets none."""
  if vocab:
    clip_bpe.read_merges(vocab)  # a file that is not one is refused
    return vocab, {}
  if vocab_size != clip_bpe.VOCAB_SIZE:
    why = f"the text tower has {vocab_size} ids, CLIP's BPE {clip_bpe.VOCAB_SIZE}: set tokenizer.path yourself"
    return None, {"tokenizer": why}
  merges, why = _folder_merges(folder)
  if merges:
    return merges, {}
  installed = clip_bpe.installed_vocabulary()
  if installed:
    return installed, {"tokenizer": f"{why}; CLIP's BPE inside the installed open_clip is used"}
  return None, {"tokenizer": f"{why}: pass --vocab={clip_bpe.VOCAB_FILE} (inside the open-clip-torch package)"}


def read(
  checkpoint: str, vocab: str | None = None, *, config: ConfigDict | None = None, workdir: str | None = None
) -> ImportedRun:
  """A CLIP run of a transformers CLIPModel folder (module docstring); `vocab`: CLIP's merges file
  (bpe_simple_vocab_16e6.txt.gz) when the folder has no vocab.json and merges.txt."""
  folder, cfg, sd = read_folder(checkpoint, "clip")
  method, vocab_size, image_size = clip_method(cfg, os.path.join(folder, "config.json"))
  expected = expected_shapes(method, vocab_size, image_size)
  km = KeyMap("Hugging Face CLIPModel", clip_rules())
  params, converted = convert(sd, km, expected, clip_embeddings_in, CLIP_EMBEDDINGS, folder)
  merges, notes = vocabulary(folder, vocab, vocab_size)
  # vlrep.interop.import_run copies `files` into the run directory, where the tokenizer reads them.
  files = {RUN_VOCAB: merges} if merges and workdir else {}
  path = os.path.join(os.path.abspath(workdir), RUN_VOCAB) if files else (merges or "")
  tokenizer = dict(kind="clip_bpe", path=path)
  pp = f"decode|resize_small({image_size})|central_crop({image_size})|normalize(mean={CLIP_MEAN}, std={CLIP_STD})"
  run = run_config(config, method, tokenizer, pp)
  note = {
    "format": "hf_clip",
    "source": folder,
    "hf_config": hf_fields_kept(cfg),
    "vocab_size": vocab_size,
    "image_size": image_size,
    "dropped": {k: "a constant buffer (0, 1, 2, ...), not a parameter" for k in converted.dropped},
    **notes,
  }
  hooks = code_hooks(cfg)
  if hooks:
    note["code_hooks_ignored"] = hooks
  return ImportedRun(config=run, params=params, model_state={}, note=note, files=files)


# ------------------------------------------------------------------------------------------------------------------
# Export.
# ------------------------------------------------------------------------------------------------------------------
def vit_and_text(run, pool_type: str) -> tuple[dict, dict]:
  """The run's ViT and text-transformer sections, or a refusal saying what the run is."""
  m = run.config.method
  if m.get("name") != "clip":
    raise keymaps.NotExportable(
      f"{run.path}: method {m.get('name')!r} is not CLIP; only CLIP / SigLIP runs export as one."
    )
  backbone, text = dict(m.get("backbone", {})), dict(m.get("text", {}))
  if backbone.get("arch") != "vit" or text.get("arch") != "transformer":
    raise keymaps.NotExportable(
      f"{run.path}: a Hugging Face CLIP / SigLIP folder holds a ViT image tower and a text transformer (text.arch="
      f"'transformer'); this run's are backbone arch={backbone.get('arch', 'resnet')!r}, text arch="
      f"{text.get('arch')!r}."
    )
  if backbone.get("pool_type") != pool_type or backbone.get("posemb", "learn") != "learn":
    raise keymaps.NotExportable(
      f"{run.path}: the ViT pools with {backbone.get('pool_type')!r} and posemb={backbone.get('posemb', 'learn')!r}; "
      f"this format's model pools with {pool_type!r} and learned position embeddings."
    )
  return backbone, text


def hf_tower(section: dict, kind: str) -> dict:
  """A tower's transformers config fields (sizes, activation, LayerNorm epsilon) of its vlrep section (a ViT's or
  a text transformer's: the same field names)."""
  act = section.get("mlp_act", "gelu_tanh" if kind == "vision" else "gelu")
  eps = section.get("ln_eps", 1e-6 if kind == "vision" else 1e-5)
  return {
    "hidden_size": int(section["width"]),
    "num_hidden_layers": int(section["depth"]),
    "num_attention_heads": int(section["num_heads"]),
    "intermediate_size": int(section.get("mlp_dim") or 4 * int(section["width"])),
    "hidden_act": {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[act],
    "layer_norm_eps": float(eps),
  }


def check_shapes(run, expected: dict, flat: dict) -> None:
  wrong = [
    f"{k}: {tuple(np.shape(flat[k])) if k in flat else 'missing'} (needs {v})"
    for k, v in sorted(expected.items())
    if k not in flat or tuple(np.shape(flat[k])) != tuple(v)
  ] + [f"{k}: unexpected" for k in sorted(set(flat) - set(expected))]
  if wrong:
    raise keymaps.NotExportable(f"{run.path}'s parameters are not the model its config describes: {wrong[:5]}.")


def vocab_rows(run) -> int:
  return int(np.shape(run.params["textual"]["Embed_0"]["embedding"])[0])


def image_size_of(run, patch: int) -> int:
  side = math.isqrt(int(np.shape(run.params["backbone"]["pos_embedding"])[1]))
  return side * patch


def tokenizer_file(run, kind: str) -> str | None:
  """The file the run's tokenizer reads (`tokenizer.path`, relative paths from the run's folder) when the
  tokenizer is of `kind` and the file is there; else None."""
  tok = run.config.get("tokenizer", {})
  path = os.path.expanduser(tok.get("path", "") or "") if tok.get("kind") == kind else ""
  if path and not os.path.isabs(path):
    path = os.path.join(run.workdir, path)
  return path if path and os.path.isfile(path) else None


def state_dict(run) -> tuple[OrderedDict, dict]:
  """(CLIPModel's state dict, config.json's object) of a CLIP run (ViT with a class token and CLIP's pre-norm, a
  causal text transformer pooled at its end-of-text token, projections without bias)."""
  backbone, text = vit_and_text(run, "tok")
  m = run.config.method
  why = []
  if m.get("loss", "softmax") != "softmax" or not m.get("image_projection", True) or m.get("text_projection_bias"):
    why.append("CLIP's softmax loss, an image projection and a text projection without bias")
  if not backbone.get("pre_norm") or backbone.get("patch_bias", True):
    why.append("a ViT with CLIP's pre-norm (pre_norm=True) and no patch bias (patch_bias=False)")
  if not text.get("causal", True) or text.get("pool") not in ("argmax", "eos"):
    why.append("a causal text tower pooled at its end-of-text token (pool 'argmax' or 'eos')")
  if backbone.get("mlp_act") not in ("quick_gelu", "gelu", "gelu_tanh") or text.get("mlp_act", "gelu") not in (
    "quick_gelu",
    "gelu",
    "gelu_tanh",
  ):
    why.append("activations transformers has (quick_gelu, gelu, gelu_tanh)")
  if why:
    raise keymaps.NotExportable(f"{run.path} is not a transformers CLIPModel: it needs " + "; ".join(why) + ".")
  vocab_size, image_size = vocab_rows(run), image_size_of(run, int(backbone["patch_size"]))
  flat = {f"params/{k}": np.asarray(v) for k, v in flatten(run.params).items()}
  check_shapes(run, expected_shapes(dict(m), vocab_size, image_size), flat)
  special = {"params/backbone/cls", "params/backbone/pos_embedding", *TEXT_POSITIONS}
  sd = KeyMap("Hugging Face CLIPModel", clip_rules()).to_foreign({k: v for k, v in flat.items() if k not in special})
  sd.update(clip_embeddings_out(flat))
  note = run.meta.get("import", {}) if run.meta.get("import", {}).get("format") == "hf_clip" else {}
  eos = LEGACY_EOS_ID if text["pool"] == "argmax" else int(text["eos_id"])
  config = hf_fields_kept(note.get("hf_config", {}))
  config.update(architectures=["CLIPModel"], model_type="clip", projection_dim=int(m["embed_dim"]))
  config["text_config"] = {
    **dict(config.get("text_config") or {}),
    **hf_tower(text, "text"),
    "max_position_embeddings": int(text["max_len"]),
    "vocab_size": vocab_size,
    "eos_token_id": eos,
    "projection_dim": int(m["embed_dim"]),
  }
  config["vision_config"] = {
    **dict(config.get("vision_config") or {}),
    **hf_tower(backbone, "vision"),
    "patch_size": int(backbone["patch_size"]),
    "image_size": image_size,
    "projection_dim": int(m["embed_dim"]),
  }
  for section in ("text_config", "vision_config"):
    config[section].pop("transformers_version", None)
  return OrderedDict(sorted(sd.items())), config


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run as a folder `transformers.CLIPModel.from_pretrained(out)` loads with no missing or unexpected
  keys: config.json, model.safetensors, and the run's vocab.json and merges.txt when it keeps them."""
  sd, config = keymaps.refusal(state_dict, run)
  texts, notes = {}, []
  path = tokenizer_file(run, "clip_bpe")
  if path:
    vocab, merges = hf_vocabulary(clip_bpe.ClipTokenizer(path))
    texts = {"vocab.json": json.dumps(vocab, ensure_ascii=False) + "\n", "merges.txt": "\n".join(merges) + "\n"}
  else:
    notes.append("no vocab.json / merges.txt written: the run's tokenizer is not CLIP's BPE file it can read")
  info = write_folder(out, overwrite, sd, config, {}, texts)
  info["notes"] = notes
  return {"keys": len(sd), "parameters": keymaps.parameter_count(sd), "step": run.step, "config": config, **info}
