r"""Captioning metrics of a VirTex checkpoint's forward model on a validation split.

  python -m vlrep.evaluate --config=configs/eval/captioning.py --workdir=DIR            # COCO val2017, beam 5
  python -m vlrep.evaluate --config=configs/eval/captioning.py:decoding=nucleus --workdir=DIR
  python -m vlrep.evaluate --config=configs/eval/captioning.py:runlocal --workdir=/tmp/virtex_local

Arguments: decoding=greedy|beam|nucleus, beam_size, limit (first N images), runlocal (synthetic_scenes val).
CIDEr-D and BLEU are computed in Python; METEOR (and SPICE) too when Java and pycocoevalcap are installed.
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg

common = config_module(__file__, "../common.py")  # the blocks every recipe shares


def get_config(arg=None):
  arg = parse_arg(arg, runlocal=False, decoding="beam", beam_size=5, limit=0)
  cap = common.captioning_eval(decoding=arg.decoding, beam_size=arg.beam_size, limit=arg.limit)
  if arg.runlocal:
    cap.update(common.captioning_local())
  return ConfigDict({"evals": {f"captioning_{arg.decoding}": cap}})
