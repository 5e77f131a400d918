"""Every `python -m vlrep...` command the documentation shows runs, in its smallest real form.

The commands are collected from the files themselves (tests/docs_commands.py). COMMANDS below holds one entry per
documented command, in the order they run: how it is made small (the tiny dataset and runs, a step or two) or, for
one that needs real data, a GPU or a cluster, the clear message it must refuse with at once. A documented command
with no entry fails `test_every_documented_command_has_an_entry`; an entry whose command exits otherwise than its
entry says fails `test_documented_command`.

Every command goes through the same rewrites (REWRITES): the runlocal configs become their tiny test versions
(tests/tiny_NAME.py, which is NAME.py:runlocal with a tiny override list), and every path the docs show (/tmp/...,
/runs/..., gs://BUCKET/..., /data/..., ~/tensorflow_datasets, $W, $R) moves under this session's temp directory,
so a run a command trains (e.g. /tmp/loctex_local) is the run a later command reads. The commands run in a
pre-warmed process forked per command (vlrep.bench.forkserver): the argv is the documented one, run as
`python -m` runs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil

import docs_commands
import labelled_photos
import numpy as np
import pytest
from conftest import ROOT

from vlrep.bench.forkserver import Server

# ---------------------------------------------------------------------------------------------------- #
# How each documented command runs.
# ---------------------------------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Run:
  """Run it (after the rewrites, `replace` pairs, then `add` flags); it must exit 0 and print `expect`."""

  add: tuple[str, ...] = ()
  replace: tuple[tuple[str, str], ...] = ()
  expect: str = ""
  timeout: int = 300


@dataclasses.dataclass(frozen=True)
class Refuses:
  """It needs what a CPU test machine lacks (a real dataset, a GPU, a cluster): it must exit non-zero within
  `timeout` seconds printing `message` (a regex)."""

  message: str
  add: tuple[str, ...] = ()
  replace: tuple[tuple[str, str], ...] = ()
  timeout: int = 60


@dataclasses.dataclass(frozen=True)
class DryRun:
  """A sweep of many full runs: run with --dry_run, which resolves every run's config (arguments and override
  keys checked) and prints its command; the sweep mechanism itself is tested in test_evaluation.py."""

  add: tuple[str, ...] = ()
  replace: tuple[tuple[str, str], ...] = ()
  timeout: int = 120


@dataclasses.dataclass(frozen=True)
class Synopsis:
  """A usage line, not a command (placeholders such as NAME or [..|..], '...', shell variables, a bare module
  name in prose): the module's --help must work."""

  timeout: int = 60


@dataclasses.dataclass(frozen=True)
class SessionRun:
  """Run by one of the session's shared runs (tests/conftest.py's `shared_run`: `python -m vlrep.main
  --config=tests/tiny_NAME.py --workdir=...`, which is what this command becomes; other test files read the same
  run): its exit status and output are checked; a copy of the run at the command's workdir is the one later
  commands read."""

  expect: str = ""
  config: str = "tiny_virtex"


@dataclasses.dataclass(frozen=True)
class SameAs:
  """The same module on the same kind of input as another documented command that is run (it differs in paths,
  placeholder names or values only, e.g. RUN vs /tmp/icmlm_attfc): not run twice. `command` must have an entry
  that runs it."""

  command: str


@dataclasses.dataclass(frozen=True)
class Covered:
  """Run in its smallest real form by another test (a multi-process harness, or a step that only exists at full
  size, too slow to repeat here); that test file must exist and run this module."""

  test: str


D = "{data_dir}"  # the tiny synthetic_scenes data (VLREP_TEST_DATA_DIR)
TINY_EVAL = lambda name: (f"--config.evals.{name}.data_dir={D}", f"--config.evals.{name}.config_name=tiny")
# A dataset not prepared, or a run to start from that is not there (init_from, extractor=).
NOT_PREPARED = r"is not prepared in .*Prepare it|No run directory|has no checkpoint .*Train with vlrep.main first"
NO_MANUAL_DIR = r"--manual_dir=.* is not a folder or is empty"
# The paper recipe's VirTex, shrunk for a CPU (what tests/tiny_virtex.py does to runlocal), for the commands that
# train or time the full recipe.
TINY_RECIPE = (
  "--config.method.hidden=32",
  "--config.method.backbone.depth=10",
  "--config.method.backbone.width=8",
  "--config.method.backbone.bn_group_size=4",
  "--config.batch_size=4",
)
TINY_BENCHMARK = (*TINY_RECIPE, "--image_size=32", "--vocab_size=64", "--steps=1", "--windows=1", "--gemm_size=0")
VIRTEX = "{tmp}/vlrep_virtex_local"
# The runlocal backbones have the small stem, which the torchvision/Detectron2/official layouts lack: export says so
# (README); tests/test_export.py exports ImageNet-stem backbones.
SMALL_STEM = r"stem='small'"  # the quick start's run (tests/conftest.py's tiny_virtex_run, copied)
LOCTEX, MCT, ICMLM = "{tmp}/loctex_local", "{tmp}/mct_local", "{tmp}/icmlm_attfc"

COMMANDS: dict[str, object] = {
  # --- Training runs, first: later commands read them. ---------------------------------------------- #
  "python -m vlrep.main --config=configs/virtex.py:runlocal --workdir=/tmp/vlrep_virtex_local": SessionRun(
    expect="probe/map: pretrained"
  ),
  "python -m vlrep.main --config=configs/virtex.py:runlocal --workdir=/tmp/virtex_local": SameAs(
    "python -m vlrep.main --config=configs/virtex.py:runlocal --workdir=/tmp/vlrep_virtex_local"
  ),
  "python -m vlrep.main --config=configs/loctex.py:runlocal --workdir=/tmp/loctex_local": SessionRun(
    expect="Finished", config="tiny_loctex"
  ),
  # tests/test_clip.py trains tests/tiny_clip.py (this command's smallest form) to the end, resumed, evaluated.
  "python -m vlrep.main --config=configs/clip.py:runlocal --workdir=/tmp/clip_local": Covered("tests/test_clip.py"),
  # docs/at_scale.md: microbatches and remat, run on the tiny VirTex against a whole-batch run.
  "python -m vlrep.main --config=configs/clip.py --workdir=/data/runs/clip --config.microbatches=8 "
  "--config.remat=dots": Covered("tests/test_microbatches.py"),
  "python -m vlrep.main --config=configs/mct.py:runlocal --workdir=/tmp/mct_local": SessionRun(
    expect="Finished", config="tiny_mct"
  ),
  "python -m vlrep.main --config=configs/icmlm.py:runlocal,variant=tp --workdir=/tmp/icmlm_tp": Run(expect="Finished"),
  # docs/results/detection.md's pretraining runs: the runlocal recipes above with other argument values.
  "python -m vlrep.main --config=configs/virtex.py:runlocal --config.seed=1 --workdir=/tmp/virtex_local_s1": SameAs(
    "python -m vlrep.main --config=configs/virtex.py:runlocal --workdir=/tmp/vlrep_virtex_local"
  ),
  "python -m vlrep.main --config=configs/loctex.py:runlocal --config.seed=1 --workdir=/tmp/loctex_local_s1": SameAs(
    "python -m vlrep.main --config=configs/loctex.py:runlocal --workdir=/tmp/loctex_local"
  ),
  "python -m vlrep.main --config=configs/loctex.py:runlocal,loss=contrastive --workdir=/tmp/loctex_lc_local": SameAs(
    "python -m vlrep.main --config=configs/loctex.py:runlocal --workdir=/tmp/loctex_local"
  ),
  "python -m vlrep.main --config=configs/mct.py:runlocal,steps=550 --workdir=/tmp/mct_local": SameAs(
    "python -m vlrep.main --config=configs/mct.py:runlocal --workdir=/tmp/mct_local"
  ),
  "python -m vlrep.main --config=configs/icmlm.py:runlocal,variant=tfm,steps=550 --workdir=/tmp/icmlm_tfm_local": SameAs(
    "python -m vlrep.main --config=configs/icmlm.py:runlocal,variant=tp --workdir=/tmp/icmlm_tp"
  ),
  "python -m vlrep.main --config=configs/icmlm.py:runlocal,variant=att_fc,warmup_frozen=150 "
  "--config.init_from=/tmp/icmlm_tp --workdir=/tmp/icmlm_attfc": Run(expect="Backbone initialised from"),
  "python -m vlrep.main --config=configs/finetune.py:runlocal --config.init_from=/tmp/virtex_local "
  "--workdir=/tmp/ft_local": Run(
    # finetune.py:runlocal itself (a ResNet-26, ImageNet stem) from the quick start's ResNet-10: init_from brings
    # the architecture (tests/tiny_finetune.py would hide that by matching the backbone).
    replace=(("tests/tiny_finetune.py", "configs/finetune.py:runlocal"),),
    add=(
      "--config.data.config_name=tiny",
      f"--config.data.data_dir={D}",
      "--config.method.backbone.bn_group_size=4",
      "--config.batch_size=8",
      "--config.total_epochs=0",
      "--config.total_steps=2",
      *TINY_EVAL("val"),
      "--config.evals.val.batch_size=8",
    ),
    expect="the backbone takes the architecture of",
  ),
  # The supervised reference (synthetic_scenes' presence labels, the benchmark's ResNet-10), 2 steps on the tiny data.
  "python -m vlrep.main --config=configs/finetune.py:runlocal,labels=presence,steps=550 --workdir=/tmp/supervised_local": Run(
    add=(
      "--config.data.config_name=tiny",
      f"--config.data.data_dir={D}",
      "--config.batch_size=8",
      "--config.total_steps=2",
      *TINY_EVAL("probe"),
    ),
    expect="Finished",
  ),
  "python -m vlrep.main --config=configs/vlbert.py:runlocal,arch=visual_bert,stage=pretrain,data=questions,"
  "extractor=$V --workdir=/tmp/vb_q": Run(expect="Finished"),
  "python -m vlrep.main --config=configs/vlbert.py:runlocal,arch=visual_bert,stage=finetune,task=vqa,frozen,"
  "extractor=$V --config.method.pretrained_run=/tmp/vb_q --workdir=/tmp/vb_q_vqa_frozen": Run(expect="Finished"),
  "python -m vlrep.main --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local,arch=vilbert,"
  "stage=pretrain,data=captions,lr=3e-4 --workdir=/tmp/vl_plr/vilbert_captions": Covered(
    "tests/test_vlbert.py"
  ),  # ViLBERT pretraining, end to end there
  # Your own data: prepared from a folder the test writes, then the paper recipe on it (shrunk).
  "python -m vlrep.data.prepare --dataset=image_text --manual_dir=/data/mine --data_dir=/data/mine_tfds": Run(
    replace=(("{tmp}/data/mine ", "{own_data} "),), expect="image_text"
  ),
  "python -m vlrep.data.prepare --dataset=image_text": SameAs(
    "python -m vlrep.data.prepare --dataset=image_text --manual_dir=/data/mine --data_dir=/data/mine_tfds"
  ),
  # The paper recipe on it, shrunk; its VOC07 probe is not prepared here, so evaluations are off.
  "python -m vlrep.main --config=configs/virtex.py:data=/data/mine_tfds --workdir=/tmp/virtex_mine": Run(
    add=(
      *TINY_RECIPE,
      # float32: bf16 is emulated on CPUs and compiles slower; the recipe's bf16 step is
      # test_models_optim_eval's (every task, finite loss and gradients).
      "--config.method.dtype=float32",
      "--config.tokenizer.path={vocab}",
      "--config.total_steps=2",
      "--config.log_every_steps=1",
      "--config.evals={}",
    ),
    expect="Finished 2 steps",
  ),
  # Each other method on your own data, end to end (runlocal's sizes, shrunk) in tests/test_own_data.py.
  **{
    c: Covered("tests/test_own_data.py")
    for c in (
      "python -m vlrep.main --config=configs/loctex.py:data=/data/mine_tfds --workdir=/tmp/loctex_mine",
      "python -m vlrep.main --config=configs/mct.py:data=/data/mine_tfds,tags=True,bert=$BERT --workdir=/tmp/mct_mine",
      "python -m vlrep.main --config=configs/icmlm.py:data=/data/mine_tfds,variant=tp,bert=$BERT "
      "--workdir=/tmp/icmlm_tp_mine",
      "python -m vlrep.main --config=configs/vlbert.py:data=/data/mine_tfds,arch=visual_bert,stage=pretrain,"
      "extractor=RUN,bert=$BERT --workdir=/tmp/vb_mine",
    )
  },
  # Your own classes (docs/own_classes.md): a folder per class of real photos (tests/labelled_photos.py) prepared;
  # each evaluator on such a folder, through vlrep.evaluate on the quick start's run at its 32 px, with its metrics
  # checked in summary.json, in tests/test_own_labelled.py.
  "python -m vlrep.data.prepare --dataset=image_folder --manual_dir=/data/labelled --data_dir=/data/labelled_tfds": Run(
    replace=(("{tmp}/data/labelled ", "{labelled} "),), expect="image_folder"
  ),
  **{
    f"python -m vlrep.evaluate --config=configs/eval/{name}.py:data=/data/labelled_tfds --workdir=RUN": Covered(
      "tests/test_own_labelled.py"
    )
    for name in ("linear_probe", "voc07_svm", "zero_shot")
  },
  # --- The paper recipes: real datasets, so each refuses at once. ----------------------------------- #
  **{
    c: Refuses(NOT_PREPARED)
    for c in (
      "python -m vlrep.main --config=configs/virtex.py --workdir=$W/virtex",
      "python -m vlrep.main --config=configs/virtex.py --workdir=/runs/virtex_r50_l1_h2048",
      "python -m vlrep.main --config=configs/virtex.py --workdir=gs://BUCKET/virtex_r50_l1_h2048",
      "python -m vlrep.main --config=configs/loctex.py --workdir=$W/loctex",
      "python -m vlrep.main --config=configs/loctex.py --workdir=/runs/loctex_r50",
      "python -m vlrep.main --config=configs/loctex.py --workdir=gs://BUCKET/loctex_r50",
      "python -m vlrep.main --config=configs/clip.py --workdir=gs://BUCKET/clip_r50",
      "python -m vlrep.main --config=configs/clip.py:loss=sigmoid --workdir=gs://BUCKET/siglip_r50",
      "python -m vlrep.main --config=configs/mct.py:text=scratch --workdir=...",
      "python -m vlrep.main --config=configs/finetune.py --config.init_from=$W/virtex --workdir=$W/ft",
      "python -m vlrep.main --config=configs/finetune.py --config.init_from=/runs/virtex_r50 --workdir=/runs/inat_ft",
      "python -m vlrep.tools.build_vocab --config=configs/virtex.py",
    )
  },
  **{
    c: Refuses(rf"{NOT_PREPARED}|BERT|bert-base-uncased")
    for c in (
      "python -m vlrep.main --config=configs/mct.py:bert=$BERT --workdir=$W/mct",
      "python -m vlrep.main --config=configs/mct.py:bert=/data/bert-base-uncased --workdir=/runs/mct_r50",
      "python -m vlrep.main --config=configs/mct.py:bert=/data/bert-base-uncased --workdir=gs://BUCKET/mct_r50",
      "python -m vlrep.main --config=configs/mct.py:bert=/data/bert-base-uncased,tags=True --workdir=...",
      "python -m vlrep.main --config=configs/icmlm.py:variant=tp,bert=$BERT --workdir=$W/tp",
      "python -m vlrep.main --config=configs/icmlm.py:variant=tfm,bert=$BERT --config.init_from=$W/tp "
      "--workdir=$W/icmlm",
      "python -m vlrep.main --config=configs/icmlm.py:variant=tp,bert=/data/bert-base-uncased --workdir=$W/tp_postag",
      "python -m vlrep.main --config=configs/icmlm.py:variant=tp,bert=/data/bert-base-uncased "
      "--workdir=/runs/tp_postag",
      "python -m vlrep.main --config=configs/icmlm.py:variant=tfm,bert=/data/bert-base-uncased "
      "--config.init_from=$W/tp_postag --workdir=$W/icmlm_tfm",
      "python -m vlrep.main --config=configs/icmlm.py:variant=tfm,bert=/data/bert-base-uncased "
      "--config.init_from=/runs/tp_postag --workdir=/runs/icmlm_tfm",
      "python -m vlrep.main --config=configs/vlbert.py:arch=visual_bert,stage=pretrain,data=captions,bert=$BERT "
      "--workdir=$W/vb_coco",
      "python -m vlrep.main --config=configs/vlbert.py:arch=visual_bert,stage=finetune,task=vqa,bert=$BERT "
      "--config.method.pretrained_run=$W/vb_coco --workdir=$W/vb_coco_vqa",
      "python -m vlrep.main --config=configs/vlbert.py:arch=visual_bert,stage=pretrain,data=captions,bert=$BERT,"
      "extractor=$W/virtex --workdir=$W/vb",
      "python -m vlrep.main --config=configs/vlbert.py:arch=visual_bert,stage=finetune,task=vqa,bert=$BERT,"
      "extractor=$W/virtex --config.method.pretrained_run=$W/vb --workdir=$W/vb_vqa",
    )
  },
  # --- Preparing the real datasets: from a local copy that is not here. ----------------------------- #
  **{
    c: Refuses(NO_MANUAL_DIR)
    for c in (
      "python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=/data/coco",
      "python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=/data/coco "
      "--data_dir=~/tensorflow_datasets",
      "python -m vlrep.data.prepare --dataset=conceptual_captions --manual_dir=/data/cc",
      "python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=/data/coco",
      "python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=/data/coco "
      "--data_dir=~/tensorflow_datasets",
      "python -m vlrep.data.prepare --dataset=mm_imdb --manual_dir=/data/mmimdb",
      "python -m vlrep.data.prepare --dataset=snli_ve --manual_dir=/data/snli_ve",
      "python -m vlrep.data.prepare --dataset=vizwiz --manual_dir=/data/vizwiz",
      "python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=/data/VOCdevkit --data_dir=~/tensorflow_datasets",
      "python -m vlrep.data.prepare --dataset=vqa2 --manual_dir=/data/vqa2",
    )
  },
  **{
    c: Synopsis()
    for c in (
      "python -m vlrep.data.prepare",
      "python -m vlrep.data.prepare --dataset=NAME --manual_dir=DIR",
      "python -m vlrep.data.prepare --dataset=coco_captions2017",
      "python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=MANUAL_DIR",
      "python -m vlrep.data.prepare --dataset=coco_captions2017 --manual_dir=PATH",
      "python -m vlrep.data.prepare --dataset=image_text --manual_dir=/data/mine (your own: webdataset shards, or",
      "python -m vlrep.data.prepare --dataset=image_folder --manual_dir=/data/labelled (your own labelled images: a",
      "python -m vlrep.data.prepare --dataset=image_folder --manual_dir=MANUAL_DIR --data_dir=DATA_DIR",
      "python -m vlrep.data.prepare --dataset=image_text --manual_dir=MANUAL_DIR",
      "python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=/data/coco "
      "[--config_name=coco_openimages]",
      "python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=MANUAL_DIR",
      "python -m vlrep.data.prepare --dataset=localized_narratives --manual_dir=PATH",
      "python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=...",
      "python -m vlrep.data.prepare --dataset=voc2007 --manual_dir=PATH",
      "python -m vlrep.data.prepare --dataset=vqa2 --manual_dir=/data/vqa2 (also vizwiz, snli_ve, mm_imdb,",
      "python -m vlrep.evaluate",
      "python -m vlrep.evaluate --config=configs/eval/NAME.py --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/NAME.py[:ARGS] --workdir=RUN [--checkpoint=best",
      "python -m vlrep.main",
      'python -m vlrep.main --config="$CONFIG" --workdir="$WORKDIR" "$@"',
      'python -m vlrep.main --config="$CONFIG" --workdir="$WORKDIR" --coordinator_address="127.0.0.1:$PORT" '
      '--num_processes="$N" --process_id="$i" "$@" > "$WORKDIR/process_$i.log" 2>',
      "python -m vlrep.main --config=configs/finetune.py",
      "python -m vlrep.main --config=configs/virtex.py[:ARG] --workdir=DIR [--config.KEY=VALUE]",
      'python -m vlrep.main --multihost --config="$CONFIG" --workdir="$WORKDIR" "${EXTRA[@]}" "$@"',
      'python -m vlrep.main --multihost --config=$CONFIG --workdir=$WORKDIR $*"',
      "python -m vlrep.main ... --coordinator_address=HOST:PORT --num_processes=N --process_id=I",
      "python -m vlrep.tools.attention_maps --workdir=RUN --out_dir=DIR [--map=1x",
      "python -m vlrep.bench.benchmark --config=CONFIG --config.batch_size=256 --steps=20",
      'python -m vlrep.bench.benchmark --steps="$STEPS" --windows="$WINDOWS" --input=device ${CMDS[$NAME]} '
      '--output="$OUT/$NAME.json" $TURN >"/tmp/vlrep_gpu_$NAME.log" 2>',
      "python -m vlrep.tools.caption --workdir=RUN [--decoding=beam",
      "python -m vlrep.tools.coco_subset",
      "python -m vlrep.tools.convert_regions",
      "python -m vlrep.tools.grounding --workdir=/tmp/virtex_local [--direction=backward] [--limit=300]",
      'python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="hidden=128 256',
    )
  },
  # --- Evaluation. ------------------------------------------------------------------------------------ #
  "python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:runlocal --workdir=/tmp/virtex_local": Run(
    add=TINY_EVAL("voc07_svm"), expect="voc07_svm/map"
  ),
  "python -m vlrep.evaluate --config=configs/eval/linear_probe.py:runlocal --workdir=/tmp/virtex_local": Run(
    add=(*TINY_EVAL("linear_probe_virtex"), "--config.evals.linear_probe_virtex.epochs=1"), expect="linear_probe"
  ),
  "python -m vlrep.evaluate --config=configs/eval/captioning.py:runlocal --workdir=/tmp/virtex_local": Run(
    add=(*TINY_EVAL("captioning_beam"), "--config.evals.captioning_beam.limit=4"), expect="captioning_beam/cider"
  ),
  "python -m vlrep.evaluate --config=configs/eval/tagging.py:runlocal --workdir=/tmp/mct_local": Run(
    add=TINY_EVAL("tagging"), expect="tagging/"
  ),
  "python -m vlrep.evaluate --config=configs/eval/retrieval.py:runlocal --workdir=/tmp/mct_local": Run(
    add=(*TINY_EVAL("vsepp"), "--config.evals.vsepp.fold_size=8"), expect="vsepp/"
  ),
  "python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal --workdir=/tmp/virtex_local": Run(
    add=(*TINY_EVAL("zero_shot"), *TINY_EVAL("zero_shot_multi")), expect="zero_shot/top1"
  ),
  # docs/results/baselines.md's choices on probe_val: one label form each, on the quick start's (captioner) run.
  "python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal,split=probe_val,labels=single,b"
  "iggest=False --workdir=RUN": Run(replace=(("RUN", VIRTEX),), add=TINY_EVAL("zero_shot"), expect="zero_shot/top1"),
  "python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal,split=probe_val,labels=single --workdir=RUN": SameAs(
    "python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal,split=probe_val,labels=single,b"
    "iggest=False --workdir=RUN"
  ),
  "python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal,split=probe_val,labels=multi,po"
  "sterior=False --workdir=RUN": Run(
    replace=(("RUN", VIRTEX),), add=TINY_EVAL("zero_shot_multi"), expect="zero_shot_multi/map"
  ),
  "python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal,split=probe_val,labels=multi --workdir=RUN": SameAs(
    "python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal,split=probe_val,labels=multi,po"
    "sterior=False --workdir=RUN"
  ),
  "python -m vlrep.evaluate --config=configs/eval/localization.py --workdir=/tmp/loctex_local": Run(
    add=TINY_EVAL("localization"),
    replace=(("configs/eval/localization.py", "configs/eval/localization.py:sizes=2+4"),),
    expect="localization/pointing",
  ),
  **{
    c: Refuses(NOT_PREPARED, replace=(("DIR", VIRTEX),))
    for c in (
      "python -m vlrep.evaluate --config=configs/eval/captioning.py --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/captioning.py:decoding=nucleus --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/linear_probe.py --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/linear_probe.py:dataset=i_naturalist2018 --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/linear_probe.py:variant=mct --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/voc07_svm.py --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:variant=icmlm --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/tagging.py --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/retrieval.py --workdir=DIR",
      "python -m vlrep.evaluate --config=configs/eval/zero_shot.py --workdir=DIR",
    )
  },
  "python -m vlrep.evaluate --config=configs/eval/retrieval.py:protocol=towers --workdir=DIR": Refuses(
    NOT_PREPARED, replace=(("DIR", MCT),)
  ),
  # The tiny LocTex run's maps are 2x2 and 4x4 (32 px): the first two sizes are its own.
  "python -m vlrep.evaluate --config=configs/eval/localization.py:sizes=2+4+8,limit=0 --workdir=DIR": Run(
    add=TINY_EVAL("localization"), replace=(("DIR", LOCTEX),), expect="localization/pointing"
  ),
  "python -m vlrep.evaluate --config=configs/eval/retrieval.py:protocol=both": Refuses(r"--workdir", timeout=60),
  # --- Detection transfer (helper detection): a 2-iteration Mask R-CNN on a few tiny scenes. ------------ #
  "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/tmp/virtex_local": Run(
    add=(
      *TINY_EVAL("detection"),
      *(
        f"--config.evals.detection.{k}"
        for k in ("train_limit=8", "test_limit=4", "detector.iterations=2", "detector.batch_size=2")
      ),
      *(f"--config.evals.detection.detector.{k}" for k in ("min_size=32", "max_size=32", "threads=1")),
    ),
    expect="detection/box_ap",
  ),
  "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init --workdir=/tmp/virtex_local": Run(
    add=(
      *TINY_EVAL("detection_random_init"),
      *(
        f"--config.evals.detection_random_init.{k}"
        for k in ("train_limit=8", "test_limit=4", "detector.iterations=2", "detector.batch_size=2")
      ),
      *(f"--config.evals.detection_random_init.detector.{k}" for k in ("min_size=32", "max_size=32", "threads=1")),
    ),
    expect="detection_random_init/mask_ap",
  ),
  # docs/results/detection.md: the same evaluator on other runs, seeds and settings (parallel workers: tests/test_detection.py).
  **{
    c: SameAs("python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/tmp/virtex_local")
    for c in (
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/tmp/virtex_local_s1",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/tmp/loctex_local_s1",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/virtex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_lc_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/clip_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/mct_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/icmlm_tfm_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/supervised_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,iterations=300,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,train_limit=500,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,iterations=450,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,iterations=300,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/virtex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,iterations=300,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
    )
  },
  # docs/results/detection.md: random initialisation at the same settings.
  **{
    c: SameAs(
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init --workdir=/tmp/virtex_local"
    )
    for c in (
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/virtex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init,iterations=300,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init,train_limit=500,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init,iterations=450,split=probe_val,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/loctex_local",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal,random_init,iterations=300,seeds=0+1+2,parallel=3,threads=1 --workdir=/tmp/virtex_local",
    )
  },
  "python -m vlrep.evaluate --config=configs/eval/detection.py:coco=/data/coco --workdir=DIR": Refuses(
    r"train_annotations=.*instances_train2017.json does not exist", replace=(("DIR", VIRTEX),)
  ),
  "python -m vlrep.data.instances --dataset=synthetic_scenes --split=val --out=/tmp/scenes_val/instances.json": Run(
    add=("--config_name=tiny", f"--data_dir={D}"), expect="Wrote 16 images and"
  ),
  "python -m vlrep.data.instances --dataset=synthetic_scenes --config_name=tiny --split=val --out=/tmp/scenes_tiny/in"
  "stances.json --images=/tmp/scenes_tiny/images": Run(add=(f"--data_dir={D}",), expect="Wrote 16 images and"),
  # The worker imports torch, which crashes in the forkserver's pre-warmed TensorFlow process; the evaluator runs it
  # as a fresh `python -m vlrep.pytorch.detection_worker` process, which tests/test_detection.py's fine-tune does.
  **{
    c: Covered("tests/test_detection.py")
    for c in (
      "python -m vlrep.pytorch.detection_worker --spec=SPEC.json --out=METRICS.json",
      "python -m vlrep.pytorch.detection_worker",
    )
  },
  # --- Export. ---------------------------------------------------------------------------------------- #
  # The detection hand-off (backbone.safetensors + backbone.json): any stem exports, the quick start's run too.
  "python -m vlrep.interop.export --workdir=RUN --checkpoint=best --format=backbone --out=FOLDER": Run(
    replace=(("RUN", VIRTEX), ("FOLDER", "{tmp}/backbone_handoff")), expect="Exported step"
  ),
  "python -m vlrep.interop.export --workdir=DIR --format=backbone --out=FOLDER": SameAs(
    "python -m vlrep.interop.export --workdir=RUN --checkpoint=best --format=backbone --out=FOLDER"
  ),
  "python -m vlrep.interop.export --workdir=/tmp/vlrep_virtex_local --format=vlrep --out=/tmp/vlrep_virtex_shared": Run(),
  "python -m vlrep.interop.export --workdir=/tmp/clip_local --format=vlrep --out=/tmp/clip_shared": SameAs(
    "python -m vlrep.interop.export --workdir=/tmp/vlrep_virtex_local --format=vlrep --out=/tmp/vlrep_virtex_shared"
  ),
  "python -m vlrep.interop.export --workdir=RUN --format=torchvision --out=backbone.safetensors": Refuses(
    SMALL_STEM, replace=(("RUN", VIRTEX), ("backbone.safetensors", "{tmp}/backbone.safetensors"))
  ),
  "python -m vlrep.interop.export --workdir=RUN --format=detectron2 --out=backbone.pkl": Refuses(
    SMALL_STEM, replace=(("RUN", VIRTEX), ("backbone.pkl", "{tmp}/backbone.pkl"))
  ),
  "python -m vlrep.interop.export --workdir=DIR --format=torchvision --out=backbone.safetensors": Refuses(
    SMALL_STEM, replace=(("DIR", VIRTEX), ("backbone.safetensors", "{tmp}/backbone_dir.safetensors"))
  ),
  "python -m vlrep.interop.export --workdir=DIR --format=detectron2 --out=backbone.pkl": Refuses(
    SMALL_STEM, replace=(("DIR", VIRTEX), ("backbone.pkl", "{tmp}/backbone_dir.pkl"))
  ),
  # The quick start's run is a VirTex, not a VisualBERT: a clear refusal (tests/test_import_visual_bert.py exports).
  "python -m vlrep.interop.export --workdir=DIR --format=visual_bert --out=FOLDER": Refuses(
    r"exports VisualBERT runs", replace=(("DIR", VIRTEX), ("FOLDER", "{tmp}/visual_bert_hf"))
  ),
  # --- Tools on the runs above. ------------------------------------------------------------------------ #
  "python -m vlrep.tools.caption --workdir=/tmp/virtex_local photo1.jpg photo2.png": Run(
    replace=(("photo1.jpg", "{image}"), ("photo2.png", "{image_png}")), expect="photo"
  ),
  "python -m vlrep.tools.caption --workdir=DIR --decoding=nucleus --attention_dir=/tmp/att photo.jpg": Run(
    replace=(("DIR", VIRTEX), (" photo.jpg", " {image}"))
  ),
  "python -m vlrep.tools.caption --workdir=RUN --attention_dir=DIR IMAGE...": SameAs(
    "python -m vlrep.tools.caption --workdir=DIR --decoding=nucleus --attention_dir=/tmp/att photo.jpg"
  ),
  # vlrep.tools.features (docs/interop.md) on the quick start's run; tests/test_features.py checks its values against
  # torchvision's own preprocessing and model (an imported ResNet) and against a trained run's backbone.
  "python -m vlrep.tools.features --workdir=RUN IMAGES... --out=FILE": Synopsis(),
  "python -m vlrep.tools.features --workdir=/tmp/vlrep_virtex_local photo1.jpg photo2.png "
  "--out=/tmp/features.safetensors": Run(
    replace=(("photo1.jpg", "{image}"), ("photo2.png", "{image_png}")), expect=r"Preprocessing: shorter side resized"
  ),
  "python -m vlrep.tools.features --workdir=/runs/in1k_r50 photo.jpg --resize=256 --size=224 --out=/tmp/pooled.npy": Run(
    replace=(("{tmp}/runs/in1k_r50", VIRTEX), (" photo.jpg", " {image}")), expect=r"1 images, pooled \[1, \d+\]"
  ),
  # vlrep.predict (README, docs/interop.md) on the quick start's run; tests/test_predict.py checks its JSON lines
  # against vlrep.load's values and its refusals.
  "python -m vlrep.predict": Synopsis(),
  "python -m vlrep.predict --model=/tmp/vlrep_virtex_local caption photo.jpg": Run(
    replace=((" photo.jpg", " {image}"),), expect=r'\{"image": "[^"]*photo\.jpg", "caption": "\w'
  ),
  "python -m vlrep.predict --model=/tmp/vlrep_virtex_local zero-shot --labels=cat,dog,boat photo.jpg": Run(
    replace=((" photo.jpg", " {image}"),), expect=r'"top": \[\{"label": "(cat|dog|boat)", "score": -?\d'
  ),
  "python -m vlrep.predict --model=/tmp/vlrep_virtex_local embed photo.jpg": Run(
    replace=((" photo.jpg", " {image}"),), expect=r'"pooled": \[-?\d'
  ),
  # vlrep.bench.load_speed (docs/speed.md) on the shared folder the export entry above wrote, one fresh process.
  "python -m vlrep.bench.load_speed --model=/tmp/vlrep_virtex_shared --task=caption --repeats=5": Run(
    replace=(("--repeats=5", "--repeats=1"),), expect=r"total +median +\d"
  ),
  "python -m vlrep.bench.load_speed --model=/tmp/clip_shared --task=zero_shot --repeats=5": SameAs(
    "python -m vlrep.bench.load_speed --model=/tmp/vlrep_virtex_shared --task=caption --repeats=5"
  ),
  "python -m vlrep.bench.load_speed --model=/tmp/vlrep_virtex_shared --task=zero_shot --repeats=5": SameAs(
    "python -m vlrep.bench.load_speed --model=/tmp/vlrep_virtex_shared --task=caption --repeats=5"
  ),
  "python -m vlrep.predict --model=/tmp/vlrep_virtex_shared caption photo.png": SameAs(
    "python -m vlrep.predict --model=/tmp/vlrep_virtex_local caption photo.jpg"
  ),
  # vlrep.pytorch.detectron2_transfer (docs/detectron2.md): Detectron2 is not on the package index, so CI has none;
  # tests/test_detectron2_transfer.py checks its refusal, and where Detectron2 is built, runs it end to end.
  "python -m vlrep.pytorch.detectron2_transfer --workdir=RUN --config-file=configs/detectron2/FILE.yaml": Synopsis(),
  "python -m vlrep.pytorch.detectron2_transfer": Synopsis(),
  "python -m vlrep.pytorch.detectron2_transfer --workdir=RUN --config-file=configs/detectron2/FILE.yaml "
  "[KEY VALUE ...]": Synopsis(),
  "python -m vlrep.pytorch.detectron2_transfer --workdir=/runs/virtex_r50 "
  "--config-file=configs/detectron2/voc_faster_rcnn_R_50_C4_24k.yaml --num-gpus=8": Refuses(r"no such run directory"),
  "python -m vlrep.pytorch.detectron2_transfer --workdir=/runs/loctex_r50 "
  "--config-file=configs/detectron2/coco_mask_rcnn_R_50_FPN_2x.yaml "
  "--dataset=mine_train=coco:/data/mine/train.json:/data/mine/images "
  "--dataset=mine_val=coco:/data/mine/val.json:/data/mine/images --train=mine_train --test=mine_val "
  'SOLVER.MAX_ITER 2000 SOLVER.STEPS "(1500,)"': Refuses(r"no such run directory"),
  # docs/detectron2.md's run of the driver: the ResNet-50 run it transfers (what tests/test_detectron2_transfer.py
  # trains, with Detectron2 installed, for its end-to-end test), the instances it fine-tunes on (as above, tiny), and
  # the driver itself, which here has no run at that path (and CI no Detectron2).
  "python -m vlrep.main --config=configs/virtex.py:runlocal --workdir=/tmp/d2run_r50 --config.method.backbone.stem=imagenet "
  "--config.method.backbone.depth=50 --config.method.backbone.width=16 --config.total_steps=60 --config.evals={}": Covered(
    "tests/test_detectron2_transfer.py"
  ),
  "python -m vlrep.data.instances --dataset=synthetic_scenes --split=train --limit=400 "
  "--out=/tmp/scenes_d2/train/instances.json --images=/tmp/scenes_d2/train/images": Run(
    add=("--config_name=tiny", f"--data_dir={D}"), expect=r"Wrote 64 images and \d+ instances"
  ),
  "python -m vlrep.data.instances --dataset=synthetic_scenes --split=val --limit=200 "
  "--out=/tmp/scenes_d2/val/instances.json --images=/tmp/scenes_d2/val/images": Run(
    add=("--config_name=tiny", f"--data_dir={D}"), expect="Wrote 16 images and"
  ),
  "python -m vlrep.pytorch.detectron2_transfer --workdir=/tmp/d2run_r50 "
  "--config-file=configs/detectron2/coco_mask_rcnn_R_50_FPN_2x.yaml "
  "--dataset=scenes_train=coco:/tmp/scenes_d2/train/instances.json:/tmp/scenes_d2/train/images "
  "--dataset=scenes_val=coco:/tmp/scenes_d2/val/instances.json:/tmp/scenes_d2/val/images "
  "--train=scenes_train --test=scenes_val --num-workers=0 "
  'SOLVER.MAX_ITER 40 SOLVER.STEPS "(30,)" SOLVER.IMS_PER_BATCH 4 SOLVER.BASE_LR 0.01 SOLVER.WARMUP_ITERS 10 '
  'INPUT.MIN_SIZE_TRAIN "(256,)" INPUT.MAX_SIZE_TRAIN 256 INPUT.MIN_SIZE_TEST 256 INPUT.MAX_SIZE_TEST 256 '
  "MODEL.ROI_HEADS.NUM_CLASSES 10 TEST.EVAL_PERIOD 0": Refuses(r"no such run directory"),
  "python -m vlrep.tools.generate_captions --workdir=/tmp/virtex_local --dataset=synthetic_scenes "
  "--split=ood_train --output=/tmp/ood_generated.json": Run(add=(f"--data_dir={D}", "--config_name=tiny")),
  "python -m vlrep.tools.generate_captions --workdir=/tmp/vlrep_virtex_local --output=/tmp/vl/ood_generated.json": SameAs(
    "python -m vlrep.tools.generate_captions --workdir=/tmp/virtex_local --dataset=synthetic_scenes "
    "--split=ood_train --output=/tmp/ood_generated.json"
  ),
  "python -m vlrep.tools.grounding --workdir=/tmp/r/virtex/taskbicaptioning": Run(
    replace=(("{tmp}/r/virtex/taskbicaptioning", VIRTEX),), add=("--limit=8",)
  ),
  "python -m vlrep.tools.attention_maps --workdir=/tmp/loctex_local --out_dir=/tmp/att --num_examples=4": Run(),
  'python -m vlrep.tools.attention_maps --workdir=RUN --out_dir=/tmp/att --caption="a dog on the left" dog.jpg': Run(
    replace=(("RUN", LOCTEX), (" dog.jpg", " {image}"))
  ),
  "python -m vlrep.tools.train_metrics --workdir=/tmp/loctex_local --metrics=grad_norm,contrastive_loss": Run(),
  "python -m vlrep.tools.train_metrics --workdir=/tmp/loctex_local --metrics=train/ --format=csv": Run(),
  "python -m vlrep.tools.masked_attention --workdir=/tmp/icmlm_attfc --out_dir=/tmp/icmlm_maps": Run(),
  'python -m vlrep.tools.masked_attention --workdir=RUN --out_dir=/tmp/maps --caption="a dog on a red sofa" '
  "dog.jpg": Run(replace=(("RUN", ICMLM), (" dog.jpg", " {image}"))),
  "python -m vlrep.tools.masked_attention --workdir=RUN --out_dir=DIR": SameAs(
    "python -m vlrep.tools.masked_attention --workdir=/tmp/icmlm_attfc --out_dir=/tmp/icmlm_maps"
  ),
  "python -m vlrep.tools.coco_subset --annotations=instances_train2017.json": Refuses(r"--percent"),
  "python -m vlrep.tools.coco_subset --annotations=instances_train2017.json --percent=10 "
  "--out=instances_train2017_10pct.json": Run(
    replace=(("instances_train2017.json", "{coco_json}"), ("instances_train2017_10pct.json", "{tmp}/subset.json"))
  ),
  "python -m vlrep.tools.convert_regions --format=mmf --src=/data/vqa/features/trainval "
  "--dst=/data/vlrep_regions": Refuses(r"trainval"),
  "python -m vlrep.tools.weight_distance --root=/tmp/vl_study --arch=visual_bert --task=vqa": Refuses(r"vl_study"),
  # --- vlrep.bench: the benchmarks, shrunk. --------------------------------------------------------- #
  "python -m vlrep.bench.svm_benchmark --workdir=/tmp/virtex_local": Run(add=("--sets=synthetic_scenes",)),
  "python -m vlrep.bench.svm_benchmark --config=configs/virtex.py:runlocal": Run(add=("--voc07_size_scale=0.05",)),
  "python -m vlrep.bench.svm_benchmark --chance": Run(add=(f"--data_dir={D}", "--config_name=tiny"), expect="chance"),
  # One kind at one core (a process each; the kinds' equal work is tests/test_speed_tools.py's).
  "python -m vlrep.bench.pipeline_benchmark": Run(
    add=("--cores=1", "--kinds=tfdata_cache", "--seconds=0.5", "--num_images=16"), expect="images/s"
  ),
  **{
    c: Covered("tests/test_speed_tools.py")  # the same kinds at more cores: a process each
    for c in (
      "python -m vlrep.bench.pipeline_benchmark --cores=1,2 --seconds=15 --output=/tmp/pipeline.json",
      "python -m vlrep.bench.pipeline_benchmark --cores=1,2 --seconds=15 --kinds=tfdata,tfdata_cache,torch",
      "python -m vlrep.bench.pipeline_benchmark --cores=1,2 --seconds=15 --kinds=tfdata,tfdata_disk",
    )
  },
  "python -m vlrep.bench.torch_reference --batch_size=256 --steps=30 --compile_mode=max-autotune": Refuses(
    r"GPU|CUDA|torchvision"
  ),
  # The official kdexd/virtex step needs a checkout of its code (not in this repository, not on the package index).
  "python -m vlrep.bench.official_virtex --virtex_src=/tmp/virtex --batch_size=256 --steps=20 --windows=3": Refuses(
    r"is not a checkout of kdexd/virtex"
  ),
  **{
    c: SameAs("python -m vlrep.bench.official_virtex --virtex_src=/tmp/virtex --batch_size=256 --steps=20 --windows=3")
    for c in (
      "python -m vlrep.bench.official_virtex --virtex_src=DIR",
      'python -m vlrep.bench.official_virtex --virtex_src="$VIRTEX_SRC" --batch_size=256 --steps="$STEPS" '
      '--windows="$WINDOWS" --output="$OUT/official_virtex.json" $TURN >/tmp/vlrep_gpu_official.log 2>',
    )
  },
  # The speed benchmark: the paper recipe's step, shrunk (TINY_BENCHMARK).
  "python -m vlrep.bench.benchmark --config=configs/virtex.py:runlocal --steps=10": Run(
    add=("--steps=1", "--windows=1", "--gemm_size=0")
  ),
  "python -m vlrep.bench.benchmark --config=configs/virtex.py --config.batch_size=256 --steps=20 --windows=3": Run(
    add=TINY_BENCHMARK
  ),
  # Profiles and variants: test_speed_tools.py times variants round robin and profiles them through the same
  # benchmark function these flags call (a tiny step each; another compile of the recipe here would add nothing).
  # The PyTorch reference mirrors the full ResNet-50 only (too slow to compile here twice).
  **{
    c: Covered("tests/test_speed_tools.py")
    for c in (
      "python -m vlrep.bench.benchmark --config=configs/virtex.py --profile --output_dir=/tmp/bench",
      "python -m vlrep.bench.benchmark --config=configs/virtex.py --torch_reference",
      "python -m vlrep.bench.benchmark --config=configs/virtex.py --variant=f32:method.dtype=float32 "
      "--variant=fsdp:sharding.params=fsdp",
      # MCT's step with tags and the text tower from scratch: tiny_mct (runlocal's tags and scratch tower) there.
      "python -m vlrep.bench.benchmark --config=configs/mct.py:text=scratch,tags=True",
    )
  },
  # docs/speed.md's memory table and step-time ratios (vlrep.bench.memory): on the tiny CLIP, one device.
  "python -m vlrep.bench.memory --methods=virtex@1,virtex,clip,loctex --microbatches=1,2,4,8 --remat=none,dots,full "
  "--devices=8 --out=/tmp/memory.json": Run(
    replace=(
      ("--methods=virtex@1,virtex,clip,loctex", "--methods=tests/tiny_clip.py@1"),
      ("--microbatches=1,2,4,8", "--microbatches=1,2"),
      ("--remat=none,dots,full", "--remat=none,full"),
    ),
    expect="| tiny_clip | 1 | 8 (4) | 2 | full |",
  ),
  "python -m vlrep.bench.memory --time --methods=clip --settings=1:none,2:none,4:none,1:dots,1:full,4:full --steps=2 "
  "--windows=7 --out=/tmp/step_time_clip.json": Run(
    replace=(
      ("--methods=clip", "--methods=tests/tiny_clip.py"),
      ("--settings=1:none,2:none,4:none,1:dots,1:full,4:full", "--settings=2:dots"),
      ("--steps=2 --windows=7", "--steps=1 --windows=1"),
    ),
    expect="| tiny_clip | 8 | 2 | dots |",
  ),
  "python -m vlrep.bench.benchmark --config=configs/clip.py:runlocal --config.batch_size=128 "
  "--config.sharding.num_devices=1 --variant=mb2:microbatches=2 --image_size=64 --steps=1 --windows=2 --profile "
  "--profile_steps=1 --output_dir=/tmp/bench_microbatches": Covered("tests/test_speed_tools.py"),
  # --- Published checkpoints in and out (docs/interop.md): the files are not here, so each command refuses;
  # tests/test_import_run.py and tests/test_import_visual_bert.py run the same chain on checkpoints they write.
  **{
    # (the fine-tuning commands first name the datasets not prepared here: every dataset a run reads is checked
    # before anything is built)
    c: Refuses(r"No checkpoint \S+\.|No such image file|No run directory|is not prepared in .*Prepare it")
    for c in (
      "python -m vlrep.interop.import_run --format=torchvision --checkpoint=resnet50-0676ba61.pth --workdir=/runs/in1k_r50",
      "python -m vlrep.interop.import_run --format=virtex --checkpoint=bicaptioning_R_50_L1_H2048.pth --vocab=coco_10k.model "
      "--workdir=/runs/virtex_zoo",
      "python -m vlrep.interop.import_run --format=virtex --checkpoint=bicaptioning_R_50_L1_H2048.pth --vocab=coco_10k.model "
      "--workdir=/runs/virtex_zoo_h2048",
      "python -m vlrep.interop.import_run --format=visual_bert --checkpoint=visualbert-vqa-coco-pre/ "
      "--vocab=bert-base-uncased/vocab.txt --workdir=/runs/visualbert_coco",
      "python -m vlrep.interop.export --workdir=/runs/visualbert_coco --format=visual_bert --out=visualbert_coco_hf",
      "python -m vlrep.evaluate --config=configs/eval/voc07_svm.py --workdir=/runs/in1k_r50",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/runs/in1k_r50",
      "python -m vlrep.evaluate --config=configs/eval/detection.py:runlocal --workdir=/runs/virtex_zoo",
      "python -m vlrep.evaluate --config=configs/eval/captioning.py --workdir=/runs/virtex_zoo",
      "python -m vlrep.tools.caption --workdir=/runs/virtex_zoo photo.jpg",
      "python -m vlrep.tools.caption --workdir=/runs/virtex_zoo --decoding=virtex_official "
      "--preprocess=virtex_official photo.jpg",
      "python -m vlrep.evaluate --config=configs/eval/captioning.py:official --workdir=/runs/virtex_zoo",
      "python -m vlrep.tools.caption --workdir=/runs/virtex_zoo_h2048 photo.jpg",
      "python -m vlrep.main --config=configs/finetune.py --config.init_from=/runs/virtex_zoo --workdir=/runs/inat_ft",
      "python -m vlrep.main --config=configs/finetune.py --config.init_from=/runs/in1k_r50 --workdir=/runs/inat_ft",
      "python -m vlrep.interop.export --workdir=/runs/virtex_zoo --format=virtex --out=bicaptioning.pth",
      "python -m vlrep.interop.export --workdir=/runs/virtex_zoo_h2048 --format=virtex --out=bicaptioning.pth",
    )
  },
  "python -m vlrep.main --config=configs/vlbert.py:arch=visual_bert,stage=finetune,task=vqa,bert=$BERT,"
  "regions=$REGIONS --config.method.pretrained_run=/runs/visualbert_coco --config.method.region_type_id=1 "
  "--workdir=/runs/vb_vqa": Refuses(NOT_PREPARED),
  "python -m vlrep.interop.import_run --format=auto --checkpoint=FILE --workdir=RUN": Synopsis(),
  # --- CLIP, SigLIP and ViT checkpoints in and out (docs/interop.md): the published files are not here; the test
  # files build them with the real open_clip / transformers / timm and run these modules on them.
  "python -m vlrep.interop.export --workdir=RUN --format=timm --out=vit.safetensors": Covered(
    "tests/test_vit_evaluators.py"
  ),
  "python -m vlrep.interop.import_run --format=timm --checkpoint=vit.safetensors --workdir=/runs/timm_vit": Covered(
    "tests/test_vit_evaluators.py"
  ),
  **{
    c: Covered("tests/test_hf_clip_checkpoints.py")
    for c in (
      "python -m vlrep.interop.import_run --format=hf_clip --checkpoint=clip-vit-base-patch32/ --workdir=/runs/clip_b32",
      "python -m vlrep.interop.export --workdir=/runs/clip_b32 --format=hf_clip --out=clip_b32_hf",
      "python -m vlrep.interop.import_run --format=hf_siglip --checkpoint=siglip-base-patch16-224/ --workdir=/runs/siglip",
      "python -m vlrep.interop.export --workdir=/runs/siglip --format=hf_siglip --out=siglip_hf",
      "python -m vlrep.interop.import_run --format=big_vision --checkpoint=webli_en_b16_224_63724782.npz "
      "--vocab=c4_en.model --workdir=/runs/siglip_b16",
      "python -m vlrep.interop.export --workdir=/runs/siglip_b16 --format=big_vision --out=siglip_b16.npz",
      "python -m vlrep.interop.import_run --format=auto --checkpoint=clip-vit-base-patch32/ --workdir=RUN",
    )
  },
  **{
    c: Covered("tests/test_open_clip_checkpoints.py")
    for c in (
      "python -m vlrep.interop.import_run --format=open_clip --checkpoint=ViT-B-32.safetensors --workdir=/runs/clip_b32",
      "python -m vlrep.interop.import_run --format=auto --checkpoint=ViT-B-32.safetensors --workdir=/runs/clip_b32",
      "python -m vlrep.interop.import_run --format=auto --checkpoint=RN50.pt --workdir=/runs/clip_rn50",
      "python -m vlrep.interop.export --workdir=/runs/clip_b32 --format=open_clip --out=ViT-B-32.safetensors",
    )
  },
  # A ViT-B/16 at 224 px compiles for minutes on a CPU: tests/test_configs.py builds these recipes' models on tiny
  # inputs and runs the benchmark's `@FILE:ARG` variant.
  "python -m vlrep.bench.benchmark --config=configs/clip.py --config.batch_size=4 --steps=2 --windows=5 "
  "--variant=vit_b16:@configs/clip.py:backbone=vit_b16": Covered("tests/test_configs.py"),
  "python -m vlrep.bench.benchmark --config=configs/virtex.py:task=cappa,backbone=vit_b16 --config.batch_size=2 "
  "--steps=1 --windows=1": Covered("tests/test_configs.py"),
  # The quick start's run has the small stem, which the official ResNet lacks: a clear refusal.
  "python -m vlrep.interop.export --workdir=DIR --format=virtex --out=virtex.pth": Refuses(
    SMALL_STEM, replace=(("DIR", VIRTEX), ("virtex.pth", "{tmp}/virtex.pth"))
  ),
  # --- vlrep.bench: the multi-process harnesses, run by their own tests. ---------------------------- #
  "python -m vlrep.bench.faults --config=tests/tiny_virtex.py --workdir=/tmp/faults --kills=30": Covered(
    "tests/test_faults.py"
  ),
  "python -m vlrep.bench.faults --config=tests/tiny_virtex.py --workdir=/tmp/faults --kills=30 "
  "--overrides=total_steps=120,checkpoint.every_steps=4,evals.probe.every_steps=40": Covered("tests/test_faults.py"),
  "python -m vlrep.bench.faults --config=tests/tiny_virtex.py --workdir=/tmp/faults --kills=30 --seed=0 "
  "--overrides=total_steps=200,checkpoint.every_steps=4,evals.probe.every_steps=20": Covered("tests/test_faults.py"),
  "python -m vlrep.bench.faults --config=tests/tiny_virtex.py --workdir=/tmp/faults2 --kills=22 --seed=0 "
  "--processes=2 --overrides=total_steps=300,checkpoint.every_steps=4,evals.probe.every_steps=20": Covered(
    "tests/test_multihost.py"
  ),
  "python -m vlrep.bench.scale_test --workdir=/tmp/vlrep_scale --sizes=20k,200k --steps=300": Covered(
    "tests/test_multihost.py"
  ),
}

# Sweeps and studies: dry runs (each resolves its runs' configs).
_SWEEPS = """
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="task=bicaptioning" --seeds=0,1,2 --root=/tmp/r/virtex --eval_config=configs/eval/zero_shot.py:runlocal --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="task=cappa" --seeds=0,1,2 --root=/tmp/r/cappa_zs --eval_config=configs/eval/zero_shot.py:runlocal --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/clip.py:runlocal --vary="loss=softmax sigmoid" --seeds=0,1,2 --root=/tmp/r/clip_siglip --eval_config=configs/eval/zero_shot.py:runlocal --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/loctex.py:runlocal --vary="steps=550" --seeds=0,1,2 --root=/tmp/r/loctex550 --eval_config=configs/eval/zero_shot.py:runlocal --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/mct.py:runlocal --vary="steps=550" --seeds=0,1,2 --root=/tmp/r/mct550 --eval_config=configs/eval/zero_shot.py:runlocal --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,variant=tfm --vary="steps=550" --seeds=0,1,2 --root=/tmp/r/icmlm550 --metrics=probe/map,probe/map_val,probe/map_random_init
python -m vlrep.tools.sweep --config=configs/clip.py:runlocal --vary="loss=softmax" --seeds=0,1,2 --root=/tmp/r/clip --eval_config=configs/eval/zero_shot.py:runlocal --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/clip.py:runlocal,loss=sigmoid --vary="lr=1e-3 1e-2" --root=/tmp/r/siglip_lr --metrics=probe/map_val,probe/map
python -m vlrep.tools.sweep --config=configs/clip.py:runlocal --vary="loss=sigmoid" --seeds=0,1,2 --root=/tmp/r/siglip --eval_config=configs/eval/zero_shot.py:runlocal --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/finetune.py:runlocal,labels=presence --vary="steps=400" --seeds=0,1,2 --root=/tmp/supervised --metrics=probe/map,probe/map_val,probe/map_random_init
python -m vlrep.tools.sweep --config=configs/finetune.py:runlocal,labels=presence --vary="steps=550" --seeds=0,1,2 --root=/tmp/r/supervised --metrics=probe/map,probe/map_val,probe/map_random_init
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal --vary="variant=text_only" --seeds=0,1,2 --root=$R/text_only --metrics=masked_tokens/top1,masked_tokens/top5
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,variant=tfm,warmup_frozen=150 --vary="tp_weight=0.1" --seeds=0,1,2 --overrides="init_from=$R/tp/tagspostag{suffix}" --root=$R/lambda --metrics=probe/map_val,masked_tokens/top1
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,variant=tfm,warmup_frozen=150 --vary="tp_weight=1.0" --seeds=0,1,2 --overrides="init_from=$R/tp/tagspostag{suffix}" --root=$R/tfm --metrics=probe/map,probe/map_val,probe/map_random_init,probe/map_val_random_init,masked_tokens/top1,masked_tokens/top5
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,variant=tp --vary="tags=postag" --seeds=0,1,2 --root=$R/tp --metrics=probe/map,probe/map_val
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,variant=tp --vary="tags=postag" --seeds=0,1,2 --root=R/tp
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,variant=tp,steps=300,warmup_frozen=150 --vary="tags=postag" --seeds=0,1,2 --overrides="init_from=$R/tp/tagspostag{suffix}" --root=$R/control --metrics=probe/map,probe/map_val
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,warmup_frozen=150 --vary="variant=att_fc" --seeds=0,1,2 --overrides="init_from=$R/tp/tagspostag{suffix}" --root=$R/att --metrics=probe/map,probe/map_val
python -m vlrep.tools.sweep --config=configs/icmlm.py:runlocal,warmup_frozen=150 --vary="variant=tfm att_fc" --seeds=0,1,2 --overrides="init_from=R/tp/tagspostag{suffix}" --root=R/icmlm
python -m vlrep.tools.sweep --config=configs/loctex.py:runlocal --vary="loss=both" --seeds=0,1,2 --root=/tmp/loctex_w1 --overrides=method.localization_weight=1.0 --metrics=probe/map_val,localization/pointing_1x,localization/pointing_2x
python -m vlrep.tools.sweep --config=configs/loctex.py:runlocal --vary="loss=both" --seeds=0,1,2 --root=/tmp/r/loctex --metrics=probe/map,probe/map_val,probe/map_random_init,localization/pointing_1x,localization/chance_1x,localization/pointing_2x,localization/chance_2x
python -m vlrep.tools.sweep --config=configs/loctex.py:runlocal --vary="loss=contrastive localization both" --seeds=0,1,2 --root=/tmp/loctex_sweep --metrics=$M
python -m vlrep.tools.sweep --config=configs/loctex.py:runlocal --vary="scales=1 1+2 1+2+4" --seeds=0,1,2 --root=/tmp/loctex_sweep_scales --metrics=$M
python -m vlrep.tools.sweep --config=configs/loctex.py:runlocal,oracle=True --vary="loss=both localization" --seeds=0,1,2 --root=/tmp/loctex_sweep_oracle --metrics=$M
python -m vlrep.tools.sweep --config=configs/mct.py:runlocal --vary="loss=full" --seeds=0,1,2 --root=/tmp/r/mct --metrics=probe/map,probe/map_val,probe/map_random_init,retrieval/i2t_r10,retrieval/t2i_r10,retrieval/chance_r10
python -m vlrep.tools.sweep --config=configs/mct.py:runlocal --vary="loss=moco tags inter full" --seeds=0,1,2 --root=/tmp/mct_sweep --metrics=probe/map,probe/map_val,probe/map_random_init,retrieval/i2t_r1,retrieval/i2t_r10,retrieval/t2i_r1,retrieval/t2i_r10,retrieval/chance_r1,retrieval/chance_r10,vsepp/i2t_r1,vsepp/i2t_r10,vsepp/t2i_r1,vsepp/t2i_r10
python -m vlrep.tools.sweep --config=configs/mct.py:runlocal --vary="text=scratch bert" --seeds=0,1,2 --root=/tmp/mct_text --metrics=probe/map,probe/map_val,retrieval/i2t_r10,retrieval/t2i_r10
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="task=cappa" --seeds=0,1,2 --root=/tmp/r/cappa --eval_config=configs/eval/zero_shot.py:runlocal,biggest=False,posterior=False --metrics=probe/map,probe/map_random_init,probe/map_val,zero_shot/top1,zero_shot/chance,zero_shot_multi/map,zero_shot_multi/chance
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 100" --root=DIR --collect_only
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 20 50 100" --root=/tmp/sweep_fraction --metrics=probe/map,probe/map_random_init
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 50 100" --root=/tmp/sweep_fraction --metrics=probe/map,probe/map_random_init [--eval_config=configs/eval/NAME.py]
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="fraction=10 50 100" --seeds=0,1,2 --root=/tmp/sweep --metrics=probe/map,probe/map_val
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="steps=400 550" --seeds=0,1,2 --root=/tmp/r/steps --metrics=probe/map,probe/map_val
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="task=bicaptioning captioning masked_lm token_classification" --seeds=0,1,2 --root=/tmp/r/virtex --metrics=probe/map,probe/map_val,probe/map_random_init,probe/map_val_random_init
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="task=bicaptioning" --seeds=0,1,2 --root=/tmp/r/virtex --metrics=probe/map,probe/map_val,probe/map_random_init,probe/map_val_random_init
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal --vary="task=bicaptioning" --seeds=0,1,2 --root=/tmp/r/head_without --metrics=probe/map,probe/map_val --overrides=method.decoder_ln_eps=1e-8,method.mlp_dropout=False,method.official_init=False
python -m vlrep.tools.sweep --config=configs/virtex.py:runlocal,backbone=vit_local --vary="backbone_lr=0.001 0.003" --seeds=0,1,2 --root=/tmp/r/virtex_vit --metrics=probe/map,probe/map_val,probe/map_random_init,probe/map_val_random_init
python -m vlrep.tools.sweep --config=configs/clip.py:runlocal --vary="backbone=vit_local" --seeds=0,1,2 --root=/tmp/r/clip_vit --metrics=probe/map,probe/map_val,probe/map_random_init,probe/map_val_random_init
python -m vlrep.tools.sweep --config=configs/loctex.py:runlocal --vary="backbone=vit_local" --seeds=0,1,2 --root=/tmp/r/loctex_vit --metrics=probe/map,probe/map_val,probe/map_random_init,probe/map_val_random_init,localization/pointing_1x,localization/chance_1x
"""
COMMANDS.update(
  {
    c: DryRun(
      replace=(
        ("--root=DIR", "--root={tmp}/dir"),
        (" [--eval_config=configs/eval/NAME.py]", ""),
        ("--root=R/", "--root={tmp}/r/"),
        ("=R/tp", "={tmp}/r/tp"),
      )
    )
    for c in _SWEEPS.strip().splitlines()
  }
)

_STUDIES = """
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal --root=/tmp/vl_study --archs=visual_bert,vilbert --sources=none,captions,questions,ood_captions,generated --tasks=vqa,ve --generated=/tmp/ood_generated.json
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local --root=/tmp/vl --archs=visual_bert,vilbert --sources=none,captions --tasks=vqa --modes=frozen --seeds=0,1,2
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local --root=/tmp/vl/study --tasks=vqa --seeds=0,1,2 --generated=/tmp/vl/ood_generated.json
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local --root=/tmp/vl_align --archs=vilbert --sources=captions --tasks=vqa --modes=frozen --seeds=0,1,2 --overrides=method.alignment_weight=1.0 --downstream_overrides=evals.task.split=probe_val
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local --root=/tmp/vl_plr --archs=vilbert --sources=none,captions --tasks=vqa --modes=frozen --seeds=0,1,2 --downstream_overrides=evals.task.split=probe_val
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local --root=/tmp/vl_study --tasks=vqa,ve --generated=/tmp/ood_generated.json
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local --root=/tmp/vl_sum --archs=vilbert --sources=none,captions --tasks=vqa --modes=frozen --seeds=0,1,2 --overrides=method.fusion=sum --downstream_overrides=evals.task.split=probe_val
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local,lr=1e-3 --root=/tmp/vl_lr --archs=vilbert --sources=none,captions --tasks=vqa --modes=frozen --seeds=0,1,2 --downstream_overrides=evals.task.split=probe_val
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local,lr=1e-3 --root=/tmp/vl_vil --archs=vilbert --sources=none,captions --tasks=vqa --modes=frozen --seeds=0,1,2 --downstream_overrides=evals.task.split=probe_val
python -m vlrep.tools.vl_study --config=configs/vlbert.py:runlocal,extractor=/tmp/vlrep_virtex_local,pairs=1 --root=/tmp/vl_sel --archs=visual_bert --sources=none,captions --tasks=vqa --modes=frozen --seeds=0,1,2 --downstream_overrides=evals.task.split=probe_val
"""
COMMANDS.update({c: DryRun() for c in _STUDIES.strip().splitlines()})


# ---------------------------------------------------------------------------------------------------- #
# The rewrites every command goes through, and running one.
# ---------------------------------------------------------------------------------------------------- #
TINY_CONFIGS = (
  "virtex",
  "loctex",
  "mct",
  "icmlm",
  "finetune",
  "vlbert",
  "clip",
)  # tests/tiny_NAME.py = NAME.py:runlocal + tiny
_PATHS = re.compile(r"gs://BUCKET/|/runs/|/tmp/|/data/|~/tensorflow_datasets|\$W/|\$R/|\$BERT\b|\$V\b")
_PATH_TO = {
  "gs://BUCKET/": "{tmp}/bucket/",
  "/runs/": "{tmp}/runs/",
  "/tmp/": "{tmp}/",
  "/data/": "{tmp}/data/",
  "~/tensorflow_datasets": "{tmp}/tensorflow_datasets",
  "$W/": "{tmp}/w/",
  "$R/": "{tmp}/r/",
  "$BERT": "{tmp}/data/bert-base-uncased",
  "$V": VIRTEX,
}


def rewrite(command: str) -> str:
  """The documented command in the test's world: tiny configs, paths under the session's temp directory, and
  /tmp/virtex_local (configs' docstrings) the same run as /tmp/vlrep_virtex_local (README's quick start)."""

  def tiny(m):
    return f"tests/tiny_{m.group(1)}.py" + (f":{m.group(2)}" if m.group(2) else "")

  names = "|".join(TINY_CONFIGS)
  command = re.sub(rf"configs/({names})\.py:runlocal(?:,(\S+?))?(?=[\s\"]|$)", tiny, command)
  command = command.replace("/tmp/virtex_local", "/tmp/vlrep_virtex_local").replace(
    "--workdir=...", "--workdir=/tmp/dots"
  )
  return _PATHS.sub(lambda m: _PATH_TO[m.group(0)], command)


def argv_of(command: str, entry, ctx: dict) -> list[str]:
  """[module, args...] to run for a documented command under its entry."""
  if isinstance(entry, Synopsis):  # a usage line need not even parse as shell words
    return [command.split()[2], "--help"]
  text = rewrite(command)
  for old, new in getattr(entry, "replace", ()):
    if isinstance(entry, DryRun) and old not in text:
      continue  # the sweeps share one list of placeholders
    assert old in text, f"entry replaces {old!r}, which {text!r} does not hold"
    text = text.replace(old, new)
  words = shlex.split(text)
  assert words[:2] == ["python", "-m"], text
  extra = list(getattr(entry, "add", ()))
  if isinstance(entry, DryRun):
    extra.append("--dry_run")

  def fill(word):  # only the test's own {names}: a command may hold braces of its own (evals={}, {suffix})
    for key, value in ctx.items():
      if isinstance(value, str):
        word = word.replace("{" + key + "}", value)
    return word

  return [fill(w) for w in words[2:] + extra]


def check(command: str, entry, ctx: dict, runner: Server, log: str) -> float:
  """Runs one documented command under its entry; an AssertionError says what went wrong, with the output."""
  if isinstance(entry, SessionRun):
    argv = argv_of(command, Run(), ctx)
    assert argv[:2] == ["vlrep.main", f"--config=tests/{entry.config}.py"] and len(argv) == 3, argv
    ran = ctx["session_runs"][entry.config]
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert re.search(entry.expect, ran.stdout + ran.stderr), f"the output does not show /{entry.expect}/"
    return 0.0
  if isinstance(entry, SameAs):
    other = COMMANDS.get(entry.command)
    assert isinstance(other, (Run, Refuses, SessionRun)), (
      f"{command!r} is said to be the same as {entry.command!r}, not run"
    )
    assert command.split()[2] == entry.command.split()[2], f"{command!r} and {entry.command!r} run different modules"
    return 0.0
  if isinstance(entry, Covered):
    path = os.path.join(ROOT, entry.test)
    module = command.split()[2]
    assert os.path.exists(path), f"{command!r} is said to be covered by {entry.test}, which does not exist"
    parent, _, leaf = module.rpartition(".")
    with open(path) as f:
      text = f.read()
    runs_it = module in text or f"from {parent} import {leaf}" in text
    runs_it |= module == "vlrep.main" and "run_main(" in text  # conftest's run_main runs `python -m vlrep.main`
    assert runs_it, f"{entry.test} does not run {module}"
    return 0.0
  argv = argv_of(command, entry, ctx)
  rc, seconds, out = runner.run(argv, log, entry.timeout)
  shown = (
    f"{command}\nran as: python -m {shlex.join(argv)}\nexit {rc} after {seconds:.1f}s; output ends:\n{out[-4000:]}"
  )
  if isinstance(entry, Synopsis):  # absl prints the usage and flags for --help and exits 1; argparse its options, 0
    listed = "flags:" in out or ("usage: python -m" in out and "options:" in out)
    assert rc in (0, 1) and listed and "Traceback" not in out, f"--help does not work:\n{shown}"
  elif isinstance(entry, Refuses):
    assert rc not in (0, 124), f"expected a refusal (non-zero exit) with /{entry.message}/:\n{shown}"
    assert re.search(entry.message, out, re.S), f"the refusal does not say /{entry.message}/:\n{shown}"
  else:
    assert rc == 0, f"exit {rc}:\n{shown}"
    expect = getattr(entry, "expect", "")
    assert not expect or re.search(expect, out), f"the output does not show /{expect}/:\n{shown}"
  return seconds


def missing_entries(documented: dict[str, list[str]]) -> list[str]:
  return [f"{c!r} (shown in {', '.join(files)})" for c, files in documented.items() if c not in COMMANDS]


# ---------------------------------------------------------------------------------------------------- #
# The tests.
# ---------------------------------------------------------------------------------------------------- #


def test_every_documented_command_has_an_entry():
  documented = docs_commands.documented_commands()
  missing = missing_entries(documented)
  assert not missing, "Documented commands with no entry in tests/test_docs_commands.py:COMMANDS:\n" + "\n".join(
    missing
  )
  stale = [c for c in COMMANDS if c not in documented]
  assert not stale, "Entries for commands no file shows any more (remove them):\n" + "\n".join(stale)


def test_a_new_command_in_the_docs_without_an_entry_is_reported(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "new.md").write_text(
    "Run\n```bash\npython -m vlrep.tools.new_tool --workdir=RUN \\\n  --flag=1   # a comment\n```\nand "
    "`python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:runlocal --workdir=/tmp/virtex_local`.\n"
  )
  documented = docs_commands.documented_commands(str(tmp_path))
  assert list(documented) == [
    "python -m vlrep.tools.new_tool --workdir=RUN --flag=1",
    "python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:runlocal --workdir=/tmp/virtex_local",
  ]
  assert missing_entries(documented) == [
    "'python -m vlrep.tools.new_tool --workdir=RUN --flag=1' (shown in docs/new.md)"
  ]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_virtex_run, tiny_loctex_run, tiny_mct_run, tiny_builder, tiny_tokenizer):
  """The session's temp world the rewritten commands live in, and the command server."""
  from PIL import Image

  from vlrep.data import tokenizers

  tmp = tmp_path_factory.mktemp("docs_commands")
  session_runs = {"tiny_virtex": tiny_virtex_run, "tiny_loctex": tiny_loctex_run, "tiny_mct": tiny_mct_run}
  # Each SessionRun command's run, copied to its documented workdir (a later command resumes or evaluates into it).
  for command, entry in COMMANDS.items():
    if isinstance(entry, SessionRun):
      workdir = next(w for w in argv_of(command, Run(), {"tmp": str(tmp)}) if w.startswith("--workdir="))
      shutil.copytree(session_runs[entry.config].workdir, workdir.removeprefix("--workdir="))
  rng = np.random.default_rng(0)
  Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(tmp / "photo.jpg")
  Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp / "photo.png")
  own = tmp / "own_data"
  (own / "images").mkdir(parents=True)
  rows = []
  for i in range(12):
    Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(own / "images" / f"{i}.jpg")
    rows.append(json.dumps({"image": f"images/{i}.jpg", "caption": f"a red circle and {i % 3 + 1} blue squares"}))
  (own / "captions.jsonl").write_text("\n".join(rows) + "\n")
  labelled_photos.write_labelled_folder(str(tmp / "labelled"))  # your own classes (docs/own_classes.md)
  coco = {
    "images": [{"id": i, "file_name": f"{i}.jpg", "width": 10, "height": 10} for i in range(20)],
    "annotations": [
      {"id": i, "image_id": i, "category_id": 1, "bbox": [0, 0, 5, 5], "area": 25, "iscrowd": 0} for i in range(20)
    ],
    "categories": [{"id": 1, "name": "thing"}],
  }
  (tmp / "instances.json").write_text(json.dumps(coco))
  ctx = {
    "tmp": str(tmp),
    "data_dir": os.environ["VLREP_TEST_DATA_DIR"],
    "image": str(tmp / "photo.jpg"),
    "image_png": str(tmp / "photo.png"),
    "own_data": str(own),
    "labelled": str(tmp / "labelled"),
    "coco_json": str(tmp / "instances.json"),
    "vocab": tokenizers.default_path(tiny_virtex_run_config().tokenizer, tiny_builder),
    "session_runs": session_runs,
  }
  (tmp / "home").mkdir()
  (tmp / "logs").mkdir()
  # HOME inside the temp world: a command that misses an override cannot write into the user's ~/.cache.
  runner = Server({**os.environ, "HOME": str(tmp / "home"), "TF_CPP_MIN_LOG_LEVEL": "2"}, cwd=ROOT)
  yield ctx, runner
  runner.close()


def tiny_virtex_run_config():
  from conftest import load_tiny_config

  return load_tiny_config()


@pytest.mark.parametrize("command", list(COMMANDS), ids=[f"{i:03d}" for i in range(len(COMMANDS))])
def test_documented_command(command, world):
  ctx, runner = world
  log = os.path.join(ctx["tmp"], "logs", f"{list(COMMANDS).index(command):03d}.log")
  check(command, COMMANDS[command], ctx, runner, log)


def test_an_entry_whose_command_fails_or_refuses_wrongly_fails(world):
  ctx, runner = world
  log = os.path.join(ctx["tmp"], "logs", "self_test.log")
  bad = "python -m vlrep.evaluate --config=configs/eval/voc07_svm.py:runlocal --workdir=/tmp/no_such_run"
  with pytest.raises(AssertionError, match="exit 2"):
    check(bad, Run(), ctx, runner, log)
  with pytest.raises(AssertionError, match="does not say"):
    check(bad, Refuses("a message it does not print"), ctx, runner, log)
  check(bad, Refuses(r"No run directory"), ctx, runner, log)


def test_localization_evaluation_defaults_to_the_runlocal_loctex_maps():
  """The docstring's `configs/eval/localization.py --workdir=/tmp/loctex_local` runs here on the tiny LocTex run
  (32 px, maps half the size), so its default sizes are checked against the runlocal recipe's maps here."""
  import importlib.util

  def load(path, arg):
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)

  runlocal = load("configs/loctex.py", "runlocal")
  default = load("configs/eval/localization.py", None)
  assert tuple(default.evals.localization.grid_sizes) == tuple(runlocal.method.grid_sizes) == (4, 8)
