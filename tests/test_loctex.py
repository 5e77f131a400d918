"""LocTex: trace rendering, bad narrations, losses against numpy, per-device vs global InfoNCE, Localized
Narratives from local files, and an end-to-end run."""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
from conftest import ROOT, run_module
from PIL import Image

from vlrep.data import pipeline, prepare, records, registry, tokenizers, traces
from vlrep.pytorch import detectron2_heads


def _narration(words_times, points, caption=None, size=32):
  """A hand-made example in the synthetic_scenes / localized_narratives layout."""
  words = [w for w, _, _ in words_times]
  return {
    "image": tf.zeros([size, size, 3], tf.uint8),
    "narration": tf.constant(caption if caption is not None else " ".join(words)),
    "timed_caption": {
      "utterance": tf.constant(words, tf.string) if words else tf.zeros([0], tf.string),
      "start_time": tf.constant([s for _, s, _ in words_times], tf.float32),
      "end_time": tf.constant([e for _, _, e in words_times], tf.float32),
    },
    "traces": tf.constant(np.asarray(points, np.float32).reshape(-1, 3)),
    "_rng": tf.constant([0, 1], tf.int64),
  }


def _run(pp, example):
  out = registry.parse(pp).example_fn(dict(example))
  return {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in out.items()}


# Word 0 'a' (0-1 s): no points. Word 1 'circle' (1-2 s): points in the top-left quadrant. Word 2 'left'
# (2-3 s): one point bottom-right. A point at t=5 s is spoken during no word.
WORDS = [("a", 0.0, 1.0), ("circle", 1.0, 2.0), ("left", 2.0, 3.0)]
POINTS = [(0.1, 0.1, 1.2), (0.3, 0.2, 1.5), (0.9, 0.8, 2.5), (0.5, 0.5, 5.0)]


def test_rendered_masks_on_hand_made_traces():
  out = _run("clean_traces|trace_words(5, sizes=(2, 4))", _narration(WORDS, POINTS))
  assert [w.decode() for w in out["words"]] == ["a", "circle", "left", "", ""] and out["num_words"] == 3
  m2, m4 = out["word_masks_2"], out["word_masks_4"]
  assert m2.shape == (5, 2, 2) and m4.shape == (5, 4, 4)
  assert m2[0].sum() == 0 and m2[3:].sum() == 0  # no points while 'a' was spoken; padding is empty
  np.testing.assert_array_equal(m2[1], [[1, 0], [0, 0]])
  np.testing.assert_array_equal(m2[2], [[0, 0], [0, 1]])
  expected = np.zeros((4, 4), np.uint8)
  expected[0, 0] = expected[0, 1] = 1  # (x=0.1, y=0.1) -> row 0 col 0; (x=0.3, y=0.2) -> row 0 col 1
  np.testing.assert_array_equal(m4[1], expected)
  assert m4[2, 3, 3] == 1 and m4[2].sum() == 1
  assert out["stat_trace_points_outside_time"] == 1 and not out["stat_trace_mismatch"]


def test_segments_hit_every_cell_the_pointer_crosses_between_a_words_points():
  """segments=True adds the cells crossed between consecutive points of the same word (4x4 grid, rows = y)."""
  pts = [
    (0.1, 0.2, 1.1),  # 'circle': y = 0.2 + (x - 0.1) / 2 across the grid
    (0.9, 0.6, 1.9),
    (0.1, 0.9, 2.2),  # 'left': up column 0 ...
    (0.1, 0.3, 2.5),
    (1.5, 0.3, 2.8),  # ... then right along row 1, leaving the image (the part outside is ignored)
  ]
  points_only = _run("trace_words(5, sizes=(4,))", _narration(WORDS, pts))["word_masks_4"]
  out = _run("trace_words(5, sizes=(4,), segments=True)", _narration(WORDS, pts))["word_masks_4"]

  def cells(mask):  # (row, col)
    return sorted(map(tuple, np.argwhere(mask).tolist()))

  assert cells(points_only[1]) == [(0, 0), (2, 3)] and cells(points_only[2]) == [(1, 0), (3, 0)]
  # The line enters row 1 at x = 0.2 (col 0) and row 2 at x = 0.7 (col 2): six cells.
  assert cells(out[1]) == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 2), (2, 3)]
  assert cells(out[2]) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (3, 0)]
  # The segment from 'circle''s last point to 'left''s first spans two words: neither gets it; 'a' has no points.
  assert out[0].sum() == 0 and out[3:].sum() == 0
  # A diagonal through grid corners hits the cells it passes through, not those it only touches.
  diagonal = traces.segment_cells(tf.constant([[0.0, 0.0]]), tf.constant([[1.0, 1.0]]), 4).numpy().reshape(4, 4)
  np.testing.assert_array_equal(diagonal, np.eye(4, dtype=bool))
  # A zero-length segment hits its point's cell; one along the right border, the last column (as points there).
  edge = traces.segment_cells(tf.constant([[0.3, 0.3], [1.0, 0.2]]), tf.constant([[0.3, 0.3], [1.0, 0.8]]), 2)
  np.testing.assert_array_equal(edge.numpy(), [[1, 0, 0, 0], [0, 1, 0, 1]])


def test_flip_mirrors_masks_and_swaps_left_right():
  out = _run("clean_traces|flip_lr_swap_words(prob=1.0)|trace_words(5, sizes=(2, 4))", _narration(WORDS, POINTS))
  assert [w.decode() for w in out["words"][:3]] == ["a", "circle", "right"]
  assert out["narration"].decode() == "a circle right"
  np.testing.assert_array_equal(out["word_masks_2"][1], [[0, 1], [0, 0]])
  np.testing.assert_array_equal(out["word_masks_2"][2], [[0, 0], [1, 0]])
  expected = np.zeros((4, 4), np.uint8)
  expected[0, 3] = expected[0, 2] = 1
  np.testing.assert_array_equal(out["word_masks_4"][1], expected)


def test_central_crop_moves_traces_with_the_image():
  # 32x32 image, centre 16x16 crop: pixels 8..24 -> 0..1. (0.3, 0.3) * 32 = 9.6 -> 0.1 (top-left cell);
  # (0.7, 0.6) -> (0.9, 0.7) (bottom-right); (0.1, 0.1) and (0.9, 0.8) leave the crop.
  pts = [(0.1, 0.1, 1.2), (0.3, 0.3, 1.5), (0.7, 0.6, 1.7), (0.9, 0.8, 2.5)]
  out = _run("clean_traces|central_crop(16)|trace_words(5, sizes=(2,))", _narration(WORDS, pts))
  np.testing.assert_array_equal(out["word_masks_2"][1], [[1, 0], [0, 1]])
  assert out["word_masks_2"][2].sum() == 0
  np.testing.assert_allclose(out["traces"][1:3, :2], [[0.1, 0.1], [0.9, 0.7]], atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_random_crop_and_flip_keep_traces_on_the_image_content(seed):
  """A bright pixel drawn under the trace point must stay in the point's grid cell after augmentation."""
  size = 64
  img = np.zeros((size, size, 3), np.uint8)
  x, y = 0.3 + 0.05 * seed, 0.6 - 0.04 * seed
  img[int(y * size) - 1 : int(y * size) + 2, int(x * size) - 1 : int(x * size) + 2] = 255
  ex = _narration([("dot", 0.0, 1.0)], [(x, y, 0.5)], size=size)
  ex["image"] = tf.constant(img)
  ex["_rng"] = tf.constant([seed, 7], tf.int64)
  pp = "clean_traces|inception_crop(32, area=(0.6, 1.0))|flip_lr_swap_words|trace_words(2, sizes=(8,))"
  out = _run(pp, ex)
  bright = out["image"].astype(float).sum(-1)
  by, bx = np.unravel_index(np.argmax(bright), bright.shape)
  mask = out["word_masks_8"][0]
  assert mask.sum() == 1
  cy, cx = np.argwhere(mask)[0]
  assert abs(by // 4 - cy) <= 1 and abs(bx // 4 - cx) <= 1, (by, bx, cy, cx)


def test_bad_narrations_follow_the_rules_and_are_counted():
  # Points outside [0, 1] and NaN are dropped and counted.
  pts = [(1.2, 0.5, 1.5), (-0.1, 0.5, 1.5), (np.nan, 0.5, 1.5), (0.25, 0.25, 1.5)]
  out = _run("clean_traces|trace_words(4, sizes=(2,))", _narration(WORDS, pts))
  assert out["stat_trace_points_outside"] == 3
  np.testing.assert_array_equal(out["word_masks_2"][1], [[1, 0], [0, 0]])
  # An utterance ending before it starts gets no points; counted.
  bad = [("a", 0.0, 1.0), ("circle", 2.0, 1.0), ("left", 2.0, 3.0)]
  out = _run("clean_traces|trace_words(4, sizes=(2,))", _narration(bad, POINTS))
  assert out["stat_trace_bad_times"] == 1 and out["word_masks_2"][1].sum() == 0 and out["word_masks_2"][2].sum() == 1
  # Timestamps outside every utterance: counted, belong to no word.
  late = [(0.5, 0.5, 10.0), (0.5, 0.5, -1.0)]
  out = _run("clean_traces|trace_words(4, sizes=(2,))", _narration(WORDS, late))
  assert out["stat_trace_points_outside_time"] == 2 and out["word_masks_2"].sum() == 0
  # Empty traces: every mask empty, flagged.
  out = _run("clean_traces|trace_words(4, sizes=(2,))", _narration(WORDS, np.zeros((0, 3))))
  assert out["stat_trace_empty"] and out["word_masks_2"].sum() == 0
  # Timed words that do not spell the caption: the caption's words, no masks, flagged.
  out = _run("clean_traces|trace_words(6, sizes=(2,))", _narration(WORDS, POINTS, caption="a square on the left"))
  assert out["stat_trace_mismatch"] and out["word_masks_2"].sum() == 0
  assert [w.decode() for w in out["words"][:5]] == ["a", "square", "on", "the", "left"]
  # Case and punctuation do not count as a mismatch; neither do words split differently.
  out = _run("trace_words(4, sizes=(2,))", _narration(WORDS, POINTS, caption="A circle-left."))
  assert not out["stat_trace_mismatch"] and out["word_masks_2"].sum() == 2
  # No timed words at all: a mismatch, not a crash.
  out = _run("trace_words(4, sizes=(2,))", _narration([], POINTS, caption="a circle"))
  assert out["stat_trace_mismatch"] and out["num_words"] == 2
  # More words than max_words: truncated, flagged.
  out = _run("trace_words(2, sizes=(2,))", _narration(WORDS, POINTS))
  assert out["stat_trace_words_truncated"] and out["num_words"] == 2


def test_tokens_carry_their_words_masks_and_long_captions_get_a_random_window():
  ids, owner, truncated = traces.assign_tokens([[10], [11, 12], [13]], max_len=8, window_u=0.0)
  assert ids == [tokenizers.SOS_ID, 10, 11, 12, 13, tokenizers.EOS_ID] and owner == [-1, 0, 1, 1, 2, -1]
  assert not truncated
  words = [[100 + k] for k in range(10)]
  starts = set()
  for u in np.linspace(0, 0.999, 50):
    ids, owner, truncated = traces.assign_tokens(words, max_len=6, window_u=u)
    assert truncated and len(ids) == 6 and ids[0] == tokenizers.SOS_ID and ids[-1] == tokenizers.EOS_ID
    assert ids[1:-1] == [100 + k for k in owner[1:-1]] and owner[1:-1] == list(range(owner[1], owner[1] + 4))
    starts.add(owner[1])
  assert starts == set(range(7))  # every window start 0..n-room is reachable


def test_tokenize_words_gathers_masks_per_token(tiny_tokenizer):
  ex = _narration(WORDS, POINTS)
  pp = registry.parse(
    "clean_traces|trace_words(5, sizes=(2,))|tokenize_words(12, sizes=(2,))", {"tokenizer": tiny_tokenizer}
  )
  one = {k: v.numpy() for k, v in pp.example_fn(dict(ex)).items() if k in pp.host_inputs}
  batch = pp.batch_fn({k: np.stack([v, v]) for k, v in one.items()})
  tokens, masks = batch["tokens"][0], batch["trace_mask_2"][0]
  pieces = tiny_tokenizer.encode_words(["a", "circle", "left"])
  n = sum(map(len, pieces))
  assert list(tokens[1 : n + 1]) == [i for p in pieces for i in p] and tokens[n + 1] == tokenizers.EOS_ID
  word_of_token = [k for k, p in enumerate(pieces) for _ in p]
  for t, k in enumerate(word_of_token, start=1):
    np.testing.assert_array_equal(masks[t], one["word_masks_2"][k])
  assert masks[0].sum() == 0 and masks[n + 1 :].sum() == 0


def test_oracle_masks_come_from_the_named_objects(tiny_builder):
  ds = records.examples(tiny_builder, "val", decode_images=True).take(12)
  synonyms = 0
  pp = "trace_words(64, sizes=(4,))|oracle_word_masks(sizes=(4,), match_traces=False)"
  for ex in ds:
    ex = dict(ex)
    ex["_rng"] = tf.zeros([2], tf.int64)
    labels = ex["objects"]["label"].numpy()
    omap = ex["object_map"].numpy()[..., 0]
    out = _run(pp, ex)
    from vlrep.data import scenes

    for w, m in zip(out["words"][: out["num_words"]], out["word_masks_4"][: out["num_words"]], strict=True):
      name = w.decode().strip(".")
      named = [c for c, shape in enumerate(scenes.SHAPES) if name in scenes.shape_words(shape)]
      if named:
        k = [i for i, lab in enumerate(labels) if lab == named[0]]
        visible = np.isin(omap, [i + 1 for i in k]).reshape(4, 8, 4, 8).any(axis=(1, 3))
        np.testing.assert_array_equal(m.astype(bool), visible)
        synonyms += name not in scenes.SHAPES
      else:
        assert m.sum() == 0
  assert synonyms > 0  # 'box', 'disc', 'donut' name shapes too


# ---------------------------------------------------------------------------------------------------------- #
# Losses against numpy.
# ---------------------------------------------------------------------------------------------------------- #
def _np_info_nce(img, txt, tau, symmetric=False):
  img = img / np.linalg.norm(img, axis=1, keepdims=True)
  txt = txt / np.linalg.norm(txt, axis=1, keepdims=True)
  s = img @ txt.T / tau
  rows = [-(s[i, i] - np.log(np.exp(s[i]).sum())) for i in range(len(s))]
  if symmetric:
    cols = [-(s[i, i] - np.log(np.exp(s[:, i]).sum())) for i in range(len(s))]
    rows = [(r + c) / 2 for r, c in zip(rows, cols, strict=True)]
  return float(np.mean(rows))


def _np_localization(logits, target, rows=None):
  """Eq. 3 per example over the rows in `rows` (default: the tokens with a target), then the mean."""
  losses = []
  for i, (lg, tg) in enumerate(zip(logits, target, strict=True)):
    sup = tg.sum(1) > 0
    if not sup.any():
      continue
    keep = sup if rows is None else rows[i].astype(bool) | sup
    m = np.exp(lg[keep] - lg[keep].max(1, keepdims=True))
    m = m / m.sum(1, keepdims=True)
    t = tg[keep].astype(float)
    losses.append(np.linalg.norm(m / np.linalg.norm(m) - t / np.linalg.norm(t)))
  return float(np.mean(losses)), len(losses)


def test_losses_match_numpy():
  from vlrep.methods.loctex import info_nce, localization_loss

  rng = np.random.default_rng(0)
  img, txt = rng.normal(size=(8, 5)), rng.normal(size=(8, 5))
  assert float(info_nce(img, txt, 0.1)) == pytest.approx(_np_info_nce(img, txt, 0.1), rel=1e-5)
  assert float(info_nce(img, txt, 0.1, symmetric=True)) == pytest.approx(_np_info_nce(img, txt, 0.1, True), rel=1e-5)
  halves = np.mean([_np_info_nce(img[:4], txt[:4], 0.1), _np_info_nce(img[4:], txt[4:], 0.1)])
  assert float(info_nce(img, txt, 0.1, groups=2)) == pytest.approx(halves, rel=1e-5)
  assert float(info_nce(img, txt, 0.1, groups=2)) != pytest.approx(float(info_nce(img, txt, 0.1)), rel=1e-3)

  logits = rng.normal(size=(4, 6, 9)) * 3
  target = (rng.random((4, 6, 9)) < 0.2).astype(np.uint8)
  target[2] = 0  # an example without supervised tokens is left out
  target[0, 1] = 0  # a token without trace is ignored
  loss, count = localization_loss(logits, target)
  expected, n = _np_localization(logits, target)
  assert float(loss) == pytest.approx(expected, rel=1e-5) and int(count) == n == 3
  # Zero when attention spreads evenly over each token's target cells and every supervised token has as many
  # cells (softmax rows sum to 1, so eq. 3 cannot reach zero when tokens' masks differ in size).
  even = np.zeros((1, 6, 9), np.uint8)
  even[0, 0, [1, 2]] = even[0, 3, [4, 8]] = 1
  one, _ = localization_loss(np.where(even > 0, 30.0, -30.0), even)
  assert float(one) < 1e-3
  assert float(localization_loss(np.where(even > 0, -30.0, 30.0), even)[0]) == pytest.approx(np.sqrt(2), rel=1e-3)
  rows = rng.random((4, 6)) < 0.5
  expected, _ = _np_localization(logits, target, rows)
  assert float(localization_loss(logits, target, rows)[0]) == pytest.approx(expected, rel=1e-5)


def test_eq3_normalises_the_whole_caption_map_in_the_recipe():
  """Eq. 3 divides M_k by the norm of its whole L x R x R map. One example, 2 cells: token 0 traced to cell 0,
  token 1 a caption token without trace, token 2 padding; uniform attention (0.5, 0.5) in every row.
  Eq. 3: M / |M| = 0.5 in rows 0-1 (|M| = 1), so |M/|M| - T/|T||^2 = 0.25 + 0.25 + 2 * 0.25 = 1.
  Traced rows only: M / |M| = (0.707, 0.707) in row 0, so the loss is sqrt(2 - sqrt(2)).
  (Padding counted as well would give sqrt(2 - 1 / sqrt(1.5)) = 1.088.)"""
  import jax.numpy as jnp

  from configs import loctex as loctex_config
  from vlrep import methods
  from vlrep.methods.loctex import localization_loss
  from vlrep.models import special_tokens

  logits = np.zeros((1, 3, 2), np.float32)
  target = np.array([[[1, 0], [0, 0], [0, 0]]], np.uint8)
  assert float(localization_loss(logits, target, np.array([[1, 1, 0]]))[0]) == pytest.approx(1.0, rel=1e-5)
  assert float(localization_loss(logits, target)[0]) == pytest.approx(np.sqrt(2 - np.sqrt(2)), rel=1e-5)

  # The method takes the caption's rows from its tokens (all but padding) when localization_norm="caption".
  # A stand-in model gives uniform maps over a 2x2 grid, token 0 traced to cell 0: eq. 3 gives
  # sqrt(2 - 2 * 0.25 / sqrt(8 * 0.25^2)) = sqrt(2 - 1 / sqrt(2)); traced rows only give sqrt(2 - 2 * 0.5) = 1.
  class Model:
    def apply(self, variables, image, tokens, train, rngs=None, mutable=None):
      b, t = tokens.shape
      out = {"image_embedding": jnp.ones((b, 4)), "text_embedding": jnp.ones((b, 4))}
      out["attention_logits_1x"] = jnp.zeros((b, t, 4))
      return (out, None), {}

  batch = {
    "image": np.zeros((1, 8, 8, 3), np.float32),
    "tokens": np.array([[special_tokens.SOS_ID, 7, special_tokens.PAD_ID]]),
    "trace_mask_2": np.array([[[[1, 0], [0, 0]], [[0, 0], [0, 0]], [[0, 0], [0, 0]]]], np.uint8),
  }
  expected = {"caption": np.sqrt(2 - 1 / np.sqrt(2)), "traced": 1.0}
  cfg = loctex_config.get_config("runlocal,scales=1").method
  for norm, value in expected.items():
    cfg.update(localization_norm=norm, grid_sizes=(2,))
    method = methods.build(cfg, 50)
    method.model = Model()
    metrics = method.loss({}, batch, None)[1]
    assert float(metrics["localization_loss_1x"]) == pytest.approx(value, rel=1e-5), norm
  cfg.localization_norm = "all"
  with pytest.raises(ValueError, match="localization_norm"):
    methods.build(cfg, 50)
  del cfg["localization_norm"]  # a saved config without the key means "traced", what such a run trained with
  assert methods.build(cfg, 50).localization_norm == "traced"


def test_per_device_vs_global_infonce_on_eight_devices(tmp_path):
  """Inside one sharded jit over 8 fake devices: per-device InfoNCE is the mean of each device's own
  InfoNCE; global InfoNCE is the whole batch's; they differ as numpy says."""
  script = tmp_path / "nce.py"
  script.write_text(
    """
import json, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from vlrep import sharding
from vlrep.methods.loctex import info_nce
mesh = sharding.make_mesh()
rng = np.random.default_rng(0)
img, txt = rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 6)).astype(np.float32)
sh = NamedSharding(mesh, P("data"))
img_g, txt_g = jax.device_put(img, sh), jax.device_put(txt, sh)
out = {}
for name, groups in (("per_device", mesh.shape["data"]), ("global", 1)):
  f = jax.jit(lambda a, b, g=groups: info_nce(a, b, 0.1, groups=g), in_shardings=(sh, sh))
  out[name] = float(f(img_g, txt_g))
  out[name + "_hlo_all_gather"] = "all-gather" in f.lower(img_g, txt_g).compile().as_text()
out["devices"] = len(jax.devices())
print(json.dumps(out))
"""
  )
  # A process of its own (8 devices), forked from the worker's server: the script is a module on its path.
  devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(script.parent)}
  res = run_module(script.stem, env=devices, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  rng = np.random.default_rng(0)
  img, txt = rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 6)).astype(np.float32)
  per_device = np.mean([_np_info_nce(img[4 * d : 4 * d + 4], txt[4 * d : 4 * d + 4], 0.1) for d in range(8)])
  assert out["devices"] == 8
  assert out["per_device"] == pytest.approx(per_device, rel=1e-5)
  assert out["global"] == pytest.approx(_np_info_nce(img, txt, 0.1), rel=1e-5)
  # Fewer negatives: per-device loss is lower than the global one here (log 4 vs log 32 scale).
  assert out["per_device"] < out["global"] - 0.5
  # Per-device needs no cross-device gather of embeddings; the global loss does.
  assert not out["per_device_hlo_all_gather"] and out["global_hlo_all_gather"]


# ---------------------------------------------------------------------------------------------------------- #
# Localized Narratives from local files in the official format.
# ---------------------------------------------------------------------------------------------------------- #
def _write_jpeg(path, size, seed):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(np.random.default_rng(seed).integers(0, 255, size[::-1] + (3,), dtype=np.uint8)).save(path)


def _ln_line(dataset_id, image_id, caption, words, segments):
  return json.dumps(
    {
      "dataset_id": dataset_id,
      "image_id": image_id,
      "annotator_id": 7,
      "caption": caption,
      "timed_caption": [{"utterance": w, "start_time": s, "end_time": e} for w, s, e in words],
      "traces": [[{"x": x, "y": y, "t": t} for x, y, t in seg] for seg in segments],
      "voice_recording": "coco_train/coco_train_137576_93.ogg",
    }
  )


def test_localized_narratives_from_local_files(tmp_path, tiny_tokenizer):
  root = tmp_path / "ln"
  words = [("In", 0.0, 0.4), ("this", 0.4, 0.8), ("picture", 0.8, 1.4), ("left.", 1.4, 2.0)]
  segs = [[(0.1, 0.1, 0.5), (0.2, 0.1, 0.6)], [(0.8, 0.9, 1.5), (1.3, 0.9, 1.6)]]  # one point outside the image
  lines = [
    _ln_line("mscoco_train2017", "1", "In this picture left.", words, segs),
    _ln_line("mscoco_train2017", "1", "In this picture left.", words, []),  # second narration, no trace
    _ln_line("mscoco_train2017", "2", "   ", words, segs),  # empty caption: skipped
    "{not json",  # skipped
    _ln_line("mscoco_train2017", "3", "In this picture left.", words, segs),  # missing image: skipped
  ]
  ann = root / "localized_narratives"
  os.makedirs(ann)
  (ann / "coco_train_localized_narratives-00000-of-00001.jsonl").write_text("\n".join(lines) + "\n")
  (ann / "coco_val_localized_narratives.jsonl").write_text(lines[0].replace('"1"', '"5"') + "\n")
  (ann / "open_images_train_v6_localized_narratives-00000-of-00001.jsonl").write_text(
    _ln_line("open_images", "0a1b2c3d4e5f6a7b", "In this picture left.", words, segs) + "\n"
  )
  _write_jpeg(str(root / "train2017" / f"{1:012d}.jpg"), (40, 30), 1)
  _write_jpeg(str(root / "val2017" / f"{5:012d}.jpg"), (40, 30), 5)
  _write_jpeg(str(root / "open_images" / "train" / "0a1b2c3d4e5f6a7b.jpg"), (100, 50), 9)

  report = prepare.prepare("localized_narratives", str(root), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 2, "val": 1}
  assert report["skipped"] == {
    "empty caption": 1,
    "line is not valid JSON": 1,
    "missing image file": 1,
    "narration without trace points (kept)": 1,
  }
  builder = pipeline.get_builder("localized_narratives", str(tmp_path / "tfds"), "coco")
  ex = next(iter(records.examples(builder, "train", decode_images=True).take(1)))
  assert ex["image"].shape == (30, 40, 3) and ex["narration"].numpy().decode() == "In this picture left."
  np.testing.assert_allclose(ex["traces"].numpy(), np.asarray(segs[0] + segs[1], np.float32))
  assert [u.decode() for u in ex["timed_caption"]["utterance"].numpy()] == [w for w, _, _ in words]

  # Open Images: added to train and downsampled by 0.6.
  report = prepare.prepare("localized_narratives", str(root), str(tmp_path / "tfds"), "coco_openimages")
  assert report["splits"] == {"train": 3, "val": 1}
  oi = pipeline.get_builder("localized_narratives", str(tmp_path / "tfds"), "coco_openimages")
  shapes = sorted(tuple(e["image"].shape) for e in records.examples(oi, "train", decode_images=True))
  assert shapes == [(30, 40, 3), (30, 40, 3), (30, 60, 3)]

  # The LocTex pipeline reads it: the word 'left.' gets its trace's cell, the outside point is counted.
  pp = "decode|clean_traces|resize(32)|normalize|trace_words(8, sizes=(2,))|tokenize_words(16, sizes=(2,))"
  batch = next(
    pipeline.eval_batches(builder, "train", pp, ("tokens", "trace_mask_2"), 2, context={"tokenizer": tiny_tokenizer})
  )
  assert list(batch["stat_trace_points_outside"]) == [1, 0] and list(batch["stat_trace_empty"]) == [False, True]
  masks = batch["trace_mask_2"][0].reshape(16, 4)
  assert masks[:, 0].any() and masks[:, 3].any() and masks.sum(0)[1] == masks.sum(0)[2] == 0
  assert batch["trace_mask_2"][1].sum() == 0


# ---------------------------------------------------------------------------------------------------------- #
# End to end.
# ---------------------------------------------------------------------------------------------------------- #
def test_loctex_main_end_to_end(tmp_path, tiny_loctex_run):
  """The session's tiny LocTex run (tests/conftest.py's shared_run; also runlocal's documented command), copied:
  the evaluation below writes into its run."""
  res = tiny_loctex_run
  assert res.returncode == 0, res.stderr[-4000:]
  shutil.copytree(res.workdir, tmp_path / "run")
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  for key in ("probe/map", "localization/pointing_2x", "localization/iou_2x", "localization/chance_2x"):
    assert key in summary and np.isfinite(summary[key]), key
  assert 0 < summary["localization/chance_2x"] < 100 and summary["localization/tokens"] > 0
  assert "localization/pointing_2x_random_init" in summary
  assert "data/trace_points_outside_count" in res.stderr

  # Standalone evaluation of the last checkpoint reproduces the training loop's final localization metrics.
  import tiny_loctex
  from ml_collections import ConfigDict

  from vlrep import evaluate

  loc = tiny_loctex.get_config().evals.localization
  results = evaluate.evaluate(ConfigDict({"evals": {"loc_again": loc}}), str(tmp_path / "run"), "latest")
  assert results["loc_again/checkpoint_step"] == 6
  for k in ("pointing_2x", "iou_2x", "pointing_contrastive", "tokens"):
    assert results[f"loc_again/{k}"] == pytest.approx(summary[f"localization/{k}"], abs=1e-4), k

  # Attention maps: one overlay per caption token and a strip per image.
  from vlrep.tools import attention_maps

  images = np.zeros((2, 32, 32, 3), np.uint8)
  out = attention_maps.render(str(tmp_path / "run"), str(tmp_path / "att"), images, ["a red circle", "x"], ["a", "b"])
  assert len(out["a"]["pngs"]) == len(out["a"]["tokens"]) >= 3 and out["a"]["map"] == "2x"
  assert all(os.path.exists(p) for p in out["a"]["pngs"] + [out["a"]["strip"], out["b"]["strip"]])
  assert Image.open(out["a"]["strip"]).size == (32 * 4 * (1 + len(out["a"]["tokens"])), 32 * 4 + 14)


def test_recipe_has_synchronized_bn_and_per_gpu_negatives_independent_of_devices(tiny_builder):
  """The paper: synchronized BatchNorm, InfoNCE "computed locally at each GPU" (128 of the 1024 per group)."""
  import jax
  import tiny_loctex

  from configs import loctex as loctex_config
  from vlrep import methods

  recipe = loctex_config.get_config()
  assert recipe.method.backbone.bn_group_size == 0 and recipe.batch_size == 1024
  assert recipe.method.contrastive_group_size == 128
  assert loctex_config.get_config("contrastive=global").method.contrastive_group_size == 0
  with pytest.raises(ValueError, match="Unknown contrastive"):
    loctex_config.get_config("contrastive=per_device")
  c = tiny_loctex.get_config("loss=contrastive,scales=1")
  tok = tokenizers.ensure_tokenizer(c.tokenizer, tiny_builder)
  fields = methods.build(c.method, tok.vocab_size).fields
  batch = next(pipeline.train_stream(tiny_builder, c.data, fields, 4, seed=0, context={"tokenizer": tok}))
  losses = {}
  for size in (0, 2, 4, 3):
    c.method.contrastive_group_size = size
    method = methods.build(c.method, tok.vocab_size)
    variables = method.init(jax.random.PRNGKey(0), batch)
    if size == 3:
      with pytest.raises(ValueError, match="does not split into contrastive groups of 3"):
        method.loss(variables, batch, jax.random.PRNGKey(1), train=False)
      continue
    losses[size] = float(method.loss(variables, batch, jax.random.PRNGKey(1), train=False)[1]["contrastive_loss"])
  assert losses[4] == pytest.approx(losses[0], rel=1e-6)  # one group of the whole batch is the global loss
  assert losses[2] < losses[0]  # fewer negatives per group


@pytest.mark.parametrize("arg", ["scales=1+2+4,oracle=True", "loss=contrastive,contrastive=global,scales=1"])
def test_ablation_configs_build_and_give_a_finite_loss(arg, tiny_builder):
  """Every ablation's pipeline feeds its method: mask sizes match the feature maps at every scale."""
  import jax
  import tiny_loctex

  from vlrep import methods

  c = tiny_loctex.get_config(arg)
  tok = tokenizers.ensure_tokenizer(c.tokenizer, tiny_builder)
  method = methods.build(c.method, tok.vocab_size)
  stream = pipeline.train_stream(tiny_builder, c.data, method.fields, 4, seed=0, context={"tokenizer": tok})
  batch = next(stream)
  assert set(method.fields) <= set(batch)
  variables = jax.jit(method.init)(jax.random.PRNGKey(0), batch)
  loss, metrics, _ = jax.jit(method.loss)(variables, batch, jax.random.PRNGKey(1))
  assert np.isfinite(float(loss))
  scales = c.method.scales
  assert {f"localization_loss_{s}x" for s in scales} <= set(metrics)
  if "oracle" in arg:  # shape words name visible objects, so some examples are supervised
    assert "oracle_word_masks" in c.data.pp and int(metrics["supervised_examples_4x"]) >= 1


def test_loss_weights_follow_the_recipe_and_the_runlocal_rule():
  """The recipe keeps the paper's equal weights; runlocal halves L_L and scales the oracle's by 0.33 more."""
  from configs import loctex

  def weights(arg):
    m = loctex.get_config(arg).method
    return m.contrastive_weight, m.localization_weight

  assert weights("") == (1.0, 1.0)  # the paper: L_C and L_L with equal weights
  assert weights("loss=localization") == (0.0, 1.0) and weights("loss=contrastive") == (1.0, 0.0)
  assert weights("runlocal") == (1.0, 0.5)  # chosen on probe_val: docs/results/loctex.md
  assert weights("runlocal,loss=localization") == (0.0, 0.5)  # the same L_L as in L_C + L_L
  assert weights("runlocal,loss=contrastive") == (1.0, 0.0)
  assert weights("runlocal,oracle=True") == pytest.approx((1.0, 0.165))
  assert weights("oracle=True") == (1.0, 1.0)  # the recipe is not rescaled
  with pytest.raises(ValueError, match="Unknown loss"):
    loctex.get_config("runlocal,loss=l1")


def test_recipe_follows_the_paper_and_runlocal_keeps_its_documented_choices():
  """Eq. 3 over the whole map, traces rendered as paths, the VOC07 probe on images resized to 224 x 224 (LocTex
  sec. 4.1); runlocal keeps the choices of docs/results/loctex.md's runs."""
  from configs import loctex as loctex_config

  recipe, local = loctex_config.get_config(), loctex_config.get_config("runlocal")
  assert recipe.method.localization_norm == "caption" and local.method.localization_norm == "traced"
  assert "trace_words(256, sizes=(7, 14), segments=True)" in recipe.data.pp
  assert "trace_words(64, sizes=(4, 8))|" in local.data.pp and "segments" not in local.data.pp
  assert recipe.evals.probe.pp == "decode|resize(224)|normalize|voc_labels(20)"
  assert local.evals.probe.pp == "decode|normalize|voc_labels(10)"
  image = tf.zeros([300, 500, 3], tf.uint8)
  assert _run("resize(224)", {"image": image})["image"].shape == (224, 224, 3)  # the whole image, squashed


def _detectron2_yaml(name):
  """A Detectron2 yaml with its _BASE_ chain merged (dicts recursively), as Detectron2 reads it."""
  import yaml

  with open(os.path.join(ROOT, "configs", "detectron2", name)) as f:
    cfg = yaml.safe_load(f)
  base = cfg.pop("_BASE_", None)

  def merge(a, b):
    for k, v in b.items():
      a[k] = merge(a.get(k, {}), v) if isinstance(v, dict) else v
    return a

  return merge(_detectron2_yaml(base), cfg) if base else cfg


def test_the_loctex_detectron2_configs_name_the_extra_norm_head():
  """The LocTex Detectron2 configs put the extra norm after res5 in the ROI head (MoCo's Res5ROIHeadsExtraNorm,
  vlrep.pytorch.detectron2_heads: its block is tested in tests/test_pytorch_wing.py) and keep the plain backbone;
  the plain VOC config keeps Detectron2's head."""
  pytest.importorskip("yaml")
  loctex_files = ["voc_faster_rcnn_R_50_C4_24k_extra_bn.yaml"] + [f"coco_subset_{p}pct.yaml" for p in (10, 20, 50, 100)]
  for name in loctex_files:
    model = _detectron2_yaml(name)["MODEL"]
    roi_heads = model["ROI_HEADS"]
    assert roi_heads["NAME"] == detectron2_heads.LOCTEX_EXTRA_NORM and roi_heads["IN_FEATURES"] == ["res4"], name
    assert model["BACKBONE"]["NAME"] == "build_resnet_backbone", name  # res4, which the RPN sees, is not normalised
  assert _detectron2_yaml("voc_faster_rcnn_R_50_C4_24k.yaml")["MODEL"]["ROI_HEADS"]["NAME"] == "Res5ROIHeads"


# ---------------------------------------------------------------------------------------------------- #
# Own data with few narrations (issue 77): LocTex says what it will train on, refuses, or falls back to captions.
# ---------------------------------------------------------------------------------------------------- #
def _few_narrations(root, images=8, narrated=2) -> None:
  """`images` one-colour photos with two plain captions each; the first `narrated` also narrated (LN's fields)."""
  os.makedirs(root / "imgs")
  colours = ("red", "blue", "green", "yellow", "white", "black", "purple", "orange", "gray", "pink")
  rows = []
  for i in range(images):
    Image.new("RGB", (48, 40), colours[i]).save(root / "imgs" / f"{i}.jpg")
    rows.append({"image": f"imgs/{i}.jpg", "caption": f"the photo shows a {colours[i]} thing"})
    row = {"image": f"imgs/{i}.jpg", "caption": f"a {colours[i]} square on a table"}
    if i < narrated:
      words = row["caption"].split()
      row["timed_caption"] = [{"utterance": w, "start_time": j, "end_time": j + 0.9} for j, w in enumerate(words)]
      row["traces"] = [[{"x": 0.1 + 0.1 * t, "y": 0.5, "t": 0.5 * t} for t in range(12)]]
    rows.append(row)
  (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_text_or_caption_gives_untraced_images_one_of_their_captions():
  op = registry.parse("text_or_caption('narration', 'captions')").example_fn
  plain = {
    "narration": tf.constant(""),
    "captions": tf.constant(["a red square", "a red thing"]),
    "_rng": tf.constant([0, 3], tf.int64),
  }
  out = op(plain)
  assert out["narration"].numpy().decode() in ("a red square", "a red thing") and bool(out["stat_caption_fallback"])
  narrated = dict(plain, narration=tf.constant("a red square on a table"))
  out = op(narrated)
  assert out["narration"].numpy().decode() == "a red square on a table" and not bool(out["stat_caption_fallback"])
  none = dict(plain, captions=tf.zeros([0], tf.string))
  assert op(none)["narration"].numpy().decode() == "" and not bool(op(none)["stat_caption_fallback"])


def test_few_narrations_are_refused_before_training_and_the_caption_fallback_trains(tmp_path, caplog):
  import tiny_loctex

  from vlrep import train

  _few_narrations(tmp_path / "mine")
  data_dir = tmp_path / "tfds"
  report = prepare.prepare("image_text", str(tmp_path / "mine"), str(data_dir))
  assert report["fields"]["narration"] == 2 and report["splits"] == {"train": 8}, report

  config = tiny_loctex.get_config(f"data={data_dir},val=25")
  config.evals, config.total_steps, config.batch_size = {}, 2, 4
  with pytest.raises(pipeline.SparseField) as caught, caplog.at_level("INFO"):
    train.train_and_evaluate(config, str(tmp_path / "refused"))
  said = str(caught.value)
  assert "loctex needs 'narration'" in said and "only 2 of 8 prepared examples" in said and "(25%" in said, said
  assert "data.min_field_fraction=0.5" in said and "configs/loctex.py:data=DIR,untraced=captions" in said
  assert "--config.data.min_field_fraction=0.25" in said
  assert any("2 of 8 prepared examples carry it (25%)" in r.getMessage() for r in caplog.records)  # said first
  assert not (tmp_path / "refused" / "checkpoints").exists()
  assert not [f for f in os.listdir(pipeline.get_builder("image_text", str(data_dir)).data_dir) if "bpe" in f]

  # The fallback: L_C on every image (its plain captions where it has no narration), L_L where traces are.
  config = tiny_loctex.get_config(f"data={data_dir},val=25,untraced=captions")
  config.evals, config.total_steps, config.batch_size = {}, 2, 4
  assert config.tokenizer.corpus_key == "captions" and config.data.pp.startswith("text_or_caption(")
  summary = train.train_and_evaluate(config, str(tmp_path / "fallback"))
  assert summary["steps"] == 2 and np.isfinite(summary["train/loss"])
  assert (summary["data/narration_examples"], summary["data/narration_fraction"]) == (2, 0.25)
  builder = pipeline.get_builder("image_text", str(data_dir))
  batches = pipeline.train_stream(
    builder,
    config.data,
    ("image", "tokens"),
    6,
    seed=0,
    context={"tokenizer": tokenizers.Tokenizer(tokenizers.default_path(config.tokenizer, builder))},
  )
  batch = next(iter(batches))
  assert not batch["stat_empty"].any() and batch["stat_caption_fallback"].sum() >= 4  # 6 training images, <= 2 narrated
  batches.close()

  with pytest.raises(ValueError, match="untraced=captions reads your own data"):
    tiny_loctex.get_config("untraced=captions")
