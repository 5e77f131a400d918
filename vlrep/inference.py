r"""A trained model from Python: `vlrep.load(path)` opens a run folder (any method, trained or imported with
`vlrep.interop.import_run`) or a shared folder (`vlrep.interop.export --format=vlrep`, or that folder downloaded from
a model hub) as a `TrainedModel`:

  import vlrep
  model = vlrep.load("/tmp/vlrep_virtex_local")            # or a shared folder
  model.encode_images(["photo.jpg"])                       # {'pooled': [1, C], 'grid': [1, h, w, C]}
  model.caption(["photo.jpg"])                             # captioners: VirTex, CapPa, an imported VirTex
  model.zero_shot(["photo.jpg"], ["cat", "dog", "boat"])   # {'labels', 'scores', 'top'}
  model.encode_text(["a dog on a boat."])                  # text towers: CLIP, SigLIP, LocTex, MCT
  model.similarity(["photo.jpg"], ["a dog.", "a cat."])    # [images, texts]

Images are file paths, PIL images or uint8 arrays ([H, W, 3], [H, W], or one batch [N, H, W, 3]); a path or a PIL
image is read as a viewer shows it (EXIF orientation applied, 16-bit by its range, transparency over white).

What is computed is what vlrep's own commands and evaluators compute, through the same functions: the backbone
features are `vlrep.runs.backbone_fn`'s (BatchNorm in inference mode, float32), what every transfer evaluation and
the features tool (which calls `encode_images`) use; captions are `vlrep.evaluators.captioning.captioner_for`'s
decoders (the caption tool calls `caption`); zero-shot scores are the zero_shot evaluator's scorer (its prompts, its
class embeddings or caption log-likelihoods, its class posterior). The preprocessing is the features tool's:
the shorter side resized to the run's training image size (`training_size`: its preprocessing's crop, or its
dataset's fixed size) and the centre crop taken (torchvision's Resize + CenterCrop
sizes, bicubic), ImageNet mean/std; `preprocessing=` takes another (see `preprocessing`).

The method runs in float32 on a CPU and in its configured dtype on an accelerator. Each call runs in batches of at
most `batch_size` images, padded to a power of two (a multiple of the devices), so a shape compiles once whatever
the number of images; the method and its tokenizer are built on first use, so a run whose text side needs its
training data (ICMLM's concepts) still gives image features without it.

This module also holds what the tools share about opening a run from outside (`load_run`, `saved_config_errors`,
`check_backbone`) and the image preprocessing (`preprocessing`, `load_image`, `check_images`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict
from PIL import Image

from vlrep import run_setup, runs, visualize
from vlrep.data import images as image_files
from vlrep.data import pipeline, registry
from vlrep.data.tokenizers import EOS_ID
from vlrep.errors import BadFile, UserError
from vlrep.evaluators import zero_shot as zero_shot_eval
from vlrep.evaluators.captioning import captioner_for
from vlrep.models import vit

# -- opening a run from outside ------------------------------------------------------------------------------------


def load_run(workdir: str, checkpoint: str = "best", flag: str = "--workdir") -> runs.Run:
  """runs.load_run for the tools, vlrep.evaluate and `load`: every way a folder fails to be a restorable run
  (missing, no checkpoint, damaged or crafted checkpoint files) one UserError naming it (as `flag`=WORKDIR, the
  command-line flag that gave it), not a traceback."""
  try:
    return runs.load_run(workdir, checkpoint)
  except FileNotFoundError as e:  # no such folder, or no checkpoint in it (runs.NotARun)
    raise UserError(f"{flag}={workdir} is not a vlrep run directory with a restorable checkpoint: {e}") from e
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 -- orbax and tensorstore raise many types for damaged or crafted files
    raise BadFile(
      f"{flag}={workdir} is not a vlrep run directory with a restorable checkpoint: {type(e).__name__}: {e}. "
      "Its checkpoint files are damaged or not vlrep's: copy the run folder again from where it came from."
    ) from e


@contextlib.contextmanager
def saved_config_errors(run: runs.Run):
  """Context for building a run's model (method, tokenizer, backbone) from the config its checkpoint saved: that
  config is a file from outside, so one that does not build (a value of the wrong type, a section that is not one,
  sizes that do not fit the parameters) is one BadFile naming the checkpoint's metadata file, not a traceback."""
  shared = "folder" in run.meta  # a shared folder's config is its config.json
  where = os.path.join(run.path, runs.FOLDER_CONFIG) if shared else os.path.join(run.path, "meta", "metadata")
  try:
    yield
  except BadFile as e:  # refused for what the file says: named by the file, once
    if run.workdir in str(e) or where in str(e):
      raise
    raise BadFile(f"{where}: {e}") from e
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 -- Flax, JAX and the methods raise many types for a config that does not build
    detail = (str(e).splitlines() or [""])[0][:300]
    raise BadFile(
      f"{where}: the run's saved config does not build its model ({type(e).__name__}: {detail}). The run folder "
      "is damaged or not vlrep's: copy it again from where it came from."
    ) from e


def check_backbone(run: runs.Run) -> None:
  """The run's backbone, as its saved config describes it, applies to its parameters (traced on a small image,
  nothing computed): a crafted or damaged config is refused before any image is read or evaluation run."""
  with saved_config_errors(run):
    module, variables = runs.backbone_of(run)
    # A ViT takes sides its patches divide (14-pixel patches: not 64); 64 px passes every ResNet's and VGG's stride.
    side = 4 * module.patch_size if isinstance(module, vit.ViT) else 64
    jax.eval_shape(lambda v: module.apply(v, jnp.zeros((1, side, side, 3)), False), variables)


# -- preprocessing -------------------------------------------------------------------------------------------------
TRANSFORMS = ("resize_crop", "squash", "virtex_official")
OFFICIAL_RESIZE, OFFICIAL_CROP = 256, 224  # kdexd/virtex's DEFAULT_IMAGE_TRANSFORM (its evaluation's)


DEFAULT_SIZE = 224  # a run whose training images' size is known nowhere: ImageNet's crop
MAX_SIDE = 4096  # the largest input side: a run's config may be a crafted file


def training_size(config) -> int:
  """The side of the images the run trained on (`pipeline.training_image_size` of its data section), else
  DEFAULT_SIZE."""
  return pipeline.training_image_size(config.get("data", {}) or {}) or DEFAULT_SIZE


def preprocessing(config, transform: str = "resize_crop", size: int = 0, resize: int = 0) -> dict:
  """What `load_image` does to each image, every value filled in (recorded with features).

  resize_crop: the shorter side resized to `resize` (default `size`), the centre `size` x `size` crop, with
  torchvision's sizes and offsets, bicubic; squash: resized to `size` x `size`; virtex_official: the official VirTex
  evaluation's (shorter side 256, bilinear without antialiasing as OpenCV's INTER_LINEAR, centre crop 224).
  `size` 0: the run's training image size (`training_size`)."""
  if transform not in TRANSFORMS:
    raise UserError(f"--transform={transform!r}: one of {', '.join(TRANSFORMS)}.")
  if transform == "virtex_official":
    if size or resize:
      raise UserError("virtex_official preprocessing has its own sizes (256, centre crop 224); give no size.")
    return {
      "transform": transform,
      "size": OFFICIAL_CROP,
      "size_from": "the official VirTex evaluation",
      "resize_shorter_side": OFFICIAL_RESIZE,
      "resampling": "bilinear (OpenCV INTER_LINEAR, no antialiasing)",
      **normalization(config),
    }
  size_from = "given" if size else "the run's training image size"
  if size > MAX_SIDE or resize > MAX_SIDE:
    raise UserError(f"--size={size}, --resize={resize}: at most {MAX_SIDE} px.")
  size = size or training_size(config)
  if size > MAX_SIDE:  # the run's files say so: a crafted config must not allocate the machine's memory away
    raise BadFile(f"The run's config says its images are {size} px; vlrep.load takes at most {MAX_SIDE} px (--size).")
  out = {"transform": transform, "size": size, "size_from": size_from}
  if transform == "resize_crop":
    resize = resize or size
    if resize < size:
      raise UserError(f"--resize={resize} is smaller than the --size={size} crop it is cropped to.")
    out["resize_shorter_side"] = resize
  elif resize:
    raise UserError("--resize applies to --transform=resize_crop; 'squash' resizes to --size x --size.")
  out.update(resampling="bicubic", **normalization(config))
  return out


def normalization(config) -> dict:
  """The mean and std the run's images were normalised with: its `normalize` op's (an imported CLIP's or SigLIP's
  own), described; ImageNet's without one."""
  op = registry.op_arguments((config.get("data", {}) or {}).get("pp", "") or "", "normalize")
  mean, std = (op["mean"], op["std"]) if op else (visualize.IMAGENET_MEAN, visualize.IMAGENET_STD)
  numbers = lambda v: isinstance(v, (tuple, list)) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v)
  if not (numbers(mean) and numbers(std)) or not all(x > 0 for x in std):
    raise BadFile(f"The run's config normalises with mean={mean!r}, std={std!r}: expected 3 numbers each, std > 0.")
  mean, std = [float(m) for m in mean], [float(s) for s in std]  # lists: the record is JSON (vlrep.tools.features)
  imagenet = mean == list(visualize.IMAGENET_MEAN) and std == list(visualize.IMAGENET_STD)
  return {"mean": mean, "std": std, "normalization": "ImageNet mean/std" if imagenet else f"mean {mean}, std {std}"}


def describe(prep: dict) -> str:
  if prep["transform"] == "squash":
    how = f"squashed to {prep['size']}x{prep['size']}"
  else:
    how = f"shorter side resized to {prep['resize_shorter_side']}, centre crop {prep['size']}x{prep['size']}"
  return f"{how} ({prep['resampling']}; size: {prep['size_from']}), {prep['normalization']}"


def transform_image(rgb: np.ndarray, prep: dict) -> np.ndarray:
  """uint8 [H, W, 3] -> uint8 [size, size, 3], as `prep` (from `preprocessing`) says."""
  size = prep["size"]
  if prep["transform"] == "virtex_official":
    return visualize.official_crop(rgb, prep["resize_shorter_side"], size)
  img = Image.fromarray(rgb)
  if prep["transform"] == "squash":
    return np.asarray(img.resize((size, size), Image.BICUBIC), np.uint8)
  # The sizes and offsets as torchvision.transforms.Resize(int) and CenterCrop compute them (the longer side
  # truncated, the offsets rounded), so that features match a torchvision pipeline's pixel for pixel.
  w, h = img.size
  short = prep["resize_shorter_side"]
  w, h = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
  img = img.resize((w, h), Image.BICUBIC)
  left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
  return np.asarray(img.crop((left, top, left + size, top + size)), np.uint8)


def load_image(path: str, prep: dict) -> np.ndarray:
  """An image file -> uint8 [size, size, 3], as `prep` (from `preprocessing`) says."""
  return transform_image(visualize.read_rgb(path), prep)


def check_images(paths) -> list[str]:
  """The paths as a list, each an existing file whose header an image reader recognises (before any compute)."""
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not paths:
    raise UserError("Give at least one image file.")
  paths = [os.fspath(p) for p in paths]
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise UserError(f"No such image file(s): {missing[:10]}{' ...' if len(missing) > 10 else ''}")
  visualize.check_images(paths)
  return paths


def as_image_list(images) -> list:
  """`images` as a list of items (a path, a PIL image or one uint8 array [H, W, 3] / [H, W]); a clear error for
  anything else, checked before any compute (paths: existing files with an image header)."""
  if isinstance(images, (str, os.PathLike, Image.Image)):
    items = [images]
  elif isinstance(images, np.ndarray):
    items = list(images) if images.ndim == 4 else [images]
  else:
    try:
      items = list(images)
    except TypeError:
      raise UserError(f"images: paths, PIL images or uint8 arrays; got a {type(images).__name__}.") from None
  if not items:
    raise UserError("Give at least one image.")
  paths = []
  for i, item in enumerate(items):
    if isinstance(item, (str, os.PathLike)):
      paths.append(os.fspath(item))
    elif isinstance(item, np.ndarray):
      if item.dtype != np.uint8 or item.ndim not in (2, 3) or (item.ndim == 3 and item.shape[2] not in (1, 3)):
        raise UserError(
          f"images[{i}]: an array must be uint8 RGB [H, W, 3] or grey [H, W]; got {item.dtype} {list(item.shape)}. "
          "(Give a 16-bit or float image as its file or a PIL image, which are read by their range.)"
        )
      if min(item.shape[:2]) < 1:
        raise UserError(f"images[{i}]: an empty array {list(item.shape)}.")
    elif not isinstance(item, Image.Image):
      raise UserError(f"images[{i}]: a path, a PIL image or a uint8 array; got a {type(item).__name__}.")
  if paths:
    check_images(paths)
  return items


def read_item(item) -> np.ndarray:
  """One of `as_image_list`'s items -> uint8 [H, W, 3] as a viewer shows it."""
  if isinstance(item, (str, os.PathLike)):
    return visualize.read_rgb(os.fspath(item))
  if isinstance(item, Image.Image):
    return np.asarray(image_files.viewer_rgb(item)[0], np.uint8)
  grey_or_rgb = item[..., None] if item.ndim == 2 else item
  return np.ascontiguousarray(np.broadcast_to(grey_or_rgb, (*item.shape[:2], 3)))


# -- the model -----------------------------------------------------------------------------------------------------
TEXT_TOWERS = "CLIP, SigLIP, LocTex and MCT"
_NO_TEXT_EMBEDDING = {
  "icmlm": "ICMLM's text side predicts masked caption tokens from the image; it has no text embedding to compare "
  "with images",
  "vlbert": "VisualBERT/ViLBERT encode text and image jointly; a text alone has no embedding in a space shared with "
  "images",
  "virtex": "VirTex's text side is a caption decoder: it scores a text given an image (similarity, zero_shot), but "
  "has no text embedding",
  "classifier": "a classifier has no text side",
}


def _bucket(n: int, batch_size: int) -> int:
  """The batch a call of `n` images runs in: the next power of two, at most `batch_size`, a multiple of the
  devices (one compile per bucket, whatever `n`)."""
  devices = jax.device_count()
  size = min(1 << max(0, (n - 1).bit_length()), batch_size)
  return -(-size // devices) * devices


class TrainedModel:
  """A run's model for use from Python (see the module docstring); `vlrep.load` builds it."""

  def __init__(self, run: runs.Run, batch_size: int = 32, source: str = ""):
    if batch_size < 1:
      raise UserError(f"batch_size={batch_size}: at least 1.")
    self.run = run
    self.source = source or run.workdir
    self.batch_size = batch_size
    with saved_config_errors(run):  # the run's config is a file from outside: any section may be malformed
      self.method_name = str(run.config.method.get("name"))
      self.preprocessing = preprocessing(run.config)
      # The method in float32 on a CPU (bf16 matmuls are slow and inexact there), its own dtype on an accelerator.
      self.config = copy.deepcopy(run.config)
      if jax.default_backend() == "cpu" and "dtype" in self.config.method:
        self.config.method.dtype = "float32"
    if "backbone" in run.params:
      check_backbone(run)
    self._captioners: dict = {}
    self._scorers: dict = {}
    self._class_cache: dict = {}

  def __repr__(self) -> str:
    return f"TrainedModel({self.method_name}, step {self.run.step}, from {self.source})"

  @property
  def step(self) -> int:
    return self.run.step

  @functools.cached_property
  def variables(self) -> dict:
    return jax.device_put(self.run.variables)

  @functools.cached_property
  def inputs(self):
    """The run's EvalInputs (method, tokenizer, the method's needs), built once on first use."""
    with saved_config_errors(self.run):
      return run_setup.build_inputs(self.config, self.run.workdir)

  @property
  def method(self):
    return self.inputs.method

  @property
  def tokenizer(self):
    tok = self.inputs.tokenizer
    if tok is None:
      raise UserError(f"{self.source}: this {self.method_name} run has no tokenizer (no text side).")
    return tok

  @functools.cached_property
  def _backbone(self):
    if "backbone" not in self.run.params:
      raise UserError(
        f"{self.source}: this run has no visual backbone (its parameters: {sorted(self.run.params)}); image "
        "features need one."
      )
    with saved_config_errors(self.run):
      return runs.backbone_fn(self.run)

  # -- images ----------------------------------------------------------------------------------------------------
  def pixels(self, images, prep: dict | None = None) -> np.ndarray:
    """float32 [N, S, S, 3]: the images preprocessed (`prep`, default the model's) and normalised, all at once (the
    model's own calls read them a batch at a time)."""
    return np.concatenate(list(self._pixel_chunks(as_image_list(images), prep)))

  def _pixel_chunks(self, items: list, prep: dict | None = None):
    """The checked `items` (as_image_list) read, preprocessed and normalised `batch_size` at a time, as each batch is
    reached: however many images, one batch of them is in memory."""
    prep = prep or self.preprocessing
    for start in range(0, len(items), self.batch_size):
      chunk = items[start : start + self.batch_size]
      images = np.stack([transform_image(read_item(x), prep) for x in chunk])
      mean, std = prep.get("mean", visualize.IMAGENET_MEAN), prep.get("std", visualize.IMAGENET_STD)
      yield visualize.normalize(images, mean, std)

  def _batched(self, chunks, fn) -> list:
    """fn(padded batch, real count) for each chunk of at most `batch_size` images, padded to its bucket; the
    outputs in order."""
    out = []
    for chunk in chunks:
      padded = np.zeros((_bucket(len(chunk), self.batch_size), *chunk.shape[1:]), np.float32)
      padded[: len(chunk)] = chunk
      out.append(fn(padded, len(chunk)))
    return out

  def encode_images(self, images, features=("pooled", "grid"), preprocessing: dict | None = None) -> dict:
    """{'pooled': [N, C], 'grid': [N, h, w, C]} float32: the backbone's pooled features (its `pre_logits`) and
    final feature map; with 'embedding' in `features`, the l2-normalised image embedding of a text tower too."""
    known = ("pooled", "grid", "embedding")
    if isinstance(features, str):
      features = (features,)
    if not features or any(f not in known for f in features):
      raise UserError(f"features={list(features)}: choose from {', '.join(known)}.")
    items = as_image_list(images)  # every image checked before anything is built or computed
    calls = {}
    for name in features:
      if name == "embedding":
        self._need_embed()
        embed = self._embed_images
        calls[name] = lambda batch, embed=embed: embed(self.variables, batch)
      else:
        backbone, key = self._backbone, {"pooled": "pre_logits", "grid": "grid"}[name]
        calls[name] = lambda batch, backbone=backbone, key=key: backbone({"image": batch}, key)[0]

    def apply(batch, n):
      return {name: np.asarray(call(batch), np.float32)[:n] for name, call in calls.items()}

    parts = self._batched(self._pixel_chunks(items, preprocessing), apply)
    return {name: np.concatenate([p[name] for p in parts]) for name in features}

  # -- text ------------------------------------------------------------------------------------------------------
  def _need_embed(self):
    """A UserError saying why for a run without text embeddings, decided from its method's name first: building a
    method may need its training data (an imported VisualBERT's recipe), which is no reason to give."""
    why = _NO_TEXT_EMBEDDING.get(self.method_name)
    if why is None and callable(getattr(self.method, "embed", None)):
      return
    why = why or f"this {self.method_name} method has no embed"
    raise UserError(f"{self.source}: {why}. Text embeddings come from the text towers of {TEXT_TOWERS} runs.")

  def _need_text_side(self, what: str, scorings=("embed", "caption")):
    """A UserError for `what` on a run whose method (by name, before it is built) has none of `scorings`."""
    have = zero_shot_eval.methods_with_text_side()
    names = sorted({name for scoring in scorings for name in have[scoring]})
    if self.method_name not in names:
      raise UserError(
        f"{self.source}: {what} needs a method with a text side ({', '.join(names)}); this run's is {self.method_name}."
      )

  @functools.cached_property
  def _embed_images(self):
    method = self.method
    return jax.jit(lambda v, x: method.embed(v, images=x)["image"])

  def text_length(self) -> int:
    """Tokens per text: the run's training `tokenize` length (its text positions), else the zero-shot default."""
    op = registry.op_arguments(self.config.get("data", {}).get("pp", ""), "tokenize")
    return op["max_len"] if op and isinstance(op["max_len"], int) else zero_shot_eval.DEFAULT_MAX_LEN

  def tokens(self, texts, max_len: int = 0) -> np.ndarray:
    """int32 [N, max_len] token ids of `texts` with the run's tokenizer (max_len 0: `text_length`)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
      raise UserError("texts: a non-empty list of strings.")
    tok = self.tokenizer
    max_len = max_len or self.text_length()
    method = self.config.method
    positions = method.get("max_len") or (method.get("text") or {}).get("max_len")
    if isinstance(positions, int) and positions > 0:  # no more tokens than the text side has positions
      max_len = min(max_len, positions)
    return np.stack([tok.encode(t, max_len)[0] for t in texts]).astype(np.int32)

  def _scorer(self, **settings):
    """The zero_shot evaluator's scorer of these settings, built once (its jitted functions compile once per shape)."""
    key = tuple(sorted(settings.items()))
    if key not in self._scorers:
      self._scorers[key] = zero_shot_eval.scorer(self.method, ConfigDict({"batch_size": self.batch_size, **settings}))
    return self._scorers[key]

  def encode_text(self, texts, max_len: int = 0) -> np.ndarray:
    """[N, D] float32 l2-normalised text embeddings (the text towers of CLIP, SigLIP, LocTex, MCT)."""
    self._need_embed()
    return self._scorer(scoring="embed").texts(self.variables, self.tokens(texts, max_len)).astype(np.float32)

  # -- images and texts ------------------------------------------------------------------------------------------
  def _scores(self, items: list, tokens, num_templates: int, settings: dict) -> np.ndarray:
    """[N, C] scores of the zero_shot evaluator's scorer, classes from `tokens` (class-major, `num_templates` each)."""
    try:
      scorer = self._scorer(**settings)
    except UserError as e:
      raise UserError(f"{self.source}: {e}") from None
    key = (tokens.tobytes(), tokens.shape, num_templates, tuple(sorted(settings.items())))
    if key not in self._class_cache:
      self._class_cache = {key: scorer.classes(self.variables, tokens, num_templates)}  # the last label set
    classes = self._class_cache[key]
    chunks = self._pixel_chunks(items)
    parts = self._batched(chunks, lambda batch, n: scorer.scores(self.variables, batch, classes)[:n])
    return np.concatenate(parts)

  def similarity(self, images, texts, max_len: int = 0) -> np.ndarray:
    """[N images, N texts]: the cosine of their embeddings (text towers) or log p(text | image) (captioners)."""
    self._need_text_side("similarity")
    items = as_image_list(images)
    settings = {"scoring": "auto", "class_posterior": False, "length_normalize": False}
    return self._scores(items, self.tokens(texts, max_len), 1, settings)

  def zero_shot(
    self,
    images,
    labels,
    templates=None,
    top_k: int = 5,
    articles: bool = True,
    max_len: int = zero_shot_eval.DEFAULT_MAX_LEN,
    length_normalize: bool = False,
    class_posterior: bool = True,
  ) -> dict:
    """Zero-shot classification into `labels` (class names), as the zero_shot evaluator scores it: each name in
    every template (default the evaluator's photo templates), a tower's cosine to each class's mean prompt
    embedding, or a captioner's mean prompt log-likelihood as the image's class posterior.
    Returns {'labels', 'scores' [N, C], 'top': per image the `top_k` (label, score), best first}."""
    labels = [labels] if isinstance(labels, str) else [str(x) for x in labels]
    if not labels:
      raise UserError("labels: give at least one class name.")
    self._need_text_side("zero_shot")
    templates = tuple(templates or zero_shot_eval.DEFAULT_TEMPLATES)
    texts = zero_shot_eval.prompts(labels, templates, articles)
    items = as_image_list(images)
    settings = {"scoring": "auto", "length_normalize": length_normalize, "class_posterior": class_posterior}
    scores = self._scores(items, self.tokens(texts, max_len), len(templates), settings)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
    top = [[(labels[c], float(scores[i, c])) for c in row] for i, row in enumerate(order)]
    return {"labels": labels, "scores": scores, "top": top}

  # -- captions --------------------------------------------------------------------------------------------------
  def _captioner(self, settings: dict):
    key = tuple(sorted(settings.items()))
    if key not in self._captioners:
      try:
        self._captioners[key] = captioner_for(self.method, ConfigDict(settings))
      except UserError:
        raise
      except ValueError as e:  # a run without a captioning head, or a decoding it does not support
        raise UserError(f"{self.source}: {e}") from e
    return self._captioners[key]

  def caption_tokens(
    self, pixels, decoding: str = "beam", max_len: int = 30, seed: int = 0, **decode_kwargs
  ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, T], cross-attention [N, T, cells]) of normalised `pixels` ([N, S, S, 3], or an iterable of such
    batches), as the captioning evaluator decodes them."""
    if self.method_name not in zero_shot_eval.methods_with_text_side()["caption"]:  # by name, before it is built
      raise UserError(
        f"{self.source}: Captioning needs a model with a forward captioning head (VirTex task 'captioning', "
        f"'bicaptioning' or 'cappa'); this run's method is {self.method_name}."
      )
    caption = self._captioner({"decoding": decoding, "max_len": max_len, **decode_kwargs})
    rng = jax.random.PRNGKey(seed)
    chunks = pixels
    if isinstance(pixels, np.ndarray):
      chunks = (pixels[i : i + self.batch_size] for i in range(0, len(pixels), self.batch_size))
    parts = self._batched(
      chunks, lambda batch, n: tuple(np.asarray(x)[:n] for x in caption(self.variables, batch, rng))
    )
    return np.concatenate([t for t, _ in parts]), np.concatenate([a for _, a in parts])

  def caption(
    self,
    images,
    decoding: str = "beam",
    beam_size: int = 5,
    max_len: int = 30,
    top_p: float = 0.9,
    seed: int = 0,
    preprocessing: dict | None = None,
  ) -> list[str]:
    """A caption per image (captioners: VirTex, CapPa, an imported VirTex). decoding: 'beam', 'greedy', 'nucleus'
    or 'virtex_official' (the official evaluation's beam search; with preprocessing=
    inference.preprocessing(config, 'virtex_official') it captions a zoo checkpoint as its published results)."""
    kwargs = {"beam_size": beam_size} if decoding in ("beam", "virtex_official") else {}
    kwargs.update({"top_p": top_p} if decoding == "nucleus" else {})
    chunks = self._pixel_chunks(as_image_list(images), preprocessing)
    tokens, _ = self.caption_tokens(chunks, decoding, max_len, seed, **kwargs)
    return [self.decode(ids) for ids in tokens]

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids])

  def pieces(self, ids) -> list[str]:
    """The pieces of a decoded caption up to [EOS]."""
    ids = [int(i) for i in ids]
    n = ids.index(EOS_ID) if EOS_ID in ids else len(ids)
    return [self.tokenizer.sp.id_to_piece(t) for t in ids[:n]]


def load(path, checkpoint: str = "best", batch_size: int = 32, flag: str = "path") -> TrainedModel:
  """A run folder (its 'best' checkpoint, 'latest' or a step number) or a shared folder as a `TrainedModel`; any
  folder that is not one, or whose files are damaged or crafted, a UserError naming what was wrong."""
  path = os.fspath(path)
  return TrainedModel(load_run(path, str(checkpoint), flag), batch_size, source=path)
