"""vlrep.interop.import_run: published checkpoints as vlrep runs, checked against independent torch references.

The references: `torchvision.models` ResNets themselves (random weights and BatchNorm statistics, saved as
torchvision's state dicts), and the official VirTex model's layout (kdexd/virtex: `CaptioningModel` over a
`TransformerDecoderTextualHead` of torch.nn.TransformerDecoderLayer, its embedding with LayerNorm eps 1e-8 and
learned positions, the output layer tied to the word embedding), written as the model zoo writes checkpoints. The
VirTex reference's visual backbone is torchvision's ResNet-50 at width 8 (vlrep/pytorch/resnet.py: torchvision
builds width 64 only, 30x the compute and 60x the file size of these tests' models), a copy checked here against
`torchvision.models.resnet50` itself. Every run is used as imported (no override of its config) and loaded as users
load runs (`vlrep.runs.load_run`).
"""

import copy
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import tiny_finetune
import torch
import torchvision
from conftest import ROOT, run_module
from ml_collections import ConfigDict
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

from vlrep import methods, runs, torch_files, train
from vlrep.data import tokenizers
from vlrep.interop import export, import_run
from vlrep.pytorch.resnet import ResNet as TorchResNet

TINY_VIRTEX = os.path.join(ROOT, "tests", "tiny_virtex.py")
TINY_FINETUNE = os.path.join(ROOT, "tests", "tiny_finetune.py")
CAPTIONS = [
  "a red circle above a blue square",
  "a small green triangle left of a large yellow star",
  "two purple squares and one orange circle",
  "a blue star to the right of a red triangle on a white background",
  "three small circles, one large square",
] * 20
LONG = "a red circle above a blue square and a green triangle next to a yellow star and two purple squares below"


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


# ------------------------------------------------------------------------------------------------------------------
# The official VirTex model's layout, from torch.nn (facts of kdexd/virtex's captioning.py, textual_heads.py,
# embedding.py; written here, not copied).
# ------------------------------------------------------------------------------------------------------------------
class OfficialEmbedding(nn.Module):
  def __init__(self, vocab, hidden, positions, padding_idx=0):
    super().__init__()
    self.padding_idx = padding_idx
    self.words = nn.Embedding(vocab, hidden, padding_idx=padding_idx)
    self.positions = nn.Embedding(positions, hidden)
    self.layer_norm = nn.LayerNorm(hidden, eps=1e-8)
    self.dropout = nn.Dropout(0.1)

  def forward(self, tokens):
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    x = self.dropout(self.layer_norm(self.words(tokens) + self.positions(pos)))
    return x * (tokens != self.padding_idx).unsqueeze(-1).to(x.dtype)  # padding positions zeroed


class OfficialHead(nn.Module):
  """TransformerDecoderTextualHead (post-norm): torch's decoder layers at their default LayerNorm eps (1e-5)."""

  def __init__(self, visual_size, vocab, hidden, layers, heads, ff, positions, mask_future=True):
    super().__init__()
    self.vocab_size, self.mask_future = vocab, mask_future
    self.visual_projection = nn.Linear(visual_size, hidden)
    self.embedding = OfficialEmbedding(vocab, hidden, positions)
    layer = nn.TransformerDecoderLayer(hidden, heads, ff, dropout=0.1, activation="gelu", batch_first=True)
    self.transformer = nn.TransformerDecoder(layer, layers)
    self.output = nn.Linear(hidden, vocab)
    self.output.weight = self.embedding.words.weight  # tied

  def forward(self, visual, tokens, lengths):
    b, c = visual.shape[:2]
    memory = self.visual_projection(visual.reshape(b, c, -1).permute(0, 2, 1))
    t = tokens.shape[1]
    padding = lengths[:, None] < torch.ones_like(tokens).cumsum(1)
    future = torch.triu(torch.full((t, t), float("-inf")), 1) if self.mask_future else None
    x = self.transformer(self.embedding(tokens), memory, tgt_mask=future, tgt_key_padding_mask=padding)
    return self.output(x)


class OfficialVisual(nn.Module):
  """TorchvisionVisualBackbone (torchvision's ResNet-50 under `cnn`, no fc), at `width`: its layer4 grid."""

  def __init__(self, width):
    super().__init__()
    self.cnn = TorchResNet(50, width)

  def forward(self, image):
    return self.cnn(image)[0]


class OfficialVirTex(nn.Module):
  """CaptioningModel (bicaptioning when `backward`): the backward head a deep copy sharing the visual projection,
  embedding and output; the loss cross-entropy ignoring padding (id 0), summed over the directions."""

  def __init__(self, width=8, vocab=100, hidden=128, layers=2, heads=2, ff=512, positions=16, backward=True):
    super().__init__()
    self.visual = OfficialVisual(width)
    self.textual = OfficialHead(width * 32, vocab, hidden, layers, heads, ff, positions)
    if backward:
      self.backward_textual = copy.deepcopy(self.textual)
      self.backward_textual.visual_projection = self.textual.visual_projection
      self.backward_textual.embedding = self.textual.embedding
      self.backward_textual.output = self.textual.output
    self.loss = nn.CrossEntropyLoss(ignore_index=0)

  def forward(self, image, tokens, noitpac, lengths):
    visual = self.visual(image)
    logits = self.textual(visual, tokens, lengths)
    v = self.textual.vocab_size
    loss = self.loss(logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1))
    back = None
    if hasattr(self, "backward_textual"):
      back = self.backward_textual(visual, noitpac, lengths)
      loss = loss + self.loss(back[:, :-1].reshape(-1, v), noitpac[:, 1:].reshape(-1))
    return logits, back, loss

  @torch.no_grad()
  def greedy(self, image, steps, sos=1, eos=2):
    """Beam search of size 1 (the official decoder's greedy case): argmax over the whole vocabulary."""
    visual = self.visual(image)
    tokens = torch.full((image.shape[0], 1), sos)
    for _ in range(steps):
      lengths = torch.full((image.shape[0],), tokens.shape[1])
      nxt = self.textual(visual, tokens, lengths)[:, -1].argmax(-1)
      tokens = torch.cat([tokens, nxt[:, None]], 1)
      if (tokens == eos).any(1).all():
        break
    return tokens[:, 1:]


def _randomize(model, seed=0):
  """Non-trivial weights everywhere (BatchNorm statistics and affine, every bias, LayerNorms), as a trained model."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("weight") and p.ndim == 1:  # norms
        p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
      elif name.endswith("bias") or "in_proj_bias" in name:
        p.copy_(0.1 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(torch.randn(p.shape, generator=g) / float(np.prod(p.shape[1:])) ** 0.5)  # 1 / sqrt(fan in)
    for m in model.modules():
      if isinstance(m, nn.BatchNorm2d):
        m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
        m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
        m.num_batches_tracked.fill_(500_000)
  return model.eval()


def _official_vocab(path, size=100):
  """A SentencePiece BPE vocabulary built as kdexd/virtex's scripts/build_vocabulary.py builds coco_10k.model:
  <unk> 0 (its padding), control symbols [SOS] 1, [EOS] 2, [MASK] 3."""
  import sentencepiece as spm

  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(tokenizers.normalize_text(c) for c in CAPTIONS),
    model_prefix=str(path)[: -len(".model")],
    vocab_size=size,
    model_type="bpe",
    character_coverage=1.0,
    bos_id=-1,
    eos_id=-1,
    control_symbols=["[SOS]", "[EOS]", "[MASK]"],
    minloglevel=2,
  )
  return spm.SentencePieceProcessor(model_file=str(path))


def _official_tokens(sp, captions, max_len):
  """The official dataset's tokens: [SOS] pieces [EOS] cut to max_len, the flipped copy, padded with 0."""
  rows = [([1, *sp.encode(tokenizers.normalize_text(c)), 2])[:max_len] for c in captions]
  pad = lambda rs: torch.tensor([r + [0] * (max_len - len(r)) for r in rs])
  return pad(rows), pad([r[::-1] for r in rows]), torch.tensor([len(r) for r in rows])


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
  """An official-layout bicaptioning checkpoint ({'model': state_dict, ...} as the zoo's), its vocabulary, the
  reference model, and its import (with tiny_virtex's data, so vlrep's commands can run on it)."""
  root = tmp_path_factory.mktemp("zoo")
  sp = _official_vocab(root / "coco_tiny.model")
  torch.manual_seed(0)
  ref = _randomize(OfficialVirTex(vocab=sp.get_piece_size()))
  with torch.no_grad():
    # Random weights decode one repeated piece whatever the image; equal-norm word rows and a stronger visual
    # projection make greedy captions depend on the image. The special tokens other than [EOS] are made unlikely,
    # as in a trained model (vlrep's decoders never emit them; the official one could).
    words = ref.textual.embedding.words.weight
    words.copy_(6 * words / words.norm(dim=1, keepdim=True))
    ref.textual.visual_projection.weight.mul_(8)
    ref.textual.output.bias[[0, 1, 3]] = -30.0
  ckpt = root / "bicaptioning_R_50_L2_H128.pth"
  torch.save(
    {"model": ref.state_dict(), "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}, "iteration": 7}, ckpt
  )
  workdir = root / "run"
  import_run.import_run("virtex", str(ckpt), str(workdir), vocab=str(root / "coco_tiny.model"), config=TINY_VIRTEX)
  return dict(root=root, sp=sp, ref=ref, ckpt=ckpt, workdir=str(workdir), vocab=str(root / "coco_tiny.model"))


def _images(n=2, size=64, seed=1):
  return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype(np.float32)


# ------------------------------------------------------------------------------------------------------------------
# (a) torchvision: torchvision.models' ResNets, imported as saved, against their own forward.
# ------------------------------------------------------------------------------------------------------------------
def _torchvision_outputs(model, images):
  """(grid NHWC, pooled, logits) of a torchvision ResNet on NHWC images: its layer4 and flatten nodes and its
  output, through torchvision's own feature extraction."""
  extractor = create_feature_extractor(model, {"layer4": "grid", "flatten": "pooled", "fc": "logits"})
  with torch.no_grad():
    out = extractor(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))
  return out["grid"].numpy().transpose(0, 2, 3, 1), out["pooled"].numpy(), out["logits"].numpy()


def test_torchvision_resnet50_imports_and_computes_torchvisions_features(tmp_path):
  torch.manual_seed(0)
  ref = _randomize(torchvision.models.resnet50())
  from safetensors.torch import save_file

  save_file(ref.state_dict(), str(tmp_path / "resnet50.safetensors"))  # every tensor, the ImageNet fc included
  imported = import_run.import_run("auto", str(tmp_path / "resnet50.safetensors"), str(tmp_path / "run"))
  assert imported.note["format"] == "torchvision"
  assert imported.note["architecture"] == {"depth": 50, "width": 64, "inner_multiplier": 1}
  assert sorted(imported.note["dropped"]) == ["fc.bias", "fc.weight"]
  run = runs.load_run(str(tmp_path / "run"))  # as imported: nothing in its config overridden
  assert run.config.method.name == "classifier" and run.config.method.backbone.depth == 50
  # float32 is the importer's doing: a recipe named as --config (fine-tuning's) trains in bfloat16.
  assert run.config.method.dtype == "float32" and run.meta["import"]["dtype"] == "float32"
  assert import_run.load_config(os.path.join(ROOT, "configs/finetune.py")).method.dtype == "bfloat16"
  net, variables = runs.backbone_of(run)
  assert sum(x.size for x in jax.tree.leaves(variables["params"])) == 23_508_032  # torchvision's R50 without fc
  images = _images(2, 32)
  grid_t, pooled_t, logits_t = _torchvision_outputs(ref, images)
  # The evaluate path (runs.backbone_fn: what vlrep.evaluate and vlrep.tools.features call) ...
  features = runs.backbone_fn(run)
  grid, _ = features({"image": images}, "grid")
  pooled, _ = features({"image": images}, "pre_logits")
  # ... and the run's own method (its backbone in the run's method.dtype), with torchvision's fc in the first 1000
  # of its head's classes (the default config's head is iNaturalist's): torchvision's logits.
  method = methods.build(run.config.method, 0)
  kernel = np.zeros((2048, run.config.method.num_classes), np.float32)
  kernel[:, :1000] = ref.fc.weight.detach().numpy().T
  bias = np.zeros(run.config.method.num_classes, np.float32)
  bias[:1000] = ref.fc.bias.detach().numpy()
  head = {"kernel": kernel, "bias": bias}
  logits, _ = method.model.apply({"params": {**run.params, "classifier": head}, **run.model_state}, images, False)
  logits = np.asarray(logits)[:, :1000]
  figures = {
    "grid": _rel(grid, grid_t),
    "pooled": _rel(pooled, pooled_t),
    "logits (the run's method)": _rel(logits, logits_t),
  }
  print(
    "torchvision ResNet-50 (32 px), imported, vs torchvision: " + ", ".join(f"{k} {v:.2e}" for k, v in figures.items())
  )
  # float32 convolutions summed in other orders (53 layers): 1e-5 relative is rounding, a wrong map is O(1) and
  # bfloat16 compute ~1e-2.
  assert all(v < 1e-5 for v in figures.values()), figures


def test_torchvision_depths_and_widths_are_read_from_the_shapes():
  from vlrep.interop.formats import torchvision as tv

  models = {
    (18, 1): torchvision.models.resnet18,
    (101, 1): torchvision.models.resnet101,
    (152, 1): torchvision.models.resnet152,
    (50, 2): torchvision.models.wide_resnet50_2,
  }
  for (depth, inner), build in models.items():
    with torch.device("meta"):  # shapes only: no weights allocated
      sd = build().state_dict()
    assert tv.architecture(sd) == {"depth": depth, "width": 64, "inner_multiplier": inner}, build.__name__
  assert tuple(sd["layer1.0.conv1.weight"].shape) == (128, 64, 1, 1)  # wide_resnet50_2's doubled inner width


def test_the_virtex_references_resnet_is_torchvisions():
  """vlrep/pytorch/resnet.py (the VirTex reference's backbone, at width 8 there) at width 64 is
  torchvision.models.resnet50: the same names and shapes (strict load both ways) and the same grid and pooled
  features."""
  torch.manual_seed(4)
  ref = _randomize(torchvision.models.resnet50())
  copy = TorchResNet(50, 64).eval()
  copy.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("fc.")}, strict=True)
  images = _images(2, 32)
  grid_t, pooled_t, _ = _torchvision_outputs(ref, images)
  with torch.no_grad():
    grid, pooled = copy(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))
  rel_grid, rel_pooled = _rel(grid.numpy().transpose(0, 2, 3, 1), grid_t), _rel(pooled.numpy(), pooled_t)
  print(f"vlrep/pytorch/resnet.py vs torchvision.models.resnet50: grid {rel_grid:.2e}, pooled {rel_pooled:.2e}")
  assert rel_grid < 1e-6 and rel_pooled < 1e-6


# ------------------------------------------------------------------------------------------------------------------
# (b) VirTex: logits, loss and greedy captions of the imported model against the official-layout reference.
# ------------------------------------------------------------------------------------------------------------------
def _compare_with_official(run, zoo) -> dict:
  """The run (as loaded, its method built from its config as vlrep.evaluate builds it) and the official-layout
  reference on three captions and images: logits of both directions and the loss, with their relative
  differences ('rel_forward', 'rel_backward', 'rel_loss') and what the callers check further."""
  c = run.config
  tok = tokenizers.Tokenizer(c.tokenizer.path, "virtex")
  method = methods.build(c.method, tok.vocab_size)
  ref, sp = zoo["ref"], zoo["sp"]
  captions = [CAPTIONS[0], LONG, CAPTIONS[3]]
  tokens_t, noitpac_t, lengths = _official_tokens(sp, captions, 16)
  assert lengths.tolist()[1] == 16 and tokens_t[1, -1] != 2  # the long caption lost its [EOS], as officially
  # Tokenization: the run's tokenizer gives the official ids, in vlrep's layout.
  ours = np.stack([tok.encode(t, 16)[0] for t in captions])
  np.testing.assert_array_equal(ours, tokenizers.virtex_ids_to_vlrep(tokens_t.numpy()))
  images = np.concatenate([_images(2, 64), _images(1, 64, seed=2)])
  with torch.no_grad():
    logits_t, back_t, loss_t = ref(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()), tokens_t, noitpac_t, lengths)
  inputs, padding, _ = method._inputs(ours, jax.random.PRNGKey(0))
  (logits, _), _ = method.model.apply(run.variables, images, inputs, padding, train=False, mutable=["batch_stats"])
  order = tokenizers.virtex_vocabulary_order(sp.get_piece_size())
  keep = order >= 0
  real = lengths[:, None] - 1 > torch.arange(15)[None]  # positions whose next token is a target
  fw = np.asarray(logits["forward"])[..., keep][real.numpy()]
  bw = np.asarray(logits["backward"])[..., keep][real.numpy()]
  fw_t = logits_t[:, :-1][..., order[keep]][real].numpy()
  bw_t = back_t[:, :-1][..., order[keep]][real].numpy()
  loss, _, _ = method.loss(run.variables, {"image": images, "tokens": ours}, jax.random.PRNGKey(0), False)
  return dict(
    tok=tok,
    method=method,
    images=images,
    inputs=inputs,
    padding=padding,
    logits=logits,
    fw_t=fw_t,
    keep=keep,
    real=real,
    rel_forward=_rel(fw, fw_t),
    rel_backward=_rel(bw, bw_t),
    rel_loss=abs(float(loss) - float(loss_t)) / float(loss_t),
  )


def test_virtex_import_computes_what_the_official_model_computes(zoo):
  run = runs.load_run(zoo["workdir"])
  c = run.config
  assert (c.method.task, c.method.hidden, c.method.num_layers, c.method.max_len) == ("bicaptioning", 128, 2, 16)
  assert c.method.decoder_ln_eps == 1e-5 and c.method.backbone.depth == 50 and c.method.backbone.width == 8
  assert c.tokenizer.special_tokens == "virtex" and c.tokenizer.path.startswith(zoo["workdir"])
  assert "tokenize(16)" in c.data.pp
  compared = _compare_with_official(run, zoo)
  tok, method, images, logits = compared["tok"], compared["method"], compared["images"], compared["logits"]
  inputs, padding, fw_t, keep, real = (compared[k] for k in ("inputs", "padding", "fw_t", "keep", "real"))
  ref, sp = zoo["ref"], zoo["sp"]
  # vlrep's extra [UNK] column: probability exactly 0.
  assert np.all(np.exp(np.asarray(logits["forward"])[..., 1] - np.asarray(logits["forward"]).max(-1)) == 0)
  rel_f, rel_b, rel_loss = compared["rel_forward"], compared["rel_backward"], compared["rel_loss"]
  print(f"VirTex head vs official layout: logits forward {rel_f:.2e}, backward {rel_b:.2e}, loss {rel_loss:.2e} rel")
  assert rel_f <= 1e-5 and rel_b <= 1e-5 and rel_loss <= 1e-5
  # Greedy captions: the official decoder's greedy search and vlrep's, token for token up to [EOS].
  from vlrep import decoding

  steps = 12
  caption = decoding.make_captioner(method.model, steps, "greedy")
  ours_greedy = np.asarray(caption(run.variables, images, jax.random.PRNGKey(0))[0])
  theirs = ref.greedy(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()), steps).numpy()
  for a, b in zip(ours_greedy, theirs, strict=True):
    b = b.tolist()
    b = b[: b.index(2) + 1] if 2 in b else b
    assert tokenizers.virtex_ids_to_vlrep(np.array(b)).tolist() == a[: len(b)].tolist()
  assert len({tuple(x) for x in ours_greedy}) > 1  # image-dependent captions, not a constant
  # The comparison can fail: the reference's key biases are not zero (dropping them is exact only because softmax
  # removes them), and logits in the vlrep order without the reordering are far off.
  assert float(ref.textual.transformer.layers[0].self_attn.in_proj_bias[128:256].abs().max()) > 0.1
  assert _rel(np.asarray(logits["forward"])[..., : sp.get_piece_size()][real.numpy()], fw_t) > 0.1
  # For the record: vlrep's default decoder LayerNorm eps (1e-8) instead of the official 1e-5.
  c8 = ConfigDict(c.to_dict())
  c8.method.decoder_ln_eps = 1e-8
  (l8, _), _ = methods.build(c8.method, tok.vocab_size).model.apply(
    run.variables, images, inputs, padding, train=False, mutable=["batch_stats"]
  )
  print(
    f"  with eps 1e-8 in the decoder LayerNorms: {_rel(np.asarray(l8['forward'])[..., keep][real.numpy()], fw_t):.2e}"
  )


def test_virtex_key_bias_cancels_and_tied_copies_are_checked(zoo, tmp_path):
  run = runs.load_run(zoo["workdir"])
  note = run.meta["import"]
  assert "attention key biases" in note["dropped"] and note["sizes"]["heads"] == 2
  assert note["counters"]["visual.cnn.bn1.num_batches_tracked"] == 500_000
  sd = zoo["ref"].state_dict()
  bad = {k: v.clone() for k, v in sd.items()}
  bad["backward_textual.output.weight"] = bad["backward_textual.output.weight"] + 1e-3
  torch.save({"model": bad}, tmp_path / "untied.pth")
  with pytest.raises(ValueError, match="tied copy of textual.embedding.words.weight"):
    import_run.import_run(
      "virtex", str(tmp_path / "untied.pth"), str(tmp_path / "r"), vocab=zoo["vocab"], config=TINY_VIRTEX
    )
  assert not (tmp_path / "r").exists()


def test_virtex_imported_as_documented_computes_what_the_official_model_computes(zoo, tmp_path):
  """The documented import (no --config: configs/virtex.py, whose recipe trains in bfloat16), exactly as imported
  and loaded: float32 compute, the official model's logits and loss to float32 rounding."""
  import_run.import_run("virtex", str(zoo["ckpt"]), str(tmp_path / "run"), vocab=zoo["vocab"])
  run = runs.load_run(str(tmp_path / "run"))
  assert run.config.method.dtype == "float32" and run.meta["import"]["dtype"] == "float32"
  assert import_run.load_config(os.path.join(ROOT, "configs/virtex.py")).method.dtype == "bfloat16"
  compared = _compare_with_official(run, zoo)
  figures = {k: compared[k] for k in ("rel_forward", "rel_backward", "rel_loss")}
  print(f"VirTex imported with its default config vs official layout: {figures}")
  assert all(v <= 1e-5 for v in figures.values()), figures


# ------------------------------------------------------------------------------------------------------------------
# (c) import -> export: the identity, tensor for tensor.
# ------------------------------------------------------------------------------------------------------------------
def _assert_same(a: dict, b: dict, skip=()):
  assert sorted(a) == sorted(b)
  for k in a:
    if k in skip:
      continue
    assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_torchvision_round_trip_is_bit_exact(tmp_path):
  torch.manual_seed(1)
  sd = _randomize(torchvision.models.resnet50()).state_dict()
  torch.save(sd, tmp_path / "r50.pth", _use_new_zipfile_serialization=False)  # the legacy format reads too
  import_run.import_run("torchvision", str(tmp_path / "r50.pth"), str(tmp_path / "run"))
  export.export(str(tmp_path / "run"), "torchvision", str(tmp_path / "out.pth"))
  out = torch.load(tmp_path / "out.pth")
  _assert_same(out, {k: v for k, v in sd.items() if not k.startswith("fc.")})  # the ImageNet head: dropped
  model = torchvision.models.resnet50()
  assert model.load_state_dict(out, strict=False).missing_keys == ["fc.weight", "fc.bias"]


def test_auto_reads_the_checkpoint_once_and_the_config_from_no_file(tmp_path, monkeypatch):
  """--format=auto reads the file once and hands its contents to the format (no module-global cache of the last
  file); without --config the run's config is the format's own, built with no recipe file read (the working
  directory here has no configs/)."""
  from vlrep.interop.formats import torchvision as tv

  torch.manual_seed(2)
  torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pth")
  reads = []
  monkeypatch.setattr(tv, "load_checkpoint", lambda path: reads.append(path) or torch_files.load_checkpoint(path))
  monkeypatch.chdir(tmp_path)
  imported = import_run.import_run("auto", "r18.pth", "run")
  assert reads == ["r18.pth"] and imported.note["format"] == "torchvision"
  method = imported.config.method.to_dict()
  backbone = {"depth": 18, "width": 64, "stem": "imagenet"}
  assert method == {"name": "classifier", "num_classes": 1000, "dtype": "float32", "backbone": backbone}
  assert set(imported.config) == {"method", "data"} and "central_crop(224)" in imported.config.data.pp
  with pytest.raises(import_run.NoSuchFile, match="No config file"):  # --config: the path as named, here none
    import_run.import_run("torchvision", "r18.pth", "run2", config="configs/finetune.py")


def test_no_format_module_changes_the_shared_tables_on_import():
  """The one TRANSFORMS table holds every layout change: importing every format module (in a fresh process)
  leaves it as vlrep.interop.keymaps defines it."""
  code = (
    "from vlrep import modules; from vlrep.interop import keymaps; before = dict(keymaps.TRANSFORMS); "
    "[modules.get('interop.formats', n, 'format') for n in modules.available('interop.formats')]; "
    "assert keymaps.TRANSFORMS == before, set(keymaps.TRANSFORMS) ^ set(before); print(sorted(before))"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "'linear_swap2'" in done.stdout and "'swap2'" in done.stdout


@pytest.mark.parametrize("task", ["bicaptioning", "captioning", "masked_lm", "token_classification"])
def test_virtex_round_trip_is_bit_exact_for_every_task(zoo, tmp_path, task):
  vocab = zoo["sp"].get_piece_size()
  torch.manual_seed(2)
  if task == "token_classification":
    model = nn.Module()
    model.visual = OfficialVisual(8)
    model.textual = nn.Module()
    model.textual.output = nn.Linear(256, vocab)
  else:
    model = OfficialVirTex(
      vocab=vocab, hidden=64, layers=1, heads=1, ff=256, positions=20, backward=task == "bicaptioning"
    )
  sd = _randomize(model).state_dict()
  for k in sd:  # torch initialises the key bias at 0 and it gets no gradient: a trained model's is 0
    if k.endswith("in_proj_bias"):
      sd[k][sd[k].shape[0] // 3 : 2 * sd[k].shape[0] // 3] = 0
  path = tmp_path / f"{task}_R_50_L1_H64.pth"
  torch.save({"model": sd}, path)
  imported = import_run.import_run("virtex", str(path), str(tmp_path / "run"), vocab=zoo["vocab"], config=TINY_VIRTEX)
  assert imported.note["task"] == task
  info = export.export(str(tmp_path / "run"), "virtex", str(tmp_path / "out.pth"))
  out = torch.load(tmp_path / "out.pth")
  _assert_same(out["model"], sd)
  official = info["official_config"]
  assert official["DATA.VOCAB_SIZE"] == vocab and official["DATA.SOS_INDEX"] == 1
  if task != "token_classification":
    assert official["MODEL.TEXTUAL.NAME"] == "transdec_postnorm::L1_H64_A1_F256"
    model.load_state_dict(out["model"], strict=True)  # loads into the official layout


def test_virtex_export_of_a_vlrep_trained_run_loads_strictly(zoo, tmp_path):
  """A run that never was official (vlrep's vocabulary, its own decoder eps): every official key, the key biases
  zero, the tied copies equal; the torch model loads it with strict=True and computes vlrep's logits."""
  run = runs.load_run(zoo["workdir"])
  c = ConfigDict(run.config.to_dict())
  c.tokenizer.special_tokens = "vlrep"
  from vlrep.interop.formats import virtex as virtex_format

  native = runs.Run(c, run.params, run.model_state, 3, run.path, {})
  sd, official = virtex_format.state_dict(native)
  assert official["DATA.SOS_INDEX"] == 2 and official["notes"]
  vocab = run.params["textual_head"]["embedding"]["words"]["embedding"].shape[0]
  model = OfficialVirTex(vocab=vocab)
  model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
  for k in sd:
    if k.endswith("in_proj_bias"):
      assert not sd[k][128:256].any()
  assert np.array_equal(sd["textual.output.weight"], sd["backward_textual.embedding.words.weight"])


# ------------------------------------------------------------------------------------------------------------------
# (d) imported runs work with the existing commands.
# ------------------------------------------------------------------------------------------------------------------
def _probe_config():
  import tiny_virtex

  cfg = tiny_virtex.get_config()
  return ConfigDict({"evals": {"svm": cfg.evals.probe.to_dict(), "captions": cfg.evals.captioning.to_dict()}})


def _finetune_one_step(init_from: str, workdir) -> None:
  """tests/tiny_finetune.py from `init_from` for one step at LR 0, in this process (vlrep.train.train_and_evaluate, as
  `python -m vlrep.main` runs it; no evaluations): the backbone must arrive unchanged."""
  config = tiny_finetune.get_config()
  config.update(init_from=init_from, total_steps=1, evals={})
  config.optim.lr_groups = ((".*", 0.0),)
  train.train_and_evaluate(config, str(workdir))


def test_imported_virtex_run_evaluates_captions_and_exports(zoo, tmp_path):
  from PIL import Image

  from vlrep import evaluate
  from vlrep.tools import caption

  results = evaluate.evaluate(_probe_config(), zoo["workdir"])
  assert np.isfinite(results["svm/map"]) and np.isfinite(results["captions/cider"])
  summary = json.loads(open(os.path.join(zoo["workdir"], "summary.json")).read())
  assert summary["import/format"] == "virtex" and "svm/map" in summary
  path = tmp_path / "photo.png"
  Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(path)
  out = caption.caption_files(zoo["workdir"], [str(path)], "best", "greedy", size=64, max_len=8)
  entry = out[str(path)]
  assert isinstance(entry["caption"], str) and entry["tokens"]
  # The pieces shown are the official vocabulary's pieces of the decoded ids.
  sp = zoo["sp"]
  assert all(t in {sp.id_to_piece(i) for i in range(sp.get_piece_size())} for t in entry["tokens"])
  # ... and it initialises a fine-tuning run (--config.init_from): its backbone arrives unchanged (LR 0), the
  # architecture adopted from the imported run.
  _finetune_one_step(zoo["workdir"], tmp_path / "ft")
  imported, ft = runs.load_run(zoo["workdir"]), runs.load_run(str(tmp_path / "ft"), "latest")
  for a, b in zip(jax.tree.leaves(imported.params["backbone"]), jax.tree.leaves(ft.params["backbone"]), strict=True):
    np.testing.assert_array_equal(a, b)


def test_imported_backbone_initialises_a_finetuning_run(tmp_path):
  torch.manual_seed(3)
  # The copy at width 8 (test_the_virtex_references_resnet_is_torchvisions): this test is about the wiring (init_from
  # adopts the architecture, the weights arrive), which needs no width-64 compute.
  sd = _randomize(TorchResNet(50, 8)).state_dict()
  torch.save(sd, tmp_path / "r50w8.pth")
  import_run.import_run("torchvision", str(tmp_path / "r50w8.pth"), str(tmp_path / "in1k"))
  results = __import__("vlrep.evaluate", fromlist=["evaluate"]).evaluate(
    ConfigDict({"evals": {"svm": _probe_config().evals.svm.to_dict()}}), str(tmp_path / "in1k")
  )
  assert np.isfinite(results["svm/map"])
  _finetune_one_step(str(tmp_path / "in1k"), tmp_path / "ft")  # ResNet-50, ImageNet stem: adopted from the run
  ft = runs.load_run(str(tmp_path / "ft"), "latest")
  assert np.array_equal(ft.params["backbone"]["conv1"]["kernel"], sd["conv1.weight"].numpy().transpose(2, 3, 1, 0))


def test_the_command_computes_in_float32_unless_asked(tmp_path):
  """`python -m vlrep.interop.import_run`: float32 by default, `--dtype=bfloat16` when asked (said on the console and in
  the run's note); a dtype it does not offer is refused before anything is written."""
  torch.manual_seed(5)
  torch.save(_randomize(TorchResNet(18, 8)).state_dict(), tmp_path / "r18w8.pth")
  for dtype in ("float32", "bfloat16"):
    args = ["--format=torchvision", f"--checkpoint={tmp_path / 'r18w8.pth'}", f"--workdir={tmp_path / dtype}"]
    proc = run_module("vlrep.interop.import_run", *args, *([f"--dtype={dtype}"] if dtype != "float32" else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"it computes in {dtype}." in proc.stdout
    run = runs.load_run(str(tmp_path / dtype))
    assert run.config.method.dtype == dtype and run.meta["import"]["dtype"].startswith(dtype)
  proc = run_module("vlrep.interop.import_run", *args[:2], f"--workdir={tmp_path / 'f16'}", "--dtype=float16")
  assert proc.returncode != 0 and "one of <float32|bfloat16>" in proc.stderr and not (tmp_path / "f16").exists()


# ------------------------------------------------------------------------------------------------------------------
# (e) bad inputs: each a clear error, nothing written.
# ------------------------------------------------------------------------------------------------------------------
def test_a_file_of_no_format_names_the_closest_and_the_keys(tmp_path):
  sd = {"encoder.weight": torch.zeros(3, 3), "conv1.weight": torch.zeros(64, 3, 7, 7), "decoder.bias": torch.zeros(3)}
  torch.save(sd, tmp_path / "other.pth")
  with pytest.raises(ValueError, match=r"matches no import format: the closest is 'torchvision'.*missing \(first: "
                     r"\['bn1.weight'.*unexpected \(first: \['decoder.bias', 'encoder.weight'\]"):  # fmt: skip
    import_run.import_run("auto", str(tmp_path / "other.pth"), str(tmp_path / "run"))
  with pytest.raises(ValueError, match="Unknown import format 'onnx'; known formats: .*torchvision.*virtex"):
    import_run.import_run("onnx", str(tmp_path / "other.pth"), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(zoo, tmp_path):
  sd = {k: v.clone() for k, v in zoo["ref"].state_dict().items()}
  sd["textual.transformer.layers.1.linear2.weight"] = torch.zeros(128, 500)
  torch.save({"model": sd}, tmp_path / "bad.pth")
  with pytest.raises(ValueError, match=r"textual.transformer.layers.1.linear2.weight is \(128, 500\) in the "
                     r"checkpoint, but the model .* needs \(128, 512\)"):  # fmt: skip
    import_run.import_run(
      "virtex", str(tmp_path / "bad.pth"), str(tmp_path / "run"), vocab=zoo["vocab"], config=TINY_VIRTEX
    )
  assert not (tmp_path / "run").exists()


def test_a_vocabulary_of_another_size_is_refused(zoo, tmp_path):
  _official_vocab(tmp_path / "small.model", size=60)
  with pytest.raises(ValueError, match=r"has 60 pieces but the checkpoint's textual.embedding.words.weight has 100"):
    import_run.import_run("virtex", str(zoo["ckpt"]), str(tmp_path / "run"), vocab=str(tmp_path / "small.model"))
  with pytest.raises(ValueError, match="pass its vocabulary, --vocab=coco_10k.model"):
    import_run.import_run("virtex", str(zoo["ckpt"]), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_an_existing_workdir_needs_overwrite(zoo, tmp_path):
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "keep.txt").write_text("mine")
  args = ("virtex", str(zoo["ckpt"]), str(tmp_path / "run"))
  with pytest.raises(FileExistsError, match="already exists and is not empty; pass --overwrite"):
    import_run.import_run(*args, vocab=zoo["vocab"], config=TINY_VIRTEX)
  assert (tmp_path / "run" / "keep.txt").read_text() == "mine"
  import_run.import_run(*args, vocab=zoo["vocab"], config=TINY_VIRTEX, overwrite=True)
  assert not (tmp_path / "run" / "keep.txt").exists() and runs.load_run(str(tmp_path / "run")).step == 0
