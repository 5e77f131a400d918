"""Mouse traces (Localized Narratives) -> per-token attention targets, as LocTex renders them.

A narration is a caption, its `timed_caption` (utterances with start/end times in seconds) and `traces`
(points [N, 3]: x, y normalised to the image, t in seconds). The ops below turn them into, for every caption
token, a binary mask of the grid cells the mouse visited while that token was spoken:

  clean_traces                drop points that are not finite or lie outside [0, 1] (counted)
  inception_crop / flip ...   (in ops.py) move the points with the image; flips swap 'left'/'right' words
  trace_words(max_words, sizes, segments)
                              align utterances to the caption and render one mask per word and grid size:
                              the cells of its points, with segments=True also those crossed between them
  oracle_word_masks(sizes)    (synthetic_scenes) ground-truth masks instead: LocTex's "oracle" supervision
  tokenize_words(max_len)     host op: BPE-tokenise word by word; every token gets its word's masks; captions
                              longer than max_len are cut to a random window of max_len - 2 tokens

Rules for imperfect annotations (each counted in a `stat_*` field that the training loop sums and logs):
  - A point outside [0, 1] or not finite is dropped (`stat_trace_points_outside`, points).
  - A point spoken during no utterance (before the first, after the last, in pauses) belongs to no word;
    `stat_trace_points_outside_time` counts those before the first utterance starts or after the last ends.
  - An utterance whose end precedes its start, or whose times are not finite, gets no points
    (`stat_trace_bad_times`, utterances).
  - A narration without any trace points keeps its caption for the contrastive loss; all its masks are empty
    (`stat_trace_empty`, examples).
  - If the utterances do not spell the caption (compared lower-cased, letters and digits only), the caption's
    text is used with empty masks (`stat_trace_mismatch`, examples): supervision never attaches a trace to
    the wrong word.
  - Words beyond `max_words` are dropped (`stat_trace_words_truncated`, examples).
Tokens with an empty mask ([SOS], [EOS], padding, words without trace) are ignored by the localization loss.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from vlrep.data import registry, scenes, tokenizers

_NOT_ALNUM = r"[^\p{L}\p{N}]"


def _squash(text: tf.Tensor) -> tf.Tensor:
  """Lower-cased letters and digits only: the form in which utterances and caption are compared."""
  return tf.strings.regex_replace(tf.strings.lower(text), _NOT_ALNUM, "")


def inside_unit_square(points: tf.Tensor) -> tf.Tensor:
  """[N] bool: finite points with 0 <= x, y <= 1."""
  xy = points[:, :2]
  return tf.reduce_all(tf.math.is_finite(points), axis=1) & tf.reduce_all((xy >= 0.0) & (xy <= 1.0), axis=1)


def crop_points(points: tf.Tensor, offset_yx, crop_hw, image_hw) -> tf.Tensor:
  """Re-normalises points to a crop of the image (offset and size in pixels). Points outside it leave [0, 1]
  and are ignored by the rendering."""
  offset = tf.cast(tf.stack([offset_yx[1], offset_yx[0]]), tf.float32)
  crop = tf.cast(tf.stack([crop_hw[1], crop_hw[0]]), tf.float32)
  image = tf.cast(tf.stack([image_hw[1], image_hw[0]]), tf.float32)
  xy = (points[:, :2] * image - offset) / crop
  return tf.concat([xy, points[:, 2:]], axis=1)


def flip_points(points: tf.Tensor) -> tf.Tensor:
  return tf.concat([1.0 - points[:, :1], points[:, 1:]], axis=1)


def segment_cells(a: tf.Tensor, b: tf.Tensor, size: int) -> tf.Tensor:
  """bool [S, size*size]: the cells that the segment from a[s] to b[s] (x, y in [0, 1] image coordinates; the
  parts outside the image are ignored) passes through over a positive length (Liang-Barsky clipping against
  each cell; a segment that only touches a cell's corner or edge does not hit it). A zero-length segment hits
  the cell of its point, and an axis-parallel one the column or row of its constant coordinate, with the
  point rendering's rule (a point on the right/bottom border falls in the last cell)."""
  edges = tf.range(size + 1, dtype=tf.float32) / size

  def axis(p, q):  # [S] -> (lo, hi) [S, size]: the range of u (point p + u (q - p)) inside each column/row
    d = q - p
    flat = tf.equal(d, 0.0)
    u = (edges[None, :] - p[:, None]) / tf.where(flat, 1.0, d)[:, None]  # [S, size + 1]
    lo, hi = tf.minimum(u[:, :-1], u[:, 1:]), tf.maximum(u[:, :-1], u[:, 1:])
    index = tf.clip_by_value(tf.cast(tf.floor(p * size), tf.int32), 0, size - 1)
    inside = (p >= 0.0) & (p <= 1.0)
    in_cell = tf.equal(tf.range(size)[None, :], index[:, None]) & inside[:, None]
    lo = tf.where(flat[:, None], tf.where(in_cell, -np.inf, np.inf), lo)
    hi = tf.where(flat[:, None], tf.where(in_cell, np.inf, -np.inf), hi)
    return lo, hi

  lo_x, hi_x = axis(a[:, 0], b[:, 0])
  lo_y, hi_y = axis(a[:, 1], b[:, 1])
  lo = tf.maximum(tf.maximum(lo_y[:, :, None], lo_x[:, None, :]), 0.0)  # [S, row, col]
  hi = tf.minimum(tf.minimum(hi_y[:, :, None], hi_x[:, None, :]), 1.0)
  return tf.reshape(lo < hi, [-1, size * size])


def render_word_masks(
  points: tf.Tensor, starts: tf.Tensor, ends: tf.Tensor, size: int, segments: bool = False
) -> tf.Tensor:
  """uint8 [W, size, size]: cell (i, j) of word w is 1 iff a point with start_w <= t <= end_w lies in it, or,
  with `segments`, the straight segment between two consecutive such points (both spoken during word w)
  crosses it: the pointer's path rather than its samples.

  Cells split [0, 1] evenly; a point on the right/bottom border (x or y == 1) falls in the last cell. A segment
  whose endpoints belong to different words (or to none) is left out; its endpoints still count.
  """
  pts = tf.reshape(points, [-1, 3])
  valid = inside_unit_square(pts)
  cell_xy = tf.clip_by_value(tf.cast(tf.floor(pts[:, :2] * size), tf.int32), 0, size - 1)
  cell = cell_xy[:, 1] * size + cell_xy[:, 0]
  onehot = tf.one_hot(cell, size * size, dtype=tf.float32) * tf.cast(valid, tf.float32)[:, None]
  t = pts[:, 2]
  spoken = (t[None, :] >= starts[:, None]) & (t[None, :] <= ends[:, None])  # [W, N]
  hits = tf.matmul(tf.cast(spoken, tf.float32), onehot)  # [W, size*size]
  if segments:
    a, b = pts[:-1], pts[1:]
    finite = tf.reduce_all(tf.math.is_finite(a), axis=1) & tf.reduce_all(tf.math.is_finite(b), axis=1)
    crossed = tf.cast(segment_cells(a[:, :2], b[:, :2], size) & finite[:, None], tf.float32)  # [N-1, size*size]
    both = tf.cast(spoken[:, :-1] & spoken[:, 1:], tf.float32)  # [W, N-1]
    hits += tf.matmul(both, crossed)
  return tf.reshape(tf.cast(hits > 0, tf.uint8), [-1, size, size])


@registry.register
def get_clean_traces(key: str = "traces"):
  """Drops trace points that are not finite or outside [0, 1]; counts them (`stat_trace_points_outside`).

  Also accepts Localized Narratives' nested layout flattened to [N, 3] by the builders."""

  def op(ex):
    ex = dict(ex)
    pts = tf.reshape(tf.cast(ex[key], tf.float32), [-1, 3])
    keep = inside_unit_square(pts)
    ex[key] = tf.boolean_mask(pts, keep)
    ex["stat_trace_points_outside"] = tf.reduce_sum(tf.cast(~keep, tf.int32))
    return ex

  return op


@registry.register
def get_trace_words(
  max_words: int,
  sizes: tuple[int, ...] = (7, 14),
  text: str = "narration",
  timed: str = "timed_caption",
  traces: str = "traces",
  segments: bool = False,
):
  """Aligns the utterances to the caption and renders each word's trace at every grid size in `sizes`: the
  cells of its points, and with `segments` also the cells the pointer crosses between two consecutive points
  of the word (render_word_masks).

  Produces `words` [max_words] (padded with ''), `num_words`, `word_masks_<size>` uint8 [max_words, size,
  size], `window_u` (a uniform draw for tokenize_words' random window) and the stats described above.
  """

  def op(ex):
    ex = dict(ex)
    caption = ex[text]
    utter = ex[timed]["utterance"]
    starts = tf.cast(ex[timed]["start_time"], tf.float32)
    ends = tf.cast(ex[timed]["end_time"], tf.float32)
    pts = tf.reshape(tf.cast(ex[traces], tf.float32), [-1, 3])

    matches = (tf.size(utter) > 0) & tf.equal(_squash(caption), tf.strings.reduce_join(_squash(utter)))
    caption_words = tf.strings.split(caption)
    n_caption = tf.size(caption_words)
    no_time = tf.fill([n_caption], np.float32(np.inf))
    words = tf.cond(matches, lambda: utter, lambda: caption_words)
    starts = tf.cond(matches, lambda: starts, lambda: no_time)
    ends = tf.cond(matches, lambda: ends, lambda: -no_time)

    good_times = tf.math.is_finite(starts) & tf.math.is_finite(ends) & (ends >= starts)
    bad_times = tf.reduce_sum(tf.cast(matches, tf.int32) * tf.cast(~good_times, tf.int32))
    starts = tf.where(good_times, starts, np.inf)
    ends = tf.where(good_times, ends, -np.inf)

    # Bad-time words already carry an empty window (+inf, -inf), so min/max skip them.
    first, last = tf.reduce_min(starts), tf.reduce_max(ends)
    n = tf.size(words)
    truncated = n > max_words
    words, starts, ends = words[:max_words], starts[:max_words], ends[:max_words]
    n = tf.minimum(n, max_words)
    pad = max_words - n
    ex["words"] = tf.ensure_shape(tf.pad(words, [[0, pad]], constant_values=""), [max_words])
    ex["num_words"] = n
    starts = tf.pad(starts, [[0, pad]], constant_values=np.inf)
    ends = tf.pad(ends, [[0, pad]], constant_values=-np.inf)
    for size in sizes:
      masks = render_word_masks(pts, starts, ends, size, segments)
      ex[f"word_masks_{size}"] = tf.ensure_shape(masks, [max_words, size, size])

    t = pts[:, 2]
    outside_time = (t < first) | (t > last)
    ex["stat_trace_points_outside_time"] = tf.where(
      matches & tf.math.is_finite(first), tf.reduce_sum(tf.cast(outside_time, tf.int32)), 0
    )
    ex["stat_trace_bad_times"] = bad_times
    ex["stat_trace_mismatch"] = ~matches
    ex["stat_trace_empty"] = tf.shape(pts)[0] == 0
    ex["stat_trace_words_truncated"] = truncated
    ex["window_u"] = tf.random.stateless_uniform([], registry.next_rng(ex))
    return ex

  return op


@registry.register
def get_oracle_word_masks(
  sizes: tuple[int, ...] = (7, 14),
  class_names: tuple[str, ...] | None = None,
  match_traces: bool = True,
  object_map: str = "object_map",
  objects: str = "objects",
):
  """Ground-truth word masks from instance masks (LocTex's oracle; also the localization metric's targets).

  A word naming a class (`class_names` and their plurals; by default synthetic_scenes' shapes with the
  synonyms its texts use, e.g. 'box'/'boxes' for square; case and punctuation ignored) gets the cells
  covered by that class's visible instances; with `match_traces`, only the instances its rendered trace
  touches (the paper matches instances to traces by IoU), or all of them if it touches none. Other words get
  empty masks. Needs `trace_words` before it and the instance map (`object_map`, value k + 1 where object k
  is visible), cropped and flipped with the image.
  """
  if class_names is None:
    words_of = [scenes.shape_words(shape) for shape in scenes.SHAPES]
  else:
    words_of = [(n, n + "s") for n in class_names]
  keys = [w for words in words_of for w in words]
  values = [c for c, words in enumerate(words_of) for _ in words]
  table = tf.lookup.StaticHashTable(
    tf.lookup.KeyValueTensorInitializer(tf.constant(keys), tf.constant(values, tf.int64)), default_value=-1
  )

  def op(ex):
    ex = dict(ex)
    omap = ex[object_map]
    if omap.dtype == tf.string:
      omap = tf.io.decode_png(omap, channels=1)
    labels = tf.cast(ex[objects]["label"], tf.int64)
    k = tf.size(labels)
    ids = tf.cast(omap[..., 0], tf.int32)
    instances = tf.cast(tf.equal(ids[None], tf.range(1, k + 1)[:, None, None]), tf.float32)[..., None]  # [K,H,W,1]
    word_class = table.lookup(_squash(ex["words"]))  # [W]
    names_class = tf.equal(word_class[:, None], labels[None, :])  # [W, K]
    for size in sizes:
      cells = tf.reshape(tf.image.resize(instances, [size, size], "area") > 0, [k, size * size])  # [K, R*R]
      chosen = names_class & tf.reduce_any(cells, axis=1)[None, :]
      if match_traces:
        trace = tf.reshape(ex[f"word_masks_{size}"] > 0, [-1, size * size])
        touched = chosen & tf.reduce_any(trace[:, None, :] & cells[None], axis=2)
        chosen = tf.where(tf.reduce_any(touched, axis=1, keepdims=True), touched, chosen)
      union = tf.reduce_any(chosen[:, :, None] & cells[None], axis=1)  # [W, R*R]
      ex[f"word_masks_{size}"] = tf.reshape(tf.cast(union, tf.uint8), [-1, size, size])
    return ex

  return op


def assign_tokens(word_ids: list[list[int]], max_len: int, window_u: float) -> tuple[list[int], list[int], bool]:
  """Flattens per-word token ids into [SOS] ... [EOS] of at most `max_len` and each token's word index (-1 for
  specials). Longer captions keep a window of max_len - 2 tokens starting at floor(u * (n - max_len + 3))."""
  ids = [i for w in word_ids for i in w]
  owner = [k for k, w in enumerate(word_ids) for _ in w]
  room = max_len - 2
  truncated = len(ids) > room
  if truncated:
    start = min(int(window_u * (len(ids) - room + 1)), len(ids) - room)
    ids, owner = ids[start : start + room], owner[start : start + room]
  return [tokenizers.SOS_ID, *ids, tokenizers.EOS_ID], [-1, *owner, -1], truncated


@registry.register_host
def get_tokenize_words(
  max_len: int, sizes: tuple[int, ...] = (7, 14), random_window: bool = True, out: str = "tokens", context=None
):
  """Host op after `trace_words`: tokens [B, max_len] and `trace_mask_<size>` uint8 [B, max_len, size, size]
  (each token carries its word's mask; specials and padding are empty)."""
  tokenizer = (context or {}).get("tokenizer")
  if tokenizer is None:
    raise ValueError("tokenize_words() needs a tokenizer; the pipeline passes it in `context`.")
  mask_keys = tuple(f"word_masks_{s}" for s in sizes)

  def fn(batch):
    batch = dict(batch)
    words, num_words = np.asarray(batch["words"]), np.asarray(batch["num_words"])
    window = np.asarray(batch["window_u"]) if random_window else np.zeros(len(words))
    b = len(words)
    tokens = np.full((b, max_len), tokenizers.PAD_ID, np.int32)
    owners = np.full((b, max_len), -1, np.int64)
    truncated = np.zeros(b, bool)
    for i in range(b):
      texts = [w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in words[i, : num_words[i]]]
      ids, owner, truncated[i] = assign_tokens(tokenizer.encode_words(texts), max_len, float(window[i]))
      tokens[i, : len(ids)] = ids
      owners[i, : len(owner)] = owner
    batch[out] = tokens
    rows = np.arange(b)[:, None]
    for size, key in zip(sizes, mask_keys, strict=True):
      masks = np.asarray(batch[key])[rows, np.maximum(owners, 0)]
      batch[f"trace_mask_{size}"] = masks * (owners >= 0)[..., None, None].astype(masks.dtype)
    batch["stat_truncated"] = truncated
    batch["stat_empty"] = num_words == 0
    return batch

  outputs = (out, *(f"trace_mask_{s}" for s in sizes), "stat_truncated", "stat_empty")
  return registry.HostOp(("words", "num_words", "window_u", *mask_keys), outputs, fn)
