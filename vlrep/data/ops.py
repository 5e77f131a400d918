"""Preprocessing ops: a registry of `name(args)` -> function(example dict) -> example dict, in TensorFlow.

The general image and caption ops, registered in `vlrep.data.registry`; the method-specific ops register there
from their own modules: LocTex's traces (traces.py), MCT's caption views and paraphrases (caption_views.py),
ICMLM's concept tags (concepts.py), the vision-and-language ops (vl_ops.py, region_files.py). A preprocessing
string chains ops with `|`, e.g.
  `decode|inception_crop(64, area=(0.2, 1.0))|flip_lr_swap_words|color_jitter(0.4, 0.4, 0.4, 0.1)|normalize`
  `|choose_caption|tokenize(30)`

Randomness is stateless (`registry.next_rng`): the same example index always gets the same augmentation.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from vlrep.data import traces as traces_lib
from vlrep.data.registry import Example, HostOp, next_rng, register, register_host

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@register
def get_decode(key: str = "image"):
  """Decodes an encoded image; pixels that are already decoded (the in-memory image cache) pass through."""

  def op(ex):
    ex = dict(ex)
    if ex[key].dtype == tf.uint8:
      return ex
    img = tf.io.decode_image(ex[key], channels=3, expand_animations=False)
    img.set_shape([None, None, 3])
    ex[key] = img
    return ex

  return op


@register
def get_inception_crop(
  size: int, area: tuple[float, float] = (0.2, 1.0), aspect: tuple[float, float] = (3 / 4, 4 / 3), key: str = "image"
):
  """Random crop covering `area` of the image with random aspect ratio, resized to size x size."""

  def op(ex):
    ex = dict(ex)
    img = ex[key]
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
      tf.shape(img),
      tf.zeros([0, 0, 4], tf.float32),
      seed=next_rng(ex),
      area_range=area,
      aspect_ratio_range=aspect,
      min_object_covered=0.0,
      use_image_if_no_bounding_boxes=True,
    )
    crop = tf.slice(img, begin, crop_size)
    ex[key] = tf.cast(
      tf.clip_by_value(tf.image.resize(crop, [size, size], "bilinear", antialias=True), 0, 255), tf.uint8
    )
    _crop_companions(ex, begin[:2], crop_size[:2], tf.shape(img)[:2], [size, size])
    return ex

  return op


@register
def get_resize(size: int, key: str = "image"):
  def op(ex):
    ex = dict(ex)
    shape = tf.shape(ex[key])[:2]
    ex[key] = tf.cast(tf.clip_by_value(tf.image.resize(ex[key], [size, size], antialias=True), 0, 255), tf.uint8)
    _crop_companions(ex, [0, 0], shape, shape, [size, size])
    return ex

  return op


@register
def get_resize_small(size: int, key: str = "image", official: bool = False):
  """Resizes so that the shorter side is `size`, keeping the aspect ratio (bilinear, antialiased). `official`:
  as kdexd/virtex's evaluation (albumentations' SmallestMaxSize): the new size is albumentations' `py3round` of
  side * size / shorter side in double precision (round half to even, Python's round: 300x451 -> 256x385),
  OpenCV's INTER_LINEAR (bilinear without antialiasing), rounded to uint8."""

  def op(ex):
    ex = dict(ex)
    img = ex[key]
    if official:
      # float64 as Python computes it; tf.round rounds half to even, as py3round does.
      h64, w64 = tf.cast(tf.shape(img)[0], tf.float64), tf.cast(tf.shape(img)[1], tf.float64)
      scale64 = tf.constant(float(size), tf.float64) / tf.minimum(h64, w64)
      new = tf.cast(tf.round(tf.stack([h64 * scale64, w64 * scale64])), tf.int32)
      resized = tf.round(tf.image.resize(img, new, "bilinear", antialias=False))
    else:
      h, w = tf.cast(tf.shape(img)[0], tf.float32), tf.cast(tf.shape(img)[1], tf.float32)
      scale = size / tf.minimum(h, w)
      new = tf.cast(tf.round(tf.stack([h * scale, w * scale])), tf.int32)
      resized = tf.image.resize(img, new, antialias=True)
    ex[key] = tf.cast(tf.clip_by_value(resized, 0, 255), tf.uint8)
    _crop_companions(ex, [0, 0], tf.shape(img)[:2], tf.shape(img)[:2], new)
    return ex

  return op


@register
def get_central_crop(size: int, key: str = "image"):
  def op(ex):
    ex = dict(ex)
    img = ex[key]
    h, w = tf.shape(img)[0], tf.shape(img)[1]
    ex[key] = tf.image.crop_to_bounding_box(img, (h - size) // 2, (w - size) // 2, size, size)
    _crop_companions(ex, [(h - size) // 2, (w - size) // 2], [size, size], [h, w], [size, size])
    return ex

  return op


# Fields that move with the image when it is cropped, resized or flipped (if the example has them).
TRACES, OBJECT_MAP = "traces", "object_map"


def _crop_companions(ex: Example, offset_yx, crop_hw, image_hw, out_hw) -> None:
  """Applies a crop (pixel offset/size in an image of image_hw) resized to out_hw to the mouse traces
  (normalised coordinates) and the instance map (nearest neighbour), in place."""
  if TRACES in ex:
    ex[TRACES] = traces_lib.crop_points(
      tf.reshape(tf.cast(ex[TRACES], tf.float32), [-1, 3]), offset_yx, crop_hw, image_hw
    )
  if OBJECT_MAP in ex:
    omap = ex[OBJECT_MAP]
    if omap.dtype == tf.string:
      omap = tf.io.decode_png(omap, channels=1)
    omap = tf.slice(omap, tf.stack([offset_yx[0], offset_yx[1], 0]), tf.stack([crop_hw[0], crop_hw[1], 1]))
    ex[OBJECT_MAP] = tf.cast(tf.image.resize(omap, out_hw, "nearest"), tf.uint8)


def _swap_left_right(text: tf.Tensor) -> tf.Tensor:
  text = tf.strings.regex_replace(text, r"\bleft\b", "\x00")
  text = tf.strings.regex_replace(text, r"\bright\b", "left")
  return tf.strings.regex_replace(text, "\x00", "right")


@register
def get_flip_lr_swap_words(
  keys: tuple[str, ...] = ("captions", "narration", "timed_caption/utterance"), prob: float = 0.5, key: str = "image"
):
  """Horizontal flip that also swaps the words 'left' and 'right' in the text fields (VirTex, LocTex); `a/b`
  names a nested field. Mouse traces and the instance map flip with the image."""

  def op(ex):
    ex = dict(ex)
    flip = tf.random.stateless_uniform([], next_rng(ex)) < prob
    ex[key] = tf.cond(flip, lambda: tf.reverse(ex[key], axis=[1]), lambda: ex[key])
    if TRACES in ex:
      pts = tf.reshape(tf.cast(ex[TRACES], tf.float32), [-1, 3])
      ex[TRACES] = tf.cond(flip, lambda: traces_lib.flip_points(pts), lambda: pts)
    if OBJECT_MAP in ex and ex[OBJECT_MAP].dtype != tf.string:
      ex[OBJECT_MAP] = tf.cond(flip, lambda: tf.reverse(ex[OBJECT_MAP], axis=[1]), lambda: ex[OBJECT_MAP])
    elif OBJECT_MAP in ex:
      omap = tf.io.decode_png(ex[OBJECT_MAP], channels=1)
      ex[OBJECT_MAP] = tf.cond(flip, lambda: tf.reverse(omap, axis=[1]), lambda: omap)
    for k in keys:
      outer, _, inner = k.partition("/")
      if outer in ex and inner and inner in ex[outer]:
        sub = dict(ex[outer])
        sub[inner] = tf.cond(flip, lambda: _swap_left_right(sub[inner]), lambda: sub[inner])
        ex[outer] = sub
      elif k in ex:
        ex[k] = tf.cond(flip, lambda k=k: _swap_left_right(ex[k]), lambda k=k: ex[k])
    ex["flipped"] = flip
    return ex

  return op


@register
def get_color_jitter(
  brightness: float = 0.4,
  contrast: float = 0.4,
  saturation: float = 0.4,
  hue: float = 0.1,
  prob: float = 0.8,
  key: str = "image",
):
  """torchvision-style ColorJitter applied with probability `prob` (VirTex uses 0.4/0.4/0.4/0.1, p=0.8)."""

  def op(ex):
    ex = dict(ex)
    seeds = tf.random.experimental.stateless_split(next_rng(ex), num=5)
    img = tf.cast(ex[key], tf.float32) / 255.0
    out = img
    if brightness:
      out = tf.image.stateless_random_brightness(out, brightness, seeds[0])
    if contrast:
      out = tf.image.stateless_random_contrast(out, 1 - contrast, 1 + contrast, seeds[1])
    if saturation:
      out = tf.image.stateless_random_saturation(out, 1 - saturation, 1 + saturation, seeds[2])
    if hue:
      out = tf.image.stateless_random_hue(out, hue, seeds[3])
    apply = tf.random.stateless_uniform([], seeds[4]) < prob
    out = tf.where(apply, tf.clip_by_value(out, 0.0, 1.0), img)
    ex[key] = tf.cast(tf.round(out * 255.0), tf.uint8)
    return ex

  return op


@register
def get_normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD, key: str = "image"):
  """uint8 [0, 255] -> float32 normalised by ImageNet mean/std."""

  def op(ex):
    ex = dict(ex)
    img = tf.cast(ex[key], tf.float32) / 255.0
    ex[key] = (img - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)
    return ex

  return op


@register
def get_filter_captions(min_words: int = 3, max_words: int = 25, key: str = "captions"):
  """ICMLM's caption cleaning: drops an image's duplicate captions (after lower-casing and stripping; the first
  copy stays) and those with fewer than `min_words` or more than `max_words` words (whitespace-separated).
  `stat_captions_filtered` counts the dropped captions (`data/captions_filtered_count`); an image left without
  captions trains on an empty one, which `tokenize` flags (`data/empty_count`) and the losses ignore."""

  def op(ex):
    ex = dict(ex)
    caps = ex[key]
    words = tf.strings.split(tf.strings.strip(caps)).row_lengths()
    keep = (words >= min_words) & (words <= max_words)
    kept = tf.boolean_mask(caps, keep)
    norm = tf.strings.lower(tf.strings.strip(kept))
    # The first index of each distinct caption: unique ids in order of first appearance.
    unique_norm, ids = tf.unique(norm)
    first = tf.math.unsorted_segment_min(tf.range(tf.shape(norm)[0]), ids, tf.shape(unique_norm)[0])
    ex[key] = tf.gather(kept, first)
    ex["stat_captions_filtered"] = tf.shape(caps)[0] - tf.shape(first)[0]
    return ex

  return op


@register
def get_choose_caption(num_captions: int = 5, key: str = "captions", out: str = "caption"):
  """Samples one of the first `num_captions` captions of the example (VirTex's 1 vs 5 captions ablation)."""

  def op(ex):
    ex = dict(ex)
    caps = ex[key][:num_captions]
    n = tf.shape(caps)[0]
    idx = tf.random.stateless_uniform([], next_rng(ex), 0, tf.maximum(n, 1), dtype=tf.int32)
    # An image without captions yields an empty caption, which `tokenize` flags and losses ignore.
    ex[out] = tf.cond(n > 0, lambda: tf.gather(caps, idx), lambda: tf.constant(""))
    return ex

  return op


@register
def get_text_or_caption(key: str = "narration", captions: str = "captions"):
  """Where the example's `key` text is empty (an image without a narration), one of its plain `captions` (drawn
  with the example's seed) instead: LocTex's fallback for own data with few narrations (configs/loctex.py
  untraced=captions), L_C trained on every image's captions and L_L only where traces are present (the caption's
  words get no trace). `stat_caption_fallback` counts the examples that took a caption
  (`data/caption_fallback_count`)."""

  def op(ex):
    ex = dict(ex)
    text, caps = ex[key], ex[captions]
    n = tf.shape(caps)[0]
    idx = tf.random.stateless_uniform([], next_rng(ex), 0, tf.maximum(n, 1), dtype=tf.int32)
    missing = tf.equal(tf.strings.length(tf.strings.strip(text)), 0)
    fallback = missing & (n > 0)
    ex[key] = tf.cond(fallback, lambda: tf.gather(caps, idx), lambda: text)
    ex["stat_caption_fallback"] = fallback
    return ex

  return op


@register_host
def get_tokenize(max_len: int, key: str = "caption", out: str = "tokens", context=None):
  """SentencePiece-encodes the strings `key` to int32[B, max_len] on the host. Emits `stat_truncated` and
  `stat_empty` flags that the training loop sums: over-long captions are cut (keeping [EOS]), empty ones are
  masked out of the loss."""
  tokenizer = (context or {}).get("tokenizer")
  if tokenizer is None:
    raise ValueError("tokenize() needs a tokenizer; the pipeline passes it in `context`.")

  def fn(batch):
    batch = dict(batch)
    texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in np.asarray(batch[key]).reshape(-1)]
    encoded = [tokenizer.encode(t, max_len) for t in texts]
    batch[out] = np.stack([ids for ids, _ in encoded]) if encoded else np.zeros((0, max_len), np.int32)
    batch["stat_truncated"] = np.array([trunc for _, trunc in encoded], bool)
    batch["stat_empty"] = np.array([not t.strip() for t in texts], bool)
    return batch

  return HostOp((key,), (out, "stat_truncated", "stat_empty"), fn)


@register
def get_fixed_captions(num_captions: int = 5, key: str = "captions", out: str = "captions"):
  """The first `num_captions` captions, padded with empty strings: a fixed shape that batches (COCO images have
  5 to 7 captions)."""

  def op(ex):
    ex = dict(ex)
    caps = ex[key][:num_captions]
    ex[out] = tf.concat([caps, tf.fill([num_captions - tf.shape(caps)[0]], "")], 0)
    ex[out].set_shape([num_captions])
    return ex

  return op


@register
def get_voc_labels(num_classes: int, key: str = "objects", out: str = "labels", field: str = "label"):
  """VOC07 classification targets from object annotations: 1 present, 0 only difficult, -1 absent.

  `field` picks the objects' class field: 'label' (the object class), or another ClassLabel of the objects, e.g.
  synthetic_scenes' 'color' (8 colours) for a probe of what the features say about colour rather than shape.
  """

  def op(ex):
    ex = dict(ex)
    if field not in ex[key]:
      raise ValueError(f"voc_labels(field={field!r}): the {key!r} of this dataset have {sorted(ex[key])}.")
    labels = tf.cast(ex[key][field], tf.int32)
    difficult = tf.cast(ex[key]["is_difficult"], tf.int32)
    easy = tf.reduce_max(tf.one_hot(labels, num_classes, dtype=tf.int32) * (1 - difficult)[:, None], axis=0)
    any_ = tf.reduce_max(tf.one_hot(labels, num_classes, dtype=tf.int32), axis=0)
    # (An image without objects reduces over an empty axis: the minimum int, i.e. absent.)
    ex[out] = tf.where(easy > 0, 1, tf.where(any_ > 0, 0, -1))
    return ex

  return op


@register
def get_largest_object_label(key: str = "objects", out: str = "label", object_map: str = "object_map"):
  """Single-label classification target: the class of the object covering most pixels (its visible area, from
  the instance map `object_map`, where object k is drawn as k + 1); from box areas when there is no map."""

  def op(ex):
    ex = dict(ex)
    labels = ex[key]["label"]
    if object_map in ex:
      ids = tf.reshape(tf.io.decode_png(ex[object_map]) if ex[object_map].dtype == tf.string else ex[object_map], [-1])
      area = tf.math.bincount(tf.cast(ids, tf.int32), minlength=tf.size(labels) + 1)[1 : tf.size(labels) + 1]
    else:
      box = ex[key]["bbox"]
      area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
    ex[out] = tf.cast(tf.gather(labels, tf.argmax(area)), tf.int32)
    return ex

  return op


@register
def get_copy(src: str, dst: str):
  """ex[dst] = ex[src] (e.g. a dataset's class feature into the 'label' field evaluators read)."""

  def op(ex):
    ex = dict(ex)
    ex[dst] = tf.cast(ex[src], tf.int32) if ex[src].dtype == tf.int64 else ex[src]  # class labels -> int32
    return ex

  return op


@register
def get_keep(*keys: str):
  """Keeps only `keys` (and the per-example seed `_rng`): later ops then never touch unused fields."""

  def op(ex):
    return {k: ex[k] for k in (*keys, "_rng") if k in ex}

  return op


@register
def get_random_grayscale(prob: float = 0.2, key: str = "image"):
  """With probability `prob`, the image's luma in all three channels (MoCo-v2's RandomGrayscale)."""

  def op(ex):
    ex = dict(ex)
    img = ex[key]
    gray = tf.cast(tf.round(tf.image.rgb_to_grayscale(tf.cast(img, tf.float32))), img.dtype)
    apply = tf.random.stateless_uniform([], next_rng(ex)) < prob
    ex[key] = tf.where(apply, tf.tile(gray, [1, 1, 3]), img)
    return ex

  return op


@register
def get_gaussian_blur(
  prob: float = 0.5, sigma: tuple[float, float] = (0.1, 2.0), size_fraction: float = 0.1, key="image"
):
  """With probability `prob`, a Gaussian blur with sigma ~ U(sigma) in pixels of a 224 image, scaled to this
  image's size (MoCo-v2 / SimCLR: kernel 10% of the side). Separable, reflect-padded."""

  def op(ex):
    ex = dict(ex)
    img = ex[key]
    seeds = tf.random.experimental.stateless_split(next_rng(ex), num=2)
    side = tf.cast(tf.shape(img)[1], tf.float32)
    s = tf.random.stateless_uniform([], seeds[0], sigma[0], sigma[1]) * side / 224.0
    radius = tf.maximum(tf.cast(side * size_fraction / 2, tf.int32), 1)
    x = tf.cast(tf.range(-radius, radius + 1), tf.float32)
    k = tf.exp(-0.5 * tf.square(x / tf.maximum(s, 1e-3)))
    k = k / tf.reduce_sum(k)
    f = tf.pad(tf.cast(img, tf.float32)[None], [[0, 0], [radius, radius], [radius, radius], [0, 0]], "REFLECT")
    kh = tf.tile(tf.reshape(k, [-1, 1, 1, 1]), [1, 1, 3, 1])
    kw = tf.tile(tf.reshape(k, [1, -1, 1, 1]), [1, 1, 3, 1])
    f = tf.nn.depthwise_conv2d(f, kh, [1, 1, 1, 1], "VALID")
    f = tf.nn.depthwise_conv2d(f, kw, [1, 1, 1, 1], "VALID")[0]
    blurred = tf.cast(tf.clip_by_value(tf.round(f), 0, 255), img.dtype)
    apply = tf.random.stateless_uniform([], seeds[1]) < prob
    ex[key] = tf.where(apply, blurred, img)
    return ex

  return op


@register
def get_tags(fields=(("objects", "label", 0),), num_tags: int = 0, out: str = "tags"):
  """Multi-hot tag vector (uint8[num_tags]) from class-label fields: each (outer, inner, offset) adds the labels
  `ex[outer][inner] + offset` (e.g. shapes at 0 and colours at 10). Repeated labels count once. No fields: all
  zeros (a method that reads tags, trained without them)."""

  def op(ex):
    ex = dict(ex)
    if not fields:
      ex[out] = tf.zeros([num_tags], tf.uint8)
      return ex
    ids = [tf.reshape(tf.cast(ex[o][i], tf.int32), [-1]) + off for o, i, off in fields]
    ids = tf.concat(ids, 0)
    hot = tf.concat([tf.zeros([1, num_tags], tf.int32), tf.one_hot(ids, num_tags, dtype=tf.int32)], 0)
    ex[out] = tf.cast(tf.reduce_max(hot, axis=0), tf.uint8)  # the zero row: images without objects
    return ex

  return op
