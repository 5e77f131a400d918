"""The PyTorch baseline a user would otherwise write: VirTex's model and train step in plain PyTorch, timed.

ResNet-50 in torchvision's layout (`vlrep.models.torch_resnet`, so it needs `torch` alone), a linear visual
projection, word + position embeddings with LayerNorm, one `nn.TransformerDecoder` per direction (post-LN,
GELU, H/64 heads, 4H feed-forward), output tied to the word embeddings, bicaptioning cross-entropy, SGD with
momentum and weight decay (backbone LR 0.2, head 1e-3). Speed settings: bf16 autocast, channels_last,
`torch.compile` (on by default; `--nocompile` to compare), `zero_grad(set_to_none=True)`, fused SGD where
available. Inputs are random tensors already on the device, as in `vlrep.tools.benchmark --input=device`.

  python -m vlrep.tools.torch_reference --batch_size=256 --steps=30

`vlrep.tools.benchmark --torch_reference` runs this first, then vlrep's step, and reports the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from vlrep.models.torch_resnet import ResNet

PAD_ID = 0


class TorchVirTex(nn.Module):
  def __init__(self, vocab_size: int, hidden: int, layers: int, max_len: int, depth: int = 50, dropout: float = 0.1):
    super().__init__()
    self.backbone = ResNet(depth)
    self.visual_projection = nn.Linear(2048 if depth >= 50 else 512, hidden)
    self.words = nn.Embedding(vocab_size, hidden)
    self.positions = nn.Embedding(max_len, hidden)
    self.embedding_ln = nn.LayerNorm(hidden, eps=1e-8)
    self.dropout = nn.Dropout(dropout)
    self.output_bias = nn.Parameter(torch.zeros(vocab_size))

    def decoder():
      layer = nn.TransformerDecoderLayer(
        hidden, max(1, hidden // 64), 4 * hidden, dropout, activation="gelu", batch_first=True, norm_first=False
      )
      return nn.TransformerDecoder(layer, layers)

    self.forward_decoder = decoder()
    self.backward_decoder = decoder()
    # BERT-style initialisation of the textual head, as vlrep's (PyTorch's N(0, 1) embeddings, tied to the
    # output, would start the loss far above log(vocab)).
    for name, module in self.named_modules():
      if name.startswith("backbone"):
        continue
      if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
      if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
      if isinstance(module, nn.MultiheadAttention):
        nn.init.normal_(module.in_proj_weight, std=0.02)
        nn.init.zeros_(module.in_proj_bias)

  def caption_loss(self, decoder, memory, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t = inputs.shape[1]
    pos = torch.arange(t, device=tokens.device)
    x = self.dropout(self.embedding_ln(self.words(inputs) + self.positions(pos)[None]))
    causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)  # True: may not attend
    x = decoder(x, memory, tgt_mask=causal, tgt_key_padding_mask=inputs == PAD_ID, tgt_is_causal=True)
    logits = x @ self.words.weight.t() + self.output_bias
    return nn.functional.cross_entropy(
      logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=PAD_ID
    )

  def forward(self, images, tokens):
    grid, _ = self.backbone(images)
    memory = self.visual_projection(grid.flatten(2).transpose(1, 2))
    lengths = (tokens != PAD_ID).sum(1, keepdim=True)
    idx = torch.arange(tokens.shape[1], device=tokens.device)[None]
    backward = tokens.gather(1, torch.where(idx < lengths, lengths - 1 - idx, idx))
    return self.caption_loss(self.forward_decoder, memory, tokens) + self.caption_loss(
      self.backward_decoder, memory, backward
    )


def benchmark(
  batch_size: int, image_size: int, vocab_size: int, hidden: int, layers: int, max_len: int, steps: int, compile_: bool
) -> dict:
  if not torch.cuda.is_available():
    raise SystemExit("torch_reference times a CUDA device; none is visible to PyTorch.")
  torch.backends.cudnn.benchmark = True
  torch.backends.cuda.matmul.allow_tf32 = True
  torch.backends.cudnn.allow_tf32 = True
  device = torch.device("cuda")
  model = TorchVirTex(vocab_size, hidden, layers, max_len).to(device).to(memory_format=torch.channels_last)
  backbone = [p for n, p in model.named_parameters() if n.startswith("backbone.")]
  head = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
  kwargs = {"fused": True} if "fused" in torch.optim.SGD.__init__.__code__.co_varnames else {}
  opt = torch.optim.SGD(
    [{"params": backbone, "lr": 0.2}, {"params": head, "lr": 1e-3}], momentum=0.9, weight_decay=1e-4, **kwargs
  )
  gen = torch.Generator(device=device).manual_seed(0)
  images = torch.randn(batch_size, 3, image_size, image_size, device=device, generator=gen)
  images = images.contiguous(memory_format=torch.channels_last)
  tokens = torch.randint(5, vocab_size, (batch_size, max_len), device=device, generator=gen)
  tokens[:, 0], tokens[:, -1] = 2, 3

  def step(images, tokens):
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = model(images, tokens)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  step_fn = torch.compile(step) if compile_ else step
  t0 = time.time()
  for _ in range(3):
    loss = step_fn(images, tokens)
  torch.cuda.synchronize()
  warmup_s = time.time() - t0
  t0 = time.time()
  for _ in range(steps):
    loss = step_fn(images, tokens)
  torch.cuda.synchronize()
  step_s = (time.time() - t0) / steps
  return {
    "framework": f"torch {torch.__version__}",
    "device": torch.cuda.get_device_name(),
    "batch_size": batch_size,
    "image_size": image_size,
    "compiled": compile_,
    "step_seconds": step_s,
    "images_per_second": batch_size / step_s,
    "warmup_seconds": warmup_s,
    "final_loss": float(loss),
    "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--image_size", type=int, default=224)
  p.add_argument("--vocab_size", type=int, default=10000)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--layers", type=int, default=1)
  p.add_argument("--max_len", type=int, default=30)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--nocompile", action="store_true", help="eager mode (no torch.compile)")
  p.add_argument("--output", default=None, help="optional JSON file for the results")
  a = p.parse_args(argv)
  result = benchmark(a.batch_size, a.image_size, a.vocab_size, a.hidden, a.layers, a.max_len, a.steps, not a.nocompile)
  print(json.dumps(result, indent=2), flush=True)
  if a.output:
    with open(a.output, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
