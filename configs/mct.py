r"""MCT: multimodal contrastive training of visual representations (Yuan et al., CVPR 2021).

Paper recipe (COCO Captions train2017 with the 80 instance categories as tags, prepared with
`python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=PATH` where PATH/annotations also holds
instances_{train,val}2017.json; probe on VOC07):
  python -m vlrep.main --config=configs/mct.py:bert=/data/bert-base-uncased --workdir=gs://BUCKET/mct_r50
  python -m vlrep.main --config=configs/mct.py:bert=/data/bert-base-uncased,tags=True --workdir=...  # 'with tag'
  python -m vlrep.main --config=configs/mct.py:text=scratch --workdir=...                            # 'scratch'

On the embedded synthetic_scenes (captions; tags = the scene's shapes and colours), sized for a 2-core CPU:
  python -m vlrep.main --config=configs/mct.py:runlocal --workdir=/tmp/mct_local

Variants (arguments combine with commas; any key can also be overridden with --config.KEY=VALUE):
  loss=full|moco|tags|inter   all five losses (J_tag weighted by tags=), J_ii alone (MoCo-v2), J_ii + J_tag,
                              the inter-modal rankings alone (J_ic + J_ci)
  tags=True|False             lambda_tag 1 ('with tag') or 0 for loss=full. Default: False in the recipe (the
                              paper's method, lambda_tag = 0 unless 'with tag'), True in runlocal
  steps=N                     training steps instead of the recipe's epochs
  aug=mocov2|crop             image views: MoCo-v2's (crop, colour jitter, grayscale, blur, flip; the recipe's
                              default) or crops and flips only (runlocal's default, see AUGMENTATIONS)
  pool=cls|mean               the text tower's pooled output: BERT's first token (recipe) or the tokens' mean
                              (runlocal; see vlrep/models/mct.py)
  paraphrases=PATH            caption views from pre-computed paraphrases (JSON {caption: [paraphrases]}, e.g.
                              back-translations through French and German made elsewhere): each view is a random
                              one of its caption's paraphrases with probability paraphrase_prob=
  paraphrase_prob=P           with paraphrases=PATH (default 1: every view a paraphrase, as the paper
                              back-translates every view); captions without one keep the offline views
  head_bn=none|inter|all      BatchNorm in the hidden layer of no heads (the paper's), the inter-modal heads
                              (runlocal) or all four
  text=scratch|bert           the text tower: a pretrained BERT fine-tuned (the paper's default, the recipe's;
                              needs bert=PATH) or a BERT-base-sized encoder trained from scratch (the paper's
                              'scratch' variant; runlocal's default)
  bert=PATH                   with text=bert: a local Hugging Face BERT folder (bert-base-uncased in the paper;
                              'minilm' = the packaged MiniLM-L6-H384, runlocal's default); its WordPiece
                              vocabulary becomes the tokenizer
  bert_layers=N               with text=bert: keep the checkpoint's first N layers (runlocal: 2)
Caption views come from offline word dropout and swaps (`caption_views`), since vlrep ships no translation
model: these views stay closer to the caption than the paper's back-translations, so J_cc's positives are easier
(README, "Where a recipe differs from its paper"). With back-translations computed elsewhere, paraphrases=PATH
gives the paper's views (give each caption several, e.g. sampled through both pivot languages: two views that
draw the same paraphrase are identical).
"""

import re

from ml_collections import ConfigDict

from vlrep import defaults
from vlrep.config_utils import OWN_DATA_VAL_PERCENT, config_module, parse_arg, use_own_data

common = config_module(__file__, "common.py")  # the blocks every recipe shares

# (lambda_ii, lambda_tag, lambda_cc, lambda_ic, lambda_ci)
LOSSES = {
  "full": (1.0, 1.0, 1.0, 1e-4, 1e-4),
  "moco": (1.0, 0.0, 0.0, 0.0, 0.0),
  "tags": (1.0, 1.0, 0.0, 0.0, 0.0),
  "inter": (0.0, 0.0, 0.0, 1e-4, 1e-4),
}


# One image view; {size} and {k} (the view's key) are filled in. 'crop' is the runlocal default: on synthetic_scenes,
# MoCo-v2's colour distortions keep a 500-step run from bootstrapping (J_ii stays near ln(K+1) and every key
# collapses onto one direction), while crops and flips alone train steadily.
AUGMENTATIONS = {
  "mocov2": (
    "inception_crop({size}, area=(0.2, 1.0), key='{k}')|color_jitter(0.4, 0.4, 0.4, 0.1, prob=0.8, key='{k}')"
    "|random_grayscale(0.2, key='{k}')|gaussian_blur(0.5, key='{k}')|flip_lr_swap_words(keys=(), key='{k}')"
    "|normalize(key='{k}')"
  ),
  "crop": (
    "inception_crop({size}, area=(0.2, 1.0), key='{k}')|flip_lr_swap_words(keys=(), key='{k}')|normalize(key='{k}')"
  ),
}


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    loss="full",
    tags="",  # '' = the default of the recipe (False) or runlocal (True)
    steps=0,
    aug="",
    pool="",
    head_bn="",
    paraphrases="",
    paraphrase_prob=1.0,
    text="",  # '' = the default of the recipe (bert) or runlocal (scratch)
    bert="",
    bert_layers=-1,
    data="",
    val=0.0,
    num_tags=1000,
  )
  bert = arg.bert or ("minilm" if arg.runlocal else "")  # '' fails at load time, naming the files it needs
  text = arg.text or ("scratch" if arg.runlocal else "bert")
  if text not in ("scratch", "bert"):
    raise ValueError(f"Unknown text={arg.text!r}; expected 'scratch' or 'bert'.")
  if arg.tags.lower() not in ("", "true", "false", "1", "0"):
    raise ValueError(f"tags={arg.tags!r}: expected True or False.")
  tags = arg.tags.lower() in ("true", "1") if arg.tags else arg.runlocal
  if arg.loss not in LOSSES:
    raise ValueError(f"Unknown loss={arg.loss!r}; known: {sorted(LOSSES)}")
  weights = dict(zip(("j_ii", "j_tag", "j_cc", "j_ic", "j_ci"), LOSSES[arg.loss], strict=True))
  if arg.loss == "full" and not tags:
    weights["j_tag"] = 0.0
  image_size = 64 if arg.runlocal else 224

  c = ConfigDict()
  common.run_defaults(c)
  # The key queues (model state) are split along their first dimension: each device holds 1/N of the keys.
  c.sharding.rules = ((r"(^|/)queues/", ("data",)),)
  c.method = dict(
    name="mct",
    dtype="bfloat16",
    # Per-GPU BatchNorm in the paper (512 images on 8 GPUs); the key encoder's batch is shuffled first.
    backbone=dict(
      depth=50,
      width=64,
      bn_group_size=64,
    ),
    text_tower=text,
    bert_path=bert,  # text_tower='bert': the pretrained BERT's folder ('minilm' = the packaged MiniLM)
    bert_layers=0,  # text_tower='bert': keep its first N layers (0 = all)
    # text_tower='bert': dropout on its hidden states and attention weights while training, BERT fine-tuning's
    # 0.1 (bert-base's own config.json); < 0 takes the checkpoint's config.json rates.
    bert_dropout=0.1,
    text=dict(hidden=768, num_layers=12, num_heads=12, max_len=40, dropout=0.1),  # 'scratch': BERT-base sized
    head_hidden=2048,
    text_pool="cls",  # BERT's pooled output; 'mean' averages the tokens (see _runlocal)
    head_batchnorm=(),  # the paper's heads: Linear-ReLU-Linear; ('inter',) adds BatchNorm (see _runlocal)
    intra_dim=128,
    inter_dim=1024,
    momentum=0.999,
    queue_size=32768,
    temperature=0.07,
    tag_threshold=2.0,  # epsilon: a queue entry sharing more than this many tags is a positive (J_tag)
    margin=0.2,
    weights=weights,
  )
  aug = arg.aug or ("crop" if arg.runlocal else "mocov2")
  if aug not in AUGMENTATIONS:
    raise ValueError(f"Unknown aug={aug!r}; known: {sorted(AUGMENTATIONS)}")
  view = AUGMENTATIONS[aug]
  c.data = common.train_data(
    "coco_captions2017",
    "keep('image', 'captions', 'objects')|decode|copy('image', 'image_q')|copy('image', 'image_k')"
    f"|{view.format(size=image_size, k='image_q')}|{view.format(size=image_size, k='image_k')}"
    "|choose_caption(5)|caption_views(0.1, 0.1)|tags(num_tags=80)"
    "|tokenize(40, key='caption_q', out='tokens_q')|tokenize(40, key='caption_k', out='tokens_k')",
  )
  c.tokenizer = common.bpe_tokenizer("captions")

  c.batch_size = 512
  c.update(common.duration(steps=arg.steps, epochs=0.0 if arg.steps else 200.0))
  # The paper: image encoder 0.03, text encoder 4e-5 (section 4); it does not say where the randomly initialised
  # text heads belong. BERT's body ('textual', pretrained) at 4e-5; the text heads (text_intra, text_inter, and
  # text_pooler where pool=mean or text=scratch uses it) at the image heads' 0.03: 4e-5 is an Adam-scale
  # fine-tuning rate, under which SGD barely moves a freshly initialised head (each SGD step is 750 times smaller
  # than the image heads' on the same losses).
  c.optim = common.optim((("^textual/", 4e-5), (".*", 0.03)))

  c.evals = dict(
    probe=common.probe_eval(),
    # COCO 1K retrieval with the towers as trained (the paper's 1K test images are Karpathy's, as for vsepp below).
    retrieval=common.retrieval_eval(every_steps=0),
  )
  # VSE++ on the frozen backbone (tables 4, 6, 7): a linear image projection and a 1-layer GRU trained with the
  # hardest-negative hinge loss on train2017's pairs, Adam 2e-4 for 15 epochs then 2e-5 for 15; COCO 1K test.
  # The paper trains on Karpathy's 113K images and tests on his 1K test images; vlrep trains on train2017
  # (118K) and tests on 5 folds of 1K val2017 images: the evaluator reads whole TFDS splits, and Karpathy's test
  # images (from val2014) lie mostly in train2017, which MCT pretrains on (README, "Where a recipe differs from
  # its paper").
  c.evals.vsepp = dict(defaults.VSEPP_COCO)
  common.select_by_probe(c)  # the paper states no selection rule
  if arg.runlocal:
    _runlocal(c, arg)
  # Explicit pool= / head_bn= arguments override both the recipe's and runlocal's choice.
  if arg.pool:
    if arg.pool not in ("cls", "mean"):
      raise ValueError(f"Unknown pool={arg.pool!r}; expected 'cls' or 'mean'.")
    c.method.text_pool = arg.pool
  if arg.head_bn:
    heads = {"none": (), "inter": ("inter",), "all": ("intra", "inter")}
    if arg.head_bn not in heads:
      raise ValueError(f"Unknown head_bn={arg.head_bn!r}; expected one of {sorted(heads)}.")
    c.method.head_batchnorm = heads[arg.head_bn]
  if text == "bert":
    # The pretrained BERT's own WordPiece vocabulary ([CLS] ... [SEP], [PAD] = 0) replaces the BPE tokenizer.
    c.tokenizer = dict(kind="wordpiece", path=bert)
    if arg.bert_layers >= 0:
      c.method.bert_layers = arg.bert_layers
    elif arg.runlocal:
      c.method.bert_layers = 2  # MiniLM's first 2 of 6 layers, the size of runlocal's scratch encoder
  prob = float(arg.paraphrase_prob)
  if not 0.0 <= prob <= 1.0:
    raise ValueError(f"paraphrase_prob={arg.paraphrase_prob}: expected a probability in [0, 1].")
  if arg.paraphrases:
    # A draw per view after the offline views (TF), then the file's paraphrases replace some views (host).
    c.data.pp = re.sub(r"(caption_views\([^)]*\))", r"\1|paraphrase_draws", c.data.pp, count=1)
    c.data.pp = c.data.pp.replace("|tokenize(", f"|paraphrases({arg.paraphrases!r}, {prob:g})|tokenize(", 1)
  if arg.data:
    _own_data(c, arg, tags, image_size)
  return c


def _own_data(c, arg, tags, image_size):
  """Your own image_text data: captions, and with the tag loss (tags=True) its `tags` strings, the `num_tags`
  most frequent of which form the tag set (`concepts.kind='tags'`, built from the training part)."""
  needs = {"captions": "MCT's caption towers"}
  if tags:
    needs["tags"] = "MCT's tag loss J_tag (or train without it: configs/mct.py:data=DIR,tags=False)"
  use_own_data(c, arg.data, arg.val or OWN_DATA_VAL_PERCENT, needs, ("retrieval", "vsepp"), image_size=image_size)
  if tags:
    c.concepts = dict(kind="tags", size=arg.num_tags, corpus_split=c.data.split, corpus_key="tags", path="")
    tag_op = re.search(r"\|tags\([^|]*\)", c.data.pp).group(0)
    # At most 32 tags an image, as fixed-shape strings that batch; the host maps them onto the tag set.
    c.data.pp = c.data.pp.replace(tag_op, "|fixed_captions(32, key='tags', out='tags')", 1)
    c.data.pp += "|concept_tags(key='tags')"
  else:  # no tag loss: an empty tag vector (the model reads its width, J_tag is off)
    tag_op = re.search(r"\|tags\([^|]*\)", c.data.pp).group(0)
    c.data.pp = c.data.pp.replace(tag_op, "|tags(fields=(), num_tags=1)", 1)
  c.data.pp = c.data.pp.replace("keep('image', 'captions', 'objects')", "keep('image', 'captions', 'tags')")


def _runlocal(c, arg):
  """synthetic_scenes at 64x64 on a 2-core CPU budget; tags are the 10 shapes and the colours present."""
  c.data.update(common.synthetic_scenes("name"))
  c.data.pp = c.data.pp.replace(
    "tags(num_tags=80)", "tags(fields=(('objects', 'label', 0), ('objects', 'color', 10)), num_tags=20)"
  ).replace("area=(0.2, 1.0)", "area=(0.5, 1.0)")
  c.method.update(dtype="float32", head_hidden=256, queue_size=1024)
  # J_ic and J_ci are sums over the queue: keep the paper's weight per hinge (1e-4 for 32768 keys) at 1024 keys.
  for name in ("j_ic", "j_ci"):
    c.method.weights[name] *= 32768 / c.method.queue_size
  # Without BatchNorm in the inter-modal heads both towers' 1024-d embeddings collapse to one point within a few
  # hundred steps here (retrieval at chance).
  c.method.head_batchnorm = ("inter",)
  # The from-scratch text encoder's first-token state is the same for every caption at init and stays so.
  c.method.text_pool = "mean"
  # text=bert: no dropout at this budget, where the recipe's 0.1 lowers the probe and VSE++ recall.
  c.method.bert_dropout = 0.0
  # VirTex runlocal's backbone (ResNet-10 w16, small stem): it probes better here than a ResNet-26 w16 with the
  # ImageNet stem (docs/results/mct.md).
  c.method.backbone = dict(depth=10, width=16, bn_group_size=16, stem="small", stem_stride=2)
  c.method.text = dict(hidden=128, num_layers=2, num_heads=4, max_len=40, dropout=0.1)
  c.tokenizer.vocab_size = 1000
  c.batch_size = 64
  c.total_steps = arg.steps or 500
  c.total_epochs = 0.0
  c.optim.warmup_steps = 50
  # 0.03 / 4e-5 are tuned for 200 epochs of COCO; at a few hundred steps both towers need more. runlocal trains
  # the whole text tower, heads included, at 0.05 (the recipe puts the text heads in the image group): the setting
  # of docs/results/mct.md's runlocal figures.
  c.optim.lr_groups = (("^(textual|text_pooler|text_intra|text_inter)/", 0.05), (".*", 0.1))
  # Momentum 0.999 follows the query encoder over thousands of steps; 500 steps need a faster key encoder.
  c.method.momentum = 0.99
  c.checkpoint.every_steps = 250
  c.log_every_steps = 50
  common.local_probe(c)
  c.evals.retrieval.update(common.retrieval_local(), random_init=True)
  c.evals.vsepp.update(defaults.VSEPP_RUNLOCAL, random_init=True)
