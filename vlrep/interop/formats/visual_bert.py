"""VisualBERT in: a Hugging Face `VisualBertModel` / `VisualBertForPreTraining` folder (config.json and
model.safetensors or pytorch_model.bin; e.g. the authors' COCO-pretrained `uclanlp/visualbert-*-pre`) or an MMF
VisualBERT checkpoint (the pretraining study's zoo: a `model.pth` / `*.ckpt` file, or the folder holding it and its
`config.yaml`) -> a vlrep VisualBERT *pretraining* run (the model of configs/vlbert.py:arch=visual_bert,stage=pretrain,
built here: `default_config`) that downstream runs load through `method.pretrained_run`.

The imported run computes what VisualBERT computes: its config sets the VisualBERT-exact region embeddings
(`region_boxes=False`, `region_norm='shared'`, `region_type_embedding='tables'`, vlrep.models.vl_bert) and the
regions' token type (`region_type_id`: 1 for Hugging Face folders, the authors' convention and transformers'
default; 0 for MMF checkpoints, whose VisualBERT feeds `visual_embeddings_type = zeros`). Regions are detector
features of `visual_embedding_dim` dims read from region files (`method.visual.mode='file'`); VisualBERT has no
box input. BERT's architecture is written into the config (`method.bert_config`), so the run needs no BERT
weights folder: `method.bert_path` (and the tokenizer) only name the folder of the WordPiece `vocab.txt`. It computes
in float32 (`method.dtype`), as the checkpoint's own code does: configs/vlbert.py's bfloat16 moves its outputs by
up to 2.5e-2 relative (`vlrep.interop.import_run --dtype` chooses otherwise).

The key map is data (`visual_bert_rules`: vlrep.interop.formats `rule`s, read by `KeyMap` both ways), one table for the
three layouts (`LAYOUTS`, told apart by their names: Hugging Face's, MMF's and the authors' original code's), which
differ in prefixes and in MMF's names of the three visual embeddings. Dropped, and listed in the run's note: the
`position_ids` buffer, the MLM decoder (tied to the word embeddings in both codes; a checkpoint where they differ is
said so), MMF's `cls.seq_relationship` (BERT's next-sentence head, copied by MMF and never trained by its MLM-only
pretraining) and MMF's `classifier` (a downstream task head). Hugging Face's `cls.seq_relationship` (the authors'
sentence-image prediction, trained) becomes vlrep's alignment head, its two logits in vlrep's order.

  python -m vlrep.interop.import_run --format=visual_bert --checkpoint=visualbert-vqa-coco-pre/ \
      --vocab=bert-base-uncased/vocab.txt --workdir=/runs/visualbert_coco
  python -m vlrep.interop.export --workdir=/runs/visualbert_coco --format=visual_bert --out=visualbert_coco_hf

Out (`state_dict`, `write_folder`; vlrep.interop.export --format=visual_bert): a Hugging Face `VisualBertForPreTraining`
folder (config.json, model.safetensors, vocab.txt) through the same table read the other way, the tied MLM decoder
written as copies of the word embeddings and the output bias. A run exports when its model is VisualBERT's
(`EXPORT_KNOBS`: the three region-embedding knobs above and the pooler reading [CLS]): an imported run (import ->
export is the identity, bit for bit, config.json's other fields included) or a vlrep-trained
`configs/vlbert.py:arch=visual_bert` run built with them; any other run is refused, naming the flags. A run without
a trained alignment head (`method.alignment_weight=0`) gets `cls.seq_relationship` as zeros (logits 0: even odds),
said in the notes, as is a `region_type_id` of 0 (pass `visual_token_type_ids` of zeros to transformers' model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from absl import logging
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from vlrep import defaults, safe_files
from vlrep.errors import BadFile, UserError, reading
from vlrep.interop import keymaps
from vlrep.interop.formats import torchvision as tv
from vlrep.interop.keymaps import (
  ImportedRun,
  KeyMap,
  closest_format,
  flatten,
  rule,
)
from vlrep.methods import vlbert
from vlrep.models import bert as bert_lib
from vlrep.models import vl_bert
from vlrep.runs import unflatten

DESCRIPTION = (
  "VisualBERT: a Hugging Face VisualBertModel / VisualBertForPreTraining folder or an MMF VisualBERT checkpoint, as "
  "a VisualBERT pretraining run (VisualBERT's region embeddings; regions from region files)"
)
OUT_SUFFIXES = ()  # export writes a folder


def _linear(vlrep: str, foreign: str, transform: str = "linear") -> list:
  bias = "swap2" if transform == "linear_swap2" else "same"
  return [
    rule(f"{vlrep}/kernel", f"{foreign}.weight", transform=transform),
    rule(f"{vlrep}/bias", f"{foreign}.bias", transform=bias),
  ]


def _norm(vlrep: str, foreign: str) -> list:
  return [rule(f"{vlrep}/scale", f"{foreign}.weight"), rule(f"{vlrep}/bias", f"{foreign}.bias")]


def visual_bert_rules(base: str = "", heads: str = "cls.", mmf: bool = False) -> list:
  """The key map: vlrep's VisualBERT pretraining variables <-> a checkpoint's names, the encoder under `base` and
  the pretraining heads under `heads`: Hugging Face's VisualBertModel ('', no heads), VisualBertForPreTraining
  ('visual_bert.', 'cls.'), MMF's VisualBERT ('model.bert.', 'model.cls.', with MMF's embedding names) and the
  authors' original code ('bert.bert.', 'bert.cls.', MMF's names)."""
  visual = (
    ("projection", "token_type_embeddings_visual", "position_embeddings_visual")
    if mmf
    else ("visual_projection", "visual_token_type_embeddings", "visual_position_embeddings")
  )
  emb, layer = f"{base}embeddings", f"{base}encoder.layer.{{}}"
  p = "params/bert"
  rules = [
    rule(f"{p}/embeddings/word_embeddings/embedding", f"{emb}.word_embeddings.weight"),
    rule(f"{p}/embeddings/position_embeddings/embedding", f"{emb}.position_embeddings.weight"),
    rule(f"{p}/embeddings/token_type_embeddings/embedding", f"{emb}.token_type_embeddings.weight"),
    *_norm(f"{p}/embeddings/LayerNorm", f"{emb}.LayerNorm"),
    *_linear("params/regions_embed/feature", f"{emb}.{visual[0]}"),
    rule("params/regions_embed/token_type_embeddings/embedding", f"{emb}.{visual[1]}.weight"),
    rule("params/regions_embed/position_embeddings/embedding", f"{emb}.{visual[2]}.weight"),
    *_linear(f"{p}/layer_{{}}/query", f"{layer}.attention.self.query"),
    *_linear(f"{p}/layer_{{}}/key", f"{layer}.attention.self.key"),
    *_linear(f"{p}/layer_{{}}/value", f"{layer}.attention.self.value"),
    *_linear(f"{p}/layer_{{}}/attention_output", f"{layer}.attention.output.dense"),
    *_norm(f"{p}/layer_{{}}/attention_LayerNorm", f"{layer}.attention.output.LayerNorm"),
    *_linear(f"{p}/layer_{{}}/intermediate", f"{layer}.intermediate.dense"),
    *_linear(f"{p}/layer_{{}}/output", f"{layer}.output.dense"),
    *_norm(f"{p}/layer_{{}}/output_LayerNorm", f"{layer}.output.LayerNorm"),
    *_linear(f"{p}/pooler", f"{base}pooler.dense"),
    # The MLM head; its decoder is the word embeddings (tied: checked and dropped by `read`, as `tied` says).
    *_linear("params/mlm_head/transform", f"{heads}predictions.transform.dense"),
    *_norm("params/mlm_head/LayerNorm", f"{heads}predictions.transform.LayerNorm"),
    rule("params/mlm_head/bias", f"{heads}predictions.bias"),
    rule(None, f"{emb}.position_ids", absent="dropped"),  # a constant buffer (0, 1, 2, ...)
  ]
  if mmf:  # BERT's next-sentence head, copied by MMF and never trained by its MLM-only VisualBERT pretraining
    rules += [rule(None, f"{heads}seq_relationship.{w}", absent="dropped") for w in ("weight", "bias")]
    classifier = base.removesuffix("bert.") + "classifier."  # a fine-tuned model's task head (MMF's VQA, ...)
    rules += [
      rule(None, f"{classifier}{m}.{w}", absent="dropped")
      for m in ("0.dense", "0.LayerNorm", "1")
      for w in ("weight", "bias")
    ]
  else:
    rules += _linear("params/align_head", f"{heads}seq_relationship", transform="linear_swap2")
  return rules


def tied(base: str, heads: str) -> dict[str, str]:
  """{tied copy: the tensor it copies} of the MLM decoder (both codes tie it to the word embeddings)."""
  return {
    f"{heads}predictions.decoder.weight": f"{base}embeddings.word_embeddings.weight",
    f"{heads}predictions.decoder.bias": f"{heads}predictions.bias",
  }


# The layouts, told apart by their names: (encoder prefix, heads prefix, MMF's embedding names).
LAYOUTS = {
  "huggingface": ("visual_bert.", "cls.", False),  # VisualBertForPreTraining (VisualBertModel: no prefix)
  "mmf": ("model.bert.", "model.cls.", True),
  "original": ("bert.bert.", "bert.cls.", True),  # the authors' code (MMF renames it when loading)
}
_PLACEHOLDER_REGIONS = "REGION_FEATURES_DIR"
# config.json fields an imported run does not keep: what export writes itself (the model class, the type) and what
# describes the file rather than the model (the writer's version, the dtype: export writes float32).
_HF_NOT_KEPT = ("architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype")


def layout_of(keys) -> tuple[str, str, str, bool]:
  """(layout name, encoder prefix, heads prefix, MMF names) of a state dict's names."""
  keys = set(keys)
  for name, (base, heads, mmf) in LAYOUTS.items():
    if f"{base}embeddings.word_embeddings.weight" in keys:
      return name, base, heads, mmf
  mmf = any("embeddings.token_type_embeddings_visual." in k for k in keys)
  return ("mmf" if mmf else "huggingface"), "", "cls.", mmf  # a bare encoder (VisualBertModel)


def key_map(keys) -> KeyMap:
  name, base, heads, mmf = layout_of(keys)
  return KeyMap(f"VisualBERT ({name} layout)", visual_bert_rules(base, heads, mmf))


def expected_keys(keys=()) -> list[str]:
  """The names every VisualBERT checkpoint of this layout has (layer 0 standing for all layers)."""
  _, base, _, mmf = layout_of(keys)
  return [
    r.foreign[0].replace("{}", "0")
    for r in visual_bert_rules(base, "cls.", mmf)
    if r.vlrep is not None and not r.vlrep.startswith(("params/mlm_head", "params/align_head"))
  ]


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  """(the fraction of `expected_keys` present, times the fraction of the keys the key map reads; the first
  missing keys; the first unexpected ones)."""
  keys = {k.removeprefix("module.") for k in keys}
  if not keys:
    return 0.0, expected_keys()[:5], []
  _, base, heads, _ = layout_of(keys)
  km, want = key_map(keys), expected_keys(keys)
  copies = set(tied(base, heads))
  missing = [k for k in want if k not in keys]
  unexpected = sorted(k for k in keys if not km.matches(k) and k not in copies)
  fraction = (len(want) - len(missing)) / len(want) * (1 - len(unexpected) / len(keys))
  return fraction, missing[:5], unexpected[:5]


def _state_dict(obj, path: str) -> tuple[dict[str, np.ndarray], dict | None]:
  """(the tensors, the checkpoint's own 'config' entry or None) of what `load_checkpoint` read: the state dict
  itself or under 'model' / 'state_dict' (MMF's training checkpoints, whose 'config' is plain containers)."""
  if not isinstance(obj, dict):
    raise BadFile(f"{path} holds a {type(obj).__name__}, not a state dict.")
  config = obj.get("config") if isinstance(obj.get("config"), dict) else None
  if not any(isinstance(v, np.ndarray) for v in obj.values()):
    inner = next((obj[k] for k in ("model", "state_dict") if isinstance(obj.get(k), dict)), None)
    if inner is None:
      raise BadFile(f"{path} holds no tensors at its top level nor under 'model' / 'state_dict'.")
    obj = inner
  bad = [k for k, v in obj.items() if not isinstance(v, np.ndarray)]
  if bad:
    raise BadFile(f"{path}: the state dict holds entries that are not tensors: {bad[:5]}.")
  return {str(k).removeprefix("module."): v for k, v in obj.items()}, config


# ------------------------------------------------------------------------------------------------------------ #
# Reading.
# ------------------------------------------------------------------------------------------------------------ #
class MissingFile(UserError, FileNotFoundError):
  """A file the folder (or the run being exported) should hold is not there."""


def _locate(checkpoint: str) -> tuple[str, str | None, str | None]:
  """(weights file, Hugging Face config.json or None, MMF config.yaml or None)."""
  checkpoint = os.path.expanduser(checkpoint)
  if os.path.isfile(checkpoint):
    folder = os.path.dirname(os.path.abspath(checkpoint))
    config_json = os.path.join(folder, "config.json")
    config_yaml = os.path.join(folder, "config.yaml")
    return (
      checkpoint,
      config_json if os.path.exists(config_json) else None,
      config_yaml if os.path.exists(config_yaml) else None,
    )
  if not os.path.isdir(checkpoint):
    raise MissingFile(f"--checkpoint {checkpoint!r} does not exist.")
  if os.path.exists(os.path.join(checkpoint, "model.safetensors.index.json")) or os.path.exists(
    os.path.join(checkpoint, "pytorch_model.bin.index.json")
  ):
    raise UserError(f"{checkpoint} holds a sharded checkpoint; save it unsharded (VisualBERT-base is one 450 MB file).")
  for name in ("model.safetensors", "pytorch_model.bin"):
    if os.path.exists(os.path.join(checkpoint, name)):
      config_json = os.path.join(checkpoint, "config.json")
      if not os.path.exists(config_json):
        raise MissingFile(f"{checkpoint} has {name} but no config.json (a Hugging Face folder has both).")
      return os.path.join(checkpoint, name), config_json, None
  found = sorted(n for n in os.listdir(checkpoint) if n.endswith((".pth", ".ckpt", ".pt")))
  if len(found) != 1:
    raise MissingFile(
      f"{checkpoint} holds no model.safetensors / pytorch_model.bin (Hugging Face) and "
      + (f"several torch files {found}: pass one of them." if found else "no .pth / .ckpt file (MMF).")
    )
  config_yaml = os.path.join(checkpoint, "config.yaml")
  return os.path.join(checkpoint, found[0]), None, config_yaml if os.path.exists(config_yaml) else None


def _mmf_model_config(config_yaml: str | None, embedded: dict | None) -> dict:
  """MMF's `model_config.visual_bert`, from the zoo's config.yaml beside the weights or from the training
  checkpoint's own 'config' entry; {} when neither has one."""
  raw = embedded
  if config_yaml:
    with reading(config_yaml, what="MMF config.yaml", hint=_FOLDER_HINT):
      _check_size(config_yaml)
      with open(config_yaml, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
  if not isinstance(raw, dict):
    return {}
  model_config = raw.get("model_config", raw)
  found = model_config.get("visual_bert") if isinstance(model_config, dict) else None
  return found if isinstance(found, dict) else {}


def _bert_fields(sd, base: str, mmf: bool, config_json: str | None, mmf_config: dict, options: dict, notes: dict):
  """BertConfig fields and visual_embedding_dim: config.json's (Hugging Face), else the tensors' shapes and
  MMF's config / the options / BERT's conventions for what shapes do not show (each assumption noted)."""
  sizes = _tensor_sizes(sd, base, mmf, config_json or "the checkpoint")
  if config_json:
    raw = _read_config_json(config_json)
    hooks = code_hooks(raw)
    if hooks:
      raw = without_code_hooks(raw)
      for key in hooks:
        notes["dropped"][f"config.json {key}"] = _CODE_HOOK_WHY
      logging.warning("%s: dropped %s (%s).", config_json, ", ".join(hooks), _CODE_HOOK_WHY)
    if raw.get("model_type", "visual_bert") != "visual_bert":
      raise BadFile(f"{config_json}: model_type {raw['model_type']!r} is not 'visual_bert'.")
    if raw.get("bypass_transformer"):
      raise UserError(
        f"{config_json}: bypass_transformer=true (text-only layers, then one extra layer over text and regions) "
        "has no vlrep counterpart."
      )
    if raw.get("position_embedding_type", "absolute") != "absolute":
      raise UserError(f"{config_json}: only absolute position embeddings are supported.")
    names = (*vlbert.BERT_ARCHITECTURE, "visual_embedding_dim")
    missing = [n for n in names if n not in raw]
    if missing:
      raise BadFile(f"{config_json} lacks {missing}: not a VisualBERT config.json.")
    fields = {n: raw[n] for n in names}
    fields.update(
      hidden_dropout_prob=raw.get("hidden_dropout_prob", 0.1),
      attention_probs_dropout_prob=raw.get("attention_probs_dropout_prob", 0.1),
    )
    _check_fields(fields, sizes, config_json)
    # The folder's other config.json fields (pad_token_id, initializer_range, ...), which export writes back.
    notes["hf_config"] = {k: v for k, v in raw.items() if k not in fields and k not in _HF_NOT_KEPT}
    return fields
  if mmf_config.get("bypass_transformer") or any(k.startswith(f"{base}additional_layer.") for k in sd):
    raise UserError(
      "An MMF VisualBERT with bypass_transformer (text-only layers, then one extra layer) has no vlrep counterpart."
    )

  def unreadable(name, default, why):
    if options.get(name) is not None:
      return options[name]
    if name in mmf_config:
      return mmf_config[name]
    flag = "heads" if name == "num_attention_heads" else name
    notes.setdefault("assumed", {})[name] = f"{default!r} ({why}; pass {flag}=... otherwise)"
    return default

  hidden = sizes["hidden_size"]
  heads = unreadable("num_attention_heads", max(1, hidden // 64), "BERT's 64-wide heads")
  eps = unreadable("layer_norm_eps", 1e-12, "BERT's")
  try:  # YAML reads 1e-12 (no dot) as a string
    heads, eps = int(heads), float(eps)
  except (TypeError, ValueError) as e:
    raise BadFile(f"The MMF config's num_attention_heads={heads!r} or layer_norm_eps={eps!r} is not a number.") from e
  fields = dict(
    sizes,
    num_attention_heads=heads,
    hidden_act=unreadable("hidden_act", "gelu", "BERT's"),
    layer_norm_eps=eps,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
  )
  _check_fields(fields, sizes, "the MMF config and options")
  return fields


# config.json keys that name Python code to load (transformers' `trust_remote_code` machinery): vlrep never runs a
# file's code, so an imported run does not keep them and an export never writes them.
CODE_HOOKS = ("auto_map", "custom_pipelines", "trust_remote_code")
_CODE_HOOK_WHY = "names Python code to load (remote code); vlrep runs no code from a file and does not carry it"
_MAX_TEXT_BYTES = 16 << 20  # config.json, config.yaml: a few KB; vocab.txt: about 230 KB for BERT's 30522 pieces
_FOLDER_HINT = "Pass the folder as `save_pretrained` (or MMF) wrote it; re-download it if it may be damaged."


def _is_code_hook(key, value) -> bool:
  return (
    str(key) in CODE_HOOKS or "remote_code" in str(key) or (isinstance(value, str) and value.strip().endswith(".py"))
  )


def code_hooks(config, prefix: str = "") -> list[str]:
  """The (dotted) keys of a config.json, at any depth, that name Python code to load."""
  found = []
  if isinstance(config, dict):
    for k, v in config.items():
      if _is_code_hook(k, v):
        found.append(f"{prefix}{k}")
      else:
        found += code_hooks(v, f"{prefix}{k}.")
  return found


def without_code_hooks(config):
  """A config.json's content without the keys `code_hooks` finds."""
  if isinstance(config, dict):
    return {k: without_code_hooks(v) for k, v in config.items() if not _is_code_hook(k, v)}
  return config


def _check_size(path: str) -> None:
  if os.path.getsize(path) > _MAX_TEXT_BYTES:
    raise ValueError(f"{os.path.getsize(path)} bytes, more than the {_MAX_TEXT_BYTES >> 20} MB such a file takes")


def _read_config_json(path: str) -> dict:
  """A Hugging Face config.json's object; not JSON, not UTF-8, nested too deep, too large or not an object: one
  BadFile naming it."""
  with reading(path, what="Hugging Face config.json", hint=_FOLDER_HINT):
    _check_size(path)
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  if not isinstance(raw, dict):
    raise BadFile(f"{path} holds a JSON {type(raw).__name__}, not a config object. {_FOLDER_HINT}")
  return raw


def _tensor_sizes(sd, base: str, mmf: bool, path: str) -> dict:
  """The BERT sizes the checkpoint's tensors show (what a config.json must agree with)."""
  with tv.tensors_of(path, "VisualBERT"):
    words = sd[f"{base}embeddings.word_embeddings.weight"]
    layers = sorted({int(m.group(1)) for k in sd if (m := re.match(re.escape(base) + r"encoder\.layer\.(\d+)\.", k))})
    if layers != list(range(len(layers))) or not layers:
      raise ValueError(f"The checkpoint's encoder layers are {layers}: expected 0..N-1.")
    return dict(
      vocab_size=int(words.shape[0]),
      hidden_size=int(words.shape[1]),
      num_hidden_layers=len(layers),
      intermediate_size=int(sd[f"{base}encoder.layer.0.intermediate.dense.weight"].shape[0]),
      max_position_embeddings=int(sd[f"{base}embeddings.position_embeddings.weight"].shape[0]),
      type_vocab_size=int(sd[f"{base}embeddings.token_type_embeddings.weight"].shape[0]),
      visual_embedding_dim=int(sd[f"{base}embeddings.{'projection' if mmf else 'visual_projection'}.weight"].shape[1]),
    )


def _check_fields(fields: dict, sizes: dict, where: str) -> None:
  """BertConfig fields of the right types and ranges, and the layer count the tensors show (checked before any model
  is built: a config.json that claims 100000 layers over a two-layer checkpoint is refused, not built)."""
  wrong = []
  for k in (*sizes, "num_attention_heads"):
    v = fields[k]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      wrong.append(f"{k}={v!r} (a positive integer)")
    elif k == "num_hidden_layers" and v != sizes[k]:  # the other sizes: to_vlrep names the tensor and both shapes
      wrong.append(f"{k}={v} (the checkpoint's tensors have {sizes[k]})")
  if not wrong and fields["hidden_size"] % fields["num_attention_heads"]:
    wrong.append(f"num_attention_heads={fields['num_attention_heads']} (does not divide hidden_size)")
  if not isinstance(fields["hidden_act"], str) or fields["hidden_act"] not in bert_lib._ACTIVATIONS:
    wrong.append(f"hidden_act={fields['hidden_act']!r} (one of {sorted(bert_lib._ACTIVATIONS)})")
  eps = fields["layer_norm_eps"]
  if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
    wrong.append(f"layer_norm_eps={eps!r} (a number in (0, 1))")
  for k in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
    v = fields[k]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1:
      wrong.append(f"{k}={v!r} (a rate in [0, 1))")
  if wrong:
    raise BadFile(f"{where}: {'; '.join(wrong)}. The configuration does not describe the checkpoint's model.")
  fields["layer_norm_eps"] = float(eps)


def _vocab_folder(vocab: str | None, checkpoint_folder: str, vocab_size: int) -> str:
  """The folder of the WordPiece vocab.txt (what vlrep's tokenizer and method read), checked against the word
  embedding's size and BERT's special tokens."""
  if vocab is None:
    if not os.path.exists(os.path.join(checkpoint_folder, "vocab.txt")):
      raise MissingFile(
        f"No vocabulary: {checkpoint_folder} has no vocab.txt. Pass --vocab=PATH, the WordPiece vocab.txt the model "
        "was trained with (VisualBERT's and MMF's: bert-base-uncased's)."
      )
    vocab = checkpoint_folder
  vocab = os.path.abspath(os.path.expanduser(vocab))
  folder = vocab if os.path.isdir(vocab) else os.path.dirname(vocab)
  path = os.path.join(folder, "vocab.txt")
  if not os.path.isdir(vocab) and os.path.basename(vocab) != "vocab.txt":
    raise UserError(f"--vocab {vocab}: vlrep's WordPiece tokenizer reads FOLDER/vocab.txt; name the file vocab.txt.")
  if not os.path.exists(path):
    raise MissingFile(f"--vocab: {path} does not exist.")
  with reading(path, what="WordPiece vocab.txt (UTF-8 text)", hint=_FOLDER_HINT):
    _check_size(path)
    with open(path, encoding="utf-8") as f:
      tokens = [line.rstrip("\n") for line in f]
  if len(tokens) != vocab_size:
    raise BadFile(
      f"The vocabulary {path} has {len(tokens)} tokens but the checkpoint's word embedding has {vocab_size} rows: "
      "not the vocabulary this model was trained with."
    )
  missing = [t for t in ("[CLS]", "[SEP]", "[MASK]") if t not in tokens]
  if missing or tokens[0] != "[PAD]":
    raise BadFile(f"{path} is not a BERT WordPiece vocabulary ([PAD] first, then [CLS], [SEP], [MASK]): {missing}")
  return folder


def default_config(regions: str) -> ConfigDict:
  """An imported VisualBERT run's config when no --config names a recipe: the model as published (VisualBERT's
  pretraining: masked language modelling over text and region features from `regions`, BERT's dropout and mask
  rate), what rebuilds and applies it. Nothing about training it further (no optimizer, schedule or evaluations): a
  fine-tuning run brings its own recipe (configs/vlbert.py:...,stage=finetune with method.pretrained_run=RUN).
  The vilbert-only sizes are there because vlrep.methods.vlbert reads them for either arch; they build nothing."""
  pp = f"vl_pairs('captions', 1)|tokenize_pairs(36)|region_features({regions!r}, 36, class_probs=False)"
  return ConfigDict(
    dict(
      method=dict(
        name="vlbert",
        arch="visual_bert",
        task="pretrain",
        loss="bce",
        num_labels=-1,
        freeze_base=False,
        **defaults.VLBERT_MODEL,
        visual=dict(**defaults.VLBERT_VISUAL, mode="file", dim=2048),
      ),
      tokenizer=dict(kind="wordpiece", path=""),
      data=dict(name="coco_captions2017", split="train", data_dir="", config_name="", pp=pp),
    )
  )


def _run_config(base, bert: dict, type_id: int, alignment: bool, vocab_folder: str, regions: str) -> ConfigDict:
  """The base config (`default_config` unless --config names one) with region files, VisualBERT's embeddings and
  BERT's architecture written in."""

  if base is None:
    c = default_config(regions or _PLACEHOLDER_REGIONS)
  else:
    c = ConfigDict(base.to_dict())
    if c.get("method", {}).get("name") != "vlbert":
      raise UserError("--config for the visual_bert format must be a vlbert config (configs/vlbert.py).")
  c.method.update(
    arch="visual_bert",
    task="pretrain",
    pretrained_run="",
    bert_path=vocab_folder,
    bert_layers=0,
    bert_config={k: v for k, v in bert.items() if k != "visual_embedding_dim"},
    text_pool="cls",
    region_boxes=False,
    region_norm="shared",
    region_type_embedding="tables",
    region_type_id=type_id,
    alignment_weight=1.0 if alignment else 0.0,
    dtype="float32",  # as the checkpoint's code computes; the base config's bfloat16 is a training speed choice
  )
  c.method.visual.update(mode="file", dim=bert["visual_embedding_dim"])
  c.tokenizer.update(kind="wordpiece", path=vocab_folder)
  return c


def expected_shapes(bert: dict, type_id: int, alignment: bool, mlm: bool = True):
  """({'params/...': shape}, the model) of the VisualBERT pretraining model these sizes build (without the MLM
  head's entries when `mlm` is False)."""

  cfg = vlbert.bert_config_from_dict({k: v for k, v in bert.items() if k != "visual_embedding_dim"}, "config")
  model = vl_bert.VLBertModel(
    arch="visual_bert",
    bert=cfg,
    region_dim=bert["visual_embedding_dim"],
    alignment=alignment,
    region_boxes=False,
    region_norm="shared",
    region_type_embedding="tables",
    region_type_id=type_id,
  )
  shapes = jax.eval_shape(lambda: _init(model, bert))["params"]
  flat = {f"params/{k}": tuple(v.shape) for k, v in flatten(shapes).items()}
  return {k: v for k, v in flat.items() if mlm or not k.startswith("params/mlm_head/")}, model


def _init(model, bert):

  ids = jnp.zeros((1, 2), jnp.int32)
  regions = jnp.zeros((1, 1, bert["visual_embedding_dim"]), jnp.float32)
  return model.init(jax.random.PRNGKey(0), ids, ids, regions, jnp.zeros((1, 1, 4)), jnp.ones((1, 1), bool))


def read(
  checkpoint: str,
  vocab: str | None = None,
  *,
  contents: Any = None,
  config: ConfigDict | None = None,
  workdir: str | None = None,
  heads: int | None = None,
  hidden_act: str | None = None,
  layer_norm_eps: float | None = None,
  region_type_id: int | None = None,
  regions: str = "",
) -> ImportedRun:
  """A VisualBERT checkpoint as a vlrep VisualBERT pretraining run.

  config: the base config (default: `default_config`). workdir: the run directory
  the run will live in (vlrep.interop.import_run's): its config then names the vocab.txt copied there (`files`), so the
  run is self-contained; else the folder of `vocab`. heads, hidden_act, layer_norm_eps: for MMF checkpoints, whose
  tensors do not show them (default: MMF's config in the checkpoint or beside it, else BERT's 64-wide heads, 'gelu',
  1e-12, noted in the run's note); a Hugging Face folder's config.json says them. region_type_id: the regions'
  token type (default 1 for Hugging Face folders, 0 for MMF checkpoints). regions: the region-feature directory the
  run's data section names (a placeholder by default)."""
  options = dict(num_attention_heads=heads, hidden_act=hidden_act, layer_norm_eps=layer_norm_eps)
  options = {k: v for k, v in options.items() if v is not None}
  weights, config_json, config_yaml = _locate(checkpoint)
  obj = contents if contents is not None and weights == checkpoint else tv.read_contents(weights)
  sd, embedded_config = _state_dict(obj, weights)
  layout, base, heads, mmf = layout_of(sd)
  notes: dict = {"format": "visual_bert", "source": os.path.abspath(weights), "layout": layout, "dropped": {}}
  missing = [k for k in expected_keys(sd) if k not in sd]
  if missing:
    fmt, best, m, u = closest_format(set(sd))
    if fmt != "visual_bert":
      raise tv.no_format(weights, set(sd))
    raise BadFile(f"{weights} is not a complete VisualBERT checkpoint ({layout} layout): it lacks {missing[:5]}.")
  mmf_config = _mmf_model_config(config_yaml, embedded_config) if mmf else {}
  bert = _bert_fields(sd, base, mmf, None if mmf else config_json, mmf_config, options, notes)

  code = sorted(n for n in os.listdir(os.path.dirname(os.path.abspath(weights))) if n.endswith(".py"))
  if code:  # e.g. a remote-code folder's modeling_*.py: never imported, never copied into the run
    notes["dropped"]["Python files"] = f"{', '.join(code[:10])}: {_CODE_HOOK_WHY}"
    logging.warning("%s: not imported, not copied: %s (%s).", os.path.dirname(weights), ", ".join(code), _CODE_HOOK_WHY)
  type_id = int(region_type_id) if region_type_id is not None else (0 if mmf else 1)

  # The MLM decoder: a tied copy of the word embeddings (and of the output bias) in both codes.
  sd = dict(sd)
  for copy, source in tied(base, heads).items():
    if copy not in sd:
      continue
    a = sd.pop(copy)
    if source in sd and a.shape == sd[source].shape and np.array_equal(a, sd[source]):
      notes["dropped"][copy] = f"a tied copy of {source}"
    else:
      diff = float(np.abs(a - sd[source]).max()) if source in sd and a.shape == sd[source].shape else "its shape"
      notes["dropped"][copy] = (
        f"differs from {source} (largest difference {diff}): vlrep's MLM head ties its decoder to the word "
        "embeddings, so the imported MLM head scores with those"
      )
  mlm_keys = [f"{heads}predictions.transform.dense.weight", f"{heads}predictions.bias"]
  mlm = any(k in sd for k in mlm_keys)
  alignment = not mmf and f"{heads}seq_relationship.weight" in sd
  expected, model = expected_shapes(bert, type_id, alignment, mlm)
  with tv.tensors_of(weights, "VisualBERT"):
    converted = key_map(sd).to_vlrep(sd, expected)
  for key, shape in converted.dropped.items():
    notes["dropped"][key] = _why(key, shape)
  params = unflatten(converted.variables)["params"]
  if not mlm:  # a VisualBertModel: no pretraining heads in the checkpoint
    params["mlm_head"] = jax.tree.map(np.asarray, _init(model, bert)["params"]["mlm_head"])
    notes["initialised"] = {"mlm_head": "the checkpoint has no MLM head (a VisualBertModel): vlrep's initialisation"}
  notes["sizes"] = {k: v for k, v in bert.items() if "dropout" not in k}
  notes["region_type_id"] = type_id

  vocab_folder = _vocab_folder(vocab, os.path.dirname(os.path.abspath(weights)), bert["vocab_size"])
  files = {"vocab.txt": os.path.join(vocab_folder, "vocab.txt")}
  if workdir:  # the run keeps its vocabulary: vlrep.interop.import_run copies `files` into the run directory
    vocab_folder = os.path.abspath(os.path.expanduser(workdir))
  if not regions and config is None:
    notes["regions"] = (
      f"the run's data section reads region features from {_PLACEHOLDER_REGIONS!r}: set regions=DIR (configs/vlbert.py)"
      f" for runs built from it; VisualBERT's features are {bert['visual_embedding_dim']}-d detector features"
    )
  run_config = _run_config(config, bert, type_id, alignment, vocab_folder, regions)
  return ImportedRun(
    config=run_config,
    params=params,
    model_state={},
    note=notes,
    files=files,
  )


def _why(key: str, shape) -> str:
  if key.endswith("position_ids"):
    return "a constant buffer (0, 1, 2, ...), not a parameter"
  if "seq_relationship" in key:
    return "BERT's next-sentence head, copied by MMF and never trained by its MLM-only VisualBERT pretraining"
  return (
    f"shape {shape}: MMF's downstream task head; vlrep's task heads belong to the downstream run (never loaded from "
    "a pretrained run)"
  )


# ------------------------------------------------------------------------------------------------------------ #
# Writing (vlrep.interop.export --format=visual_bert).
# ------------------------------------------------------------------------------------------------------------ #
# What a run's method config must say for its model to be Hugging Face's VisualBERT: VisualBERT's region embeddings
# (vlrep.models.vl_bert) and the pooler over [CLS]. Why each other value has no place in VisualBertForPreTraining:
EXPORT_KNOBS = dict(region_boxes=False, region_norm="shared", region_type_embedding="tables", text_pool="cls")
_NOT_VISUAL_BERT = {
  "region_boxes": "a box embedding (regions_embed/location), for which VisualBERT has no input",
  "region_norm": "the regions' own LayerNorm (regions_embed/LayerNorm), where VisualBERT applies BERT's embedding "
  "LayerNorm to text and regions alike",
  "region_type_embedding": "one learned segment vector (regions_embed/segment), where VisualBERT adds its visual "
  "token-type and position tables",
  "text_pool": "a pooled output over the mean text state, where VisualBERT's pooler reads [CLS]",
}
# config.json's fields besides the architecture, as transformers' VisualBertConfig writes them (an imported run's
# own values, kept in its import note, take their place).
_HF_DEFAULTS = dict(initializer_range=0.02, bypass_transformer=False, special_visual_initialize=True)
_HF_HEADS = ("bert", "regions_embed", "mlm_head", "align_head")


def check_exportable(run) -> None:
  """A clear error unless the run's model is Hugging Face's VisualBERT (naming the flags of one that is)."""
  method = run.config.method
  if method.get("name") != "vlbert" or method.get("arch") != "visual_bert":
    what = f"method is {method.get('name')!r}" if method.get("name") != "vlbert" else f"arch is {method.get('arch')!r}"
    raise UserError(
      f"{run.path}: --format=visual_bert exports VisualBERT runs (configs/vlbert.py:arch=visual_bert, or a run "
      f"written by vlrep.interop.import_run --format=visual_bert); this run's {what}, which has no "
      "Hugging Face VisualBERT layout."
    )
  have = {**vlbert.region_embedding_knobs(method), "text_pool": method.get("text_pool", "cls")}
  differ = [k for k, want in EXPORT_KNOBS.items() if have[k] != want]
  if differ:
    flags = " ".join(f"--config.method.{k}={v}" for k, v in EXPORT_KNOBS.items())
    raise UserError(
      f"{run.path} is not Hugging Face's VisualBERT, so it cannot be written as one: "
      + "; ".join(f"{k}={have[k]!r} builds {_NOT_VISUAL_BERT[k]}" for k in differ)
      + ". A trained run's weights belong to the model it was trained as; only a run built with VisualBERT's "
      f"embeddings exports: train (or fine-tune from it) with {flags} (what an imported VisualBERT run sets)."
    )


def _bert_of(run) -> dict:
  """BertConfig fields of the run's BERT: `method.bert_config` (imported runs) or method.bert_path's config.json cut
  to `bert_layers`; the dropout rates are the checkpoint's own (what transformers' config.json holds)."""

  method = run.config.method
  if method.get("bert_config"):
    cfg = vlbert.bert_config_from_dict(dict(method.bert_config), f"{run.path}'s method.bert_config")
  else:
    folder = bert_lib.resolve_path(method.get("bert_path", ""))
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
      raise MissingFile(
        f"{run.path} was built from the BERT folder {folder!r} (method.bert_path), whose config.json says what the "
        "weights' shapes do not (heads, activation, LayerNorm eps); it is not there."
      )
    cfg = bert_lib.BertConfig.from_json(path)
    cfg, _ = bert_lib.first_layers(cfg, {}, int(method.get("bert_layers", 0)), folder)
  return dataclasses.asdict(cfg)


def _vocab_file(run, vocab_size: int) -> str | None:
  """The run's WordPiece vocab.txt (method.bert_path's, the tokenizer's, or the run directory's copy), checked
  against the word embedding's rows; None when none is found."""

  folders = []
  for path in (run.config.method.get("bert_path"), run.config.get("tokenizer", {}).get("path")):
    try:
      folders.append(bert_lib.resolve_path(path))
    except (FileNotFoundError, ValueError):  # '' or the packaged MiniLM not installed
      continue
  folders.append(os.path.dirname(os.path.dirname(run.path)))  # <workdir>/best/<step>: an imported run's copy
  for folder in folders:
    path = os.path.join(folder, "vocab.txt")
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        tokens = sum(1 for _ in f)
      if tokens != vocab_size:
        raise UserError(f"{path} has {tokens} tokens but the run's word embedding has {vocab_size} rows.")
      return path
  return None


def state_dict(run) -> tuple[OrderedDict, dict]:
  """(a VisualBertForPreTraining state dict as float32 numpy arrays under Hugging Face's names, {'config': its
  config.json, 'vocab': the vocab.txt to copy or None, 'notes': [...]}) of a VisualBERT run, through
  `visual_bert_rules` read the other way; the tied MLM decoder written as copies. Everything is checked: the
  run's model (`check_exportable`) and every parameter's shape against the model its config.json builds."""
  check_exportable(run)
  method = run.config.method
  note = run.meta.get("import", {}) if run.meta.get("import", {}).get("format") == "visual_bert" else {}
  bert = _bert_of(run)
  params = {k: v for k, v in run.params.items() if k in _HF_HEADS}
  notes = []
  if set(run.params) - set(params):
    notes.append(
      f"not written: {sorted(set(run.params) - set(params))} (a downstream task head: VisualBertForPreTraining has "
      "none; the encoder and the MLM head are written)"
    )
  if "regions_embed" not in params or "feature" not in params["regions_embed"]:
    raise UserError(f"{run.path} has no regions_embed/feature: not a VisualBERT run's parameters.")
  hidden = bert["hidden_size"]
  bert["visual_embedding_dim"] = int(np.shape(params["regions_embed"]["feature"]["kernel"])[0])
  if "align_head" not in params:
    params["align_head"] = {"kernel": np.zeros((hidden, 2), np.float32), "bias": np.zeros((2,), np.float32)}
    notes.append(
      "cls.seq_relationship (VisualBERT's sentence-image head) is written as zeros: the run has no trained "
      "alignment head (method.alignment_weight=0), so its two logits are 0 (even odds) until fine-tuned"
    )
  if note.get("initialised", {}).get("mlm_head"):
    notes.append(f"cls.predictions is not trained: {note['initialised']['mlm_head']} when the run was imported")
  type_id = int(method.get("region_type_id", 1))
  if type_id != 1:
    notes.append(
      f"the regions' token type is {type_id} (method.region_type_id; 0 is MMF's convention): pass "
      f"visual_token_type_ids filled with {type_id} to the model (transformers' default, ones, computes another "
      "embedding)"
    )
  if method.get("visual", {}).get("mode", "file") != "file":
    notes.append(
      f"the run's regions come from its frozen vlrep ResNet (method.visual.mode={method.visual.mode!r}), which the "
      "folder does not hold: compute visual_embeds with that extractor"
    )
  flat = {f"params/{k}": np.asarray(v) for k, v in flatten(params).items()}
  expected, _ = expected_shapes(bert, type_id, alignment=True)
  wrong = [
    f"{k}: {tuple(flat[k].shape) if k in flat else 'missing'} (needs {v})"
    for k, v in sorted(expected.items())
    if k not in flat or tuple(flat[k].shape) != tuple(v)
  ] + [f"{k}: unexpected" for k in sorted(set(flat) - set(expected))]
  if wrong:
    raise UserError(
      f"{run.path}'s parameters are not the VisualBERT its config describes ({bert}): {wrong[:5]}"
      + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
    )
  base, heads, mmf = LAYOUTS["huggingface"]
  sd = KeyMap("VisualBERT (huggingface layout)", visual_bert_rules(base, heads, mmf)).to_foreign(flat)
  for copy, source in tied(base, heads).items():
    sd[copy] = sd[source].copy()
  out = OrderedDict((k, np.ascontiguousarray(v, np.float32)) for k, v in sd.items())
  vocab = _vocab_file(run, bert["vocab_size"])
  if vocab is None:
    notes.append("no vocab.txt found (method.bert_path, tokenizer.path, the run directory): none written")
  config = {"architectures": ["VisualBertForPreTraining"], "model_type": "visual_bert", **_HF_DEFAULTS}
  if vocab is not None:
    with open(vocab, encoding="utf-8") as f:
      tokens = [line.rstrip("\n") for line in f]
    if "[PAD]" in tokens:  # the row vlrep pads with (BERT's pad_token_id)
      config["pad_token_id"] = tokens.index("[PAD]")
  config.update(without_code_hooks(note.get("hf_config", {})))  # a run imported before hooks were dropped
  config.update({k: bert[k] for k in (*vlbert.BERT_ARCHITECTURE, "visual_embedding_dim")})
  config.update({k: bert[k] for k in ("hidden_dropout_prob", "attention_probs_dropout_prob")})
  return out, {"config": dict(sorted(config.items())), "vocab": vocab, "notes": notes}


def write_folder(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run as a Hugging Face VisualBertForPreTraining folder: config.json, model.safetensors and the run's
  vocab.txt, checked first, written beside `out` and renamed into place; an existing non-empty `out` is an error
  unless `overwrite`. Returns {'keys', 'parameters', 'step', 'files', 'config', 'notes'}."""

  out = os.path.abspath(os.path.expanduser(out)).rstrip(os.sep)

  def check_out():
    if os.path.exists(out) and not os.path.isdir(out):
      raise FileExistsError(f"--out={out} is a file; --format=visual_bert writes a folder.")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
      raise FileExistsError(
        f"--out={out} already exists and is not empty; pass --overwrite to replace it, or choose another folder."
      )

  check_out()
  sd, info = state_dict(run)
  with safe_files.atomic_dir(out) as tmp:  # a fresh folder beside OUT, renamed into place when whole
    save_file(dict(sd), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    safe_files.write_text(os.path.join(tmp, "config.json"), json.dumps(info["config"], indent=2) + "\n", root=tmp)
    if info["vocab"]:
      with safe_files.open_atomic(os.path.join(tmp, "vocab.txt"), "wb", root=tmp) as f, open(info["vocab"], "rb") as v:
        shutil.copyfileobj(v, f)
    check_out()  # (it may have appeared meanwhile)
  copies = set(tied(*LAYOUTS["huggingface"][:2]))
  return {
    "keys": len(sd),
    "parameters": sum(int(v.size) for k, v in sd.items() if k not in copies),
    "step": run.step,
    "files": sorted(os.listdir(out)),
    "config": info["config"],
    "notes": info["notes"],
  }


def _run_without_code_hooks(run) -> tuple[Any, list[str]]:
  """The run with the code hooks (CODE_HOOKS) of its saved Hugging Face config.json fields (an imported run's
  `import.hf_config`, which the export writes back) removed, and the names removed."""
  note = run.meta.get("import", {})
  fields = note.get("hf_config", {}) if isinstance(note, dict) else {}
  hooks = sorted(k for k in fields if k in CODE_HOOKS) if isinstance(fields, dict) else []
  if not hooks:
    return run, []
  kept = {k: v for k, v in fields.items() if k not in CODE_HOOKS}
  return dataclasses.replace(run, meta={**run.meta, "import": {**note, "hf_config": kept}}), hooks


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run as a Hugging Face folder that `transformers.VisualBertForPreTraining.from_pretrained(FOLDER)`
  loads with no missing or unexpected keys (`write_folder`); code hooks (CODE_HOOKS: keys that make transformers
  import Python from a folder) are never written, whatever the run's saved config.json fields hold, and dropping
  one is a note. An existing non-empty `out` needs `overwrite`. Returns `write_folder`'s dict."""
  folder = os.path.abspath(os.path.expanduser(out)).rstrip(os.sep)
  if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
    raise keymaps.OutExists(
      f"--out={out} already exists and is not empty; pass --overwrite to replace it, or choose another folder."
    )
  if os.path.lexists(folder) and not os.path.isdir(folder) or os.path.islink(folder):
    raise keymaps.NotExportable(f"--out={out} is a file or a link; --format=visual_bert writes a folder.")
  safe_files.make_dirs(keymaps.out_root(folder))
  run, hooks = _run_without_code_hooks(run)
  info = keymaps.refusal(write_folder, run, out, overwrite)
  written = os.path.join(folder, "config.json")
  with open(written, encoding="utf-8") as f:  # the file just written: no code hook reached it
    left = sorted(set(CODE_HOOKS) & set(json.load(f)))
  if left:
    raise RuntimeError(f"{written} was written with code hooks {left}; vlrep's export must never write them.")
  if hooks:
    info["notes"] = [
      *info.get("notes", []),
      f"not written: {hooks} (code hooks: transformers would import Python from the folder; an export carries none)",
    ]
  return info
