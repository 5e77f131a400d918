r"""Zero-shot classification with a checkpoint's own text side, no training: CLIP / SigLIP / LocTex / MCT towers
(cosine to each class's mean prompt embedding) or a captioner such as VirTex (each class's prompts scored by their
log-likelihood given the image).

  python -m vlrep.evaluate --config=configs/eval/zero_shot.py:runlocal --workdir=/tmp/virtex_local
  python -m vlrep.evaluate --config=configs/eval/zero_shot.py --workdir=DIR                        # VOC2007 test
  python -m vlrep.evaluate --config=configs/eval/zero_shot.py:data=/data/labelled_tfds --workdir=RUN

Arguments: dataset (voc2007, multi-label: mAP; or any prepared TFDS classification set with 'image' and a 'label'
ClassLabel, e.g. an ImageFolder-style set: top-1), split (voc2007: test; others: validation), length_normalize
(captioners: each prompt's log-likelihood divided by its token count), posterior (captioners, default True: each
image's log posterior over the classes rather than the raw log-likelihoods; chosen on synthetic_scenes' probe_val,
docs/results/baselines.md), limit (first N images; 0 = all), runlocal
(synthetic_scenes' probe_test in both label forms: `zero_shot`, the shape of each scene's most visible object, top-1
with chance 10%, its prompts asking for the biggest object; `zero_shot_multi`, every shape present, VOC form, mAP,
its prompts saying a shape is there), labels=single|multi|both (runlocal), biggest (runlocal, default True: the
single-label form's prompts name the biggest object, as the captions' "N objects, the biggest one is a X."; False:
the multi-label form's prompts for both; chosen on probe_val, docs/results/baselines.md), data=DIR (your own
classes, prepared into DIR with `vlrep.data.prepare --dataset=image_folder`, docs/own_classes.md: the prompts name
the class folders, underscores as spaces; top-1 on the test split, or split=val; images resized to `size` px,
default 224, as resize_small + centre crop).

In a training config's `evals`: `c.evals.update(config_module(__file__, "eval/zero_shot.py").get_config(
"runlocal").evals)` (with `every_steps`, as any evaluator's entry).
"""

from ml_collections import ConfigDict

from vlrep.config_utils import config_module, parse_arg
from vlrep.data.builders import image_folder, voc2007

common = config_module(__file__, "../common.py")  # the blocks every recipe shares

# CLIP's prompt style for photographs.
PHOTO_TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "an image of a {}.", "a photo of the {}.")
# synthetic_scenes' captions: "there is a X and a Y.", "a picture of X.", "X and Y in a colorful scene.".
SCENE_TEMPLATES = ("there is a {}.", "a picture of a {}.", "an image of a {}.", "a {} in a colorful scene.")
# The single-label question (which shape is the most visible?) as the captions ask it: "two objects, the biggest
# one is a X."
BIGGEST_TEMPLATES = tuple(
  f"{n} {'object' if n == 'one' else 'objects'}, the biggest one is a {{}}." for n in ("one", "two", "three")
)
# VOC2007's ClassLabel names are run together ('diningtable'); the prompts read them as words.
_VOC_WORDS = {"diningtable": "dining table", "pottedplant": "potted plant", "tvmonitor": "tv monitor"}
VOC_NAMES = tuple(_VOC_WORDS.get(name, name) for name in voc2007.CLASSES)
EVAL_PP = "decode|resize_small(256)|central_crop(224)|normalize"


def zero_shot_eval(**settings) -> dict:
  """The evaluator's entry: a classification set's 'label', photo templates, no length normalisation, a captioner's
  scores as its class posterior."""
  return dict(
    dict(
      type="zero_shot",
      dataset="",
      data_dir="",
      config_name="",
      split="validation",
      pp=EVAL_PP,
      label_key="label",
      class_key="",  # the ClassLabel naming the classes: label_key's when empty
      class_names=(),  # the dataset's names when empty
      templates=PHOTO_TEMPLATES,
      articles=True,
      max_len=24,
      scoring="auto",
      length_normalize=False,
      class_posterior=True,
      batch_size=256,
      prompts_per_call=64,
      limit=0,
    ),
    **settings,
  )


def get_config(arg=None):
  arg = parse_arg(
    arg,
    runlocal=False,
    dataset="voc2007",
    split="",
    labels="both",
    length_normalize=False,
    posterior=True,
    biggest=True,
    limit=0,
    data="",
    size=224,
  )
  if arg.labels not in ("single", "multi", "both"):
    raise ValueError(f"Unknown labels={arg.labels!r}; expected 'single', 'multi' or 'both'.")
  shared = dict(length_normalize=arg.length_normalize, class_posterior=arg.posterior, limit=arg.limit)
  if arg.runlocal and arg.data:
    raise ValueError("data=DIR evaluates on your own classes; runlocal on synthetic_scenes: give one of them.")
  if arg.runlocal:
    # 64 px images as they are; the classes are the 10 shapes.
    local = dict(
      common.synthetic_scenes(),
      split=arg.split or "probe_test",
      class_key="objects/label",
      templates=SCENE_TEMPLATES,
      batch_size=200,
      **shared,
    )
    forms = {
      "zero_shot": dict(
        pp="decode|normalize|largest_object_label",
        label_key="label",
        templates=BIGGEST_TEMPLATES if arg.biggest else SCENE_TEMPLATES,
      ),
      "zero_shot_multi": dict(pp="decode|normalize|voc_labels(10)", label_key="labels"),
    }
    chosen = {"single": ("zero_shot",), "multi": ("zero_shot_multi",), "both": tuple(forms)}[arg.labels]
    return ConfigDict({"evals": {name: zero_shot_eval(**{**local, **forms[name]}) for name in chosen}})
  if arg.data:
    entry = zero_shot_eval(
      **image_folder.eval_settings(arg.data, arg.size), split=arg.split or "test", label_key="label", **shared
    )
  elif arg.dataset == "voc2007":
    entry = zero_shot_eval(
      dataset="voc2007",
      split=arg.split or "test",
      pp=f"{EVAL_PP}|voc_labels(20)",
      label_key="labels",
      class_key="objects/label",
      class_names=VOC_NAMES,
      **shared,
    )
  else:
    entry = zero_shot_eval(dataset=arg.dataset, split=arg.split or "validation", **shared)
  return ConfigDict({"evals": {"zero_shot": entry}})
