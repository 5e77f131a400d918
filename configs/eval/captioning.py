r"""Captioning metrics of a VirTex checkpoint's forward model on a validation split.

  python -m vlrep.evaluate --config=configs/eval/captioning.py --workdir=DIR            # COCO val2017, beam 5
  python -m vlrep.evaluate --config=configs/eval/captioning.py:decoding=nucleus --workdir=DIR
  python -m vlrep.evaluate --config=configs/eval/captioning.py:official --workdir=/runs/virtex_zoo  # published
  python -m vlrep.evaluate --config=configs/eval/captioning.py:runlocal --workdir=/tmp/virtex_local

Arguments: decoding=greedy|beam|nucleus|virtex_official, beam_size, limit (first N images), runlocal
(synthetic_scenes val), official (the official VirTex evaluation: decoding=virtex_official and its transform,
shorter side 256 without antialiasing, centre crop 224; see docs/interop.md). The default transform is the
paper's too (shorter side 256, centre crop 224, antialiased); `squash` resizes every image to 224x224 instead.
CIDEr-D and BLEU are computed in Python; METEOR (and SPICE) too when Java and pycocoevalcap are installed.
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg

common = config_module(__file__, "../common.py")  # the blocks every recipe shares

PP = {
  "paper": "decode|resize_small(256)|central_crop(224)|normalize",
  "official": "decode|resize_small(256, official=True)|central_crop(224)|normalize",
  "squash": "decode|resize(224)|normalize",
}


def get_config(arg=None):
  arg = parse_arg(arg, runlocal=False, official=False, squash=False, decoding="beam", beam_size=5, limit=0)
  decoding = "virtex_official" if arg.official else arg.decoding
  pp = PP["official" if arg.official else "squash" if arg.squash else "paper"]
  cap = common.captioning_eval(decoding=decoding, beam_size=arg.beam_size, limit=arg.limit, pp=pp)
  if arg.runlocal:
    cap.update(common.captioning_local())
  return ConfigDict({"evals": {f"captioning_{decoding}": cap}})
