r"""Multi-label image tagging, mIOU@K, on any checkpoint's frozen backbone (MCT's table 5 protocol).

  python -m vlrep.evaluate --config=configs/eval/tagging.py --workdir=DIR            # COCO: 80 categories
  python -m vlrep.evaluate --config=configs/eval/tagging.py:runlocal --workdir=/tmp/mct_local

A PMI tag space from the training split's tag co-occurrence, a 2-layer MLP on the frozen features trained with
the cosine loss, and mIOU@K of the top-K tags (see vlrep/evaluators/tagging.py). The paper's table is on Stock,
which is not public; COCO's instance categories stand in. runlocal: synthetic_scenes' shapes and colours.
"""

from ml_collections import ConfigDict

from vlrep import defaults
from vlrep.config_utils import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, runlocal=False)
  return ConfigDict(
    {"evals": {"tagging": dict(defaults.TAGGING_COCO, **(defaults.TAGGING_RUNLOCAL if arg.runlocal else {}))}}
  )
