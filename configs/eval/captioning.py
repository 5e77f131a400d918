r"""Captioning metrics of a VirTex checkpoint's forward model on a validation split.

  python -m vlrep.evaluate --config=configs/eval/captioning.py --workdir=DIR            # COCO val2017, beam 5
  python -m vlrep.evaluate --config=configs/eval/captioning.py:decoding=nucleus --workdir=DIR
  python -m vlrep.evaluate --config=configs/eval/captioning.py:runlocal --workdir=/tmp/virtex_local

Arguments: decoding=greedy|beam|nucleus, beam_size, limit (first N images), runlocal (synthetic_scenes val).
CIDEr-D and BLEU are computed in Python; METEOR (and SPICE) too when Java and pycocoevalcap are installed.
"""

from ml_collections import ConfigDict

from vlrep.config_utils import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, runlocal=False, decoding="beam", beam_size=5, limit=0)
  cap = dict(
    type="captioning",
    dataset="coco_captions2017",
    data_dir="",
    config_name="",
    split="val",
    pp="decode|resize(224)|normalize",
    references="captions",
    decoding=arg.decoding,
    beam_size=arg.beam_size,
    top_p=0.9,
    max_len=30,
    batch_size=64,
    limit=arg.limit,
    examples=3,
    seed=0,
  )
  if arg.runlocal:
    cap.update(
      dataset="synthetic_scenes",
      config_name="default",
      data_dir="~/.cache/vlrep/tensorflow_datasets",
      pp="decode|normalize",
      max_len=39,
      batch_size=100,
    )
  return ConfigDict({"evals": {f"captioning_{arg.decoding}": cap}})
