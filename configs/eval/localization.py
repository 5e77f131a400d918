r"""Word localization of a LocTex checkpoint on synthetic_scenes (pointing game and IoU of object words).

  python -m vlrep.evaluate --config=configs/eval/localization.py --workdir=/tmp/loctex_local
  python -m vlrep.evaluate --config=configs/eval/localization.py:sizes=2+4+8,limit=0 --workdir=DIR

Arguments: sizes (grid side per map, '+'-separated, in the run's scale order: input size / output stride x scale;
the 64x64 runlocal models, with the small stem's stride 16, have 4 at 1x and 8 at 2x; the evaluator says the
sizes of the run it is given when they differ), split, limit (first N images; 0 = all).
Ground truth: the visible instances of the class each object word names (oracle_word_masks without traces).
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg

common = config_module(__file__, "../common.py")  # the blocks every recipe shares


def get_config(arg=None):
  arg = parse_arg(arg, sizes="4+8", split="val", limit=500)
  sizes = tuple(int(s) for s in str(arg.sizes).split("+"))
  return ConfigDict({"evals": {"localization": common.localization_eval(sizes, arg.split, arg.limit)}})
