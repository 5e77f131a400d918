r"""Image-caption retrieval on any checkpoint (MCT's tables 4, 6, 7).

  python -m vlrep.evaluate --config=configs/eval/retrieval.py --workdir=DIR                  # VSE++, COCO 1K
  python -m vlrep.evaluate --config=configs/eval/retrieval.py:protocol=towers --workdir=DIR  # MCT's own towers
  python -m vlrep.evaluate --config=configs/eval/retrieval.py:runlocal --workdir=/tmp/mct_local

protocol=vsepp (default): VSE++ trained on the frozen backbone's features (works for every method with a ResNet
backbone: VirTex, LocTex, ICMLM, MCT); protocol=towers: the run's own image and caption towers, no training
(MCT only); protocol=both. runlocal: synthetic_scenes (vsepp on 2000 training images, 500 test images).
"""

from ml_collections import ConfigDict

from vlrep import defaults
from vlrep.config_utils import config_module, parse_arg

common = config_module(__file__, "../common.py")  # the blocks every recipe shares


def get_config(arg=None):
  arg = parse_arg(arg, runlocal=False, protocol="vsepp")
  if arg.protocol not in ("vsepp", "towers", "both"):
    raise ValueError(f"Unknown protocol={arg.protocol!r}; expected 'vsepp', 'towers' or 'both'.")
  evals = {}
  if arg.protocol in ("vsepp", "both"):
    evals["vsepp"] = dict(defaults.VSEPP_COCO, **(defaults.VSEPP_RUNLOCAL if arg.runlocal else {}))
  if arg.protocol in ("towers", "both"):
    evals["retrieval"] = dict(common.retrieval_eval(), **(common.retrieval_local() if arg.runlocal else {}))
  return ConfigDict({"evals": evals})
