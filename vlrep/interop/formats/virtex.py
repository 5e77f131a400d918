"""Official VirTex checkpoints (kdexd/virtex) <-> vlrep VirTex runs.

  python -m vlrep.interop.import_run --format=virtex --checkpoint=bicaptioning_R_50_L1_H2048.pth \
      --vocab=coco_10k.model --workdir=/runs/virtex_zoo_h2048
  python -m vlrep.tools.caption --workdir=/runs/virtex_zoo_h2048 photo.jpg
  python -m vlrep.interop.export --workdir=/runs/virtex_zoo_h2048 --format=virtex --out=bicaptioning.pth

What is read: the model zoo's `{"model": state_dict, ...}` files of every task (bicaptioning, captioning, masked_lm:
a `TransformerDecoderTextualHead`; token_classification: a `LinearTextualHead`), every width, depth and backbone
(torchvision resnet50 / resnet101 / wide_resnet50_2 under `visual.cnn.`), and the hub's backbone-only files
(`backbone_bicaptioning_R_50_L1_H2048.pth`: torchvision names, imported as `vlrep.interop.formats.torchvision` does).
The sizes come from the tensors: H (embedding width), L (decoder layers), F (feed-forward width), the caption length
(position embeddings), the vocabulary (embedding rows) and the backbone. What they cannot tell is a flag: the
number of attention heads (`--heads`, default H / 64 as every zoo model) and, for a forward-only transformer head,
captioning or masked LM (`--task`; default from the file name).

The official vocabulary (`--vocab=coco_10k.model`) is required for text models and must have as many pieces as
the embedding has rows. Its special ids (<unk> = padding 0, [SOS] 1, [EOS] 2, [MASK] 3) differ from vlrep's (PAD 0,
UNK 1, SOS 2, EOS 3, MASK 4): the run's tokenizer reads it with `special_tokens='virtex'`, which presents its ids in
vlrep's layout (official id 0 -> 0, i >= 1 -> i + 1) and cuts long captions as the official code; the vocabulary
rows of the embedding, output bias or classifier are reordered the same way, and vlrep's extra [UNK] id gets a zero
row and an output bias of -1e4 (`vlrep.interop.keymaps.DEAD_LOGIT`: probability exactly 0 in float32). So the imported
model tokenizes, scores and decodes as the official code, and export reorders the rows back.

Dropped, and said so in the note: each attention's key bias (the middle third of `in_proj_bias`; it adds q.b_k to
every logit of a query alike, which softmax removes: exact; its largest magnitude is noted; export writes zeros).
Checked: the tied copies (`textual.output.weight` = `textual.embedding.words.weight`, and in bicaptioning the
backward head's shared visual projection, embedding and output) must be identical. The run's config sets the
official head's decoder (LayerNorm epsilon 1e-5, torch's default: `method.decoder_ln_eps`; dropout on the
feed-forward's hidden activations: `method.mlp_dropout`; `method.official_init` for what a fine-tuning run adds)
and float32 compute.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from vlrep import safe_files
from vlrep.data import tokenizers
from vlrep.errors import BadFile, UserError, reading
from vlrep.interop import keymaps
from vlrep.interop.formats import torchvision as tv
from vlrep.interop.keymaps import ImportedRun, KeyMap, flatten, rule
from vlrep.methods import virtex as virtex_method
from vlrep.runs import unflatten

DESCRIPTION = "official VirTex checkpoint (model zoo {'model': ...} .pth, any task) or hub backbone file"
OUT_SUFFIXES = (".pth", ".pt")  # the official code reads it with torch.load
# The official model's evaluation preprocessing (kdexd/virtex: resize to 256, centre crop 224).
OFFICIAL_EVAL_PP = "decode|resize_small(256)|central_crop(224)|normalize"
TASKS = ("bicaptioning", "captioning", "masked_lm", "token_classification")
OFFICIAL_LN_EPS = 1e-5  # torch.nn.TransformerDecoderLayer's LayerNorms (the official head passes no eps)
BACKBONE_PREFIX = "visual.cnn."
ANCHORS = (
  "visual.cnn.conv1.weight",
  "visual.cnn.layer1.0.conv1.weight",
  "textual.output.weight",
  "textual.output.bias",
)
# vlrep's decoder directions -> the official module holding each one's transformer.
_MODULES = {"forward": "textual", "backward": "backward_textual", "bidirectional": "textual"}
_DIRECTIONS = {"bicaptioning": ("forward", "backward"), "captioning": ("forward",), "masked_lm": ("bidirectional",)}


def rules(task: str) -> list:
  """The official VirTex model's names (`CaptioningModel` / `MaskedLMModel` / `TokenClassificationModel`
  state_dict) <-> a vlrep VirTex run's variables, for one task."""
  out = tv.resnet_rules(BACKBONE_PREFIX, "backbone")
  out = [r for r in out if not r.foreign[0].startswith(f"{BACKBONE_PREFIX}fc.")]  # the official fc is nn.Identity
  if task == "token_classification":
    return out + [
      rule("params/classifier/kernel", "textual.output.weight", transform="vocab_linear"),
      rule("params/classifier/bias", "textual.output.bias", transform="vocab_bias"),
    ]
  modules = sorted({_MODULES[d] for d in _DIRECTIONS[task]}, key=len)  # 'textual' first: the tensor, then copies

  def shared(name):  # the visual projection, embedding and output: one module, shared by both directions
    return [f"{m}.{name}" for m in modules]

  t = "params/textual_head"
  out += [
    rule("params/visual_projection/kernel", *shared("visual_projection.weight"), transform="linear"),
    rule("params/visual_projection/bias", *shared("visual_projection.bias")),
    rule(
      f"{t}/embedding/words/embedding",
      *shared("embedding.words.weight"),
      *shared("output.weight"),
      transform="vocab_rows",
    ),  # fmt: skip
    rule(f"{t}/embedding/positions/embedding", *shared("embedding.positions.weight")),
    rule(f"{t}/embedding/ln/scale", *shared("embedding.layer_norm.weight")),
    rule(f"{t}/embedding/ln/bias", *shared("embedding.layer_norm.bias")),
    rule(f"{t}/output_bias", *shared("output.bias"), transform="vocab_bias"),
  ]
  for direction in _DIRECTIONS[task]:
    v, f = f"{t}/{direction}_layer{{}}", f"{_MODULES[direction]}.transformer.layers.{{}}"
    for ours, theirs in (("self_attention", "self_attn"), ("cross_attention", "multihead_attn")):
      a, b = f"{v}/{ours}", f"{f}.{theirs}"
      out += [
        rule(f"{a}/query/kernel", f"{b}.in_proj_weight", transform="heads_in", part=(0, 3)),
        rule(f"{a}/key/kernel", f"{b}.in_proj_weight", transform="heads_in", part=(1, 3)),
        rule(f"{a}/value/kernel", f"{b}.in_proj_weight", transform="heads_in", part=(2, 3)),
        rule(f"{a}/query/bias", f"{b}.in_proj_bias", transform="heads_bias", part=(0, 3)),
        rule(None, f"{b}.in_proj_bias", part=(1, 3), absent="zeros"),  # the key bias: cancels in softmax
        rule(f"{a}/value/bias", f"{b}.in_proj_bias", transform="heads_bias", part=(2, 3)),
        rule(f"{a}/out/kernel", f"{b}.out_proj.weight", transform="heads_out"),
        rule(f"{a}/out/bias", f"{b}.out_proj.bias"),
      ]
    for ours, theirs in (("ln_self", "norm1"), ("ln_cross", "norm2"), ("ln_mlp", "norm3")):
      out += [rule(f"{v}/{ours}/scale", f"{f}.{theirs}.weight"), rule(f"{v}/{ours}/bias", f"{f}.{theirs}.bias")]
    for ours, theirs in (("mlp_in", "linear1"), ("mlp_out", "linear2")):
      out += [
        rule(f"{v}/{ours}/kernel", f"{f}.{theirs}.weight", transform="linear"),
        rule(f"{v}/{ours}/bias", f"{f}.{theirs}.bias"),
      ]
  return out


_MATCHING = KeyMap("VirTex", rules("bicaptioning") + rules("token_classification"))


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  keys = set(keys)
  if keys and not any(k.startswith(BACKBONE_PREFIX) for k in keys):
    return tv.score(keys)  # a hub backbone file: torchvision's names
  if not keys:
    return 0.0, list(ANCHORS), []
  matched = {k for k in keys if _MATCHING.matches(k)}
  missing = [a for a in ANCHORS if a not in keys]
  return len(matched) / len(keys) * (1 - len(missing) / len(ANCHORS)), missing, sorted(keys - matched)


def detect_task(sd: dict, checkpoint: str, task: str | None) -> str:
  """The pretraining task of a state dict: bicaptioning and token classification show in the keys; a forward-only
  transformer head is captioning or masked LM, told by `task` or the zoo's file name."""
  if "textual.embedding.words.weight" not in sd:
    found = "token_classification"
  elif any(k.startswith("backward_textual.") for k in sd):
    found = "bicaptioning"
  else:
    name = os.path.basename(checkpoint).lower()
    guess = "masked_lm" if "masked_lm" in name else "captioning" if "captioning" in name else None
    if task is None and guess is None:
      raise ValueError(
        f"{checkpoint} has one forward transformer head: a captioning or a masked-LM model, which its tensors do not "
        "tell apart (masked LM only drops the causal mask). Pass --task=captioning or --task=masked_lm."
      )
    found = task or guess
    if found not in ("captioning", "masked_lm"):
      raise ValueError(f"--task={task} does not fit a single transformer head; it is captioning or masked_lm.")
    return found
  if task is not None and task != found:
    raise ValueError(f"--task={task}, but {checkpoint}'s tensors are a {found} model.")
  return found


def head_sizes(sd: dict, task: str) -> dict:
  """The textual head's sizes read from the tensors' shapes."""
  if task == "token_classification":
    return {"vocab": int(sd["textual.output.weight"].shape[0]), "hidden": 0, "layers": 0, "positions": 30, "mlp": 0}
  words = sd["textual.embedding.words.weight"]
  layers = 0
  while f"textual.transformer.layers.{layers}.linear1.weight" in sd:
    layers += 1
  if not layers:
    raise ValueError("The checkpoint's textual head has no transformer layers (textual.transformer.layers.0.*).")
  return {
    "vocab": int(words.shape[0]),
    "hidden": int(words.shape[1]),
    "layers": layers,
    "positions": int(sd["textual.embedding.positions.weight"].shape[0]),
    "mlp": int(sd["textual.transformer.layers.0.linear1.weight"].shape[0]),
  }


def default_config(max_len: int) -> ConfigDict:
  """An imported VirTex run's data section when no --config names a recipe: the model as published (COCO Captions,
  the official evaluation preprocessing, captions of at most `max_len` tokens); the method and tokenizer are the
  checkpoint's (`_config`). Nothing about training it further: a fine-tuning run brings its own recipe."""
  pp = f"{OFFICIAL_EVAL_PP}|choose_caption(5)|tokenize({max_len})"
  return ConfigDict(dict(data=dict(name="coco_captions2017", split="train", data_dir="", config_name="", pp=pp)))


def _config(base: ConfigDict | None, task: str, sizes: dict, arch: dict, heads: int, vocab_path: str, vocab_size: int):
  """The run's config: `base` (--config's recipe, else `default_config`) with the checkpoint's method and
  tokenizer written in."""
  c = ConfigDict((base if base is not None else default_config(sizes["positions"])).to_dict())
  method = dict(c.get("method", {}))
  method.update(
    name="virtex",
    task=task,
    max_len=sizes["positions"],
    dtype="float32",
    decoder_ln_eps=OFFICIAL_LN_EPS,
    mlp_dropout=True,
    official_init=True,
    official_padding=True,
    backbone=tv.backbone_section(method.get("backbone"), arch),
  )
  method.setdefault("dropout", 0.1)
  method.setdefault("init_std", 0.02)
  for k, v in (("mask_prob", 0.15), ("mask_token_prob", 0.8), ("random_token_prob", 0.1)):
    method.setdefault(k, v)
  if task != "token_classification":
    method.update(hidden=sizes["hidden"], num_layers=sizes["layers"])
    if heads != max(1, sizes["hidden"] // 64):
      method["num_heads"] = heads
    if sizes["mlp"] != 4 * sizes["hidden"]:
      method["mlp_dim"] = sizes["mlp"]
  else:
    method.setdefault("hidden", 2048)
    method.setdefault("num_layers", 1)
  c.method = method
  if "data" in c and "pp" in c.data:
    c.data.pp = re.sub(r"tokenize\(\s*\d+", f"tokenize({sizes['positions']}", c.data.pp)
  tok = dict(c.get("tokenizer", {}))
  tok.update(path=vocab_path, vocab_size=vocab_size, build_if_missing=False, special_tokens="virtex")
  tok.setdefault("corpus_split", "train")
  tok.setdefault("corpus_key", "captions")
  c.tokenizer = tok
  if task not in ("bicaptioning", "captioning") and "evals" in c:
    c.evals = {k: v for k, v in c.evals.to_dict().items() if v.get("type") != "captioning"}
  return c


def expected_shapes(config: ConfigDict, vocab_size: int) -> dict[str, tuple]:
  """{'params/...' / 'batch_stats/...': shape} of the VirTex model `config.method` builds (shapes only)."""
  method = virtex_method.Method(config.method, vocab_size)
  batch = {"image": jnp.zeros((1, 64, 64, 3)), "tokens": jnp.zeros((1, config.method.max_len), jnp.int32)}
  shapes = jax.eval_shape(method.init, jax.random.PRNGKey(0), batch)
  return {f"{coll}/{p}": tuple(s.shape) for coll in ("params", "batch_stats") for p, s in flatten(shapes[coll]).items()}


def read_vocabulary(path: str) -> tokenizers.Tokenizer:
  """The official VirTex vocabulary (a SentencePiece model) in vlrep's id layout; a file that is not one is a
  BadFile naming it."""
  hint = "Pass the vocabulary the model was trained with: kdexd/virtex's datasets/vocab/coco_10k.model."
  with reading(path, what="SentencePiece vocabulary", hint=hint):
    return tokenizers.Tokenizer(path, "virtex")


def read(
  checkpoint: str,
  vocab: str | None = None,
  *,
  contents: Any = None,
  config: ConfigDict | None = None,
  workdir: str | None = None,
  task: str | None = None,
  heads: int = 0,
  backbone_only: bool = False,
) -> ImportedRun:
  """An official VirTex checkpoint as a vlrep run. `config`: the base config (its data, optimizer and evaluations
  are kept; the method and tokenizer are the checkpoint's; default: `default_config`); `contents`: the file's
  contents when the caller read them already; `workdir`: where the run goes (the vocabulary is copied
  to WORKDIR/vocab/); `backbone_only`: import `visual.cnn` alone (e.g. the zoo's multilabel classification model,
  which has no vlrep method)."""
  if task is not None and task not in TASKS:
    raise UserError(f"Unknown --task={task!r}; the VirTex tasks are {', '.join(TASKS)}.")
  # The vocabulary first: a file that is not a SentencePiece model is refused before a large checkpoint is read.
  tokenizer = read_vocabulary(vocab) if vocab else None
  sd = tv.read_state_dict(checkpoint, contents)
  keys = set(sd)
  if not any(k.startswith(BACKBONE_PREFIX) for k in keys):  # the hub's backbone file: torchvision's names
    s, missing, _ = tv.score(keys)
    if missing:
      raise tv.no_format(checkpoint, keys)
    if vocab:
      raise UserError(f"{checkpoint} is a VirTex backbone alone (torchvision names); --vocab does not apply.")
    arch, converted = tv.read_backbone(sd, path=checkpoint)
    return tv.backbone_run(checkpoint, "virtex (hub backbone)", arch, converted, config)
  s, missing, unexpected = score(keys)
  if missing[:2]:  # no visual.cnn stem / first block
    raise tv.no_format(checkpoint, keys)
  if backbone_only:
    arch, converted = tv.read_backbone(sd, BACKBONE_PREFIX, path=checkpoint)
    dropped = sorted(k for k in keys if not k.startswith(BACKBONE_PREFIX))
    run = tv.backbone_run(
      checkpoint,
      "virtex (backbone only)",
      arch,
      converted,
      config,
      {"backbone_prefix": BACKBONE_PREFIX, "textual_dropped": f"{len(dropped)} tensors (--backbone_only)"},
    )
    return run
  if missing:
    raise tv.no_format(checkpoint, keys)
  with tv.tensors_of(checkpoint, "VirTex"):
    task = detect_task(sd, checkpoint, task)
    sizes = head_sizes(sd, task)
    arch = tv.architecture(sd, BACKBONE_PREFIX)
  heads = heads or max(1, sizes["hidden"] // 64)
  if heads < 1 or (sizes["hidden"] and sizes["hidden"] % heads):
    raise UserError(f"--heads={heads} does not divide the head width H={sizes['hidden']}.")
  if not vocab:
    raise UserError(
      f"{checkpoint} is a {task} model: pass its vocabulary, --vocab=coco_10k.model (kdexd/virtex's "
      "datasets/vocab/coco_10k.model, built by its scripts/build_vocabulary.py)."
    )
  official_size = tokenizer.vocab_size - 1
  if official_size != sizes["vocab"]:
    where = "textual.output.weight" if task == "token_classification" else "textual.embedding.words.weight"
    raise BadFile(
      f"The vocabulary {vocab} has {official_size} pieces but the checkpoint's {where} has {sizes['vocab']} rows: "
      "it is not the vocabulary this model was trained with."
    )
  vocab_path = os.path.join(os.path.abspath(workdir), "vocab", os.path.basename(vocab)) if workdir else vocab
  c = _config(config, task, sizes, arch, heads, vocab_path, official_size)
  ctx = {"vocab_order": tokenizers.virtex_vocabulary_order(official_size)}
  expected = expected_shapes(c, official_size + 1)
  with tv.tensors_of(checkpoint, "VirTex"):
    converted = KeyMap(f"VirTex {task}", rules(task)).to_vlrep(sd, expected, ctx)
  variables = unflatten(converted.variables)
  key_bias = max(converted.redundant_max.values(), default=0.0)
  note = {
    "format": "virtex",
    "source": checkpoint,
    "vocabulary": vocab,
    "task": task,
    "sizes": {**sizes, "heads": heads},
    "architecture": arch,
    "backbone_prefix": BACKBONE_PREFIX,
    "counters": converted.counters,
    "dropped": {
      "attention key biases": (
        f"{len(converted.redundant_max)} blocks (the middle third of each in_proj_bias), largest magnitude "
        f"{key_bias:.3g}: q.b_k is the same for every key of a query, so softmax removes it (exact); exported as zeros"
      )
    }
    if converted.redundant_max
    else {},
    "special_tokens": "official ids in vlrep's layout: <unk>/padding 0 -> [PAD] 0, [SOS] 1 -> 2, [EOS] 2 -> 3, "
    "[MASK] 3 -> 4, piece i -> i + 1; vlrep's [UNK] 1 is a zero row with output bias -1e4 (never predicted)",
    "decoder_ln_eps": OFFICIAL_LN_EPS,
  }
  return ImportedRun(
    config=c,
    params=variables["params"],
    model_state={"batch_stats": variables["batch_stats"]},
    note=note,
    files={os.path.join("vocab", os.path.basename(vocab)): vocab} if workdir else {},
  )


# ------------------------------------------------------------------------------------------------------------------
# Export: a vlrep VirTex run -> the official model's state dict.
# ------------------------------------------------------------------------------------------------------------------
def state_dict(run) -> tuple[OrderedDict, dict]:
  """(the official model's state dict as numpy arrays, what the official config needs to build it) of a vlrep
  VirTex run: every key the official model has (strict=True), the attention key biases as zeros and the tied
  copies written out; an imported run's vocabulary rows back in the official order."""
  method = run.config.method
  if method.get("name") != "virtex":
    raise UserError(f"{run.path}: --format=virtex exports VirTex runs; this run's method is {method.get('name')!r}.")
  task = method.task
  if task not in TASKS:
    raise UserError(f"{run.path}: unknown VirTex task {task!r}.")
  stem = method.get("backbone", {}).get("stem", "imagenet")
  if stem != "imagenet":
    raise UserError(
      f"{run.path}: the backbone uses stem={stem!r}, which the official code's torchvision ResNet does not have; only "
      "stem='imagenet' backbones export."
    )
  params = {k: v for k, v in run.params.items() if k in ("backbone", "visual_projection", "textual_head", "classifier")}
  flat = {f"params/{k}": np.asarray(v) for k, v in flatten(params).items()}
  stats = run.model_state.get("batch_stats", {})
  flat.update({f"batch_stats/{k}": np.asarray(v) for k, v in flatten({"backbone": stats["backbone"]}).items()})
  official_vocab = run.config.get("tokenizer", {}).get("special_tokens", "vlrep") == "virtex"
  rows = (
    run.params["classifier"]["kernel"].shape[1]
    if task == "token_classification"
    else run.params["textual_head"]["embedding"]["words"]["embedding"].shape[0]
  )
  ctx = {"vocab_order": tokenizers.virtex_vocabulary_order(rows - 1) if official_vocab else None}
  sd = KeyMap(f"VirTex {task}", rules(task)).to_foreign(flat, ctx)
  counters = run.meta.get("import", {}).get("counters", {})
  out = OrderedDict()
  for key, value in sd.items():
    out[key] = value.astype(np.float32)
    if key.endswith(".running_var"):
      counter = key[: -len("running_var")] + "num_batches_tracked"
      out[counter] = np.array(counters.get(counter, 0), np.int64)
  return out, official_config(run, task, rows - 1 if official_vocab else rows, official_vocab)


def official_config(run, task: str, vocab: int, official_vocab: bool) -> dict:
  """The kdexd/virtex config values that build the exported model (its YAML keys)."""
  method = run.config.method
  b = method.get("backbone", {})
  names = {
    (50, 64, 1): "resnet50",
    (101, 64, 1): "resnet101",
    (50, 64, 2): "wide_resnet50_2",
    (152, 64, 1): "resnet152",
  }
  cnn = names.get((b.get("depth", 50), b.get("width", 64), b.get("inner_multiplier", 1)))
  out = {
    "MODEL.NAME": task,
    "MODEL.VISUAL.NAME": f"torchvision::{cnn}" if cnn else None,
    "DATA.VOCAB_SIZE": vocab,
    "DATA.MAX_CAPTION_LENGTH": method.get("max_len", 30),
  }
  if task != "token_classification":
    h = method.hidden
    heads = method.get("num_heads") or max(1, h // 64)
    mlp = method.get("mlp_dim") or 4 * h
    out["MODEL.TEXTUAL.NAME"] = f"transdec_postnorm::L{method.num_layers}_H{h}_A{heads}_F{mlp}"
  else:
    out["MODEL.TEXTUAL.NAME"] = "none"
  notes = []
  if cnn is None:
    notes.append(
      f"the backbone (depth {b.get('depth')}, width {b.get('width')}) is no torchvision model: the official "
      "code builds torchvision's models by name only"
    )
  if official_vocab:
    out.update({"DATA.UNK_INDEX": 0, "DATA.SOS_INDEX": 1, "DATA.EOS_INDEX": 2, "DATA.MASK_INDEX": 3})
  else:
    out.update({"DATA.UNK_INDEX": 0, "DATA.SOS_INDEX": 2, "DATA.EOS_INDEX": 3, "DATA.MASK_INDEX": 4})
    notes.append(
      "the vocabulary is vlrep's ([PAD] 0, [UNK] 1, [SOS] 2, [EOS] 3, [MASK] 4): the official code must use these "
      "indices, and its datasets pad with the id of '<unk>', which a vlrep vocabulary names '[UNK]' (1)"
    )
  if task != "token_classification" and method.get("decoder_ln_eps", 1e-8) != OFFICIAL_LN_EPS:
    notes.append(
      f"the run's decoder LayerNorms use eps {method.get('decoder_ln_eps', 1e-8)}; the official layers use 1e-5 "
      "(logits differ by about 5e-6 relative)"
    )
  out["notes"] = notes
  return out


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the whole VirTex model as the official code's checkpoint, {"model": state_dict, "iteration": step}
  with torch.save (`.pth`, needs torch): every key its model has (load_state_dict strict=True), the attention key
  biases as zeros (vlrep has none: they cancel in softmax) and the tied copies (output = embedding, the backward
  head's shared modules) written out. A run imported from an official checkpoint gets its vocabulary rows back in
  the official order, so import -> export is the identity. Returns {'keys', 'parameters', 'step',
  'official_config'}: the official config values that build the model (MODEL.TEXTUAL.NAME, DATA.VOCAB_SIZE, the
  special token indices, ...)."""
  del overwrite  # one file, replaced atomically
  torch = keymaps.require_torch("--format=virtex writes a torch checkpoint: install torch.")
  sd, official = keymaps.refusal(state_dict, run)
  root = keymaps.out_root(out)
  safe_files.make_dirs(root)
  model = OrderedDict((k, torch.from_numpy(np.array(v))) for k, v in sd.items())
  with safe_files.atomic_path(out, ".pth", root=root) as tmp:
    torch.save({"model": model, "iteration": int(run.step)}, tmp)
  return {"keys": len(sd), "parameters": keymaps.parameter_count(sd), "step": run.step, "official_config": official}
