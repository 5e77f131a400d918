r"""VisualBERT / ViLBERT pretraining and downstream fine-tuning: the study of Singh et al., "Are we pretraining it
right? Digging deeper into visio-linguistic pretraining" (arXiv 2004.08744).

A study is two stages, each a run:
  # 1. pretraining (MLM for VisualBERT, MMM for ViLBERT) on one source
  python -m vlrep.main --config=configs/vlbert.py:arch=visual_bert,stage=pretrain,data=captions,bert=$BERT \
      --workdir=$W/vb_coco
  # 2. a downstream task, fine-tuned or with the base frozen, from that run (or from BERT alone: no pretraining)
  python -m vlrep.main --config=configs/vlbert.py:arch=visual_bert,stage=finetune,task=vqa,bert=$BERT \
      --config.method.pretrained_run=$W/vb_coco --workdir=$W/vb_coco_vqa

The paper's recipe: both models start from bert-base-uncased (pass `bert=/path/to/folder`; `bert=minilm`
= the packaged MiniLM-L6-H384), AdamW (eps 1e-8), LR 5e-5, 2000 warmup steps then cosine, 88K updates (section
2.5, "unless otherwise specified"); fine-tuning with batch 1024 and betas 0.9/0.999, evaluated every 6000 updates,
the best validation score reported (section 2.5: no task states another budget); pretraining as its Table A.1
says: batch 896 (VisualBERT; ViLBERT on COCO) or 1024 (ViLBERT on VQA-P and CC; generated captions follow CC),
betas 0.9/0.98, no gradient clipping; 15% of the tokens masked as BERT (80% [MASK], 10% random, 10% kept);
ViLBERT also masks 15% of the regions (zeroed 90% of the time) and predicts the detector's class distribution
(KL). The paper's regions are a Visual Genome Faster R-CNN's: pass them as `regions=DIR` (their cls_prob is the
KL target). Without region files, a frozen vlrep ResNet extracts them (`extractor=RUN`, any vlrep run with a
ResNet backbone):
RoIAlign over the dataset's object boxes (COCO's ground truth; their class is ViLBERT's target), or the 7x7 grid
at 224 px (`--config.method.visual.mode=grid --config.method.region_target=feature`: cells have no labels). A
randomly initialised extractor is an error (`visual.allow_random_init` makes it a deliberate baseline).

On the embedded synthetic_scenes (the study's analogues: in-domain captions = `train` captions, questions =
`train` question/answer pairs, out-of-domain captions = the sketch-style `ood_train` captions, generated
captions = a VirTex captioner's captions of the `ood_train` images; every source clipped to 500 images), with the
quick start's VirTex run ($V, e.g. /tmp/vlrep_virtex_local) extracting the regions:
  python -m vlrep.main --config=configs/vlbert.py:runlocal,arch=visual_bert,stage=pretrain,data=questions,extractor=$V \
      --workdir=/tmp/vb_q
  python -m vlrep.main \
      --config=configs/vlbert.py:runlocal,arch=visual_bert,stage=finetune,task=vqa,frozen,extractor=$V \
      --config.method.pretrained_run=/tmp/vb_q --workdir=/tmp/vb_q_vqa_frozen
(a downstream run names the pretraining run's extractor too: it builds that ResNet and takes its weights from the
pretraining run; a different one is an error when the run starts).

Arguments (comma-separated; any key can also be set with --config.KEY=VALUE):
  arch=visual_bert|vilbert
  stage=pretrain|finetune
  data=captions|questions|ood_captions|generated   the pretraining source (stage=pretrain); or data=DIR: your own
                       image_text captions prepared in DIR (docs/data.md, "Your own data"), regions from the
                       extractor's grid, the first P% (val=P, default 5) held out for the mlm evaluator
  generated=PATH       the generated-caption file (JSON {image_id: [captions]}) for data=generated
  task=vqa|vizwiz|ve|mmimdb   the downstream task (stage=finetune): VQA 2.0 or VizWiz (answer vocabulary, soft
                       scores, BCE, VQA accuracy), SNLI-VE visual entailment (3-way softmax, accuracy), MM-IMDB
                       (23 genres, multi-label BCE, micro/macro F1); runlocal has analogues of vqa and ve
  frozen               train only the task head (the paper's "frozen base", Table 2)
  lr=X                 the learning rate of what trains (the whole model, or the head when frozen) instead of the
                       recipe's 5e-5 (runlocal's: 1e-4 pretraining and fine-tuning; a frozen base's head 1e-3,
                       ViLBERT's 1e-2)
  regions=DIR          precomputed region features (DIR/<image_id>.npz; `python -m vlrep.tools.convert_regions`
                       converts MMF's Faster R-CNN dumps) instead of the frozen vlrep ResNet; set
                       --config.method.visual.dim to their width (2048 by default); ViLBERT pretraining reads
                       their cls_prob as its masked-region target (region_classes = the detector's classes)
  extractor=RUN        the vlrep run whose backbone (architecture and weights) extracts the regions, frozen: sets
                       method.visual.init_from and method.visual.backbone (read from RUN's saved config, so the run
                       saves the architecture it builds); runlocal: e.g. the quick start's VirTex run; without it
                       runlocal's extractor is a random ResNet-26, a deliberate baseline
  bert=PATH            a local Hugging Face BERT folder (the recipe needs bert-base-uncased; 'minilm' = the
                       packaged MiniLM-L6-H384, runlocal's default)
  pairs=N              texts of each image per training step, sampled (the recipe's 1; runlocal fine-tuning: all of
                       an image's questions or statements, whose regions are then extracted once)
  steps=N              training steps instead of the recipe's
  fraction=P           pretrain on the first P% of the source (the paper's 10/50/100% of COCO and VQA; its
                       0.04M/0.2M/0.4M CC subsets are P = 1.2/6/12 of CC's 3.3M); runlocal: P% of the 500-image clip
"""

import re

from ml_collections import ConfigDict

from vlrep import defaults, runs
from vlrep.config_utils import OWN_DATA_VAL_PERCENT, config_module, parse_arg, use_own_data

common = config_module(__file__, "common.py")  # the blocks every recipe shares

ARCHS = ("visual_bert", "vilbert")
STAGES = ("pretrain", "finetune")
SOURCES = ("captions", "questions", "ood_captions", "generated")
TASKS = ("vqa", "vizwiz", "ve", "mmimdb")
# task -> (dataset, loss, labels (-1: the answer vocabulary), eval metric, best metric, text length)
TASK_SETUP = {
  "vqa": ("vqa2", "bce", -1, "vqa", "task/vqa", 24),
  "vizwiz": ("vizwiz", "bce", -1, "vqa", "task/vqa", 24),
  "ve": ("snli_ve", "softmax", 3, "accuracy", "task/accuracy", 48),
  "mmimdb": ("mm_imdb", "bce", 23, "f1", "task/micro_f1", 256),
}


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    arch="visual_bert",
    stage="pretrain",
    data="captions",
    generated="",
    regions="",
    extractor="",
    pairs=0,
    task="vqa",
    frozen=False,
    lr=0.0,
    bert="",
    steps=0,
    fraction=0.0,
    val=0.0,
  )
  bert = arg.bert or ("minilm" if arg.runlocal else "")  # '' fails at load time, naming the files it needs
  for name, value, known in (("arch", arg.arch, ARCHS), ("stage", arg.stage, STAGES), ("task", arg.task, TASKS)):
    if value not in known:
      raise ValueError(f"Unknown {name}={value!r}; known: {known}")
  own = arg.data not in SOURCES and ("/" in arg.data or "~" in arg.data)  # your own image_text data: a folder
  if arg.data not in SOURCES and not own:
    raise ValueError(f"Unknown data={arg.data!r}; known: {SOURCES}, or the folder of your own prepared data")
  if own and arg.stage != "pretrain":
    raise ValueError("data=DIR (your own captions) is a pretraining source: stage=pretrain.")
  if arg.data == "generated" and arg.stage == "pretrain" and not arg.generated:
    raise ValueError("data=generated needs generated=PATH (made by `python -m vlrep.tools.caption --output=PATH`).")
  pretrain = arg.stage == "pretrain"
  image_size = 64 if arg.runlocal else 224

  c = ConfigDict()
  common.run_defaults(c)
  c.method = dict(
    name="vlbert",
    arch=arg.arch,
    bert_path=bert,
    bert_layers=0,
    # The pooled output reads BERT's [CLS] (the study's); 'mean' = the mean text state.
    text_pool="cls",
    task="pretrain" if pretrain else "classify",
    loss=TASK_SETUP[arg.task][1],
    num_labels=TASK_SETUP[arg.task][2],  # -1: the answer vocabulary's size
    pretrained_run="",
    freeze_base=arg.frozen,
    # fusion, dropout, masking rates, the masked-region target and ViLBERT's stream sizes: vlrep.defaults.VLBERT_MODEL
    # (runlocal: region_classes = synthetic_scenes' 10 shapes, below)
    **defaults.VLBERT_MODEL,
    # Image-text alignment in pretraining (ViLBERT's multimodal alignment prediction): the study drops it (0), as
    # VQA-P's questions fit many images; > 0 adds it with that weight (vlrep.methods.vlbert).
    alignment_weight=0.0,
    dtype="bfloat16",
    visual=dict(**defaults.VLBERT_VISUAL, mode="roi_align"),
  )
  if arg.arch == "visual_bert":
    # Region embeddings (vlrep/models/vl_bert.py) as VisualBERT's and MMF's (BertVisioLinguisticEmbeddings, the
    # study's code): no box embedding, BERT's embedding LayerNorm over text and regions alike, and visual
    # token-type and position tables that start as copies of BERT's; the regions' token type is MMF's 0 (the
    # authors' code and transformers' default use 1). vlrep's other embeddings: region_boxes=True,
    # region_norm='own', region_type_embedding='segment' (docs/interop.md).
    c.method.update(region_boxes=False, region_norm="shared", region_type_embedding="tables", region_type_id=0)
  c.tokenizer = dict(kind="wordpiece", path=bert)
  c.data = common.train_data("coco_captions2017", "")  # pp below
  # No cache_image_size key: these runs offer no --config.data.cache_image_size (the pipeline reads it as 0).
  del c.data["cache_image_size"]
  image_pp = f"decode|resize_small({image_size})|central_crop({image_size})|normalize|regions_from_objects(36)"
  if pretrain:
    source = {"captions": "captions", "questions": "qa", "ood_captions": "captions", "generated": "captions"}.get(
      arg.data, "captions"
    )
    pairs = f"vl_pairs('{source}', 1, answer_as_text_b=True)" if source == "qa" else f"vl_pairs('{source}', 1)"
    host = f"|generated_captions('{arg.generated}')" if arg.data == "generated" else ""
    c.data.pp = f"{image_pp}|{pairs}{host}|tokenize_pairs(36)"
    c.data.name = {"captions": "coco_captions2017", "questions": "vqa2"}.get(arg.data, "conceptual_captions")
  else:
    c.data.name, length = TASK_SETUP[arg.task][0], TASK_SETUP[arg.task][5]
    # Targets made in tf.data come before the (host-side) tokenizer; VQA's soft scores are a host op after it.
    source, before, after = {
      "vqa": ("qa", "", "|answer_targets"),
      "vizwiz": ("qa", "", "|answer_targets"),
      "ve": ("entailment", "|onehot_targets(3)", ""),
      "mmimdb": ("plot", "|multihot_targets(23)", ""),
    }[arg.task]
    c.data.pp = f"{image_pp}|vl_pairs('{source}', 1){before}|tokenize_pairs({length}){after}"
    if arg.task in ("vqa", "vizwiz"):
      c.answers = dict(split="train", size=3129, min_count=1)
  # Section 2.5: batch 1024 and 88K updates "unless otherwise specified"; the supplement's Table A.1 specifies
  # pretraining (batch 896 but for ViLBERT on VQA-P and CC); no fine-tuning task is given another budget.
  c.batch_size = pretrain_batch_size(arg.arch, arg.data) if pretrain else 1024
  c.update(common.duration(steps=arg.steps or 88_000))
  c.optim = common.optim(
    # Frozen base: LR 0 for everything but the head (neither gradient nor weight decay moves it).
    (("^task_head", 5e-5), (".*", 0.0)) if arg.frozen else ((".*", 5e-5),),
    name="adamw",
    weight_decay=0.01,
    # Pretraining: Table A.1's "gradient clipping 0" (none). Fine-tuning: not stated; vlrep clips at 1.0.
    grad_clip_norm=0.0 if pretrain else 1.0,
    warmup_steps=2000,
    frozen_steps=(),
    no_decay="(bias|LayerNorm|scale)",
    b2=0.98 if pretrain else 0.999,  # Table A.1 (pretraining); section 2.5's (0.9, 0.999) otherwise
  )
  c.init_from = ""  # a run whose checkpoint initialises this one
  eval_pp_pairs = {
    "vqa": "vl_pairs('qa', 10, sample=False)|tokenize_pairs(24)|answer_targets",
    "vizwiz": "vl_pairs('qa', 1, sample=False)|tokenize_pairs(24)|answer_targets",
    "ve": "vl_pairs('entailment', 10, sample=False)|onehot_targets(3)|tokenize_pairs(48)",
    "mmimdb": "vl_pairs('plot', 1, sample=False)|multihot_targets(23)|tokenize_pairs(256)",
  }
  if pretrain:
    c.evals = dict(
      mlm=dict(
        type="vl_task",
        metric="mlm",
        dataset=c.data.name,
        data_dir="",
        config_name="",
        split="val",
        # Held-out text of the same source (the real captions where the training text was generated).
        pp=c.data.pp.replace(", 1", ", 5, sample=False", 1).replace(f"|generated_captions('{arg.generated}')", ""),
        batch_size=128,
        limit=2000,
        every_steps=0,
      )
    )
    c.best_metric = ""
  else:
    c.evals = dict(
      task=dict(
        type="vl_task",
        metric=TASK_SETUP[arg.task][3],
        dataset=c.data.name,
        data_dir="",
        config_name="",
        split="val",
        pp=f"{image_pp}|{eval_pp_pairs[arg.task]}",
        batch_size=128,
        limit=0,
        every_steps=6000,  # section 2.5: "We evaluate every 6000 updates" and report the best
      )
    )
    c.best_metric = TASK_SETUP[arg.task][4]
  if arg.runlocal:
    _runlocal(c, arg, pretrain)
    if not pretrain and not arg.pairs:
      arg.pairs = {"vqa": 5, "ve": 4}[arg.task]  # synthetic_scenes' most per image
  if arg.lr < 0:
    raise ValueError(f"lr={arg.lr}: a learning rate must be > 0 (or leave lr out for the config's).")
  if arg.lr:
    c.optim.lr_groups = (("^task_head", arg.lr), (".*", 0.0)) if arg.frozen else ((".*", arg.lr),)
  if arg.fraction:
    if not (pretrain and 0 < arg.fraction <= 100):
      raise ValueError(f"fraction={arg.fraction} needs stage=pretrain and 0 < P <= 100.")
    # A fraction of what the split already holds: 'train' -> 'train[:P%]', 'train[:6.25%]' -> 'train[:6.25*P/100%]'.
    name, held = pipeline_split(c.data.split)
    c.data.split = f"{name}[:{held * arg.fraction:g}%]"
  if arg.pairs:  # texts of each image per training step (their regions are extracted once for all of them)
    c.data.pp = re.sub(r"vl_pairs\('(\w+)', 1\b", rf"vl_pairs('\1', {arg.pairs}", c.data.pp)
  if arg.regions and arg.extractor:
    raise ValueError(
      "regions=DIR (precomputed features) and extractor=RUN (a ResNet extracting them) exclude each other."
    )
  if arg.regions:
    _region_files(c, arg.regions)
  if arg.extractor:
    c.method.visual.update(init_from=arg.extractor, allow_random_init=False, backbone=extractor_backbone(arg.extractor))
  if own:
    # Your own captions (docs/data.md, "Your own data"): regions are the extractor's grid cells, which need no
    # boxes (ViLBERT's masked-region target is then the cell's feature); the mlm evaluator reads the held-out P%.
    needs = {"captions": "the masked language model's texts"}
    use_own_data(c, arg.data, arg.val or OWN_DATA_VAL_PERCENT, needs, ("mlm",), image_size=image_size)
    c.method.visual.mode = "grid"
    if arg.arch == "vilbert":
      c.method.region_target = "feature"
  return c


def pretrain_batch_size(arch, data):
  """Table A.1's pretraining batch: 896, but 1024 for ViLBERT on VQA-P and CC (generated captions, on CC's
  images, follow CC)."""
  return 1024 if arch == "vilbert" and data in ("questions", "ood_captions", "generated") else 896


def extractor_backbone(run):
  """RUN's ResNet as `visual.backbone` (read from its saved config, no weights): this run then builds, and saves,
  the architecture whose weights it takes from RUN, so evaluating or resuming it needs only its own directory."""
  backbone = runs.read_config(run).method.get("backbone")
  if backbone is None or backbone.get("arch", "resnet") != "resnet":
    raise ValueError(f"extractor={run}: that run has no ResNet backbone to extract regions with.")
  return runs.resnet_kwargs(backbone)


def pipeline_split(split):
  """('train', 100.0) for 'train'; ('train', 0.0625) for 'train[:6.25%]'."""
  m = re.fullmatch(r"(\w+)(?:\[:([\d.]+)%\])?", split)
  if not m:
    raise ValueError(f"Cannot take a fraction of split {split!r}.")
  return m.group(1), float(m.group(2) or 100.0) / 100.0


def _region_files(c, directory):
  """Precomputed region features (DIR/<image_id>.npz, vlrep.data.region_files) instead of the frozen ResNet: no
  image is decoded; the host op looks each image's regions up by image_id."""
  c.method.visual.update(mode="file", dim=2048)
  class_probs = c.method.arch == "vilbert" and c.method.task == "pretrain"
  if class_probs:
    c.method.region_target = "distribution"
  for holder in [c.data, *c.evals.values()]:
    op = f"region_features({directory!r}, 36, class_probs={class_probs})"  # repr: any path quotes safely
    parts = [p for p in holder.pp.split("|") if not p.startswith(("decode", "resize", "central_crop", "normalize"))]
    parts = [p for p in parts if not p.startswith("regions_from_objects")]
    holder.pp = "|".join(parts + [op])


def _runlocal(c, arg, pretrain):
  """synthetic_scenes at 64 px; a frozen ResNet over box crops (extractor=RUN's backbone, e.g. the quick start's
  VirTex run, as docs/results/vlbert.md measures; else a random ResNet-26 w16); MiniLM's first 2 layers; all of an
  image's questions per fine-tuning step; sized for a 2-core CPU."""
  c.data.update(common.synthetic_scenes("name"))
  c.method.update(dtype="float32", bert_layers=2, region_classes=10)
  # No dropout at this budget: the recipe's 0.1 lowers fine-tuned VQA at 200 steps, for both architectures.
  c.method.bert_dropout = 0.0
  # MiniLM was trained with mean pooling and its [CLS] never was: after 2 layers the [CLS] states of different
  # questions have cosine 1.000, so a head on them sees nothing of the question (VisualBERT's frozen-base VQA stays
  # at the answer prior). The mean text state is the sentence representation it learned.
  c.method.text_pool = "mean"
  # ViLBERT's co-attention joins the last half of the text layers (the recipe's 6 of 12): the last 1 of 2 here,
  # ahead of co-attention before both layers on probe_val (frozen-base VQA; docs/results/vlbert.md).
  c.method.update(v_layers=1, v_hidden=256, v_heads=4, v_intermediate=512, bi_hidden=256, bi_heads=4)
  # Without extractor=RUN the extractor is frozen at random init, on purpose: a cheap, fixed region featurizer (the
  # recipe refuses one; see the deviation table in README).
  c.method.visual.update(
    backbone=dict(depth=26, width=16, bn_group_size=0), mode="crops", crop_size=32, allow_random_init=True
  )
  image_pp = "decode|normalize|regions_from_objects(4)"
  old_pp = "decode|resize_small(64)|central_crop(64)|normalize|regions_from_objects(36)"
  # Text lengths that fit synthetic_scenes' texts (WordPiece pieces: captions <= 45, question + answer <= 16,
  # statements <= 10); longer ones are cut and counted (data/truncated_count).
  if not pretrain and arg.task not in ("vqa", "ve"):
    raise ValueError(f"runlocal has analogues of task=vqa and task=ve only, not {arg.task!r} (a real dataset).")
  length = {"captions": 32, "questions": 20}.get(arg.data, 32) if pretrain else {"vqa": 16, "ve": 14}[arg.task]

  def local(pp):
    pp = pp.replace("'qa', 10,", "'qa', 5,").replace("'entailment', 10,", "'entailment', 4,")  # their most per image
    return re.sub(r"tokenize_pairs\(\d+\)", f"tokenize_pairs({length})", pp.replace(old_pp, image_pp))

  c.data.pp = local(c.data.pp)
  for ev in c.evals.values():
    ev.update(common.synthetic_scenes(), pp=local(ev.pp))
  if pretrain:
    # Every source clipped to 500 images (the size of ood_train; 6.25% of train's 8000), as the study clips VQA and CC
    # to COCO's size.
    c.data.split = "ood_train" if arg.data in ("ood_captions", "generated") else "train[:6.25%]"
    c.evals.mlm.update(limit=200)
    if arg.data in ("ood_captions", "generated"):
      c.evals.mlm.split = "ood_val"
  else:
    c.data.split = "train"
    if arg.task == "vqa":
      c.answers.update(size=100)
  c.batch_size = 64
  c.total_steps = arg.steps or 200
  c.optim.warmup_steps = 20
  # Betas 0.9/0.999 and clipping at 1.0 in both stages, the setting of docs/results/vlbert.md's runlocal figures
  # (the recipe's pretraining takes Table A.1's 0.98 and no clipping).
  c.optim.update(b2=0.999, grad_clip_norm=1.0)
  # A frozen base's head: 1e-3 for VisualBERT; 1e-2 for ViLBERT, whose pooled output (a product of two ReLUs) is
  # smaller, chosen on probe_val (frozen-base VQA; docs/results/vlbert.md).
  head_lr = 1e-2 if arg.arch == "vilbert" else 1e-3
  c.optim.lr_groups = (("^task_head", head_lr), (".*", 0.0)) if arg.frozen else ((".*", 1e-4),)
  c.checkpoint.every_steps = 200
  c.log_every_steps = 50
  for ev in c.evals.values():
    ev.update(batch_size=64, every_steps=0 if pretrain else 100)
