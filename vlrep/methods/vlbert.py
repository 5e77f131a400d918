"""VisualBERT / ViLBERT pretraining (MLM; ViLBERT's MMM) and downstream fine-tuning (VQA, visual entailment,
multi-label) behind vlrep's method contract: the pretraining study of Singh et al.

Config (`configs/vlbert.py`):
  arch            'visual_bert' | 'vilbert'; bert_path: the pretrained BERT folder ('minilm' = the packaged MiniLM);
                  bert_layers: keep only its first N layers (0 = all).
  bert_config     (optional) BERT's architecture as a dict of `BertConfig` fields instead of bert_path's config.json
                  and weights: bert_path then only supplies vocab.txt and the weights come from the run's own
                  checkpoint or `pretrained_run` (an imported run: `vlrep.interop.import_run --format=visual_bert`).
  region_boxes, region_norm, region_type_embedding, region_type_id
                  VisualBERT's region embeddings (vlrep.models.vl_bert; VisualBERT only): True / 'own' / 'segment'
                  are vlrep's (a box embedding, the regions' own LayerNorm, one learned segment vector); False /
                  'shared' / 'tables' are VisualBERT's and MMF's (no box embedding, BERT's embedding LayerNorm over
                  the whole sequence, visual token-type and position tables started from BERT's own tables, the
                  regions' token type `region_type_id`: 1 as the authors' code, 0 as MMF's).
  task            'pretrain' (MLM, plus masked-region prediction for ViLBERT: MMM) | 'classify' (a head on the
                  pooled output; `loss`: 'bce' for VQA soft scores and multi-label, 'softmax' for entailment).
  visual          the frozen region-feature extractor: a vlrep ResNet (`backbone`), its weights from the run
                  `init_from`, `mode` roi_align | crops | grid; or `mode='file'`: precomputed features of `dim`
                  dims from the `region_features` op (vlrep.data.region_files). A randomly initialised extractor
                  (no init_from, no pretrained_run) is an error unless `allow_random_init` (runlocal's choice).
  region_target   ViLBERT's masked-region target: 'distribution' = KL to the detector's class distribution
                  (region files' cls_prob: the study's MMM), 'classes' = cross-entropy to each box's class label,
                  'feature' = MSE to the region's feature (grid cells, which have no labels).
  text_pool       'cls' (BERT's and the study's pooled [CLS]) | 'mean' (the mean text state, for a BERT whose [CLS]
                  was never trained: the packaged MiniLM).
  fusion          ViLBERT's pooled output: 'mul' (pooled text x pooled image, ViLBERT's and MMF's default) | 'sum'.
  alignment_weight  > 0 adds image-text alignment to pretraining (ViLBERT's multimodal alignment prediction,
                  VisualBERT's sentence-image prediction; the study drops it: 0): each pair's image is replaced by
                  the batch's next image with probability 1/2, a head on the pooled output predicts which pairs
                  are aligned, and the masked-token and masked-region losses score the aligned pairs only (a
                  caption's masked word cannot be read off another image).
  pretrained_run  a pretraining run whose best checkpoint initialises the transformer (and the extractor).
  freeze_base     train only the task head (the study's "frozen base"): gradients stop at the pooled output.
  bert_dropout    dropout while training on hidden states and attention weights of both streams, the region
                  embeddings and the pooled output before the task head (MMF's 0.1; < 0: config.json's rates).
  mask_rate, region_mask_rate: BERT's 15% (of which 80% [MASK], 10% random, 10% kept); ViLBERT's regions are
                  zeroed 90% of the time they are picked.

BERT's weights enter the fresh state through `pretrained_variables` (the loop checks every shape); the region
extractor is frozen state (`model_state['visual']`), never a parameter.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from vlrep import methods, runs
from vlrep.data import vl_ops
from vlrep.models import backbones, vl_bert
from vlrep.models import bert as bert_lib

TASKS = ("pretrain", "classify")
LOSSES = ("bce", "softmax")
# Parameters that belong to one task and are never copied from a pretraining run.
_TASK_PARAMS = ("task_head", "region_head", "align_head")
REGION_TARGETS = ("distribution", "classes", "feature")
# VisualBERT's region-embedding knobs and their defaults (vlrep's embeddings); a downstream run must build the same as
# the run it starts from.
REGION_EMBEDDING_KNOBS = dict(region_boxes=True, region_norm="own", region_type_embedding="segment", region_type_id=1)
# BertConfig fields that decide what a checkpoint's weights compute (dropout rates do not).
BERT_ARCHITECTURE = (
  "vocab_size",
  "hidden_size",
  "num_hidden_layers",
  "num_attention_heads",
  "intermediate_size",
  "hidden_act",
  "max_position_embeddings",
  "type_vocab_size",
  "layer_norm_eps",
)


def region_embedding_knobs(config: ml_collections.ConfigDict) -> dict:
  """The region-embedding knobs a method config sets (their defaults where it has none); ViLBERT has none."""
  if config.arch != "visual_bert":
    return {}
  return {k: type(v)(config.get(k, v)) for k, v in REGION_EMBEDDING_KNOBS.items()}


def bert_config_from_dict(raw: dict, where: str) -> bert_lib.BertConfig:
  """A BertConfig from `method.bert_config`; unknown fields are an error."""
  import dataclasses

  fields = {f.name for f in dataclasses.fields(bert_lib.BertConfig)}
  unknown = sorted(set(raw) - fields)
  if unknown:
    raise ValueError(f"{where}: unknown BERT config fields {unknown}; known: {sorted(fields)}")
  return bert_lib.BertConfig(**raw)


def max_predictions(length: int, rate: float) -> int:
  """Scored positions per sequence (BERT's max_predictions_per_seq): twice the expected count, at least 2."""
  return max(2, int(np.ceil(2 * rate * length)))


def bert_mask(rng, tokens, special, rate: float, vocab_size: int, mask_id: int):
  """BERT's masking: each non-special token is picked with probability `rate`; a picked token becomes [MASK]
  80% of the time, a uniformly random token 10%, and stays 10%. At most `max_predictions` per sequence are
  picked (the first ones; more is rare at twice the expected count). -> (input tokens, picked bool)."""
  pick_rng, how_rng, rand_rng = jax.random.split(rng, 3)
  picked = (jax.random.uniform(pick_rng, tokens.shape) < rate) & ~special
  picked &= jnp.cumsum(picked, axis=1) <= max_predictions(tokens.shape[1], rate)
  how = jax.random.uniform(how_rng, tokens.shape)
  random_tokens = jax.random.randint(rand_rng, tokens.shape, 0, vocab_size)
  out = jnp.where(picked & (how < 0.8), mask_id, tokens)
  out = jnp.where(picked & (how >= 0.8) & (how < 0.9), random_tokens, out)
  return out, picked


def region_kl(logits, probs, weights):
  """Mean over the weighted regions of KL(probs || softmax(logits)) (MMF's masked-region loss against the
  detector's class distribution); a region whose distribution is all zero (no target) is left out."""
  return _weighted_mean(region_kl_per_region(logits, probs), weights * _has_distribution(probs))


def region_kl_per_region(logits, probs):
  """KL(probs || softmax(logits)) of each region [..., classes] -> [...], float32 (0 for an all-zero `probs`)."""
  probs = probs.astype(jnp.float32)
  log_p = jnp.log(jnp.where(probs > 0, probs, 1.0))  # 0 * log 0 = 0
  return jnp.sum(probs * (log_p - jax.nn.log_softmax(logits.astype(jnp.float32), -1)), -1)


def _has_distribution(probs):
  return jnp.sum(probs.astype(jnp.float32), -1) > 0


def _weighted_mean(values, weights):
  return jnp.sum(values * weights) / jnp.maximum(weights.sum(), 1.0)


def _token_nll(logits, targets):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]


class Method:
  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int, answer_vocab=None):
    if config.task not in TASKS:
      raise ValueError(f"Unknown vlbert task {config.task!r}; known: {TASKS}")
    if config.task == "classify" and config.loss not in LOSSES:
      raise ValueError(f"Unknown vlbert loss {config.loss!r}; known: {LOSSES}")
    self.config = config
    self.task = config.task
    if config.get("bert_config"):
      # The architecture from the config, no weights: they come from this run's checkpoint or its pretrained_run.
      if int(config.get("bert_layers", 0)):
        raise ValueError("method.bert_layers cuts a loaded BERT; with method.bert_config set it to the layers wanted.")
      self.bert_config = bert_config_from_dict(dict(config.bert_config), "method.bert_config")
      self._bert, self._mlm_head = None, None
      folder = bert_lib.resolve_path(config.bert_path)
      if not os.path.exists(os.path.join(folder, "vocab.txt")):
        raise FileNotFoundError(f"method.bert_path {folder!r} has no vocab.txt (the WordPiece vocabulary).")
    else:
      self.bert_config, self._bert, self._mlm_head, folder = bert_lib.load_pretrained(config.bert_path)
      # The checkpoint's first n layers (small runs); its embeddings, pooler and MLM head as they are.
      self.bert_config, self._bert = bert_lib.first_layers(
        self.bert_config, self._bert, int(config.get("bert_layers", 0)), folder
      )
    # Dropout while training (BERT's and MMF's 0.1; < 0: the checkpoint's config.json), in every stream.
    self.bert_config = bert_lib.with_dropout(self.bert_config, config.get("bert_dropout", -1.0))
    if config.arch == "vilbert" and self._bert is not None:  # ViLBERT pools its text with its own t_pooler
      self._bert = {k: v for k, v in self._bert.items() if k != "pooler"}
    if vocab_size != self.bert_config.vocab_size:
      raise ValueError(
        f"The tokenizer has {vocab_size} tokens but BERT ({folder}) has {self.bert_config.vocab_size}: set "
        "tokenizer.kind='wordpiece' with the same folder as method.bert_path."
      )
    with open(f"{folder}/vocab.txt", encoding="utf-8") as f:
      vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    self.mask_id, self.cls_id, self.sep_id = vocab["[MASK]"], vocab["[CLS]"], vocab["[SEP]"]
    self.num_labels = int(config.num_labels) if self.task == "classify" else 0
    if self.num_labels == -1:  # VQA: one output per answer of the run's vocabulary
      if not answer_vocab:
        raise ValueError("method.num_labels=-1 takes the answer vocabulary's size, but the run has none (set answers).")
      self.num_labels = len(answer_vocab)
    if self.task == "classify" and self.num_labels <= 0:
      raise ValueError("method.num_labels must be > 0 (or -1: the answer vocabulary) for task='classify'.")
    v = config.visual
    self.from_files = v.mode == "file"  # precomputed region features (vlrep.data.region_files), no extractor
    _check_regions(config, self.from_files)
    self.region_target = config.get("region_target", "classes")
    self.alignment_weight = float(config.get("alignment_weight", 0.0))
    if self.alignment_weight < 0:
      raise ValueError(
        f"method.alignment_weight must be >= 0 (0: no alignment objective), got {self.alignment_weight}."
      )
    self.alignment = self.task == "pretrain" and self.alignment_weight > 0
    self.region_classes = 0
    if self.task == "pretrain" and config.arch == "vilbert":
      self.region_classes = -1 if self.region_target == "feature" else int(config.region_classes)
    self.regions = vl_bert.RegionFeatures(
      backbone=dict(v.backbone), mode=v.mode, roi_size=v.get("roi_size", 7), crop_size=v.get("crop_size", 32)
    )
    self.model = vl_bert.VLBertModel(
      arch=config.arch,
      bert=self.bert_config,
      v_layers=config.v_layers,
      v_hidden=config.v_hidden,
      v_heads=config.v_heads,
      v_intermediate=config.v_intermediate,
      bi_hidden=config.bi_hidden,
      bi_heads=config.bi_heads,
      region_classes=self.region_classes,
      region_dim=self.regions_dim(),
      num_labels=self.num_labels,
      text_pool=config.get("text_pool", "cls"),
      fusion=config.get("fusion", "mul"),
      alignment=self.alignment,
      dtype=jnp.dtype(config.dtype),
      # config.remat's policy (vlrep.methods.method_config adds it to the method's block): no value changes.
      remat=config.get("remat", "none"),
      **region_embedding_knobs(config),
    )
    visual_field = "regions" if self.from_files else "image"
    self.fields = (visual_field, "boxes", "box_mask", "region_labels", "tokens", "type_ids", "pair_mask")
    if self.region_classes > 0 and self.region_target == "distribution":
      self.fields = self.fields + ("region_probs",)
    if self.task == "classify":
      self.fields = self.fields + ("targets",)

  def _check_extractor(self, backbone, source: str) -> None:
    """The regions of a run's extractor need the same ResNet here: `visual.backbone` is what this run builds (and
    saves, so that evaluating or resuming it needs no other run); configs/vlbert.py's extractor=RUN copies it."""
    ours, theirs = runs.resnet_kwargs(self.config.visual.backbone), runs.resnet_kwargs(backbone)
    if ours != theirs:
      raise ValueError(
        f"{source} is a ResNet {theirs} but method.visual.backbone builds {ours}: pass extractor=RUN to "
        "configs/vlbert.py (it copies RUN's architecture) or set --config.method.visual.backbone.* to match."
      )

  def regions_dim(self) -> int:
    if self.config.visual.mode == "file":
      return int(self.config.visual.dim)
    return backbones.from_config(self.config.visual.backbone).num_features

  # -- contract -----------------------------------------------------------------------------------------
  def init(self, rng, batch) -> dict:
    params_rng = rng
    if self.from_files:
      visual = None
      feats, boxes, mask = batch["regions"][:1], batch["boxes"][:1], batch["box_mask"][:1]
    else:
      # The extractor's random init depends on visual.seed alone: every run of a study sees the same regions.
      visual = self.regions.init(
        jax.random.PRNGKey(self.config.visual.seed), batch["image"][:1], batch["boxes"][:1], batch["box_mask"][:1]
      )
      feats, boxes, mask = self.regions.apply(visual, batch["image"][:1], batch["boxes"][:1], batch["box_mask"][:1])
    if "region_probs" in self.fields and batch["region_probs"].shape[-1] != self.region_classes:
      raise ValueError(
        f"The region files' cls_prob has {batch['region_probs'].shape[-1]} classes but method.region_classes is "
        f"{self.region_classes}: set it to the detector's class count."
      )
    t = batch["tokens"].shape[-1]
    params = self.model.init(
      params_rng, jnp.zeros((1, t), jnp.int32), jnp.zeros((1, t), jnp.int32), feats, boxes, mask
    )["params"]
    return {"params": params} if visual is None else {"params": params, "visual": dict(visual)}

  def pretrained_runs(self) -> dict[str, str]:
    """The runs this method starts from (the loop loads each at its best checkpoint): `pretrained_run` (the
    transformer and extractor of a VL pretraining run), else `visual.init_from` (a run whose backbone extracts
    the regions)."""
    if self.config.get("pretrained_run"):
      return {"pretrained_run": self.config.pretrained_run}
    if self.config.visual.get("init_from") and not self.from_files:
      return {"visual.init_from": self.config.visual.init_from}
    return {}

  def pretrained_variables(self, pretrained: dict[str, runs.Run]) -> dict:
    """BERT's weights (and its MLM head when the checkpoint has one; VisualBERT's visual token-type and position
    tables start as copies of BERT's, as VisualBERT's and MMF's code starts them); or, from `pretrained_run`,
    everything that run learned except its task heads, and its region extractor; or the extractor from
    `visual.init_from`'s backbone. `pretrained` holds the runs `pretrained_runs` named, loaded by the loop."""
    if "pretrained_run" not in pretrained and self._bert is None:
      raise ValueError(
        "method.bert_config gives BERT's architecture without weights: this run would start from random weights. "
        "Set method.pretrained_run (e.g. a run written by `python -m vlrep.interop.import_run`), or clear "
        "method.bert_config so that BERT's weights are read from method.bert_path."
      )
    out = {"params": {"bert": self._bert}}
    if self._mlm_head is not None:
      out["params"]["mlm_head"] = self._mlm_head
    if self._bert is not None and region_embedding_knobs(self.config).get("region_type_embedding") == "tables":
      emb = self._bert["embeddings"]
      out["params"]["regions_embed"] = {
        "token_type_embeddings": {"embedding": np.array(emb["token_type_embeddings"]["embedding"])},
        "position_embeddings": {"embedding": np.array(emb["position_embeddings"]["embedding"])},
      }
    if "pretrained_run" in pretrained:
      run = pretrained["pretrained_run"]
      self._check_same_transformer(run)
      out["params"] = {k: v for k, v in run.params.items() if not k.startswith(_TASK_PARAMS)}
      if "visual" in run.model_state and not self.from_files:
        self._check_extractor(run.config.method.visual.backbone, f"{run.path}'s region extractor")
        out["model_state"] = {"visual": run.model_state["visual"]}
      elif not self.from_files:
        raise ValueError(f"{run.path} has no region extractor (a file-features run?); this config extracts regions.")
      logging.info("Transformer and region extractor from %s (step %d).", run.path, run.step)
    elif "visual.init_from" in pretrained:
      run = pretrained["visual.init_from"]
      if run.config.method.get("backbone", {}).get("arch", "resnet") != "resnet":
        raise ValueError(f"visual.init_from: {run.path}'s backbone is not a ResNet; the region extractor is one.")
      _, variables = runs.backbone_of(run)
      self._check_extractor(run.config.method.backbone, f"visual.init_from {run.path}'s backbone")
      visual = {"params": {"backbone": variables["params"]}}
      if "batch_stats" in variables:
        visual["batch_stats"] = {"backbone": variables["batch_stats"]}
      out["model_state"] = {"visual": visual}
      logging.info("Region extractor: the backbone of %s (step %d).", run.path, run.step)
    return out

  def _check_same_transformer(self, run) -> None:
    """A pretrained run's weights compute what they computed there only in the same model: the same
    architecture, the same region embeddings, and (for a run that states its BERT config, as imported runs do)
    the same BERT config, not only the same shapes (heads, activation and LayerNorm eps have none)."""
    theirs_cfg = run.config.method
    if theirs_cfg.get("arch", self.config.arch) != self.config.arch:
      raise ValueError(
        f"method.pretrained_run {run.path} is a {theirs_cfg.arch} run; this config builds {self.config.arch}."
      )
    ours, theirs = region_embedding_knobs(self.config), region_embedding_knobs(theirs_cfg)
    differ = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    if differ:
      flags = " ".join(f"--config.method.{k}={theirs[k]}" for k in differ)
      raise ValueError(
        f"method.pretrained_run {run.path} was built with other region embeddings: "
        + ", ".join(f"{k}={t!r} there, {o!r} here" for k, (o, t) in differ.items())
        + f". Build the same model: {flags}"
      )
    if theirs_cfg.get("bert_config"):
      want = bert_config_from_dict(dict(theirs_cfg.bert_config), f"{run.path}'s method.bert_config")
      differ = [
        f"{k}={getattr(want, k)!r} there, {getattr(self.bert_config, k)!r} here"
        for k in BERT_ARCHITECTURE
        if getattr(want, k) != getattr(self.bert_config, k)
      ]
      if differ:
        raise ValueError(
          f"method.pretrained_run {run.path}'s BERT differs from this config's (bert_path "
          f"{self.config.bert_path!r}, bert_layers={self.config.get('bert_layers', 0)}): {'; '.join(differ)}. Pass a "
          "BERT folder of the same "
          "architecture (bert=PATH) or set method.bert_config to the pretrained run's."
        )

  def loss(self, variables, batch, rng, train: bool = True):
    return methods.loss_of_parts(self, variables, batch, rng, train)

  def prepare(self, batch, rng):
    """The draws over the whole batch, before it is split (pretraining; fine-tuning draws only dropout): BERT's
    token masks (`masked_tokens`, `picked` [B, Q, T]); with alignment, each pair's coin (`swapped` [B, Q]) and
    the batch's other image each text may meet (`other_*`: the visual inputs rolled by one, so that a pair's
    regions stay a per-example computation); ViLBERT's masked regions (`region_picked`, `region_zeroed`
    [B, Q, R])."""
    if self.task != "pretrain":
      return batch
    mask_rng, region_rng = jax.random.split(rng)
    tokens, _, pair_mask = self._flatten_pairs(batch)
    b, q = batch["tokens"].shape[:2]
    rep = lambda x: jnp.repeat(x, q, axis=0)  # one copy of the image's regions per text
    per_pair = lambda x: x.reshape(b, q, *x.shape[1:])
    special = (tokens == 0) | (tokens == self.cls_id) | (tokens == self.sep_id) | ~pair_mask[:, None]
    inputs, picked = bert_mask(
      mask_rng, tokens, special, self.config.mask_rate, self.bert_config.vocab_size, self.mask_id
    )
    region_mask = self._region_mask(batch)
    r_mask = rep(region_mask)
    aligned = pair_mask
    out = dict(batch)
    if self.alignment:
      if b < 2:
        raise ValueError("method.alignment_weight > 0 pairs texts with other images of the batch: it needs >= 2.")
      # Folded in (as dropout's rng) so that the token and region masks stay those of a run without alignment.
      swap = jax.random.uniform(jax.random.fold_in(rng, 2), pair_mask.shape) < 0.5
      for key in self._visual_inputs():  # each text meets the batch's next image
        out[f"other_{key}"] = jnp.roll(batch[key], 1, axis=0)
      r_mask = jnp.where(swap[:, None], rep(jnp.roll(region_mask, 1, axis=0)), r_mask)
      aligned = pair_mask & ~swap
      picked = picked & aligned[:, None]
      out["swapped"] = per_pair(swap)
    out.update(masked_tokens=per_pair(inputs), picked=per_pair(picked))
    if self.region_classes:
      pick_rng, zero_rng = jax.random.split(region_rng)
      region_picked = (jax.random.uniform(pick_rng, r_mask.shape) < self.config.region_mask_rate) & r_mask
      region_picked &= aligned[:, None]
      zeroed = region_picked & (jax.random.uniform(zero_rng, r_mask.shape) < 0.9)
      out.update(region_picked=per_pair(region_picked), region_zeroed=per_pair(zeroed))
    return out

  def per_example(self, variables, batch, rng, train: bool = True):
    """Per (image, text) pair, shaped [B, Q, ...]: pretraining's negative log-likelihood of each masked-token slot
    (`mlm_nll` [B, Q, K], `_mlm_at_picked`'s slots) and whether it is the top prediction (`mlm_correct`), each
    region's loss (`region_loss` [B, Q, R]: KL, cross-entropy or squared error), the alignment head's (`alignment_nll`,
    `alignment_right`); fine-tuning's task loss and top answer's score (`task_loss`, `task_score`)."""
    # Folded in, not split off, so the token and region masks (from split(rng)) do not depend on dropout.
    dropout = {"deterministic": not train, "rngs": {"dropout": jax.random.fold_in(rng, 1)}}
    feats, boxes, region_mask = self._regions(variables, batch)
    tokens, type_ids, pair_mask = self._flatten_pairs(batch)
    b, q = batch["tokens"].shape[:2]
    rep = lambda x: jnp.repeat(x, q, axis=0)  # one copy of the image's regions per text
    pairs = lambda x: x.reshape(b * q, *x.shape[2:])
    per_pair = lambda x: x.reshape(b, q, *x.shape[1:])
    params = variables["params"]
    if self.task != "pretrain":
      logits = self.classify(variables, batch, feats=(feats, boxes, region_mask), **dropout)
      targets = batch["targets"].reshape(-1, self.num_labels).astype(jnp.float32)
      if self.config.loss == "bce":  # MMF's logit BCE: summed over labels, averaged over pairs
        per = jnp.sum(jnp.maximum(logits, 0) - logits * targets + jnp.log1p(jnp.exp(-jnp.abs(logits))), axis=-1)
      else:
        per = -jnp.sum(targets * jax.nn.log_softmax(logits, -1), -1)
      # Score of the top answer under the targets: VQA accuracy for soft scores, accuracy for one-hot.
      top = jnp.take_along_axis(targets, jnp.argmax(logits, -1)[:, None], -1)[:, 0]
      return {"task_loss": per_pair(per), "task_score": per_pair(top)}, {}
    r_feats, r_boxes, r_mask = rep(feats), rep(boxes), rep(region_mask)
    if self.alignment:
      swap = pairs(batch["swapped"])
      o_feats, o_boxes, o_mask = self._regions(variables, batch, "other_")
      pick = lambda mine, theirs: jnp.where(swap.reshape(swap.shape + (1,) * (mine.ndim - 1)), theirs, mine)
      r_feats, r_boxes, r_mask = pick(r_feats, rep(o_feats)), pick(r_boxes, rep(o_boxes)), pick(r_mask, rep(o_mask))
    r_input = r_feats
    if self.region_classes:
      r_input = jnp.where(pairs(batch["region_zeroed"])[..., None], 0.0, r_feats)
    t_states, v_states, pooled, _ = self.model.apply(
      {"params": params}, pairs(batch["masked_tokens"]), type_ids, r_input, r_boxes, r_mask,
      method=vl_bert.VLBertModel.encode, **dropout,
    )  # fmt: skip
    logits, targets, _ = self._mlm_at_picked(params, t_states, tokens, pairs(batch["picked"]))
    outputs = {
      "mlm_nll": per_pair(_token_nll(logits, targets)),
      "mlm_correct": per_pair((jnp.argmax(logits, -1) == targets).astype(jnp.float32)),
    }
    if self.region_classes:
      out = self.model.apply({"params": params}, v_states[:, 1:], method=vl_bert.VLBertModel.region_outputs)
      if self.region_target == "distribution":  # KL(detector's distribution || predicted), MMF's MMM
        region_loss = region_kl_per_region(out, rep(batch["region_probs"]))
      elif self.region_target == "classes":  # cross-entropy to the box's class (one-hot: ground-truth labels)
        labels = rep(batch["region_labels"])
        region_loss = _token_nll(out, jnp.where((labels >= 0) & (labels < self.region_classes), labels, 0))
      else:  # the region's feature
        region_loss = jnp.mean((out - r_feats) ** 2, -1)
      outputs["region_loss"] = per_pair(region_loss)
    if self.alignment:
      a_logits = self.model.apply({"params": params}, pooled, method=vl_bert.VLBertModel.alignment_logits)
      outputs["alignment_nll"] = per_pair(_token_nll(a_logits, (~swap).astype(jnp.int32)))
      outputs["alignment_right"] = per_pair(((jnp.argmax(a_logits, -1) == 1) == ~swap).astype(jnp.float32))
    return outputs, {}

  def combine(self, variables, outputs, batch):
    """The losses and metrics over the whole batch: means over its scored tokens, regions and pairs, with weights
    from the (prepared) batch alone, so linear in the outputs."""
    del variables
    _, _, pair_mask = self._flatten_pairs(batch)
    b, q = batch["tokens"].shape[:2]
    rep = lambda x: jnp.repeat(x, q, axis=0)
    pairs = lambda x: x.reshape(b * q, *x.shape[2:])
    metrics = {"pairs": jnp.sum(pair_mask).astype(jnp.float32)}
    pw = pair_mask.astype(jnp.float32)
    if self.task != "pretrain":
      loss = _weighted_mean(pairs(outputs["task_loss"]), pw)
      metrics.update(task_loss=loss, train_score=_weighted_mean(pairs(outputs["task_score"]), pw))
      return loss, metrics, {}
    _, w = self._slots(pairs(batch["picked"]))
    mlm = _weighted_mean(pairs(outputs["mlm_nll"]), w)
    metrics.update(mlm_loss=mlm, mlm_accuracy=_weighted_mean(pairs(outputs["mlm_correct"]), w), masked_tokens=w.sum())
    loss = mlm
    if self.region_classes:
      region_picked = pairs(batch["region_picked"])
      rw = region_picked.astype(jnp.float32)
      if self.region_target == "distribution":
        rw = rw * _has_distribution(rep(batch["region_probs"]))  # regions without a distribution: not scored or counted
      elif self.region_target == "classes":
        labels = rep(batch["region_labels"])
        # A label the head has no class for is left out of the loss and counted (check method.region_classes).
        metrics["region_labels_out_of_range"] = jnp.sum(region_picked & (labels >= self.region_classes)).astype(
          jnp.float32
        )
        rw = rw * ((labels >= 0) & (labels < self.region_classes))
      region_loss = _weighted_mean(pairs(outputs["region_loss"]), rw)
      metrics.update(region_loss=region_loss, masked_regions=rw.sum())
      loss = loss + self.config.region_weight * region_loss
    if self.alignment:
      a_loss = _weighted_mean(pairs(outputs["alignment_nll"]), pw)
      metrics.update(alignment_loss=a_loss, alignment_accuracy=_weighted_mean(pairs(outputs["alignment_right"]), pw))
      loss = loss + self.alignment_weight * a_loss
    return loss, metrics, {}

  def classify(self, variables, batch, feats=None, deterministic: bool = True, rngs=None) -> jax.Array:
    """Task logits float32[B * Q, num_labels] for every (image, text) pair of the batch; deterministic=False
    (training) applies dropout with rngs['dropout']."""
    feats, boxes, region_mask = feats if feats is not None else self._regions(variables, batch)
    tokens, type_ids, _ = self._flatten_pairs(batch)
    q = batch["tokens"].shape[1]
    rep = lambda x: jnp.repeat(x, q, axis=0)
    params = variables["params"]
    if self.config.freeze_base:
      params = {k: (v if k.startswith("task_head") else jax.lax.stop_gradient(v)) for k, v in params.items()}
    dropout = {"deterministic": deterministic, "rngs": rngs or {}}
    _, _, pooled, _ = self.model.apply(
      {"params": params}, tokens, type_ids, rep(feats), rep(boxes), rep(region_mask),
      method=vl_bert.VLBertModel.encode, **dropout,
    )  # fmt: skip
    return self.model.apply({"params": params}, pooled, method=vl_bert.VLBertModel.task_logits, **dropout)

  def mlm_predictions(self, variables, batch, rng):
    """(masked-token predictions, targets, picked) for evaluation of the pretraining objective."""
    feats, boxes, region_mask = self._regions(variables, batch)
    tokens, type_ids, pair_mask = self._flatten_pairs(batch)
    q = batch["tokens"].shape[1]
    rep = lambda x: jnp.repeat(x, q, axis=0)
    special = (tokens == 0) | (tokens == self.cls_id) | (tokens == self.sep_id) | ~pair_mask[:, None]
    inputs, picked = bert_mask(rng, tokens, special, self.config.mask_rate, self.bert_config.vocab_size, self.mask_id)
    params = variables["params"]
    t_states, _, _, _ = self.model.apply(
      {"params": params}, inputs, type_ids, rep(feats), rep(boxes), rep(region_mask), method=vl_bert.VLBertModel.encode
    )
    logits, targets, w = self._mlm_at_picked(params, t_states, tokens, picked)
    return jnp.argmax(logits, -1), targets, w > 0

  def features(self, variables, images) -> dict:
    """The frozen region extractor's backbone on whole images ('pre_logits', 'grid'), for backbone evaluators."""
    if self.from_files:
      raise ValueError("This run reads region features from files: it has no backbone for image evaluators.")
    v = variables["visual"]
    net_vars = {"params": v["params"]["backbone"]}
    if "batch_stats" in v:
      net_vars["batch_stats"] = v["batch_stats"]["backbone"]
    grid, aux = backbones.from_config(self.config.visual.backbone).apply(net_vars, images, train=False)
    return {"pre_logits": aux["pre_logits"], "grid": grid.astype(jnp.float32)}

  # -- helpers ------------------------------------------------------------------------------------------
  def _visual_inputs(self) -> tuple[str, ...]:
    """The batch fields the regions come from."""
    return ("regions" if self.from_files else "image", "boxes", "box_mask")

  def _regions(self, variables, batch, prefix: str = ""):
    """(features float32 [B, R, D], boxes, mask [B, R]) of the batch's images (of the `other_` images with that
    `prefix`)."""
    image_or_regions, boxes, mask = (batch[prefix + k] for k in self._visual_inputs())
    if self.from_files:
      return image_or_regions.astype(jnp.float32), boxes, mask
    feats, boxes, mask = self.regions.apply(variables["visual"], image_or_regions, boxes, mask)
    return jax.lax.stop_gradient(feats).astype(jnp.float32), boxes, mask

  def _region_mask(self, batch):
    """The mask [B, R] `_regions` gives, without extracting: the boxes', or every cell of a grid extractor's."""
    if self.from_files or self.regions.mode != "grid":
      return batch["box_mask"]
    extract = lambda *x: self.regions.init_with_output(jax.random.PRNGKey(0), *x)[0][2]
    shape = jax.eval_shape(extract, batch["image"], batch["boxes"], batch["box_mask"]).shape
    return jnp.ones(shape, bool)

  def _mlm_at_picked(self, params, t_states, tokens, picked):
    """MLM logits at the picked positions only (the vocabulary projection dominates the cost otherwise):
    -> (logits [B, K, V], target ids [B, K], weights [B, K] (0 for unused slots))."""
    order, w = self._slots(picked)
    states = jnp.take_along_axis(t_states, order[..., None], axis=1)
    logits = self.model.apply({"params": params}, states, method=vl_bert.VLBertModel.mlm_logits)
    targets = jnp.take_along_axis(tokens, order, axis=1)
    return logits, targets, w

  def _slots(self, picked):
    """The K scored slots of each sequence [N, T]: (positions [N, K]: the picked tokens first, in order, then the
    others; weights [N, K] float32: 1 at a picked token)."""
    k = max_predictions(picked.shape[1], self.config.mask_rate)
    order = jnp.argsort(~picked, axis=1, stable=True)[:, :k]
    return order, jnp.take_along_axis(picked, order, axis=1).astype(jnp.float32)

  @staticmethod
  def _flatten_pairs(batch):
    tokens = batch["tokens"]
    b, q, t = tokens.shape
    return tokens.reshape(b * q, t), batch["type_ids"].reshape(b * q, t), batch["pair_mask"].reshape(b * q)


def _check_regions(config, from_files: bool) -> None:
  """Refuse region inputs that would train silently wrong: a random frozen extractor (the study's regions come
  from a trained detector), grid cells scored against box labels, a distribution target without region files."""
  v, target = config.visual, config.get("region_target", "classes")
  if target not in REGION_TARGETS:
    raise ValueError(f"Unknown method.region_target {target!r}; known: {REGION_TARGETS}")
  if not from_files and not (v.get("init_from") or config.get("pretrained_run") or v.get("allow_random_init")):
    raise ValueError(
      "The region extractor would be a randomly initialised, frozen ResNet (the study's regions come from a trained "
      "detector): pass regions=DIR (detector features, `python -m vlrep.tools.convert_regions`) or "
      "--config.method.visual.init_from=RUN (a vlrep run whose backbone extracts the regions); "
      "method.visual.allow_random_init=True only for a deliberate random-feature baseline."
    )
  vilbert_pretrain = config.arch == "vilbert" and config.task == "pretrain"
  if vilbert_pretrain and v.mode == "grid" and target != "feature":
    raise ValueError(
      f"visual.mode='grid' regions are backbone cells, which have no class labels, so method.region_target="
      f"{target!r} would score cells against unrelated boxes' classes: set method.region_target='feature', or use "
      "boxes (visual.mode='roi_align' / 'crops') or region files (regions=DIR)."
    )
  if vilbert_pretrain and target == "distribution" and not from_files:
    raise ValueError(
      "method.region_target='distribution' is the detector's class distribution from region files (regions=DIR); "
      "with boxes from the dataset use 'classes'."
    )


def setup(config, builder, tokenizer) -> dict:
  """A VQA run's answer vocabulary (the most frequent answers of the training questions, rebuilt from the data)."""
  return {"answer_vocab": vl_ops.answer_vocab(config.answers, builder)} if config.get("answers") else {}
