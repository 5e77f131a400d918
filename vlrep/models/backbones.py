"""The visual backbones every method builds from its `backbone` config section, by the section's `arch`:
'resnet' (the default; vlrep.models.resnet), 'vgg16' (vlrep.models.vgg), 'vit' (vlrep.models.vit) or
'modified_resnet' (CLIP's ResNets, vlrep.models.modified_resnet).

Every backbone keeps one contract: `module.apply(variables, images, train) -> (grid [B, h, w, C], aux)` with
`aux['pre_logits']` the pooled vector [B, C]; methods read the grid (VirTex's and CapPa's decoders, LocTex's trace
attention, MCT, ICMLM) and evaluators the pooled vector.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from vlrep.models import modified_resnet, resnet, vgg, vit

ARCHS = ("resnet", "vgg16", "vit", "modified_resnet")


def arch_of(section) -> str:
  arch = dict(section).get("arch", "resnet")
  if arch not in ARCHS:
    raise ValueError(f"Unknown backbone arch {arch!r}; known: {', '.join(ARCHS)}.")
  return arch


def from_config(section, dtype=None, remat: str = "none", name: str = "backbone") -> nn.Module:
  """The backbone module of a config section (`method.backbone`). VGG16 takes no remat (its layers are not blocks)."""
  arch = arch_of(section)
  extra = {} if dtype is None else {"dtype": dtype}
  fields = {k: v for k, v in dict(section).items() if k != "arch"}
  if arch == "vgg16":
    return vgg.VGG16(**fields, **extra, name=name)
  if arch == "vit":
    return vit.ViT(**fields, **extra, remat=remat, name=name)
  if arch == "modified_resnet":
    return modified_resnet.from_config(fields, **extra, remat=remat, name=name)
  return resnet.ResNet(**fields, **extra, remat=remat, name=name)


def fields_of(arch: str) -> frozenset[str]:
  """The keys a backbone section of `arch` may hold (its module's fields and 'arch')."""
  modules = {
    "resnet": resnet.ResNet,
    "vgg16": vgg.VGG16,
    "vit": vit.ViT,
    "modified_resnet": modified_resnet.ModifiedResNet,
  }
  module = modules[arch]
  return frozenset({f.name for f in dataclasses.fields(module)} - {"parent", "name"} | {"arch"})


def all_fields() -> frozenset[str]:
  return frozenset().union(*(fields_of(a) for a in ARCHS))
