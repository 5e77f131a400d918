r"""Image-caption retrieval on any checkpoint (MCT's tables 4, 6, 7).

  python -m vlrep.evaluate --config=configs/eval/retrieval.py --workdir=DIR                  # VSE++, COCO 1K
  python -m vlrep.evaluate --config=configs/eval/retrieval.py:protocol=towers --workdir=DIR  # MCT's own towers
  python -m vlrep.evaluate --config=configs/eval/retrieval.py:runlocal --workdir=/tmp/mct_local

protocol=vsepp (default): VSE++ trained on the frozen backbone's features (works for every method with a ResNet
backbone: VirTex, LocTex, ICMLM, MCT); protocol=towers: the run's own image and caption towers, no training
(MCT only); protocol=both. runlocal: synthetic_scenes (vsepp on 2000 training images, 500 test images).
"""

from ml_collections import ConfigDict

from vlrep.config_utils import parse_arg


def get_config(arg=None):
  from vlrep.evaluators import vsepp

  arg = parse_arg(arg, runlocal=False, protocol="vsepp")
  if arg.protocol not in ("vsepp", "towers", "both"):
    raise ValueError(f"Unknown protocol={arg.protocol!r}; expected 'vsepp', 'towers' or 'both'.")
  evals = {}
  if arg.protocol in ("vsepp", "both"):
    evals["vsepp"] = dict(vsepp.COCO_PROTOCOL, **(vsepp.RUNLOCAL if arg.runlocal else {}))
  if arg.protocol in ("towers", "both"):
    towers = dict(
      type="retrieval",
      dataset="coco_captions2017",
      data_dir="",
      config_name="",
      split="val",
      pp="decode|resize_small(256)|central_crop(224)|normalize",
      captions_key="captions",
      num_captions=5,
      max_len=40,
      batch_size=250,
      limit=5000,
      fold_size=1000,
    )
    if arg.runlocal:
      local = {k: vsepp.RUNLOCAL[k] for k in ("dataset", "config_name", "data_dir", "pp", "batch_size", "fold_size")}
      towers.update(local, limit=vsepp.RUNLOCAL["test_limit"])
    evals["retrieval"] = towers
  return ConfigDict({"evals": evals})
