r"""Regenerates tests/fixtures/virtex_official/ by running kdexd/virtex's own code (not a copy) on a tiny model.

  git clone https://github.com/kdexd/virtex /tmp/virtex_src
  python tests/official_virtex_fixture.py --virtex_src=/tmp/virtex_src

(The fixture was made from commit ae67b23f86ab10934f43df239666592acbd74631, the repository's HEAD, with torch 2.14.1.)

What it writes (the captured data that tests/test_official_decoding.py compares vlrep's `virtex_official`
decoding against; nothing of the official code):
  bicaptioning_tiny.pth  a randomly initialised official `BidirectionalCaptioningModel` (seed 0), saved as the model
                         zoo saves checkpoints ({"model": state_dict, "iteration": 0}); its textual heads are the
                         official `TransformerDecoderTextualHead`, its `visual.cnn` a ResNet-50 of width 4 in
                         torchvision's layout (torchvision's constructor has no width; vlrep/pytorch/resnet.py)
  vocab.model            a SentencePiece BPE vocabulary in the official layout (<unk> 0, [SOS] 1, [EOS] 2, [MASK] 3)
  captured.npz           `images` (uint8 [N, 64, 64, 3]) and, per beam size, `tokens_beam{K}`: the official model's
                         `forward({"image": ...})["predictions"]` (official ids, [EOS] repeated to the end)
  captured.json          the settings, the official commit, and the head's inputs at the first three decoding steps

The official code is imported module by module (virtex.models.captioning, virtex.modules.textual_heads,
virtex.utils.beam_search); `virtex.data`'s package __init__, which imports albumentations and cv2 for the datasets,
is skipped (its `tokenizers` module is what captioning.py imports).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types

import numpy as np
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vlrep.pytorch.resnet import ResNet  # noqa: E402 (after the path; torch only, no TensorFlow)

OUT = os.path.join(ROOT, "tests", "fixtures", "virtex_official")
SETTINGS = dict(width=4, hidden=32, layers=2, heads=2, feedforward=64, positions=12, vocab=64, images=6, size=64)
BEAM_SIZES = (5, 3, 1)
EOS_BIAS = 7.5
CAPTIONS = [
  "a red circle above a blue square",
  "a small green triangle left of a large yellow star",
  "two purple squares and one orange circle",
  "a blue star to the right of a red triangle on a white background",
  "three small circles, one large square",
]


def import_official(src: str):
  """The official modules, imported from a checkout at `src`."""
  sys.path.insert(0, src)
  data = types.ModuleType("virtex.data")  # the package without its __init__ (datasets: albumentations, cv2)
  data.__path__ = [os.path.join(src, "virtex", "data")]
  sys.modules["virtex.data"] = data
  from virtex.models.captioning import BidirectionalCaptioningModel
  from virtex.modules.textual_heads import TransformerDecoderTextualHead
  from virtex.utils.beam_search import AutoRegressiveBeamSearch

  return BidirectionalCaptioningModel, TransformerDecoderTextualHead, AutoRegressiveBeamSearch


def normalize(images: np.ndarray) -> np.ndarray:
  """uint8 -> the official normalisation (ImageNet mean and std), in float32 exactly as vlrep.visualize.normalize
  computes it (imported here it would bring TensorFlow, which crashes beside torchvision's triton import)."""
  mean, std = np.array((0.485, 0.456, 0.406), np.float32), np.array((0.229, 0.224, 0.225), np.float32)
  return (images.astype(np.float32) / 255.0 - mean) / std


class Visual(nn.Module):
  """The official visual backbone's interface (`visual.cnn`, forward -> the final grid NCHW)."""

  def __init__(self, width: int):
    super().__init__()
    self.cnn = ResNet(50, width)

  def forward(self, image):
    return self.cnn(image)[0]


def build_vocab(path: str, size: int):
  import sentencepiece as spm

  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(CAPTIONS * 20),
    model_prefix=path[: -len(".model")],
    vocab_size=size,
    model_type="bpe",
    character_coverage=1.0,
    bos_id=-1,
    eos_id=-1,
    control_symbols=["[SOS]", "[EOS]", "[MASK]"],
    normalization_rule_name="identity",  # a small file; the ids are what the fixture is about
    minloglevel=2,
  )


def randomize(model: nn.Module, generator: torch.Generator) -> None:
  """Weights of a trained model's scale, so that captions depend on the image and beams separate: norms around 1,
  every bias non-zero, weights 1/sqrt(fan in), BatchNorm statistics random; larger visual projection and word
  rows (the official initialisation, N(0, 0.02), gives near-uniform distributions). Shared tensors are drawn once."""
  with torch.no_grad():
    for name, p in model.named_parameters():  # named_parameters skips the tied and shared copies
      if name.endswith("weight") and p.ndim == 1:
        p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
      elif name.endswith("bias") or "in_proj_bias" in name:
        p.copy_(0.1 * torch.randn(p.shape, generator=generator))
      else:
        p.copy_(torch.randn(p.shape, generator=generator) / float(np.prod(p.shape[1:])) ** 0.5)
    for m in model.modules():
      if isinstance(m, nn.BatchNorm2d):
        m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=generator))
        m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=generator))
    words = model.textual.embedding.words.weight
    words.copy_(4 * words / words.norm(dim=1, keepdim=True))
    model.textual.visual_projection.weight.mul_(4)
    model.textual.output.bias[2] += EOS_BIAS  # [EOS] likely enough that captions end at different lengths


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--virtex_src", required=True, help="A checkout (or archive) of github.com/kdexd/virtex.")
  parser.add_argument("--out", default=OUT)
  parser.add_argument("--commit", default="", help="The checkout's commit (default: `git rev-parse HEAD` there).")
  args = parser.parse_args()
  captioning_model, textual_head, beam_search = import_official(args.virtex_src)
  s = SETTINGS
  os.makedirs(args.out, exist_ok=True)
  vocab_path = os.path.join(args.out, "vocab.model")
  build_vocab(vocab_path, s["vocab"])
  os.remove(vocab_path[: -len(".model")] + ".vocab")  # SentencePiece's readable listing; the .model is the vocabulary
  torch.manual_seed(0)
  textual = textual_head(
    visual_feature_size=s["width"] * 32,
    vocab_size=s["vocab"],
    hidden_size=s["hidden"],
    num_layers=s["layers"],
    attention_heads=s["heads"],
    feedforward_size=s["feedforward"],
    dropout=0.1,
    max_caption_length=s["positions"],
  )
  model = captioning_model(Visual(s["width"]), textual, sos_index=1, eos_index=2)
  randomize(model, torch.Generator().manual_seed(0))
  model.eval()
  torch.save({"model": model.state_dict(), "iteration": 0}, os.path.join(args.out, "bicaptioning_tiny.pth"))

  images = np.random.default_rng(0).integers(0, 256, (s["images"], s["size"], s["size"], 3), dtype=np.uint8)
  pixels = torch.from_numpy(normalize(images).transpose(0, 3, 1, 2).copy())
  # The head's inputs during decoding: patch the (official) textual head's forward to record its caption tokens.
  step_inputs = []
  forward = model.textual.forward

  def recording(visual_features, caption_tokens, caption_lengths):
    step_inputs.append(caption_tokens.tolist())
    return forward(visual_features, caption_tokens, caption_lengths)

  model.textual.forward = recording
  captured = {"images": images}
  for k in BEAM_SIZES:
    model.decoder = beam_search(eos_index=2, max_steps=s["positions"], beam_size=k)
    step_inputs.clear()
    with torch.no_grad():
      captured[f"tokens_beam{k}"] = model({"image": pixels})["predictions"].numpy()
    if k == BEAM_SIZES[0]:
      first_steps = [inputs[0] for inputs in step_inputs[:3]]  # image 0's first beam
  np.savez_compressed(os.path.join(args.out, "captured.npz"), **captured)
  commit = (
    args.commit
    or subprocess.run(
      ["git", "-C", args.virtex_src, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
  )
  meta = {
    "source": "github.com/kdexd/virtex" + (f" at {commit}" if commit else ""),
    "settings": s,
    "beam_sizes": list(BEAM_SIZES),
    "per_node_beam_size": 2,
    "max_steps": s["positions"],
    "head_inputs_first_steps_image0_beam0": first_steps,
    "torch": torch.__version__,
  }
  with open(os.path.join(args.out, "captured.json"), "w") as f:
    json.dump(meta, f, indent=1)
  for k in BEAM_SIZES:
    print(f"beam {k}:\n{captured[f'tokens_beam{k}']}")
  print("head inputs (image 0, beam 0), first steps:", first_steps)


if __name__ == "__main__":
  main()
