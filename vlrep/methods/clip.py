"""CLIP (Radford et al., 2021) and SigLIP (Zhai et al., ICCV 2023): contrastive image-text pretraining.

`loss='softmax'` (CLIP): the symmetric cross-entropy of the global batch's cosine similarities times the learned
scale exp(logit_scale), initialised at 1 / 0.07 and clipped at 100 (`_contrastive.clip_loss`, the InfoNCE LocTex's
L_C uses too). `loss='sigmoid'` (SigLIP): -1/B sum_ij log sigmoid(z_ij (t x_i.y_j + b)) with t = exp(t'), t' and b
learned, initialised at log 10 and -10 (`_contrastive.sigmoid_loss_chunked`: block by block, the texts passed
between the devices of the `data` axis when the step is traced under a mesh; `loss_chunks` blocks otherwise).

`text_tower`: 'scratch' (a causal transformer, CLIP's layout) or 'bert' (the pretrained BERT in `bert_path`,
'minilm' = the packaged MiniLM; the tokenizer must be its WordPiece vocabulary), as MCT's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from vlrep import methods
from vlrep.methods import _contrastive
from vlrep.models import bert as bert_lib
from vlrep.models.clip import LOSSES, CLIPModel


class Method:
  """CLIP / SigLIP behind vlrep's method contract (init / loss / features), plus `embed` for the retrieval and
  zero-shot evaluators."""

  fields = ("image", "tokens")

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int):
    self.config = config
    self.loss_name = config.get("loss", "softmax")
    if self.loss_name not in LOSSES:
      raise ValueError(f"Unknown method.loss {self.loss_name!r}; known: {LOSSES}")
    self.loss_chunks = int(config.get("loss_chunks", 1))
    text_tower = config.get("text_tower", "scratch")
    self._bert, bert_config = None, None
    if text_tower == "bert":
      bert_config, self._bert, _, folder = bert_lib.load_pretrained(config.get("bert_path", ""))
      bert_config, self._bert = bert_lib.first_layers(
        bert_config, self._bert, int(config.get("bert_layers", 0)), folder
      )
      bert_config = bert_lib.with_dropout(bert_config, config.get("bert_dropout", -1.0))
      if vocab_size != bert_config.vocab_size:
        raise ValueError(
          f"The tokenizer has {vocab_size} tokens but BERT ({folder}) has {bert_config.vocab_size}: set "
          "tokenizer.kind='wordpiece' with the same folder as method.bert_path."
        )
    elif text_tower != "scratch":
      raise ValueError(f"Unknown method.text_tower {text_tower!r}; expected 'scratch' or 'bert'.")
    self.model = CLIPModel(
      vocab_size=vocab_size,
      backbone=dict(config.backbone),
      text=dict(config.text),
      bert=bert_config,
      embed_dim=config.embed_dim,
      pool=config.get("pool", "avg"),
      loss=self.loss_name,
      image_projection=config.get("image_projection", True),
      text_projection_bias=config.get("text_projection_bias", False),
      dtype=jnp.dtype(config.dtype),
      remat=config.get("remat", "none"),  # config.remat, copied in by methods.method_config
    )

  # -- contract -----------------------------------------------------------------------------------------
  def init(self, rng, batch) -> dict:
    params_rng, dropout_rng = jax.random.split(rng)
    return self.model.init({"params": params_rng, "dropout": dropout_rng}, batch["image"], batch["tokens"], False)

  def pretrained_variables(self, pretrained: dict) -> dict:
    """With text_tower='bert': BERT's weights for the text tower."""
    del pretrained
    return {} if self._bert is None else {"params": {"textual": self._bert}}

  def loss(self, variables, batch, rng, train: bool = True):
    return methods.loss_of_parts(self, variables, batch, rng, train)

  def per_example(self, variables, batch, rng, train: bool = True):
    """The l2-normalised image and caption embeddings (the towers see one example at a time, BatchNorm groups
    aside)."""
    out, new_state = self.model.apply(
      variables, batch["image"], batch["tokens"], train, rngs={"dropout": rng}, mutable=["batch_stats"]
    )
    return {"image": _contrastive.l2_normalize(out["image"]), "text": _contrastive.l2_normalize(out["text"])}, new_state

  def combine(self, variables, outputs, batch):
    """The loss over the global batch's embeddings, every other pair a negative, at the learned scale (and bias)."""
    del batch
    img, txt = outputs["image"], outputs["text"]
    learned = self.model.apply(variables, method=CLIPModel.temperature)
    if self.loss_name == "softmax":
      loss = _contrastive.clip_loss(img, txt, learned["logit_scale"])
      scale = _contrastive.clipped_logit_scale(learned["logit_scale"])
      metrics = {"clip_loss": loss, "logit_scale": scale, "temperature": 1.0 / scale}
    else:
      t = jnp.exp(learned["t_prime"].astype(jnp.float32))
      loss = _contrastive.sigmoid_loss_chunked(img, txt, t, learned["logit_bias"], self.loss_chunks)
      metrics = {"sigmoid_loss": loss, "t": t, "b": learned["logit_bias"]}
    # Mean cosine similarity of the matching pairs and of all other pairs, from sums (no B x B matrix): both
    # near 1 is a collapse to one point.
    b = img.shape[0]
    positive = jnp.sum(img * txt)
    metrics["positive_similarity"] = positive / b
    metrics["negative_similarity"] = (jnp.sum(img, 0) @ jnp.sum(txt, 0) - positive) / max(b * (b - 1), 1)
    return loss, metrics, {}

  def features(self, variables, images) -> dict:
    """Frozen-backbone features for evaluators: pooled 'pre_logits' and the final 'grid'."""
    grid, aux = self.model.apply(variables, images, False, method=CLIPModel.encode_image)
    return {"pre_logits": aux["pre_logits"], "grid": grid.astype(jnp.float32)}

  def embed(self, variables, images=None, tokens=None) -> dict:
    """l2-normalised embeddings of images and/or captions in the space the loss compares them."""
    out = {}
    if images is not None:
      out["image"] = _contrastive.l2_normalize(self.model.apply(variables, images, method=CLIPModel.embed_images))
    if tokens is not None:
      out["text"] = _contrastive.l2_normalize(self.model.apply(variables, tokens, method=CLIPModel.embed_texts))
    return out
