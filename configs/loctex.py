r"""LocTex: visual representations from captions with synchronized mouse traces (Liu et al., ICCV 2021).

Paper recipe (Localized Narratives on COCO train2017, prepared with
`python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=PATH`; probe on VOC07):
  python -m vlrep.main --config=configs/loctex.py --workdir=gs://BUCKET/loctex_r50

On the embedded synthetic_scenes narrations, sized for a 2-core CPU (a few minutes; L_L at half weight there):
  python -m vlrep.main --config=configs/loctex.py:runlocal --workdir=/tmp/loctex_local

Ablations (arguments combine with commas; any key can also be overridden with --config.KEY=VALUE):
  loss=both|contrastive|localization   L_C + L_L (the paper), L_C only, L_L only (Table 4)
  scales=1|1+2|1+2+4                    trace supervision at 1x, 1x and 2x (the paper), up to 4x (Table 5)
  backbone=r50|vit_b16|vit_local|...    the visual backbone: the paper's ResNet-50 or a ViT (big_vision's
                                        vit_<variant><patch>; vit_local is runlocal's, configs/common.py). A ViT
                                        has one grid, its patch tokens (scales=1 only: 8x8 for vit_local at 64
                                        px, 14x14 for vit_b16 at 224), and trains with CapPa's AdamW
                                        (common.vit_optim), as LocTex has no ViT recipe of its own
  oracle=True                           ground-truth masks instead of traces (Table 5; synthetic_scenes only).
                                        Only shape words are supervised, so eq. 3's gradient is ~3x larger
                                        than with traces; runlocal scales L_L by 0.33 more for it, or the run
                                        collapses (docs/methods/loctex.md)
  contrastive=per_gpu|global            InfoNCE negatives within groups of 128 consecutive examples (the paper's
                                        per-GPU sub-batch, on any number of devices) or the whole batch
  openimages=True                       COCO + Open Images narrations (the paper's scaled-up LocTex)
  steps=N                               training steps instead of the recipe's epochs
  data=DIR  val=P                       your own image_text dataset prepared in DIR, with Localized Narratives'
                                        traces (docs/data.md, "Your own data"); its first P% (default 5) held
                                        out. The localization evaluator (ground-truth object masks) is off then.
                                        At least data.min_field_fraction (0.5) of the examples must be narrated,
                                        or the run stops before training with the counts
  untraced=skip|captions                (data=DIR) images without a narration: skip (no text: the recipe's, LN
                                        narrates every image) or captions: L_C on one of their plain captions,
                                        L_L only where traces are present (the tokenizer then learns from every
                                        caption; no minimum share of narrated images)
"""

from ml_collections import ConfigDict

from vlrep.config_utils import OWN_DATA_VAL_PERCENT, config_module, parse_arg, use_own_data

common = config_module(__file__, "common.py")  # the blocks every recipe shares

LOSSES = {"both": (1.0, 1.0), "contrastive": (1.0, 0.0), "localization": (0.0, 1.0)}
CONTRASTIVE_GROUPS = {"per_gpu": 128, "global": 0}
RESNETS = ("r50",)
UNTRACED = ("skip", "captions")  # what trains on an image without a narration (own data): nothing, or its captions


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    loss="both",
    scales="",
    backbone="r50",
    oracle=False,
    contrastive="per_gpu",
    openimages=False,
    steps=0,
    data="",
    val=0.0,
    untraced="skip",
  )
  if arg.loss not in LOSSES:
    raise ValueError(f"Unknown loss={arg.loss!r}; known: {sorted(LOSSES)}")
  if arg.untraced not in UNTRACED:
    raise ValueError(f"Unknown untraced={arg.untraced!r}; known: {', '.join(UNTRACED)}")
  if arg.untraced == "captions" and not arg.data:
    raise ValueError("untraced=captions reads your own data's plain captions: give data=DIR too.")
  if arg.contrastive not in CONTRASTIVE_GROUPS:
    raise ValueError(f"Unknown contrastive={arg.contrastive!r}; known: {sorted(CONTRASTIVE_GROUPS)}")
  common.backbone_choice(arg.backbone, RESNETS)
  vit = common.is_vit(arg.backbone)
  backbone = common.vit_backbone(arg.backbone) if vit else dict(depth=50, width=64, bn_group_size=0)
  scales = tuple(int(s) for s in str(arg.scales or ("1" if vit else "1+2")).split("+"))
  if vit and scales != (1,):
    raise ValueError(
      f"scales={arg.scales}: a ViT has one feature grid (its patch tokens), not a ResNet's stages; use scales=1."
    )
  image_size = 64 if arg.runlocal else 224
  # The backbone's output stride: a ViT's patch size; a ResNet's 32 with the ImageNet stem, 16 with runlocal's small
  # stem (stride 2, no max-pool).
  stride = backbone["patch_size"] if vit else 16 if arg.runlocal else 32
  grid_sizes = tuple(image_size // stride * s for s in scales)
  contrastive_weight, localization_weight = LOSSES[arg.loss]

  c = ConfigDict()
  common.run_defaults(c)
  c.method = dict(
    name="loctex",
    # The ResNet-50 with synchronized BatchNorm over the batch, as the paper.
    backbone=backbone,
    # Textual backbone: 4 layers, 1024 wide, 16 heads, GELU; captions of at most 60 tokens.
    text=dict(hidden=1024, num_layers=4, num_heads=16, max_len=60, dropout=0.1),
    embed_dim=1024,
    temperature=0.1,
    # The paper's InfoNCE is "computed locally at each GPU": 1024 images on 8 GPUs, 128 per group.
    contrastive_group_size=CONTRASTIVE_GROUPS[arg.contrastive],
    symmetric=False,  # eq. 1 is image -> caption only
    scales=scales,
    grid_sizes=grid_sizes,
    contrastive_weight=contrastive_weight,
    localization_weight=localization_weight,
    # Eq. 3 normalises the whole L x R x R attention map: every caption token's row ("caption"), not only the
    # rows of tokens with a trace ("traced", runlocal's); vlrep/methods/loctex.py.
    localization_norm="caption",
    dtype="bfloat16",
  )

  sizes = str(grid_sizes)
  masks = f"|oracle_word_masks(sizes={sizes})" if arg.oracle else ""
  c.data = common.train_data(
    "localized_narratives",
    f"decode|clean_traces|inception_crop({image_size}, area=(0.2, 1.0))|flip_lr_swap_words"
    f"|color_jitter(0.4, 0.4, 0.4, 0.1)|normalize|trace_words(256, sizes={sizes}, segments=True){masks}"
    f"|tokenize_words(60, sizes={sizes})",
    config_name="coco_openimages" if arg.openimages else "coco",
  )
  c.tokenizer = common.bpe_tokenizer("narration")

  c.batch_size = 1024
  c.update(common.duration(steps=arg.steps, epochs=0.0 if arg.steps else 600.0))
  # LR 0.4 for the visual backbone and the projections, 0.002 for the textual backbone.
  c.optim = common.optim((("^textual/", 0.002), (".*", 0.4)), warmup_epochs=20.0)
  if vit:
    c.optim = common.vit_optim(((".*", common.VIT_LR),), warmup_epochs=20.0)

  # LocTex sec. 4.1: "we first resize all images to 224 x 224" (no 256 resize and centre crop).
  c.evals = dict(probe=common.probe_eval(pp="decode|resize(224)|normalize|voc_labels(20)"))
  common.select_by_probe(c)  # the paper states no selection rule
  if arg.runlocal:
    _runlocal(c, arg, grid_sizes)
  if arg.data:
    if arg.oracle:
      raise ValueError("oracle=True needs synthetic_scenes' ground-truth masks; your data (data=DIR) has traces.")
    needs = {"narration": "LocTex's localization loss L_L: each word's mouse trace"}
    # Validation on your data: caption retrieval with L_C's own towers on the held-out images (the localization
    # evaluator needs ground-truth object masks).
    c.evals.retrieval = common.retrieval_eval(
      dataset=c.data.name,
      data_dir=c.data.data_dir,
      config_name=c.data.config_name,
      pp=f"decode|resize_small({image_size})|central_crop({image_size})|normalize",
      max_len=c.method.text.max_len,
      batch_size=100,
      limit=1000,
      fold_size=0,
      every_steps=0,
    )
    use_own_data(
      c,
      arg.data,
      arg.val or OWN_DATA_VAL_PERCENT,
      needs,
      ("retrieval",),
      drop_evals=("localization",),
      image_size=image_size,
    )
    if arg.untraced == "captions":
      # The paper's data narrates every image; own data may narrate a few. Every image then trains L_C on a
      # caption (its narration, else one of its plain captions), L_L where traces are present; the vocabulary is
      # built from every caption (narrations included: prepare puts each narration among its image's captions).
      c.data.pp = "text_or_caption('narration', 'captions')|" + c.data.pp
      c.tokenizer.corpus_key = "captions"
      c.data.min_field_fraction = 0.0
  return c


def _runlocal(c, arg, grid_sizes):
  """synthetic_scenes' narrations at 64x64 (grids 4x4 at 1x, 8x8 at 2x) on a 2-core CPU budget.

  Besides sizes and budget, two choices differ from the recipe, as in the runs of docs/results/loctex.md:
    method.localization_norm="traced"  eq. 3 normalises the attention of traced tokens only (the paper: of the
                                       whole L x R x R map, "caption")
    trace_words(..., segments=False)   each word's mask is the cells of its trace's sample points (the paper's
                                       "covered region", the recipe's segments=True, adds the cells crossed
                                       between them)

  backbone=vit_local (configs/common.py: patch 8 at 64 px, 128 wide, 4 blocks) supervises L_L on its one 8x8 grid
  (the ResNet's 2x scale's size) and trains with AdamW: the ViT at common.LOCAL_VIT_LR (VirTex runlocal's ViT
  backbone LR), the rest at 3e-3 (VirTex's and CLIP's runlocal head LR); not chosen again for LocTex.
  """
  c.data.update(common.synthetic_scenes("name"))
  c.data.pp = (
    c.data.pp.replace("area=(0.2, 1.0)", "area=(0.5, 1.0)")
    .replace("trace_words(256", "trace_words(64")
    .replace(", segments=True", "")
  )
  c.method.update(dtype="float32", embed_dim=128, localization_norm="traced")
  # VirTex runlocal's backbone, a ResNet-10 w16 with the small stem (chosen for VirTex on probe_val; not compared
  # again for LocTex): a 64 px image through the ImageNet stem leaves shapes a cell or two of a 2x2 grid.
  vit = common.is_vit(arg.backbone)
  if not vit:
    c.method.backbone = dict(depth=10, width=16, bn_group_size=32, stem="small", stem_stride=2)
  c.method.text = dict(hidden=128, num_layers=2, num_heads=4, max_len=60, dropout=0.1)
  c.method.contrastive_group_size = 0  # the batch of 64 is smaller than the paper's per-GPU group: one group
  c.tokenizer.vocab_size = 1000
  # L_L at half weight, chosen on probe_val (docs/results/loctex.md): the paper's equal weights are tuned for 600
  # epochs; at 500 steps L_L at full weight pulls the global features down, and points worse too.
  c.method.localization_weight *= 0.5
  if arg.oracle:
    # Ground-truth masks supervise only shape words (~2.3 tokens per caption against ~25 with traces), and eq. 3
    # normalises each example's maps as one vector, so its gradient is ~3x larger: with the traces' weight the run
    # collapses (dead units, flat losses). 0.33 ~ sqrt(2.3 / 25) matches the gradient norm to the trace run's.
    c.method.localization_weight *= 0.33
  c.batch_size = 64
  c.total_steps = arg.steps or 500
  c.total_epochs = 0.0
  c.optim.warmup_epochs = 0.0
  c.optim.warmup_steps = 50
  # The textual backbone's 0.002 is tuned for 600 epochs; at a few hundred steps it barely moves.
  c.optim.lr_groups = (("^textual/", 0.05), (".*", 0.4))
  if vit:
    # AdamW as VirTex's and CLIP's runlocal ViTs: the backbone at common.LOCAL_VIT_LR (VirTex runlocal's),
    # the text tower and projections at their runlocal head LR 3e-3, weight decay 1e-4 (not chosen again here).
    c.optim.update(weight_decay=1e-4, grad_clip_norm=0.0)
    c.optim.lr_groups = (("^backbone/", common.LOCAL_VIT_LR), (".*", 3e-3))
  c.checkpoint.every_steps = 250
  c.log_every_steps = 50
  common.local_probe(c)
  # Pointing accuracy / IoU of object words against their ground-truth masks, on held-out val scenes.
  c.evals.localization = dict(common.localization_eval(grid_sizes), every_steps=0, random_init=True)
