"""big_vision's two-towers parameters in and out: an `.npz` of big_vision's image-text model
(big_vision/models/proj/image_text/two_towers.py: `img` a vit.py ViT, `txt` text_transformer.py, the temperature
`t` and SigLIP's bias `b`), its keys the parameter tree's names joined by '/' (what big_vision's
`utils.load_checkpoint_np` / `load_params` read; e.g. the published SigLIP files webli_en_b16_224_63724782.npz) <->
a vlrep CLIP / SigLIP run.

  python -m vlrep.interop.import_run --format=big_vision --checkpoint=webli_en_b16_224_63724782.npz \
      --vocab=c4_en.model --workdir=/runs/siglip_b16
  python -m vlrep.interop.export --workdir=/runs/siglip_b16 --format=big_vision --out=siglip_b16.npz

vlrep's ViT and text transformer use big_vision's names, so the map is nearly the identity: `img/...` is the
backbone, `txt/Encoder_0` the text tower's `Transformer`, `txt/head` its projection, `t` and `b` the loss's t' and
b (a file without `b`: a softmax two-towers model, `t` its log scale). Keys may carry the `params/` prefix of a
training checkpoint (the published SigLIP files do) or not. The encoder blocks are read in both of big_vision's
layouts: `encoderblock_{i}` (a Python loop) or one `encoderblock` whose arrays stack the blocks (`scan=True`, the
published files'); export writes `params/...` with stacked blocks, as the published files are. bfloat16 arrays
(numpy stores them as 2-byte void, big_vision's `recover_dtype`) are read as bfloat16.

The architecture is read from the arrays' shapes (width, depth, heads, MLP, patch, image and text lengths, MAP head
or class token); what shapes do not show is big_vision's: tanh-approximated GELU, LayerNorm epsilon 1e-6, no
pre-norm, a text tower without a causal mask pooled at its last position (SigLIP's `pool_type='last'`). An image
tower with its own `head` (`out_dim=(D, D)`) is refused: vlrep's image projection has no bias. The file is read with
numpy's `allow_pickle=False`: an array that holds Python objects (a pickle) is refused, nothing in it is run.
"""

from __future__ import annotations

import os
import re
import zipfile

import ml_dtypes
import numpy as np
from ml_collections import ConfigDict

from vlrep import safe_files, torch_files
from vlrep.errors import BadFile, UserError, reading
from vlrep.interop import keymaps
from vlrep.interop.formats import hf_clip, hf_siglip
from vlrep.interop.keymaps import ImportedRun, KeyMap, flatten, rule
from vlrep.runs import unflatten

DESCRIPTION = "big_vision two-towers (SigLIP) parameters, an .npz (params/img/..., params/txt/..., params/t, params/b)"
OUT_SUFFIXES = (".npz",)
HINT = "Pass the .npz as big_vision wrote it (np.savez of the flattened parameters)."

# vlrep path prefix <-> big_vision name prefix, in the order they are tried.
PREFIXES = (
  ("params/textual/Transformer/", "txt/Encoder_0/"),
  ("params/textual/", "txt/"),
  ("params/text_projection/", "txt/head/"),
  ("params/backbone/", "img/"),
)
SCALARS = {"params/t_prime": "t", "params/logit_bias": "b", "params/logit_scale": "t"}
_BLOCK = re.compile(r"^(img/Transformer|txt/Encoder_0)/encoderblock_(\d+)/(.*)$")
_STACKED = re.compile(r"^(img/Transformer|txt/Encoder_0)/encoderblock/(.*)$")
NEEDED = (
  "img/embedding/kernel",
  "img/Transformer/encoder_norm/scale",
  "txt/Embed_0/embedding",
  "txt/pos_embedding",
  "t",
)
_KNOWN = re.compile(
  r"^(t|b|img/(embedding|pos_embedding|cls|Transformer|MAPHead_0|head)(/.*)?|"
  r"txt/(Embed_0|pos_embedding|Encoder_0|head)(/.*)?)$"
)


def big_vision_name(path: str) -> str:
  """A vlrep run's variable path -> its big_vision name (without the `params/` prefix)."""
  if path in SCALARS:
    return SCALARS[path]
  for ours, theirs in PREFIXES:
    if path.startswith(ours):
      return theirs + path[len(ours) :]
  raise KeyError(f"big_vision: no name for the run's variable {path!r}.")


def strip_prefix(arrays: dict) -> dict:
  """The parameters without a training checkpoint's `params/` prefix (every key has it, or none)."""
  if arrays and all(k.startswith("params/") for k in arrays):
    return {k[len("params/") :]: v for k, v in arrays.items()}
  return dict(arrays)


def unstack(arrays: dict) -> dict:
  """big_vision's scan layout (`encoderblock/...`, arrays [depth, ...]) -> the loop layout (`encoderblock_{i}/...`)."""
  out = {}
  for k, v in arrays.items():
    m = _STACKED.match(k)
    if not m:
      out[k] = v
      continue
    for i in range(np.shape(v)[0]):
      out[f"{m.group(1)}/encoderblock_{i}/{m.group(2)}"] = v[i]
  return out


def stack(arrays: dict) -> dict:
  """The loop layout -> big_vision's scan layout (what the published SigLIP files hold)."""
  out, blocks = {}, {}
  for k, v in arrays.items():
    m = _BLOCK.match(k)
    if m:
      blocks.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
    else:
      out[k] = v
  for (tower, rest), parts in blocks.items():
    out[f"{tower}/encoderblock/{rest}"] = np.stack([parts[i] for i in range(len(parts))])
  return out


def score(keys: set[str]) -> tuple[float, list[str], list[str]]:
  """How well a file's keys are big_vision two-towers parameters (`keymaps` contract)."""
  keys = set(strip_prefix(dict.fromkeys(keys)))
  if not keys:
    return 0.0, list(NEEDED), []
  missing = [k for k in NEEDED if k not in keys]
  unexpected = sorted(k for k in keys if not _KNOWN.match(k))
  return (len(NEEDED) - len(missing)) / len(NEEDED) * (1 - len(unexpected) / len(keys)), missing, unexpected[:5]


def read_npz(path: str) -> dict[str, np.ndarray]:
  """{name: array} of an .npz (np.savez's zip of .npy files), read without pickles (an array of Python objects is a
  BadFile: nothing is unpickled); every member's declared size checked before anything is allocated (its .npy
  header against the member's size, the members' sizes against vlrep.torch_files' budget of 4 x the file's size +
  256 MiB); bfloat16 stored as 2-byte void restored."""
  if not os.path.isfile(path):
    raise hf_clip.MissingFile(f"No .npz file {path}.")
  out = {}
  budget = torch_files.BUDGET_PER_FILE_BYTE * os.path.getsize(path) + torch_files.BUDGET_BASE
  with reading(path, what="big_vision .npz", hint=HINT):
    if not zipfile.is_zipfile(path):
      raise ValueError("not a zip archive (np.savez writes one)")
    with zipfile.ZipFile(path) as archive:
      for info in archive.infolist():
        name = info.filename.removesuffix(".npy")
        budget -= info.file_size
        if budget < 0:
          raise BadFile(f"{path}: its members declare more bytes than a file of its size holds (a crafted file).")
        with archive.open(info) as f:
          version = np.lib.format.read_magic(f)
          read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
          )
          shape, _, dtype = read_header(f)
          if dtype.hasobject:
            raise BadFile(f"{path}: array {name!r} holds Python objects (a pickle), which vlrep never loads.")
          if int(np.prod(shape)) * dtype.itemsize > info.file_size:
            raise BadFile(f"{path}: array {name!r} declares {shape} {dtype}, more than its {info.file_size} bytes.")
        with archive.open(info) as f:
          a = np.lib.format.read_array(f, allow_pickle=False)
        if a.dtype.type is np.void and a.dtype.itemsize == 2:
          a = a.view(ml_dtypes.bfloat16)
        elif a.dtype.kind not in "fiub":
          raise BadFile(f"{path}: array {name!r} has dtype {a.dtype}, not numbers.")
        out[name] = a
  return out


def _shape(arrays: dict, key: str, path: str) -> tuple:
  if key not in arrays:
    raise BadFile(f"{path} is not big_vision two-towers parameters: {key!r} is missing.")
  return tuple(np.shape(arrays[key]))


def _depth(arrays: dict, tower: str) -> int:
  return len({m.group(2) for k in arrays if (m := _BLOCK.match(k)) and m.group(1) == tower})


def architecture(arrays: dict, path: str) -> tuple[dict, int, int]:
  """(the method section, vocabulary size, image size) the arrays' shapes describe (loop layout, no prefix)."""
  if "img/head/kernel" in arrays:
    raise UserError(
      f"{path}: the image tower has its own head (big_vision out_dim=(D, D)), with a bias vlrep's image projection "
      "does not have; vlrep imports SigLIP's two towers (out_dim=(None, D): the image tower's pooled output)."
    )
  p, _, _, width = _shape(arrays, "img/embedding/kernel", path)
  attention = "img/Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"
  pool = "map" if "img/MAPHead_0/probe" in arrays else "tok" if "img/cls" in arrays else "gap"
  backbone = dict(
    arch="vit",
    width=width,
    depth=_depth(arrays, "img/Transformer"),
    mlp_dim=_shape(arrays, "img/Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel", path)[1],
    num_heads=_shape(arrays, attention, path)[1],
    patch_size=p,
    pool_type=pool,
    posemb="learn" if "img/pos_embedding" in arrays else "sincos2d",
    pre_norm=False,
    mlp_act="gelu_tanh",
    ln_eps=1e-6,
    patch_bias="img/embedding/bias" in arrays,
  )
  vocab_size, text_width = _shape(arrays, "txt/Embed_0/embedding", path)
  text = dict(
    arch="transformer",
    width=text_width,
    depth=_depth(arrays, "txt/Encoder_0"),
    num_heads=_shape(arrays, "txt/Encoder_0/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel", path)[1],
    mlp_dim=_shape(arrays, "txt/Encoder_0/encoderblock_0/MlpBlock_0/Dense_0/kernel", path)[1],
    max_len=_shape(arrays, "txt/pos_embedding", path)[1],
    causal=False,
    pool="last",
    mlp_act="gelu_tanh",
    ln_eps=1e-6,
  )
  embed_dim = _shape(arrays, "txt/head/kernel", path)[1] if "txt/head/kernel" in arrays else text_width
  if embed_dim != width:
    raise UserError(f"{path}: the text tower embeds in {embed_dim} dims, the image tower's pooled output has {width}.")
  sigmoid = "b" in arrays
  method = dict(
    name="clip",
    loss="sigmoid" if sigmoid else "softmax",
    pool="avg",
    embed_dim=embed_dim,
    backbone=backbone,
    text_tower="scratch",
    text=text,
    image_projection=False,
    text_projection_bias=True,
    dtype="float32",
  )
  posemb = arrays.get("img/pos_embedding")
  side = int(round(np.sqrt(np.shape(posemb)[1]))) if posemb is not None else 224 // p
  return method, vocab_size, side * p


def key_map(paths) -> KeyMap:
  """One rule per variable (the names differ by prefix only); t and b are [1] arrays in big_vision."""
  rules = [rule(p, big_vision_name(p), transform="heads_bias" if p in SCALARS else "same") for p in sorted(paths)]
  return KeyMap("big_vision two-towers", rules)


def read(
  checkpoint: str,
  vocab: str | None = None,
  *,
  contents: dict | None = None,
  config: ConfigDict | None = None,
  workdir: str | None = None,
) -> ImportedRun:
  """A SigLIP (or softmax two-towers) run of big_vision parameters (module docstring); `vocab`: the SentencePiece
  model of its text tower (big_vision's tokenizer file), copied into the run."""
  arrays = contents if contents is not None else read_npz(checkpoint)
  arrays = unstack(strip_prefix(arrays))
  method, vocab_size, image_size = architecture(arrays, checkpoint)
  if method["loss"] == "softmax":
    method["text_projection_bias"] = "txt/head/bias" in arrays
  expected = hf_clip.expected_shapes(method, vocab_size, image_size)
  km = key_map(expected)
  with reading(checkpoint, what=f"{km.name} parameters", hint=HINT):
    converted = km.to_vlrep(arrays, expected)
  params = unflatten(converted.variables)["params"]
  files = {hf_siglip.VOCAB_FILE: vocab} if vocab else {}
  source = os.path.abspath(checkpoint)
  note = {"format": "big_vision", "source": source, "vocab_size": vocab_size, "image_size": image_size}
  note["assumed"] = (
    "big_vision's defaults the arrays do not show: tanh GELU, LayerNorm eps 1e-6, a text tower without causal mask "
    "pooled at its last position"
  )
  if not vocab:
    note["tokenizer"] = "no --vocab: set tokenizer.path to the text tower's SentencePiece model"
  run = hf_clip.run_config(config, method, hf_siglip.siglip_tokenizer(workdir, files), hf_siglip.siglip_pp(image_size))
  return ImportedRun(config=run, params=params, model_state={}, note=note, files=files)


def check_exportable(run) -> None:
  """A refusal unless the run is a two-towers model big_vision computes as vlrep does."""
  m = run.config.method
  backbone, text = hf_clip.vit_and_text(run, dict(m.get("backbone", {})).get("pool_type"))
  why = []
  if m.get("image_projection", True):
    why.append("no image projection (big_vision's SigLIP embeds the image tower's pooled output)")
  if backbone.get("pre_norm") or backbone.get("mlp_act", "gelu_tanh") != "gelu_tanh":
    why.append("a ViT without pre-norm and with tanh GELU (big_vision's vit.py)")
  if text.get("causal", True) or text.get("pool") != "last" or text.get("mlp_act", "gelu") != "gelu_tanh":
    why.append("a text tower without a causal mask, pooled at its last position, with tanh GELU")
  if float(backbone.get("ln_eps", 1e-6)) != 1e-6 or float(text.get("ln_eps", 1e-5)) != 1e-6:
    why.append("LayerNorm epsilon 1e-6 (flax's default, big_vision's)")
  if why:
    raise keymaps.NotExportable(f"{run.path} is not a big_vision two-towers model: it needs " + "; ".join(why) + ".")


def arrays_of(run) -> dict[str, np.ndarray]:
  """{'params/<big_vision name>': float32 array} of a run, the encoder blocks stacked (scan layout)."""
  check_exportable(run)
  flat = {f"params/{k}": np.asarray(v) for k, v in flatten(run.params).items()}
  m = run.config.method
  vocab_size = hf_clip.vocab_rows(run)
  patch = int(m.backbone["patch_size"])
  image_size = hf_clip.image_size_of(run, patch) if "pos_embedding" in run.params["backbone"] else 224
  hf_clip.check_shapes(run, hf_clip.expected_shapes(m.to_dict(), vocab_size, image_size), flat)
  named = key_map(flat).to_foreign(flat)
  return {f"params/{k}": np.array(v, np.float32, order="C") for k, v in sorted(stack(named).items())}


def export(run, out: str, overwrite: bool = False) -> dict:
  """Writes the run's parameters as a big_vision .npz (`arrays_of`); an existing file needs `overwrite`."""
  path = os.path.abspath(os.path.expanduser(out))
  if not path.endswith(OUT_SUFFIXES):
    raise keymaps.NotExportable(f"--out={out}: --format=big_vision writes an .npz file.")
  if os.path.lexists(path) and not overwrite:
    raise keymaps.OutExists(f"--out={out} already exists; pass --overwrite to replace it.")
  arrays = keymaps.refusal(arrays_of, run)
  safe_files.make_dirs(keymaps.out_root(path))
  with safe_files.open_atomic(path, "wb", root=keymaps.out_root(path)) as f:
    np.savez(f, **arrays)
  return {"keys": len(arrays), "parameters": sum(int(a.size) for a in arrays.values()), "step": run.step}
