"""Synthetic scenes, preprocessing ops, tokenizer and the resumable input stream."""

import json

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from conftest import run_module

from vlrep.data import ops, pipeline, records, registry, scenes, tokenizers


def test_captions_name_every_shape_and_some_colours():
  """Shapes are always named; colours in about COLOUR_MENTION of the mentions (with every colour named, a
  captioning head learns colours instead of shapes)."""
  rng = np.random.default_rng(3)
  named, total = 0, 0
  for _ in range(400):
    s = scenes.generate_scene(rng, 64, "main")
    phrases = s["captions"][0].rstrip(".").replace(" and ", ", ").split(", ")
    phrases = [p.split(" of ", 1)[-1].removeprefix("there is ") for p in phrases]
    shape_of = {w: shape for shape in scenes.SHAPES for w in scenes.shape_words(shape)}
    assert sorted(shape_of[p.split()[-1]] for p in phrases) == sorted(o["shape"] for o in s["objects"])
    named += sum(bool(set(p.split()) & set(scenes.COLOR_NAMES)) for p in phrases)
    total += len(phrases)
  assert abs(named / total - scenes.COLOUR_MENTION) < 0.05, named / total


def test_scene_annotations_are_consistent():
  rng = np.random.default_rng(1)
  for _ in range(20):
    s = scenes.generate_scene(rng, 64, "main")
    assert s["image"].shape == (64, 64, 3) and s["image"].dtype == np.uint8
    assert len(s["captions"]) == 5
    for o in s["objects"]:
      # Every object is named in the first caption, and its visible mask lies inside its box.
      assert set(scenes.shape_words(o["shape"])) & set(s["captions"][0].rstrip(".").replace(",", "").split())
      ys, xs = np.nonzero(o["mask"])
      if len(ys):
        y0, x0, y1, x1 = o["bbox"] * 64
        assert ys.min() >= y0 - 1 and ys.max() <= y1 + 1 and xs.min() >= x0 - 1 and xs.max() <= x1 + 1
    # Trace times are increasing and lie within the narration's time span.
    t = s["traces"][:, 2]
    assert np.all(np.diff(t) >= 0)
    assert t[0] >= s["timed_caption"][0]["start_time"] - 1e-6 and t[-1] <= s["timed_caption"][-1]["end_time"]
    counts = {a for q, a in s["questions"] if q == "how many objects are there?"}
    assert counts == {scenes.NUMBER_WORDS[len(s["objects"])]}


def test_flip_swaps_left_and_right_in_captions():
  image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
  ex = {
    "image": tf.constant(image),
    "captions": tf.constant(["a circle to the left of a star", "right leftover"]),
    "_rng": tf.constant([0, 0], tf.int64),
  }
  out = registry.parse("flip_lr_swap_words(prob=1.0)").example_fn(ex)
  assert [c.decode() for c in out["captions"].numpy()] == ["a circle to the right of a star", "left leftover"]
  np.testing.assert_array_equal(out["image"].numpy(), image[:, ::-1])
  kept = registry.parse("flip_lr_swap_words(prob=0.0)").example_fn(ex)
  assert kept["captions"].numpy()[0].decode() == "a circle to the left of a star"


def _py3round(number: float) -> int:
  """albumentations' py3round (albumentations/augmentations/functional.py), which SmallestMaxSize's new size uses."""
  if abs(round(number) - number) == 0.5:
    return int(2.0 * round(number / 2.0))
  return int(round(number))


def test_official_resize_rounds_the_new_size_as_albumentations_does():
  """`resize_small(256, official=True)` (configs/eval/captioning.py:official) sizes an image as kdexd/virtex's
  SmallestMaxSize(256): py3round(side * 256 / shorter side). At 300x451 the longer side scales to 384.85: 385, not
  the truncated 384 (whose pixels then differ wholesale after the centre crop). The sizes that round down keep
  their results; the pixels are OpenCV's INTER_LINEAR (vlrep.visualize.resize_bilinear) at that size."""
  from vlrep import visualize

  rng = np.random.default_rng(0)
  op = registry.parse("resize_small(256, official=True)").example_fn
  expected = {
    (300, 451): (256, 385),
    (451, 300): (385, 256),
    (333, 500): (256, 384),
    (480, 640): (256, 341),
    (200, 150): (341, 256),
    (299, 500): (256, 428),
    (256, 300): (256, 300),
  }
  for (h, w), want in expected.items():
    scale = 256 / float(min(w, h))
    assert (_py3round(h * scale), _py3round(w * scale)) == want  # the reference itself
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = op({"image": tf.constant(image)})["image"].numpy()
    assert out.shape[:2] == want, (h, w, out.shape)
    # TF's float32 interpolation and numpy's differ by one level where a value lands on .5 (< 0.5% of pixels).
    diff = np.abs(out.astype(int) - visualize.resize_bilinear(image, *want).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.005, (h, w, diff.max(), (diff > 0).mean())


def test_unknown_op_lists_known_ops():
  with pytest.raises(ValueError, match="Unknown preprocessing op 'blur'.*inception_crop"):
    registry.parse("decode|blur(3)")


def test_op_arguments_bind_the_ops_signature_and_never_read_a_users_path():
  """Tools read a recipe's shapes from the parsed ops: digits, quotes and '|' in a path argument change nothing
  (a regex over the string would read a region count out of pytest's temp path)."""
  path = "/tmp/pytest-0/run 7|x'y"
  pp = f"decode|resize_small(64)|region_features({path!r}, 12, class_probs=True)|tokenize_pairs(36)"
  assert [name for name, _, _ in registry.op_calls(pp)] == [
    "decode",
    "resize_small",
    "region_features",
    "tokenize_pairs",
  ]
  regions = registry.op_arguments(pp, "regions_from_objects", "region_features")
  assert regions["_op"] == "region_features" and regions["max_regions"] == 12 and regions["directory"] == path
  assert regions["class_probs"] is True and regions["key"] == "image_id"  # defaults filled in
  assert registry.op_arguments("decode|regions_from_objects()", "regions_from_objects")["max_regions"] == 10
  assert registry.op_arguments(pp, "inception_crop") is None
  with pytest.raises(ValueError, match="literal"):
    registry.op_calls("decode|resize_small(size)")


def test_tokenizer_truncates_and_flags(tiny_tokenizer):
  ids, truncated = tiny_tokenizer.encode("a red circle " * 30, 12)
  assert truncated and ids[0] == tokenizers.SOS_ID and ids[-1] == tokenizers.EOS_ID and len(ids) == 12
  ids, truncated = tiny_tokenizer.encode("A Red CIRCLE.", 12)
  assert not truncated
  assert tiny_tokenizer.decode(ids) == "a red circle."
  assert tokenizers.normalize_text("Café") == "cafe"


def test_tokenize_host_op_flags_empty_and_truncated_captions(tiny_tokenizer):
  pp = registry.parse("tokenize(8)", {"tokenizer": tiny_tokenizer})
  assert pp.host_inputs == ("caption",) and "tokens" in pp.host_outputs
  out = pp.batch_fn({"caption": np.array([b"  ", b"a red circle and a blue square and a green star", b"a star"])})
  np.testing.assert_array_equal(out["stat_empty"], [True, False, False])
  np.testing.assert_array_equal(out["stat_truncated"], [False, True, False])
  assert out["tokens"].shape == (3, 8) and out["tokens"][1, -1] == tokenizers.EOS_ID
  with pytest.raises(ValueError, match="host ops .tokenize. must come last"):
    registry.parse("tokenize(8)|normalize", {"tokenizer": tiny_tokenizer})


def test_missing_tokenizer_names_the_command(tmp_path, tiny_builder):
  from conftest import load_tiny_config

  cfg = load_tiny_config().tokenizer
  cfg.path = str(tmp_path / "missing.model")
  cfg.build_if_missing = False
  with pytest.raises(FileNotFoundError, match="vlrep.tools.build_vocab"):
    tokenizers.ensure_tokenizer(cfg, tiny_builder)


def test_missing_dataset_names_the_prepare_command(tmp_path):
  with pytest.raises(FileNotFoundError, match="python -m vlrep.data.prepare --dataset=coco_captions2017"):
    pipeline.get_builder("coco_captions2017", str(tmp_path))
  with pytest.raises(ValueError, match="Unknown dataset 'imagenet'"):
    pipeline.get_builder("imagenet", str(tmp_path))


def test_stream_resumes_at_the_exact_batch(tiny_builder, tiny_tokenizer):
  pp = "decode|inception_crop(32)|flip_lr_swap_words|normalize|choose_caption|tokenize(20)"
  ctx = {"tokenizer": tiny_tokenizer}
  full = pipeline.train_stream(tiny_builder, {"split": "train", "pp": pp}, ("image", "tokens"), 8, seed=3, context=ctx)
  batches = [next(full) for _ in range(12)]  # 12 batches of 8 = 1.5 epochs of 64
  resumed = pipeline.train_stream(
    tiny_builder, {"split": "train", "pp": pp}, ("image", "tokens"), 8, seed=3, start_step=7, context=ctx
  )
  for k in range(7, 12):
    b = next(resumed)
    np.testing.assert_array_equal(b["image"], batches[k]["image"])
    np.testing.assert_array_equal(b["tokens"], batches[k]["tokens"])
  # Epochs are permutations: the first 8 batches cover all 64 records once... images differ between epochs
  assert not np.array_equal(batches[0]["image"], batches[8]["image"])


def test_decoded_image_cache_gives_the_same_batches_and_resizes(tiny_builder):
  pp = "decode|inception_crop(32, area=(0.5, 1.0))|flip_lr_swap_words|normalize"
  plain = pipeline.train_stream(tiny_builder, {"split": "train", "pp": pp}, ("image",), 8, seed=1, start_step=5)
  # Cached at the images' own size (32): the very same pixels, augmentations and order, resumed mid-run too.
  cached = pipeline.train_stream(
    tiny_builder, {"split": "train", "pp": pp, "cache_image_size": 32}, ("image",), 8, seed=1, start_step=5
  )
  for _ in range(3):
    np.testing.assert_array_equal(next(plain)["image"], next(cached)["image"])
  recs = records.load_records(tiny_builder, "train")[:5]
  deserialize = lambda r: tiny_builder.info.features.deserialize_example(
    r, decoders=records.skip_image_decoding(tiny_builder.info.features)
  )
  buffer, offsets, shapes = pipeline.decoded_image_cache(recs, deserialize, 16)
  assert (
    buffer.dtype == np.uint8 and shapes.tolist() == [[16, 16, 3]] * 5 and offsets.tolist() == [0, 768, 1536, 2304, 3072]
  )
  lookup = pipeline._cached_lookup_fn((buffer, offsets, shapes))
  third = tf.image.resize(tf.io.decode_image(deserialize(recs[2])["image"]), [16, 16], antialias=True)
  np.testing.assert_allclose(lookup(tf.constant(2, tf.int64)).numpy(), np.clip(third.numpy(), 0, 255), atol=1)
  with pytest.raises(ValueError, match="caches the image alone"):
    pipeline.train_stream(
      tiny_builder,
      {"split": "train", "pp": pp + "|oracle_word_masks((2,))", "cache_image_size": 32},
      ("image",),
      8,
      seed=0,
    )


def test_pipelines_run_without_autotuning(tiny_builder):
  """Deleting an autotuned tf.data iterator waits out its tuning thread's sleep (a period that doubles up to a
  minute): a run's last step stalled for up to ~35 s when it closed its training stream. Every pipeline vlrep builds
  turns autotuning off; the training stream maps on every thread of its own pool."""
  ds = pipeline.stream_dataset(
    4, lambda i: tf.strings.as_string(i), lambda i, r: {"x": r}, lambda ex: ex, 2, 0, threads=3
  )
  assert (ds.options().autotune.enabled, ds.options().threading.private_threadpool_size) == (False, 3)
  assert ds.options().deterministic
  assert next(ds.as_numpy_iterator())["x"].shape == (2,)
  for split in ("train", "val"):
    assert records.examples(tiny_builder, split).options().autotune.enabled is False


def test_device_prefetch_keeps_order_surfaces_errors_and_closes():
  import jax

  from vlrep import sharding

  mesh = sharding.make_mesh()
  sh = sharding.batch_sharding(mesh)
  n = mesh.devices.size
  batches = ({"x": np.full((n, 2), i, np.float32)} for i in range(7))
  got = [float(b["x"][0, 0]) for b in sharding.device_prefetch(batches, sh, 2)]
  assert got == list(map(float, range(7)))

  def failing():
    yield {"x": np.zeros((n, 2), np.float32)}
    raise RuntimeError("broken record")

  it = sharding.device_prefetch(failing(), sh, 2)
  assert isinstance(next(it)["x"], jax.Array)
  with pytest.raises(RuntimeError, match="broken record"):
    next(it)

  closed = []

  def endless():
    try:
      i = 0
      while True:
        yield {"x": np.full((n, 2), i, np.float32)}
        i += 1
    finally:
      closed.append(True)

  it = sharding.device_prefetch(endless(), sh, 2)
  next(it), next(it)
  it.close()
  assert closed == [True]


def test_hosts_read_disjoint_shards(tiny_builder):
  a = records.load_records(tiny_builder, "train", 0, 2)
  b = records.load_records(tiny_builder, "train", 1, 2)
  assert len(a) + len(b) == 64 and not set(a) & set(b)


@pytest.fixture(scope="module")
def tiny_in_both_formats(tmp_path_factory):
  """The tiny dataset prepared twice: ArrayRecord (vlrep's storage) and TFRecord (older vlrep, TFDS's default)."""
  from vlrep.data import prepare

  root = tmp_path_factory.mktemp("formats")
  for fmt in ("array_record", "tfrecord"):
    prepare.prepare("synthetic_scenes", None, str(root / fmt), "tiny", fmt)
  return {
    fmt: pipeline.get_builder("synthetic_scenes", str(root / fmt), "tiny") for fmt in ("array_record", "tfrecord")
  }


def test_disk_stream_reads_only_its_hosts_records_and_equals_the_in_memory_stream(tiny_in_both_formats, monkeypatch):
  disk, tfrecord = tiny_in_both_formats["array_record"], tiny_in_both_formats["tfrecord"]
  assert records.is_array_record(disk) and not records.is_array_record(tfrecord)
  read = []
  plain_read = records.SplitReader.read
  monkeypatch.setattr(
    records.SplitReader, "read", lambda self, idx: read.extend(np.ravel(idx)) or plain_read(self, idx)
  )
  pp = "decode|inception_crop(32, area=(0.5, 1.0))|flip_lr_swap_words|normalize"

  def stream(builder, **kw):
    return pipeline.train_stream(
      builder, {"split": "train", "pp": pp, **kw}, ("image",), 4, seed=5, start_step=3, host_index=1, host_count=2
    )

  from_disk, from_memory, from_tfrecord = stream(disk), stream(disk, in_memory=True), stream(tfrecord)
  for _ in range(10):  # 10 batches of 4 from 32 records: past an epoch of this host's share
    image = next(from_disk)["image"]
    np.testing.assert_array_equal(image, next(from_memory)["image"])
    np.testing.assert_array_equal(image, next(from_tfrecord)["image"])
  # Host 1 of 2 read only its own records (odd indices), whether streaming them or loading its share.
  assert read and all(i % 2 == 1 for i in read), sorted(set(read))
  assert records.load_records(disk, "train", 1, 2) == records.load_records(tfrecord, "train", 1, 2)
  # Evaluation order and texts are the storage's too.
  ev = [b["image"] for b in pipeline.eval_batches(disk, "val", "decode|resize(32)", ("image",), 8, 1, 2)]
  ev_tf = [b["image"] for b in pipeline.eval_batches(tfrecord, "val", "decode|resize(32)", ("image",), 8, 1, 2)]
  np.testing.assert_array_equal(np.concatenate(ev), np.concatenate(ev_tf))
  assert records.read_texts(disk, "train[:50%]") == records.read_texts(tfrecord, "train[:50%]")
  reader = records.split_reader(disk, "train[:50%]")
  with pytest.raises(IndexError, match=r"Record index 32 is past the end of synthetic_scenes/train\[:50%\] \(32"):
    reader.read([0, 32])
  with pytest.raises(ValueError, match="no random access.*data.in_memory=True"):
    records.split_reader(tfrecord, "train")


def test_voc_labels_mark_difficult_objects():
  ex = {"objects": {"label": tf.constant([2, 5, 5, 7]), "is_difficult": tf.constant([False, True, False, True])}}
  labels = registry.parse("voc_labels(8)").example_fn(ex)["labels"].numpy()
  np.testing.assert_array_equal(labels, [-1, -1, 1, -1, -1, 1, -1, 0])
  # Another class field of the objects (synthetic_scenes' colours), with the same difficult rule.
  ex["objects"]["color"] = tf.constant([0, 3, 3, 1])
  colors = registry.parse("voc_labels(4, field='color')").example_fn(ex)["labels"].numpy()
  np.testing.assert_array_equal(colors, [1, 0, -1, 1])
  with pytest.raises(ValueError, match="have \\['color', 'is_difficult', 'label'\\]"):
    registry.parse("voc_labels(4, field='size')").example_fn(ex)


def test_build_vocab_command(tmp_path):
  path = tmp_path / "vocab.model"
  proc = run_module("vlrep.tools.build_vocab", "--config=tests/tiny_virtex.py", f"--config.tokenizer.path={path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert path.exists() and f"{path}:" in proc.stdout
  assert (
    tokenizers.Tokenizer(str(path)).decode(tokenizers.Tokenizer(str(path)).encode("a red star.", 10)[0])
    == "a red star."
  )


def test_every_split_has_its_own_images(tiny_builder):
  """Splits share no image (seeds from the first 4 bytes of their names would make probe_trainval == probe_test)."""
  import hashlib

  digests = {}
  for split in tiny_builder.info.splits:
    digests[split] = {hashlib.sha1(r).hexdigest() for r in records.load_records(tiny_builder, split)}
  names = sorted(digests)
  for i, a in enumerate(names):
    for b in names[i + 1 :]:
      assert not digests[a] & digests[b], (a, b)


def test_largest_object_label_is_the_most_visible_object(tiny_builder):

  op = ops.get_largest_object_label()
  checked = 0
  for ex in records.examples(tiny_builder, "val").take(8):
    ids = tf.io.decode_png(ex["object_map"]).numpy().reshape(-1)
    counts = np.bincount(ids, minlength=len(ex["objects"]["label"]) + 1)[1:]
    expected = int(ex["objects"]["label"].numpy()[np.argmax(counts)])
    assert int(op(ex)["label"]) == expected
    checked += len(counts) > 1
  assert checked >= 3  # several scenes with more than one object


def test_shapes_are_learnable_from_pixels_in_seconds():
  """The probe's concepts are in the pixels at a tiny budget: a ResNet-10 with the small stem trained on the shape
  labels for 150 steps of 32 images separates them well above chance (the positive rate) on held-out scenes, and
  above the same model on scenes with 1.1.0's radii (7-10% / 14-20% of the side), which do not learn at the
  runlocal budget. (The small stem, because the ImageNet stem's 4x downsampling leaves a 64 px shape a few cells
  wide; the stem's shapes are tested in test_models_optim_eval.)"""
  # In a process of its own at XLA's optimization level 1, the level its margins hold at (tests/learnability.py).
  # Forked from the worker's process server; the flag follows the suite's level 0 and overrides it.
  proc = run_module("learnability", env={"XLA_FLAGS": "--xla_backend_optimization_level=1"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  small, chance, old_geometry = out["small"], out["chance"], out["old_geometry"]
  assert small > chance + 8, (small, chance)
  assert small > old_geometry + 3, (small, old_geometry)


def test_generation_is_deterministic_from_the_seed(tiny_builder):
  """Each split's examples are a pure function of (config seed, split name, index): generating twice (in fresh
  worker processes) gives the same bytes, and the stored split holds exactly those examples."""
  import tensorflow as tf

  def generate():
    return list(tiny_builder._generate_examples("probe_val", 6))

  first, second = generate(), generate()
  assert [i for i, _ in first] == list(range(6))
  for (_, a), (_, b) in zip(first, second, strict=True):
    assert a["image"] == b["image"] and a["object_map"] == b["object_map"]  # PNG bytes
    assert a["captions"] == b["captions"] and a["narration"] == b["narration"]
  stored = {
    ex["image"].tobytes() for ex in tfds.as_numpy(records.examples(tiny_builder, "probe_val", decode_images=True))
  }
  assert {tf.io.decode_png(rec["image"]).numpy().tobytes() for _, rec in first} <= stored
