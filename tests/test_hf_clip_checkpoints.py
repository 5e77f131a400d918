"""Hugging Face CLIPModel and SiglipModel folders and big_vision SigLIP .npz parameters, in and out, against the real
transformers (random weights, small sizes; the real sizes' names and shapes checked without weights): what vlrep
computes from an imported folder equals what transformers computes from it, on real photos (skimage.data) and real
captions, to float32 rounding, and the exports load back into transformers strictly and compute the same.

Each comparison states its figure: the largest relative error of vlrep's output against transformers' in float32,
beside the reference's own floor (transformers in float32 against transformers in float64); vlrep is asserted within
a few times the floor of the float64 reference. SigLIP's tokenizer is compared with transformers' SiglipTokenizer
on a SentencePiece model trained here on the captions (no download).
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import os
import shutil
import zipfile

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_module
from PIL import Image
from skimage import data as skdata

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

from vlrep import methods, runs  # noqa: E402
from vlrep.data import clip_bpe, tokenizers  # noqa: E402
from vlrep.data.siglip_tokenizer import SiglipTokenizer  # noqa: E402
from vlrep.errors import BadFile  # noqa: E402
from vlrep.interop import export, import_run, keymaps  # noqa: E402
from vlrep.interop.formats import big_vision, hf_clip, hf_siglip  # noqa: E402
from vlrep.models.clip import CLIPModel  # noqa: E402

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
CAPTIONS = [
  "An astronaut in a white suit, holding a helmet.",
  "a cup of coffee on a saucer with a spoon",
  "A ginger cat looking to the right!",
  "a rocket on its launch pad under a blue sky",
  "two dogs playing in the snow",
]
SIZE, PATCH, TEXT_LEN = 64, 16, 16
TOWER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
CLIP_VOCAB, CLIP_EOS = 1000, 500  # an end-of-text id that is not the highest: 'eos' pooling differs from 'argmax'


def photos() -> np.ndarray:
  """Real photos at SIZE px, normalised to [-1, 1]: [N, SIZE, SIZE, 3] float32 (the same pixels go to both codes)."""
  out = []
  for name in PHOTOS:
    img = Image.fromarray(getattr(skdata, name)()).convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
    out.append(np.asarray(img, np.float32) / 127.5 - 1.0)
  return np.stack(out)


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def perturb(model, seed: int):
  """Random weights everywhere, LayerNorms and scalars included (their inits are 1, 0 and constants)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn(p.shape, generator=g))
  return model.eval()


def reference(model, pixels, ids, dtype) -> dict:
  """transformers' image and text features (unnormalised) and zero-shot logits, in `dtype`."""
  m = copy.deepcopy(model).to(dtype)
  with torch.no_grad():
    px = torch.tensor(pixels.transpose(0, 3, 1, 2)).to(dtype)
    ids = torch.tensor(np.asarray(ids, np.int64))
    out = m(input_ids=ids, pixel_values=px)
    return {
      "image": m.get_image_features(pixel_values=px).pooler_output.double().numpy(),
      "text": m.get_text_features(input_ids=ids).pooler_output.double().numpy(),
      "logits": out.logits_per_image.double().numpy(),
    }


def vlrep_figures(run, pixels, ids) -> dict:
  """The run's image and text features, and its zero-shot logits through the method's own embedding and learned
  temperature (CLIP: exp(s) cos; SigLIP: exp(t') cos + b)."""
  method = methods.build(run.config.method, hf_clip.vocab_rows(run))
  variables = run.variables
  model = method.model
  image = model.apply(variables, jnp.asarray(pixels), method=CLIPModel.embed_images)
  text = model.apply(variables, jnp.asarray(ids), method=CLIPModel.embed_texts)
  emb = method.embed(variables, jnp.asarray(pixels), jnp.asarray(ids))
  learned = model.apply(variables, method=CLIPModel.temperature)
  cos = np.asarray(emb["image"], np.float64) @ np.asarray(emb["text"], np.float64).T
  if "logit_scale" in learned:
    logits = np.exp(float(learned["logit_scale"])) * cos
  else:
    logits = np.exp(float(learned["t_prime"])) * cos + float(learned["logit_bias"])
  return {"image": np.asarray(image), "text": np.asarray(text), "logits": logits}


def compare(ours: dict, ref32: dict, ref64: dict, what: str) -> dict:
  """Relative errors {name: (vlrep vs float32 reference, vlrep vs float64, the float32 reference's own floor)};
  vlrep within 8x the floor (and 2e-6) of the float64 reference."""
  figures = {}
  for k in ("image", "text", "logits"):
    floor = rel(ref32[k], ref64[k])
    err32, err64 = rel(ours[k], ref32[k]), rel(ours[k], ref64[k])
    figures[k] = (err32, err64, floor)
    print(f"{what} {k}: vlrep vs transformers f32 {err32:.2e}, vs f64 {err64:.2e}; f32 reference's floor {floor:.2e}")
    assert err64 <= max(8 * floor, 2e-6), (what, k, figures[k])
  return figures


def strict_load(cls, folder):
  model, info = cls.from_pretrained(folder, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
  return model.eval()


# ------------------------------------------------------------------------------------------------------------------
# Fixtures: the folders transformers writes.
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pixels():
  return photos()


@pytest.fixture(scope="module")
def spiece(tmp_path_factory) -> str:
  """A SentencePiece model in SigLIP's (T5's) layout (<pad>=0, </s>=1, <unk>=2), trained on the captions."""
  texts = [c.lower() for c in CAPTIONS] * 20 + ["a photo of a dog", "a photo of a cat", "a rocket in the sky"] * 20
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(texts),
    model_writer=proto,
    model_type="unigram",
    vocab_size=150,
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    hard_vocab_limit=False,
  )
  path = tmp_path_factory.mktemp("spm") / "spiece.model"
  path.write_bytes(proto.getvalue())
  return str(path)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
  torch.manual_seed(0)
  text = dict(TOWER, vocab_size=CLIP_VOCAB, max_position_embeddings=TEXT_LEN, eos_token_id=CLIP_EOS)
  vision = dict(TOWER, image_size=SIZE, patch_size=PATCH, hidden_act="gelu")  # text: CLIP's quick_gelu
  model = perturb(
    transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=48)), 1
  )
  folder = str(tmp_path_factory.mktemp("hf") / "clip")
  model.save_pretrained(folder)
  return folder, model


@pytest.fixture(scope="module")
def siglip_folder(tmp_path_factory, spiece):
  torch.manual_seed(0)
  vocab = spm.SentencePieceProcessor(model_file=spiece).get_piece_size()
  text = dict(TOWER, vocab_size=vocab, max_position_embeddings=TEXT_LEN)
  vision = dict(TOWER, image_size=SIZE, patch_size=PATCH)
  model = perturb(transformers.SiglipModel(transformers.SiglipConfig(text_config=text, vision_config=vision)), 2)
  folder = str(tmp_path_factory.mktemp("hf") / "siglip")
  model.save_pretrained(folder)
  shutil.copy(spiece, os.path.join(folder, "spiece.model"))
  return folder, model


def clip_ids() -> np.ndarray:
  """CLIP-style ids: start 0, ids above and below the end-of-text id, the end-of-text id, padding 1."""
  rng = np.random.RandomState(0)
  ids = np.ones((len(CAPTIONS), TEXT_LEN), np.int64)
  for i in range(len(CAPTIONS)):
    n = 4 + i
    ids[i, 0] = 0
    ids[i, 1 : n + 1] = rng.randint(3, CLIP_VOCAB, n)
    ids[i, n + 1] = CLIP_EOS
  return ids


# ------------------------------------------------------------------------------------------------------------------
# Tests.
# ------------------------------------------------------------------------------------------------------------------
def test_siglip_tokenizer_matches_transformers(spiece):
  theirs = transformers.SiglipTokenizer(spiece)
  ours = SiglipTokenizer(spiece)
  texts = CAPTIONS + ["  Two   DOGS, playing!! ", "", "a photo of a </s> cat", "zebra_crossing (night)", "x" * 60]
  for text in texts:
    for length in (8, TEXT_LEN):
      want = theirs(text, padding="max_length", max_length=length, truncation=True)["input_ids"]
      ids, truncated = ours.encode(text, length)
      assert ids.tolist() == want, (text, length)
      assert truncated == (len(ours.pieces(text)) > length - 1)
  assert ours.vocab_size == theirs.vocab_size
  assert ours.decode(ours.encode("a ginger cat", TEXT_LEN)[0]) == "a ginger cat"
  assert ours.encode_words(["cat", "dog"]) == [ours.pieces("cat"), ours.pieces("dog")]


def test_clip_folder_in_and_out(clip_folder, pixels, tmp_path):
  folder, model = clip_folder
  workdir = str(tmp_path / "run")
  proc = run_module("vlrep.interop.import_run", "--format=auto", f"--checkpoint={folder}", f"--workdir={workdir}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "(hf_clip)" in proc.stdout
  run = runs.load_run(workdir)
  assert run.config.method.text.pool == "eos" and run.config.method.text.eos_id == CLIP_EOS
  ids = clip_ids()
  ref32, ref64 = reference(model, pixels, ids, torch.float32), reference(model, pixels, ids, torch.float64)
  ours = vlrep_figures(run, pixels, ids)
  compare(ours, ref32, ref64, "HF CLIP")

  out = str(tmp_path / "clip_out")
  info = export.export(workdir, "hf_clip", out)  # vlrep.interop.export's function
  assert info["keys"] == len(model.state_dict())
  back = strict_load(transformers.CLIPModel, out)
  again = reference(back, pixels, ids, torch.float32)
  for k in ("image", "text", "logits"):
    assert rel(again[k], ref32[k]) < 1e-6, k  # the class token exported as one sum: the same to float32 rounding
  with pytest.raises(keymaps.OutExists):
    export.export(workdir, "hf_clip", out)


def clip_vocabulary_files(folder: str) -> None:
  """vocab.json and merges.txt as transformers' CLIP folders hold them, made from the merges file inside the
  installed open_clip (the 48894 merges after its header line; ids: 256 byte symbols, the same with '</w>', one per
  merge, then <|startoftext|> and <|endoftext|>)."""
  path = clip_bpe.installed_vocabulary()
  assert path, "open-clip-torch (a test extra) ships bpe_simple_vocab_16e6.txt.gz"
  with gzip.open(path, "rt", encoding="utf-8") as f:
    merges = f.read().split("\n")[1 : 49152 - 256 - 2 + 1]
  symbols = list(clip_bpe.bytes_to_unicode().values())
  pieces = symbols + [s + "</w>" for s in symbols] + [m.replace(" ", "") for m in merges]
  pieces += ["<|startoftext|>", "<|endoftext|>"]
  with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
    json.dump({p: i for i, p in enumerate(pieces)}, f)
  with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
    f.write("#version: 0.2\n" + "\n".join(merges) + "\n")


def test_clip_real_vocabulary_and_legacy_eos(tmp_path, pixels):
  """A CLIP with CLIP's 49408-id vocabulary and the folder's vocab.json / merges.txt: the run's tokenizer gives
  transformers' CLIPTokenizer's ids on real captions (up to the padding: its <|endoftext|>, clip_bpe's 0), and
  text embeddings from each code's own ids agree. eos_token_id 2 (configs before transformers PR 24773) pools at
  the highest id, as transformers does. The export writes the vocabulary back."""
  torch.manual_seed(0)
  text = dict(TOWER, vocab_size=clip_bpe.VOCAB_SIZE, max_position_embeddings=TEXT_LEN, eos_token_id=2)
  vision = dict(TOWER, num_hidden_layers=1, image_size=SIZE, patch_size=PATCH)
  model = perturb(transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision)), 3)
  folder = str(tmp_path / "legacy")
  model.save_pretrained(folder)
  clip_vocabulary_files(folder)
  workdir = str(tmp_path / "run")
  import_run.import_run("hf_clip", folder, workdir)
  run = runs.load_run(workdir)
  assert run.config.method.text.pool == "argmax"
  ours_tok = tokenizers.ensure_tokenizer(run.config.tokenizer, None)
  theirs_tok = transformers.CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"))
  hf_ids = np.asarray(theirs_tok(CAPTIONS, padding="max_length", max_length=TEXT_LEN, truncation=True)["input_ids"])
  ids = np.stack([ours_tok.encode(c, TEXT_LEN)[0] for c in CAPTIONS])
  for ours, theirs in zip(ids, hf_ids, strict=True):
    n = int(np.argmax(theirs == clip_bpe.EOT_ID)) + 1
    assert ours[:n].tolist() == theirs[:n].tolist() and not ours[n:].any()
  ref32 = reference(model, pixels, hf_ids, torch.float32)
  ref64 = reference(model, pixels, hf_ids, torch.float64)
  compare(vlrep_figures(run, pixels, ids), ref32, ref64, "HF CLIP (CLIP's vocabulary, legacy eos)")

  out = str(tmp_path / "out")
  export.export(workdir, "hf_clip", out)
  strict_load(transformers.CLIPModel, out)
  back = transformers.CLIPTokenizer(os.path.join(out, "vocab.json"), os.path.join(out, "merges.txt"))
  assert back(CAPTIONS)["input_ids"] == theirs_tok(CAPTIONS)["input_ids"]


def test_siglip_folder_and_big_vision_npz(siglip_folder, spiece, pixels, tmp_path):
  folder, model = siglip_folder
  tokenizer = SiglipTokenizer(spiece)
  ids = np.stack([tokenizer.encode(c, TEXT_LEN)[0] for c in CAPTIONS]).astype(np.int64)
  hf_ids = transformers.SiglipTokenizer(spiece)(CAPTIONS, padding="max_length", max_length=TEXT_LEN, truncation=True)
  assert ids.tolist() == hf_ids["input_ids"]
  ref32, ref64 = reference(model, pixels, ids, torch.float32), reference(model, pixels, ids, torch.float64)

  workdir = str(tmp_path / "run")
  imported = import_run.import_run("auto", folder, workdir)
  assert imported.note["format"] == "hf_siglip"
  run = runs.load_run(workdir)
  assert run.config.tokenizer.kind == "siglip" and os.path.isfile(run.config.tokenizer.path)
  ours = vlrep_figures(run, pixels, ids)
  compare(ours, ref32, ref64, "HF SigLIP")
  # SigLIP's zero-shot probabilities: sigmoid(t cos + b).
  sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
  print(f"HF SigLIP sigmoid(logits): vlrep vs transformers f32 {rel(sig(ours['logits']), sig(ref32['logits'])):.2e}")

  out = str(tmp_path / "siglip_out")
  export.export(workdir, "hf_siglip", out)
  back = strict_load(transformers.SiglipModel, out)
  theirs, again = model.state_dict(), back.state_dict()
  assert set(theirs) == set(again) and all(torch.equal(theirs[k], again[k]) for k in theirs)  # bit for bit
  assert os.path.isfile(os.path.join(out, "spiece.model"))

  # big_vision: vlrep's export of the run, and an .npz written here from transformers' weights by big_vision's names
  # (the loop layout, without the params/ prefix), import to the same parameters and figures.
  exported = str(tmp_path / "siglip.npz")
  export.export(workdir, "big_vision", exported)
  with np.load(exported, allow_pickle=False) as npz:
    assert "params/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel" in npz.files
  built = str(tmp_path / "built.npz")
  np.savez(built, **big_vision_arrays(model))
  runs_in = {}
  for name, path in (("exported", exported), ("built", built)):
    import_run.import_run("auto", path, str(tmp_path / name), vocab=spiece)
    runs_in[name] = runs.load_run(str(tmp_path / name))
    compare(vlrep_figures(runs_in[name], pixels, ids), ref32, ref64, f"big_vision npz ({name})")
  a, b = keymaps.flatten(runs_in["exported"].params), keymaps.flatten(runs_in["built"].params)
  assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def big_vision_arrays(model) -> dict:
  """transformers' SiglipModel weights under big_vision's names (as transformers' convert_siglip_to_hf.py maps
  them, read the other way), written independently of vlrep's key map."""
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  out = {}
  heads = model.config.vision_config.num_attention_heads

  def attention(dst, src, width, qkv=None):
    names = (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"))
    for i, (ours, theirs) in enumerate(names):
      w = qkv[0][i * width : (i + 1) * width] if qkv else sd[f"{src}.{theirs}.weight"]
      bias = qkv[1][i * width : (i + 1) * width] if qkv else sd[f"{src}.{theirs}.bias"]
      out[f"{dst}/{ours}/kernel"] = w.T.reshape(width, heads, -1)
      out[f"{dst}/{ours}/bias"] = bias.reshape(heads, -1)
    o = "out_proj"
    out[f"{dst}/out/kernel"] = sd[f"{src}.{o}.weight"].T.reshape(heads, -1, width)
    out[f"{dst}/out/bias"] = sd[f"{src}.{o}.bias"]

  def dense(dst, src):
    out[f"{dst}/kernel"], out[f"{dst}/bias"] = sd[f"{src}.weight"].T, sd[f"{src}.bias"]

  def ln(dst, src):
    out[f"{dst}/scale"], out[f"{dst}/bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

  for tower, enc, width in (("img/Transformer", "vision_model", 64), ("txt/Encoder_0", "text_model", 64)):
    for i in range(TOWER["num_hidden_layers"]):
      block, layer = f"{tower}/encoderblock_{i}", f"{enc}.encoder.layers.{i}"
      ln(f"{block}/LayerNorm_0", f"{layer}.layer_norm1")
      ln(f"{block}/LayerNorm_1", f"{layer}.layer_norm2")
      attention(f"{block}/MultiHeadDotProductAttention_0", f"{layer}.self_attn", width)
      dense(f"{block}/MlpBlock_0/Dense_0", f"{layer}.mlp.fc1")
      dense(f"{block}/MlpBlock_0/Dense_1", f"{layer}.mlp.fc2")
  ln("img/Transformer/encoder_norm", "vision_model.post_layernorm")
  ln("txt/Encoder_0/encoder_norm", "text_model.final_layer_norm")
  out["img/embedding/kernel"] = sd["vision_model.embeddings.patch_embedding.weight"].transpose(2, 3, 1, 0)
  out["img/embedding/bias"] = sd["vision_model.embeddings.patch_embedding.bias"]
  out["img/pos_embedding"] = sd["vision_model.embeddings.position_embedding.weight"][None]
  head = "vision_model.head"
  out["img/MAPHead_0/probe"] = sd[f"{head}.probe"]
  qkv = (sd[f"{head}.attention.in_proj_weight"], sd[f"{head}.attention.in_proj_bias"])
  attention("img/MAPHead_0/MultiHeadDotProductAttention_0", f"{head}.attention", 64, qkv)
  ln("img/MAPHead_0/LayerNorm_0", f"{head}.layernorm")
  dense("img/MAPHead_0/MlpBlock_0/Dense_0", f"{head}.mlp.fc1")
  dense("img/MAPHead_0/MlpBlock_0/Dense_1", f"{head}.mlp.fc2")
  out["txt/Embed_0/embedding"] = sd["text_model.embeddings.token_embedding.weight"]
  out["txt/pos_embedding"] = sd["text_model.embeddings.position_embedding.weight"][None]
  dense("txt/head", "text_model.head")
  out["t"], out["b"] = sd["logit_scale"], sd["logit_bias"]
  return out


def test_real_sizes_map_one_to_one():
  """transformers' ViT-B/32 CLIP and ViT-B/16 SigLIP (default configs, built on the meta device: no weights): every
  tensor has a rule, and the run's variables have the shapes the key map reads."""
  for cls, cfg, rules, extra, method_of in (
    (
      transformers.CLIPModel,
      transformers.CLIPConfig(),
      hf_clip.clip_rules(),
      hf_clip.CLIP_EMBEDDINGS,
      hf_clip.clip_method,
    ),
    (
      transformers.SiglipModel,
      transformers.SiglipConfig(),
      hf_siglip.siglip_rules(),
      hf_siglip.EMBEDDINGS,
      hf_siglip.siglip_method,
    ),
  ):
    with torch.device("meta"):
      model = cls(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    km = keymaps.KeyMap("real", rules)
    assert all(km.matches(k) or k in extra for k in shapes), [k for k in shapes if not km.matches(k) and k not in extra]
    method, vocab, image = method_of(json.loads(cfg.to_json_string()), "config")
    expected = hf_clip.expected_shapes(method, vocab, image)
    for path, shape in expected.items():
      if path.endswith(("pos_embedding", "/cls")):
        continue
      r, keys = km._rule_for(path)
      want = np.shape(keymaps.TRANSFORMS[r.transform][0](np.broadcast_to(np.float32(0), shape), {}))
      n = r.part[1]
      assert shapes[keys[0]] == ((want[0] * n, *want[1:]) if n > 1 else want), (path, keys[0])


def test_refusals(clip_folder, tmp_path):
  """Pickled weights and pickles inside an .npz are refused, naming what to do; a folder of another model too."""
  folder, _ = clip_folder
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  shutil.copy(os.path.join(folder, "config.json"), pickled / "config.json")
  (pickled / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(hf_clip.MissingFile, match="safetensors only"):
    hf_clip.read(str(pickled))
  with pytest.raises(BadFile, match="not 'siglip'"):
    hf_siglip.read(folder)
  bad = str(tmp_path / "objects.npz")
  np.savez(bad, **{"params/t": np.array([object()], dtype=object)})
  with pytest.raises(BadFile, match="pickle"):
    big_vision.read_npz(bad)
  lying = tmp_path / "lying.npz"  # an .npy header declaring 40 GB in a 144-byte member: refused before allocating
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**10,)})
  with zipfile.ZipFile(lying, "w") as z:
    z.writestr("params/t.npy", header.getvalue() + bytes(16))
  with pytest.raises(BadFile, match="declares"):
    big_vision.read_npz(str(lying))
  bf16 = str(tmp_path / "bf16.npz")  # numpy stores bfloat16 as 2-byte void (big_vision's recover_dtype)
  np.savez(bf16, **{"params/t": np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16).view("V2")})
  assert big_vision.read_npz(bf16)["params/t"].dtype == ml_dtypes.bfloat16
