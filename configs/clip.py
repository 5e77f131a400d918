r"""CLIP (Radford et al., 2021) and SigLIP (Zhai et al., ICCV 2023): contrastive image-text pretraining of a ResNet.

Paper recipe: CLIP's ResNet-50 settings where they apply to COCO Captions train2017 (prepared with
`python -m vlrep.data.prepare --dataset=coco_captions2017`; probe on VOC07); the deviations are tabled in
docs/methods/clip.md:
  python -m vlrep.main --config=configs/clip.py --workdir=gs://BUCKET/clip_r50
  python -m vlrep.main --config=configs/clip.py:loss=sigmoid --workdir=gs://BUCKET/siglip_r50

On the embedded synthetic_scenes dataset, sized like configs/virtex.py:runlocal (a 2-core CPU, a few minutes):
  python -m vlrep.main --config=configs/clip.py:runlocal --workdir=/tmp/clip_local

Variants (arguments combine with commas; any key can also be overridden with --config.KEY=VALUE):
  loss=softmax|sigmoid   CLIP's symmetric cross-entropy over the global batch (learned temperature, init 0.07,
                         scale clipped at 100) or SigLIP's per-pair sigmoid loss (learned t' and b, init log 10
                         and -10), computed block by block over the devices (vlrep/methods/_contrastive.py)
  pool=avg|attention     the image embedding: the ResNet's global average pool and a linear projection, or
                         CLIP's attention pooling over the final grid
  backbone=r50|vit_b16|vit_local|...
                         the image tower: vlrep's ResNet-50, or a ViT (big_vision's vit_<variant><patch>;
                         vit_local is runlocal's, configs/common.py) as CLIP's ViTs: class-token pooling, a
                         LayerNorm before the encoder (ln_pre), QuickGELU, LayerNorm eps 1e-5, no patch bias.
                         vit_b16 is CLIP's ViT-B/16 recipe: its table 20's AdamW beta2 0.98, eps 1e-6, embedding
                         512 (docs/recipe_deviations.md)
  text=scratch|bert      the text tower: a causal transformer trained from scratch (CLIP's layout) or a
                         pretrained BERT fine-tuned (needs bert=PATH; runlocal: the packaged MiniLM)
  bert=PATH              with text=bert: a local Hugging Face BERT folder ('minilm' = the packaged MiniLM-L6-H384);
                         its WordPiece vocabulary becomes the tokenizer
  bert_layers=N          with text=bert: keep the checkpoint's first N layers (runlocal: 2)
  steps=N                training steps instead of the recipe's epochs
  lr=X                   peak learning rate (0: the default: 5e-4, runlocal 3e-3)
  backbone_lr=X          the image backbone's own peak learning rate (0: lr=; runlocal with a ViT:
                         common.LOCAL_VIT_LR)
  data=DIR  val=P        your own image_text dataset prepared in DIR (docs/data.md, "Your own data"); its first
                         P% (default 5) held out for the retrieval evaluator
"""

from ml_collections import ConfigDict

from vlrep.config_utils import OWN_DATA_VAL_PERCENT, config_module, parse_arg, use_own_data

common = config_module(__file__, "common.py")  # the blocks every recipe shares

LOSSES = ("softmax", "sigmoid")
POOLS = ("avg", "attention")
# No weight decay on gains, biases and the loss's learned temperature and bias (CLIP: "decoupled weight decay
# regularization applied to all weights that are not gains or biases").
NO_DECAY = r"(^|/)(bias|scale|logit_scale|t_prime|logit_bias)$"
RESNETS = ("r50",)
# CLIP's ViTs (OpenAI's VisionTransformer): the class token's final state, after ln_post, is the image embedding's
# input; ln_pre normalises the embedded patches; QuickGELU MLPs; LayerNorm eps 1e-5; a patch embedding without bias.
CLIP_VIT = dict(pool_type="tok", pre_norm=True, mlp_act="quick_gelu", ln_eps=1e-5, patch_bias=False)
# Embedding widths (CLIP's table 20): ViT-B/16's and B/32's 512, ViT-L/14's 768; a ViT not listed keeps its width.
VIT_EMBED_DIMS = {"vit_b16": 512, "vit_b32": 512, "vit_l14": 768}


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    loss="softmax",
    pool="avg",
    text="scratch",
    bert="",
    bert_layers=-1,
    backbone="r50",
    steps=0,
    lr=0.0,
    backbone_lr=0.0,
    data="",
    val=0.0,
  )
  if arg.loss not in LOSSES:
    raise ValueError(f"Unknown loss={arg.loss!r}; known: {LOSSES}")
  if arg.pool not in POOLS:
    raise ValueError(f"Unknown pool={arg.pool!r}; known: {POOLS}")
  if arg.text not in ("scratch", "bert"):
    raise ValueError(f"Unknown text={arg.text!r}; expected 'scratch' or 'bert'.")
  common.backbone_choice(arg.backbone, RESNETS)
  vit = common.is_vit(arg.backbone)
  if vit and arg.pool == "attention":
    raise ValueError(
      "pool=attention is CLIP's ResNet attention pooling over the final grid; CLIP's ViTs pool with their class "
      "token (the recipe's pool=avg with a ViT)."
    )
  bert = arg.bert or ("minilm" if arg.runlocal else "")  # '' fails at load time, naming the files it needs

  c = ConfigDict()
  common.run_defaults(c)
  c.method = dict(
    name="clip",
    loss=arg.loss,
    # sigmoid: the B x B similarities in this many blocks when the step is traced without a mesh (with one, a
    # block per device of the data axis); 1 = at once.
    loss_chunks=1,
    pool=arg.pool,
    embed_dim=VIT_EMBED_DIMS.get(arg.backbone, 512) if vit else 1024,  # CLIP ResNet-50's 1024
    # vlrep's ResNet-50; CLIP does not say how its BatchNorm statistics are shared: synchronised over the batch.
    backbone=common.vit_backbone(arg.backbone, **CLIP_VIT) if vit else dict(depth=50, width=64, bn_group_size=0),
    text_tower=arg.text,
    # CLIP's text transformer for ResNet-50 and ViT-B: 512 wide, 12 layers, 8 heads, no dropout.
    text=dict(hidden=512, num_layers=12, num_heads=8, max_len=40, dropout=0.0),
    bert_path=bert,
    bert_layers=0,
    bert_dropout=0.1,  # text=bert: BERT fine-tuning's dropout while training
    dtype="bfloat16",
  )
  # CLIP's only augmentation is a random square crop of the resized image; open_clip's reproduction crops 90-100%
  # of the area (RandomResizedCrop(scale=(0.9, 1.0))). One of the image's captions per visit.
  c.data = common.train_data(
    "coco_captions2017",
    "decode|inception_crop(224, area=(0.9, 1.0))|normalize|choose_caption(5)|tokenize(40)",
  )
  c.tokenizer = common.bpe_tokenizer("captions")

  c.batch_size = 4096  # CLIP's 32768 is a quarter of COCO's 118K images; see docs/methods/clip.md
  c.update(common.duration(steps=arg.steps, epochs=0.0 if arg.steps else 200.0))
  # CLIP's hyperparameters (its table 19): AdamW, decoupled weight decay 0.2, beta2 0.999 and eps 1e-8 for ResNets
  # (0.98 and 1e-6 for ViTs), peak LR 5e-4 (RN50 and ViT-B/16), cosine decay; warmup 10 epochs of COCO.
  lr_groups = ((".*", arg.lr or 5e-4),)
  if arg.text == "bert":
    # A pretrained BERT is fine-tuned at BERT's fine-tuning rate, the fresh towers and heads at CLIP's.
    lr_groups = (("^textual/", 5e-5), *lr_groups)
  if arg.backbone_lr:
    lr_groups = (("^backbone/", arg.backbone_lr), *lr_groups)
  c.optim = common.optim(
    lr_groups,
    name="adamw",
    weight_decay=0.2,
    b1=0.9,
    b2=0.98 if vit else 0.999,
    eps=1e-6 if vit else 1e-8,
    warmup_epochs=10.0,
    # CLIP's ViT: no decay on the class token and position embeddings either (gains and biases in its wording).
    no_decay=NO_DECAY.replace("logit_bias", "logit_bias|cls|pos_embedding") if vit else NO_DECAY,
  )

  c.evals = dict(
    probe=common.probe_eval(),
    # COCO 1K retrieval with the run's own towers.
    retrieval=common.retrieval_eval(every_steps=0),
  )
  common.select_by_probe(c)  # neither paper selects checkpoints: the other recipes' rule
  if arg.runlocal:
    _runlocal(c, arg)
  if arg.text == "bert":
    # The pretrained BERT's own WordPiece vocabulary ([CLS] ... [SEP], [PAD] = 0) replaces the BPE tokenizer.
    c.tokenizer = dict(kind="wordpiece", path=bert)
    if arg.bert_layers >= 0:
      c.method.bert_layers = arg.bert_layers
    elif arg.runlocal:
      c.method.bert_layers = 2  # MiniLM's first 2 of 6 layers, the size of runlocal's scratch tower
  if arg.data:
    needs = {"captions": "CLIP's contrastive loss"}
    image_size = 64 if arg.runlocal else 224
    use_own_data(c, arg.data, arg.val or OWN_DATA_VAL_PERCENT, needs, ("retrieval",), image_size=image_size)
  return c


def _runlocal(c, arg):
  """synthetic_scenes at 64x64 on configs/virtex.py:runlocal's budget and backbone, so the two compare.

  As VirTex's runlocal: 550 steps of 64, ResNet-10 w16 with the small stem, flips only (crops cut named objects
  out of the image), a 256-piece vocabulary, captions of up to 40 tokens, AdamW with 25 warmup steps. The text
  tower is 128 wide, 2 layers and 2 heads; the embedding 128-d. The LR was chosen on probe_val
  (docs/methods/clip.md); weight decay stays CLIP's 0.2.

  backbone=vit_local (configs/common.py: patch 8 at 64 px, 128 wide, 4 blocks; the ViT-Ti/8 is 4x slower a step
  on 2 cores) with CLIP's ViT layout (CLIP_VIT) and AdamW's ViT betas. The ViT trains at common.LOCAL_VIT_LR
  (VirTex runlocal's ViT backbone LR; not chosen for CLIP), the rest at the LR below. At these settings CLIP on the
  ViT collapses (docs/results/clip.md).
  """
  c.data.update(common.synthetic_scenes("name"))
  c.data.pp = "decode|flip_lr_swap_words|normalize|choose_caption(5)|tokenize(40)"
  c.method.update(dtype="float32", embed_dim=128, bert_dropout=0.0)
  if common.is_vit(arg.backbone):
    c.method.backbone = common.vit_backbone(arg.backbone, **CLIP_VIT)
  else:
    c.method.backbone = dict(depth=10, width=16, bn_group_size=32, stem="small", stem_stride=2)
  c.method.text = dict(hidden=128, num_layers=2, num_heads=2, max_len=40, dropout=0.0)
  c.tokenizer.vocab_size = 256
  c.batch_size = 64
  c.total_steps = arg.steps or 550
  c.total_epochs = 0.0
  c.optim.update(warmup_epochs=0.0, warmup_steps=25)
  lr = arg.lr or 3e-3
  # text=bert (not tuned): the pretrained tower at a tenth of the rest's LR, a shorter run's stand-in for 5e-5.
  c.optim.lr_groups = (("^textual/", lr / 10 if arg.text == "bert" else lr), (".*", lr))
  if arg.backbone_lr or common.is_vit(arg.backbone):
    c.optim.lr_groups = (("^backbone/", arg.backbone_lr or common.LOCAL_VIT_LR), *c.optim.lr_groups)
  c.checkpoint.every_steps = 200
  c.log_every_steps = 50
  common.local_probe(c)
  c.evals.retrieval.update(common.retrieval_local(), random_init=True)
