"""open_clip's and OpenAI's CLIP checkpoints (vlrep.interop.formats.open_clip) against the real open_clip: random-weight
`open_clip.create_model('ViT-B-32')` and `('RN50-quickgelu')` (no download), saved as open_clip saves them
(safetensors; torch.save; OpenAI's TorchScript archive), imported with --format=auto. Image and text embeddings and
zero-shot logits equal open_clip's to float32 rounding, measured against open_clip in float64 beside open_clip's own
float32 error; CLIP's BPE ids equal open_clip.tokenize's; `vlrep.load(RUN).zero_shot` on a real photo equals
open_clip's softmax; the export strict-loads into open_clip and computes the same. A crafted TorchScript archive
runs nothing."""

import copy
import os
import pickle
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import open_clip
import pytest
import torch
from conftest import ROOT
from PIL import Image
from safetensors.torch import load_file, save_file
from skimage import data as skdata

import vlrep
from vlrep import runs, torch_files
from vlrep.data import clip_bpe, tokenizers
from vlrep.errors import BadFile
from vlrep.interop import export, import_run
from vlrep.interop.formats import open_clip as open_clip_format
from vlrep.methods import clip as clip_method

# The open_clip configs (one model each): ViT-B-32 with open_clip's nn.GELU, RN50 with OpenAI's QuickGELU.
CONFIGS = {"vit": "ViT-B-32", "rn50": "RN50-quickgelu"}
PROMPTS = ["a photo of a cat.", "a photo of an astronaut.", "a cup of coffee on a saucer!", "A ROCKET, launching..."]
# Real texts for the tokenizer: punctuation, contractions, digits, HTML entities, accents, CJK, emoji, curly quotes
# and mojibake (which ftfy repairs), whitespace runs, an empty text and one longer than the context.
TEXTS = PROMPTS + [
  "It's 3:45pm — don't you think it'll rain? (maybe) #weather @home",
  "Ça fait déjà 20€ ; naïve café, 東京タワー 🚀🐱 “quoted” ‘single’",
  "Tom &amp; Jerry &lt;3  \t tabs\nand newlines",
  "Ã©tÃ© mojibake and ﬁ ligatures, ＦＵＬＬ width",
  "",
  " ".join(f"word{i} and, more!" for i in range(60)),
]


def _rel(a, b) -> float:
  """The largest absolute difference relative to the reference's largest magnitude."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _randomize_batch_norms(model):
  """BatchNorm statistics and affine parameters away from their identity initialisation (a trained model's are)."""
  with torch.no_grad():
    for m in model.modules():
      if isinstance(m, torch.nn.BatchNorm2d):
        m.running_mean.normal_(0.0, 0.2)
        m.running_var.uniform_(0.5, 2.0)
        m.weight.normal_(1.0, 0.2)
        m.bias.normal_(0.0, 0.2)
        m.num_batches_tracked.fill_(1234)


@pytest.fixture(scope="module")
def photos():
  """Three real photographs (scikit-image) as open_clip's own preprocessing makes them: [3, 3, 224, 224] float32."""
  preprocess = open_clip.image_transform(224, is_train=False)
  return torch.stack([preprocess(Image.fromarray(f())) for f in (skdata.chelsea, skdata.astronaut, skdata.coffee)])


@pytest.fixture(scope="module")
def clip_models(tmp_path_factory):
  """Per config: open_clip's model (float32, eval), its float64 copy, the file it was saved to and the run imported
  from it (the ViT through the command line, the ResNet in-process)."""
  root = tmp_path_factory.mktemp("open_clip")
  out = {}
  for key, name in CONFIGS.items():
    torch.manual_seed(0)
    model = open_clip.create_model(name, pretrained=None).eval()
    _randomize_batch_norms(model)
    sd = model.state_dict()
    workdir = str(root / f"run_{key}")
    if key == "vit":
      path = str(root / f"{name}.safetensors")
      save_file({k: v.contiguous() for k, v in sd.items()}, path)
      cmd = [sys.executable, "-m", "vlrep.interop.import_run", "--format=auto", f"--checkpoint={path}"]
      done = subprocess.run([*cmd, f"--workdir={workdir}"], cwd=ROOT, capture_output=True, text=True, check=False)
      assert done.returncode == 0, done.stderr[-3000:]
      assert "(open_clip)" in done.stdout, done.stdout
    else:
      path = str(root / f"{name}.pth")
      torch.save(sd, path)
      import_run.import_run("auto", path, workdir)
    out[key] = dict(model=model, model64=copy.deepcopy(model).double(), sd=sd, path=path, run=runs.load_run(workdir))
  return out


def _ours(run, images_nchw: torch.Tensor, tokens: np.ndarray) -> dict:
  """The imported run's unnormalised image and text embeddings and its logit scale (float32, as it computes)."""
  method = clip_method.Method(run.config.method, clip_bpe.VOCAB_SIZE)
  images = jnp.asarray(images_nchw.numpy().transpose(0, 2, 3, 1))
  out = jax.jit(lambda v, x, t: method.model.apply(v, x, t))(run.variables, images, jnp.asarray(tokens))
  return {k: np.asarray(v) for k, v in out.items()}


def _reference(model, images_nchw: torch.Tensor, tokens: np.ndarray) -> dict:
  dtype = next(model.parameters()).dtype
  with torch.no_grad():
    image = model.encode_image(images_nchw.to(dtype)).numpy()
    text = model.encode_text(torch.from_numpy(tokens.astype(np.int64))).numpy()
    scale = float(model.logit_scale)
  return {"image": image, "text": text, "logit_scale": scale}


def _logits(out: dict) -> np.ndarray:
  """CLIP's zero-shot logits: exp(logit_scale) x the cosines of every image with every text."""
  unit = lambda x: np.asarray(x, np.float64) / np.linalg.norm(np.asarray(x, np.float64), axis=1, keepdims=True)
  return np.exp(np.float64(out["logit_scale"])) * unit(out["image"]) @ unit(out["text"]).T


@pytest.fixture(scope="module")
def outputs(clip_models, photos):
  """Per config: the embeddings of the photos and PROMPTS by the imported run, open_clip and open_clip in float64."""
  tokens = open_clip.tokenize(PROMPTS).numpy()
  return {
    key: {
      "ours": _ours(c["run"], photos, tokens),
      "ref32": _reference(c["model"], photos, tokens),
      "ref64": _reference(c["model64"], photos, tokens),
    }
    for key, c in clip_models.items()
  }


def test_the_runs_are_clip_as_open_clip_builds_it(clip_models):
  vit_run, rn_run = clip_models["vit"]["run"], clip_models["rn50"]["run"]
  b = vit_run.config.method.backbone
  assert (b.arch, b.width, b.depth, b.mlp_dim, b.num_heads, b.patch_size) == ("vit", 768, 12, 3072, 12, 32)
  assert (b.pool_type, b.pre_norm, b.patch_bias, b.ln_eps, b.mlp_act) == ("tok", True, False, 1e-5, "gelu")
  assert vit_run.config.method.embed_dim == 512 and vit_run.config.method.pool == "avg"
  r = rn_run.config.method.backbone
  assert (r.arch, tuple(r.layers), r.width) == ("modified_resnet", (3, 4, 6, 3), 64)
  assert rn_run.config.method.pool == "attention" and rn_run.config.method.embed_dim == 1024
  assert rn_run.config.method.text.mlp_act == "quick_gelu"  # from the file name RN50-quickgelu.pth
  for run in (vit_run, rn_run):
    t = run.config.method.text
    assert (t.arch, t.width, t.depth, t.num_heads, t.max_len, t.causal, t.pool) == (
      "transformer", 512, 12, 8, 77, True, "argmax"
    )  # fmt: skip
    assert run.config.tokenizer.kind == "clip_bpe"
    assert os.path.dirname(run.config.tokenizer.path) == os.path.join(run.workdir, "vocab")  # copied into the run
    assert "normalize(mean=(0.48145466, 0.4578275, 0.40821073)" in run.config.data.pp
  assert rn_run.meta["import"]["counters"]["visual.bn1.num_batches_tracked"] == 1234


def test_clip_bpe_ids_equal_open_clip_tokenize(clip_models):
  run = clip_models["vit"]["run"]
  tok = tokenizers.ensure_tokenizer(run.config.tokenizer, None)  # what vlrep.load's scorer tokenizes with
  assert isinstance(tok, clip_bpe.ClipTokenizer) and tok.vocab_size == 49408
  ours = [tok.encode(t, 77) for t in TEXTS]
  reference = open_clip.tokenize(TEXTS).numpy()
  for text, (ids, truncated), ref in zip(TEXTS, ours, reference, strict=True):
    np.testing.assert_array_equal(ids, ref, err_msg=text)
    assert truncated == (len(tok.pieces(text)) + 2 > 77)
  assert ours[-1][1] and ours[-1][0][-1] == clip_bpe.EOT_ID  # the long text is cut, ending with <end_of_text>
  assert tok.decode(ours[0][0]) == "a photo of a cat ."
  assert tok.encode_words(["cat", "astronaut"]) == [tok.pieces("cat"), tok.pieces("astronaut")]


@pytest.mark.parametrize("key", list(CONFIGS))
def test_embeddings_and_zero_shot_logits_equal_open_clip(outputs, key):
  ours, ref32, ref64 = outputs[key]["ours"], outputs[key]["ref32"], outputs[key]["ref64"]
  print(f"\n{CONFIGS[key]}: max |ours - open_clip float64| / max |open_clip float64| (open_clip float32's own):")
  for what, a, b32, b64 in (
    ("image embeddings", ours["image"], ref32["image"], ref64["image"]),
    ("text embeddings", ours["text"], ref32["text"], ref64["text"]),
    ("zero-shot logits", _logits(ours), _logits(ref32), _logits(ref64)),
  ):
    error, floor = _rel(a, b64), _rel(b32, b64)
    print(f"  {what}: {error:.2e} (open_clip float32: {floor:.2e})")
    # Within 10 x open_clip float32's own error (a random model's cosines are near 0: the logits' figure is the
    # largest, ~5e-6).
    assert error < 10 * floor and error < 5e-5, (what, error, floor)
  assert np.float32(ours["logit_scale"]) == np.float32(ref32["logit_scale"])


def test_vlrep_load_zero_shot_on_a_photo_equals_open_clip_softmax(clip_models):
  """From the photo's pixels to the class probabilities: vlrep.load's preprocessing (CLIP's mean and std, from the
  run's config), tokenizer, towers and zero-shot scores against open_clip's preprocess, tokenize and softmax."""
  c = clip_models["vit"]
  model = vlrep.load(c["run"].workdir)
  labels = ["cat", "astronaut", "coffee", "rocket"]
  photo = skdata.chelsea()
  result = model.zero_shot(photo, labels, templates=("a photo of a {}.",), articles=False)
  pixels = open_clip.image_transform(224, is_train=False)(Image.fromarray(photo))[None]
  np.testing.assert_allclose(model.pixels([photo]).transpose(0, 3, 1, 2), pixels.numpy(), atol=1e-6)
  with torch.no_grad():
    image = c["model"].encode_image(pixels)
    text = c["model"].encode_text(open_clip.tokenize([f"a photo of a {x}." for x in labels]))
    image, text = image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)
    reference = (c["model"].logit_scale.exp() * image @ text.T).softmax(dim=-1).numpy()
  scale = np.exp(np.float64(c["run"].params["logit_scale"]))
  ours = torch.from_numpy(scale * result["scores"]).softmax(dim=-1).numpy()
  print(f"\nvlrep.load zero-shot softmax vs open_clip's: max |difference| {np.max(np.abs(ours - reference)):.2e}")
  np.testing.assert_allclose(ours, reference, atol=1e-5)
  # The ResNet run loads too (its backbone rebuilt as a ModifiedResNet and checked against its parameters).
  assert "clip" in repr(vlrep.load(clip_models["rn50"]["run"].workdir))


@pytest.mark.parametrize("key,suffix", [("vit", ".safetensors"), ("rn50", ".pth")])
def test_export_strict_loads_into_open_clip_and_computes_the_same(clip_models, outputs, photos, tmp_path, key, suffix):
  c = clip_models[key]
  out = str(tmp_path / f"exported{suffix}")
  info = export.export(c["run"].workdir, "open_clip", out)  # vlrep.interop.export's function, as the command
  assert info["open_clip_model"] == CONFIGS[key]
  sd = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
  model = open_clip.create_model(info["open_clip_model"], pretrained=None).eval()
  model.load_state_dict(sd, strict=True)
  # Every tensor as it was, but the ViT's class token, whose position embedding export folds into it.
  folded = {"visual.class_embedding", "visual.positional_embedding"} if key == "vit" else set()
  for name, tensor in c["sd"].items():
    if name not in folded:
      assert torch.equal(sd[name], tensor), name
  if key == "vit":
    original = c["sd"]["visual.class_embedding"] + c["sd"]["visual.positional_embedding"][0]
    assert torch.equal(sd["visual.class_embedding"], original) and not sd["visual.positional_embedding"][0].any()
    assert torch.equal(sd["visual.positional_embedding"][1:], c["sd"]["visual.positional_embedding"][1:])
  # The same function in float32 to the bit: cls + 0 is the sum open_clip's forward computes.
  again = _reference(model, photos, open_clip.tokenize(PROMPTS).numpy())
  np.testing.assert_array_equal(again["image"], outputs[key]["ref32"]["image"])
  np.testing.assert_array_equal(again["text"], outputs[key]["ref32"]["text"])


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::FutureWarning")
def test_an_openai_torchscript_archive_imports_its_tensors_as_data(clip_models, photos, tmp_path):
  """OpenAI's .pt files are TorchScript archives: the traced RN50 (named without 'quickgelu': QuickGELU because it
  is a TorchScript archive) imports to the very variables its state dict gave, nothing of its code run."""
  c = clip_models["rn50"]
  path = str(tmp_path / "RN50.pt")
  tokens = torch.from_numpy(open_clip.tokenize(PROMPTS[:1]).numpy())
  with torch.no_grad():
    torch.jit.trace(c["model"], (photos[:1], tokens), check_trace=False).save(path)
  assert torch_files.is_torchscript(path)
  assert import_run.resolve_format("auto", path)[0] is open_clip_format
  imported = open_clip_format.read(path)  # what import_run writes (its writing is tested above)
  assert imported.note["torchscript"] and imported.note["mlp_act"] == "quick_gelu"
  assert "attn_mask" in imported.note["dropped"]
  assert imported.config.method.to_dict() == c["run"].config.method.to_dict()
  flat = lambda tree: jax.tree_util.tree_leaves_with_path(tree)
  ours, theirs = (
    flat({"p": imported.params, **imported.model_state}),
    flat({"p": c["run"].params, **c["run"].model_state}),
  )
  assert len(ours) == len(theirs)
  for (path_a, a), (path_b, b) in zip(ours, theirs, strict=True):
    assert path_a == path_b and np.array_equal(np.asarray(a), np.asarray(b)), path_a


class _Call:
  """An object whose unpickling calls func(*args): a payload."""

  def __init__(self, func, *args):
    self.func, self.args = func, args

  def __reduce__(self):
    return self.func, self.args


def _torchscript_shaped(path, data_pkl: bytes) -> str:
  """A zip laid out as a TorchScript archive (data.pkl, constants.pkl, code/) with the given pickle."""
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("model/data.pkl", data_pkl)
    z.writestr("model/constants.pkl", pickle.dumps((), protocol=2))
    z.writestr("model/code/__torch__/model.py", "def forward(self): import os; os.system('touch pwned')\n")
    z.writestr("model/version", "3\n")
  return str(path)


def test_a_crafted_torchscript_archive_runs_nothing(tmp_path):
  marker = tmp_path / "ran"
  payload = _torchscript_shaped(tmp_path / "payload.pt", pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=2))
  assert torch_files.is_torchscript(payload)
  with pytest.raises(torch_files.UnsafeFile, match=r"payload\.pt.*posix\.system"):
    torch_files.load_checkpoint(payload)
  # A __torch__ class called (REDUCE) instead of rebuilt from data: refused; so is any non-__torch__ global in it.
  called = _torchscript_shaped(
    tmp_path / "called.pt", b"\x80\x02c__torch__.model\nCLIP\nX\x03\x00\x00\x00argq\x00\x85R."
  )
  with pytest.raises(BadFile, match="called.pt"):
    torch_files.load_checkpoint(called)
  exec_global = pickle.dumps(_Call(exec, f"open({str(marker)!r}, 'w').close()"), protocol=2)
  with pytest.raises(torch_files.UnsafeFile, match="builtins.exec"):
    torch_files.load_checkpoint(_torchscript_shaped(tmp_path / "exec.pt", exec_global))
  assert not marker.exists() and not (tmp_path / "pwned").exists()
