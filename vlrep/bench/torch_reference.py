"""The PyTorch baseline a user would otherwise write: VirTex's model and train step in plain PyTorch, timed.

ResNet-50 in torchvision's layout (`vlrep.pytorch.resnet`, so it needs `torch` alone), a linear visual
projection, word + position embeddings with LayerNorm, one `nn.TransformerDecoder` per direction (post-LN,
GELU, H/64 heads, 4H feed-forward), output tied to the word embeddings, bicaptioning cross-entropy, and vlrep's
VirTex optimizer: SGD with momentum 0.9 and weight decay 1e-4 (backbone LR 0.2, head 1e-3; no decay on the head's
biases and LayerNorm scales), the gradient clipped to global norm 10, LookAhead (k=5, alpha=0.5), BatchNorm
statistics over groups of 32 images (the paper's per-GPU BatchNorm). Speed settings: bf16 autocast,
channels_last, `torch.compile` (`--compile_mode`: default, max-autotune, or eager), `zero_grad(set_to_none=True)`,
fused SGD, foreach clipping and LookAhead. Inputs are random tensors already on the device, as in
`vlrep.bench.benchmark --input=device`. Timing: `--windows` windows of `--steps` steps; the median window and
the spread are reported.

  python -m vlrep.bench.torch_reference --batch_size=256 --steps=30 --compile_mode=max-autotune

`vlrep.bench.benchmark --torch_reference` runs this first, then vlrep's step, and reports the ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch
from torch import nn

from vlrep.bench import device_turns
from vlrep.pytorch.resnet import ResNet

PAD_ID = 0


class GroupedBatchNorm2d(nn.BatchNorm2d):
  """BatchNorm2d whose training statistics are taken over groups of `group_size` consecutive images (vlrep's
  `bn_group_size`: per-GPU BatchNorm); same parameters and buffers, so it loads a BatchNorm2d state_dict."""

  def __init__(self, channels: int, group_size: int):
    super().__init__(channels)
    self.group_size = group_size

  def forward(self, x):
    b, c = x.shape[:2]
    if not self.training or not self.group_size or self.group_size >= b:
      return super().forward(x)
    if b % self.group_size:
      raise ValueError(f"Batch {b} is not divisible by the BatchNorm group size {self.group_size}.")
    xg = x.float().reshape(b // self.group_size, self.group_size, c, *x.shape[2:])
    axes = (1, *range(3, xg.dim()))
    var, mean = torch.var_mean(xg, dim=axes, keepdim=True, correction=0)
    y = (xg - mean) * torch.rsqrt(var + self.eps)
    shape = (1, 1, c) + (1,) * (xg.dim() - 3)
    y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
    with torch.no_grad():
      n = xg[0, :, 0].numel()
      self.running_mean.lerp_(mean.mean(0).reshape(c), self.momentum)
      self.running_var.lerp_(var.mean(0).reshape(c) * n / max(n - 1, 1), self.momentum)
    return y.reshape(x.shape).to(x.dtype)


class TorchVirTex(nn.Module):
  def __init__(
    self,
    vocab_size: int,
    hidden: int,
    layers: int,
    max_len: int,
    depth: int = 50,
    dropout: float = 0.1,
    bn_group_size: int = 0,
  ):
    super().__init__()
    norm = (lambda c: GroupedBatchNorm2d(c, bn_group_size)) if bn_group_size else nn.BatchNorm2d
    self.backbone = ResNet(depth, norm=norm)
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


def make_optimizer(model, backbone_lr, head_lr, momentum, weight_decay, fused):
  """SGD with vlrep's VirTex groups: the backbone (decayed), the head's matrices and embeddings (decayed), and the
  head's biases and LayerNorm scales (not decayed: vlrep's `optim.no_decay`)."""
  groups = {"backbone": [], "head": [], "head_no_decay": []}
  for name, p in model.named_parameters():
    if name.startswith("backbone."):
      groups["backbone"].append(p)
    elif name.endswith("bias") or re.fullmatch(r"norm\d*|.*_ln", name.split(".")[-2]):
      groups["head_no_decay"].append(p)
    else:
      groups["head"].append(p)
  return torch.optim.SGD(
    [
      {"params": groups["backbone"], "lr": backbone_lr, "weight_decay": weight_decay},
      {"params": groups["head"], "lr": head_lr, "weight_decay": weight_decay},
      {"params": groups["head_no_decay"], "lr": head_lr, "weight_decay": 0.0},
    ],
    momentum=momentum,
    **({"fused": True} if fused else {}),
  )


class LookAhead:
  """Every `sync_period` steps: slow += alpha * (fast - slow), fast = slow (vlrep's optim.lookahead), with foreach
  operations, outside the compiled step."""

  def __init__(self, params, sync_period: int, alpha: float):
    self.params = [p for p in params]
    self.slow = [p.detach().clone() for p in self.params]
    self.sync_period, self.alpha, self.count = sync_period, alpha, 0

  @torch.no_grad()
  def after_step(self):
    self.count += 1
    if self.sync_period and self.count % self.sync_period == 0:
      fast = [p.data for p in self.params]
      torch._foreach_lerp_(self.slow, fast, self.alpha)
      torch._foreach_copy_(fast, self.slow)


def make_step(model, opt, grad_clip_norm: float, device_type: str):
  """One training step: bf16 autocast (on CUDA), backward, foreach clipping of the global norm, SGD."""
  params = [p for p in model.parameters() if p.requires_grad]

  def step(images, tokens):
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
      loss = model(images, tokens)
    loss.backward()
    if grad_clip_norm:
      torch.nn.utils.clip_grad_norm_(params, grad_clip_norm, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  return step


def time_windows(run, steps: int, windows: int, turns: device_turns.Turns | None):
  """Times `run(n)` (n steps, synchronised at the end; returns the last loss): 3 warm-up steps, then, in this
  process's turn on the device, `windows` windows of `steps` steps. (warm-up seconds, seconds per step of each
  window, the turn's record, the last loss)."""
  t0 = time.time()
  run(3)
  warmup_s = time.time() - t0
  if turns is not None and torch.cuda.is_available():
    # Processes sharing the device wait for their turns holding only what they use: the cached blocks go back
    # now and are taken again by an untimed step at the start of this one's turn.
    torch.cuda.empty_cache()
  seconds = []
  with device_turns.turn(turns) as turn:  # with other benchmark processes: timed alone on the device
    if turns is not None:
      run(1)
    for _ in range(windows):
      t0 = time.perf_counter()
      loss = run(steps)
      seconds.append((time.perf_counter() - t0) / steps)
  return warmup_s, seconds, turn, loss


def benchmark(
  batch_size: int,
  image_size: int,
  vocab_size: int,
  hidden: int,
  layers: int,
  max_len: int,
  steps: int,
  compile_mode: str = "default",
  windows: int = 3,
  backbone_lr: float = 0.2,
  head_lr: float = 1e-3,
  momentum: float = 0.9,
  weight_decay: float = 1e-4,
  grad_clip_norm: float = 10.0,
  lookahead_steps: int = 5,
  lookahead_alpha: float = 0.5,
  bn_group_size: int = 32,
  turns: device_turns.Turns | None = None,
) -> dict:
  if not torch.cuda.is_available():
    raise SystemExit("torch_reference times a CUDA device; none is visible to PyTorch.")
  torch.backends.cudnn.benchmark = True
  torch.backends.cuda.matmul.allow_tf32 = True
  torch.backends.cudnn.allow_tf32 = True
  device = torch.device("cuda")
  model = TorchVirTex(vocab_size, hidden, layers, max_len, bn_group_size=bn_group_size)
  model = model.to(device).to(memory_format=torch.channels_last)
  opt = make_optimizer(model, backbone_lr, head_lr, momentum, weight_decay, fused=True)
  lookahead = LookAhead(model.parameters(), lookahead_steps, lookahead_alpha)
  gen = torch.Generator(device=device).manual_seed(0)
  images = torch.randn(batch_size, 3, image_size, image_size, device=device, generator=gen)
  images = images.contiguous(memory_format=torch.channels_last)
  tokens = torch.randint(5, vocab_size, (batch_size, max_len), device=device, generator=gen)
  tokens[:, 0], tokens[:, -1] = 2, 3
  step = make_step(model, opt, grad_clip_norm, "cuda")
  if compile_mode != "eager":
    step = torch.compile(step, mode=None if compile_mode == "default" else compile_mode)

  def run(n):
    for _ in range(n):
      loss = step(images, tokens)
      lookahead.after_step()
    torch.cuda.synchronize()
    return loss

  warmup_s, seconds, turn, loss = time_windows(run, steps, windows, turns)
  step_s = statistics.median(seconds)
  return {
    "framework": f"torch {torch.__version__}",
    "device": torch.cuda.get_device_name(),
    "batch_size": batch_size,
    "image_size": image_size,
    "compile_mode": compile_mode,
    "optimizer": {
      "backbone_lr": backbone_lr,
      "head_lr": head_lr,
      "grad_clip_norm": grad_clip_norm,
      "lookahead_steps": lookahead_steps,
      "bn_group_size": bn_group_size,
    },
    "step_seconds": step_s,
    "window_step_seconds": seconds,
    "images_per_second": batch_size / step_s,
    "images_per_second_min": batch_size / max(seconds),
    "images_per_second_max": batch_size / min(seconds),
    "warmup_seconds": warmup_s,
    "turn": turn,
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
  p.add_argument("--steps", type=int, default=30, help="steps per timed window")
  p.add_argument("--windows", type=int, default=3)
  p.add_argument("--compile_mode", default="default", choices=["default", "max-autotune", "eager"])
  p.add_argument("--backbone_lr", type=float, default=0.2)
  p.add_argument("--head_lr", type=float, default=1e-3)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--weight_decay", type=float, default=1e-4)
  p.add_argument("--grad_clip_norm", type=float, default=10.0, help="0: no clipping")
  p.add_argument("--lookahead_steps", type=int, default=5, help="0: no LookAhead")
  p.add_argument("--lookahead_alpha", type=float, default=0.5)
  p.add_argument("--bn_group_size", type=int, default=32, help="images per BatchNorm group (0: the whole batch)")
  p.add_argument("--output", default=None, help="optional JSON file for the results")
  p.add_argument("--turn_dir", default="", help="share the device with other benchmarks (vlrep.bench.device_turns)")
  p.add_argument("--turn_parties", type=int, default=1, help="processes sharing --turn_dir")
  p.add_argument("--turn_deadline", type=float, default=0.0, help="Unix time after which the ready ones go on")
  a = p.parse_args(argv)
  # A reference is an optional party: killed if still compiling at the deadline (max-autotune can take long).
  turns = device_turns.join(a.turn_dir, a.turn_parties, a.turn_deadline or time.time() + 3600, optional=True)
  result = benchmark(
    a.batch_size,
    a.image_size,
    a.vocab_size,
    a.hidden,
    a.layers,
    a.max_len,
    a.steps,
    a.compile_mode,
    a.windows,
    a.backbone_lr,
    a.head_lr,
    a.momentum,
    a.weight_decay,
    a.grad_clip_norm,
    a.lookahead_steps,
    a.lookahead_alpha,
    a.bn_group_size,
    turns,
  )
  print(json.dumps(result, indent=2), flush=True)
  if a.output:
    with open(a.output, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
