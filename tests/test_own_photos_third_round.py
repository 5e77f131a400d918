"""Own photos, third round (issue 77): every photo prepared to the pixels a viewer shows, and nothing changed
without a word.

Fixtures of each kind a user's folder holds, made from real photographs (skimage.data): a full-range 16-bit PNG, a
JPEG with EXIF orientation 6 (a phone's portrait), a CMYK JPEG, a palette PNG with a transparent colour, an RGBA
PNG, an animated GIF, a float TIFF and an RGBA WebP. Each is prepared through `prepare` (captions.jsonl, a
webdataset shard and labelled class folders) and compared by pixel statistics (mean absolute difference <= 2/255)
with what the test computes on its own from PIL's decoding: ImageOps.exif_transpose, 16-bit by the type's range
and float by its min..max (numpy here), transparency over white (numpy here). Also: a row with both `caption` and
`captions`, a duplicate pair, and SIGTERM during prepare."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
from PIL import Image, ImageOps
from skimage import data as skdata

from vlrep.data import images, pipeline, prepare, records
from vlrep.data.builders import image_text

MAX_MEAN_ABS = 2.0  # of 255: JPEG re-encoding at quality 95 stays well within it


def _save(image: Image.Image, fmt: str, **kw) -> bytes:
  out = io.BytesIO()
  image.save(out, fmt, **kw)
  return out.getvalue()


def _with_transparent_corner(rgb: np.ndarray) -> np.ndarray:
  """RGBA: opaque, a fully transparent band at the top (its colour black, as many PNGs store it) and an alpha
  ramp below it, so dropping alpha (black) and compositing over white differ."""
  h, w = rgb.shape[:2]
  alpha = np.full((h, w), 255, np.uint8)
  alpha[: h // 4] = 0
  alpha[h // 4 : h // 2] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
  rgba = np.dstack([rgb, alpha])
  rgba[: h // 4, :, :3] = 0
  return rgba


def fixtures() -> dict[str, bytes]:
  """{file name: bytes} of the eight kinds."""
  # Crops at the photos' own resolution (a subsampled photo is aliased: more detail per pixel than a camera's).
  camera = skdata.camera()[100:356, 100:356]  # 256 x 256, values 0..255
  chelsea, coffee = skdata.chelsea(), skdata.coffee()[100:300, 150:450]  # 300 x 451, 200 x 300
  small = skdata.chelsea()[60:188, 100:228]  # 128 x 128: the cat's face
  exif = Image.Exif()
  exif[ImageOps.ExifTags.Base.Orientation] = 6  # stored 451 wide x 300 high, shown 300 x 451 (portrait)
  palette = Image.fromarray(small).quantize(colors=63)
  index = np.asarray(palette).copy()
  index[:32] = 63  # a transparent band at the top: palette entry 63, black
  palette_rgb = palette.getpalette()[: 63 * 3] + [0, 0, 0]
  transparent = Image.fromarray(index, "P")
  transparent.putpalette(palette_rgb)
  frames = [Image.fromarray(np.roll(camera, 40 * k, axis=1)).convert("RGB").quantize(256) for k in range(3)]
  gif = io.BytesIO()
  frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
  moon = skdata.moon()[100:356, 100:356].astype(np.float32)
  return {
    "sixteen_bit.png": _save(Image.fromarray(camera.astype(np.uint16) * 257), "PNG"),  # I;16, full range
    "portrait_exif6.jpg": _save(Image.fromarray(chelsea), "JPEG", quality=95, exif=exif),
    "print_cmyk.jpg": _save(Image.fromarray(coffee).convert("CMYK"), "JPEG", quality=95),
    "palette_transparent.png": _save(transparent, "PNG", transparency=63),
    "logo_rgba.png": _save(Image.fromarray(_with_transparent_corner(coffee)), "PNG"),
    "animated.gif": gif.getvalue(),
    "scan_float.tif": _save(Image.fromarray(moon / 255.0 * 0.5 + 0.25), "TIFF"),  # F, values 0.25..0.75
    "sticker_rgba.webp": _save(Image.fromarray(_with_transparent_corner(small)), "WEBP", lossless=True),
  }


def viewer_shows(data: bytes) -> np.ndarray:
  """What a viewer shows of the file, computed here without vlrep: PIL decodes and turns it upright
  (exif_transpose); 16-bit by the type's range, float by its own min..max and alpha over white in numpy."""
  im = Image.open(io.BytesIO(data))
  im.seek(0)
  im = ImageOps.exif_transpose(im)
  if im.mode.startswith("I;16"):
    gray = np.asarray(im).astype(np.float64) / 65535 * 255
    return np.repeat(np.round(gray)[..., None], 3, -1)
  if im.mode == "F":
    a = np.asarray(im).astype(np.float64)
    gray = (a - a.min()) / (a.max() - a.min()) * 255
    return np.repeat(np.round(gray)[..., None], 3, -1)
  if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
    rgba = np.asarray(im.convert("RGBA")).astype(np.float64)
    alpha = rgba[..., 3:] / 255
    return np.round(rgba[..., :3] * alpha + 255 * (1 - alpha))
  return np.asarray(im.convert("RGB")).astype(np.float64)


def _mean_abs(a: np.ndarray, b: np.ndarray) -> float:
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


@pytest.fixture(scope="module")
def photos():
  return fixtures()


def test_the_fixtures_are_the_kinds_they_claim(photos):
  modes = {}
  for name, data in photos.items():
    im = Image.open(io.BytesIO(data))
    modes[name] = (im.format, im.mode, getattr(im, "n_frames", 1))
  assert modes["sixteen_bit.png"][:2] == ("PNG", "I;16")
  assert modes["portrait_exif6.jpg"][:2] == ("JPEG", "RGB")
  assert Image.open(io.BytesIO(photos["portrait_exif6.jpg"])).getexif()[0x0112] == 6
  assert modes["print_cmyk.jpg"][:2] == ("JPEG", "CMYK")
  assert modes["palette_transparent.png"][:2] == ("PNG", "P")
  assert modes["logo_rgba.png"][:2] == ("PNG", "RGBA") and modes["sticker_rgba.webp"][:2] == ("WEBP", "RGBA")
  assert modes["animated.gif"][0] == "GIF" and modes["animated.gif"][2] == 3
  assert modes["scan_float.tif"][:2] == ("TIFF", "F")
  # What PIL's plain convert("RGB") (the old storage) shows differs from what a viewer shows, for all but CMYK.
  for name, data in photos.items():
    plain = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    shown = viewer_shows(data)
    if name in ("print_cmyk.jpg", "animated.gif"):
      assert _mean_abs(plain, shown) < 1, name
    elif plain.shape == shown.shape:
      assert _mean_abs(plain, shown) > 20, name
  full = viewer_shows(photos["sixteen_bit.png"])
  assert full.min() <= 5 and full.max() >= 250  # a full-range 16-bit photo: not white


def test_decode_file_shows_what_a_viewer_shows(photos, tmp_path):
  """The one decoding vlrep uses for files (the features and caption tools too), from bytes and from a path."""
  for name, data in photos.items():
    (tmp_path / name).write_bytes(data)
    shown, notes = images.decode_file(str(tmp_path / name))
    assert shown.dtype == np.uint8 and shown.ndim == 3 and shown.shape[2] == 3
    assert _mean_abs(shown, viewer_shows(data)) <= 0.5, name  # no JPEG re-encoding here: the same pixels
    assert np.array_equal(images.decode_file(data)[0], shown)
  assert images.decode_file(photos["portrait_exif6.jpg"])[0].shape == (451, 300, 3)  # upright: portrait
  assert images.decode_file(photos["animated.gif"])[1] == [images.NOTE_ANIMATED]
  with pytest.raises(ValueError, match="more than 100"):
    images.decode_file(photos["sixteen_bit.png"], max_pixels=100)


def test_the_features_and_caption_tools_read_files_as_a_viewer_shows_them(photos, tmp_path):
  """visualize.read_rgb / load_image are how the features, caption and attention tools read image files."""
  from vlrep import visualize

  for name, data in photos.items():
    (tmp_path / name).write_bytes(data)
    assert _mean_abs(visualize.read_rgb(str(tmp_path / name)), viewer_shows(data)) <= 0.5, name


EXPECTED_CONVERTED = {
  images.NOTE_16BIT: 1,
  images.NOTE_ORIENTATION: 1,
  images.NOTE_CMYK: 1,
  images.NOTE_ALPHA: 3,  # the palette PNG, the RGBA PNG, the WebP
  images.NOTE_ANIMATED: 1,
  images.NOTE_WIDE: 1,
}


def _stored(data_dir: str, dataset: str) -> dict[str, np.ndarray]:
  builder = pipeline.get_builder(dataset, data_dir)
  out = {}
  for split in builder.info.splits:
    for e in records.examples(builder, split, decode_images=True):
      out[e["key"].numpy().decode()] = e["image"].numpy()
  return out


def _check_pixels(stored: dict[str, np.ndarray], photos: dict[str, bytes], name_of) -> None:
  assert len(stored) == len(photos), sorted(stored)
  for key, pixels in stored.items():
    name = name_of(key)
    assert _mean_abs(pixels, viewer_shows(photos[name])) <= MAX_MEAN_ABS, name


def test_every_kind_prepares_to_what_a_viewer_shows_from_an_index(photos, tmp_path):
  root = tmp_path / "mine"
  os.makedirs(root / "photos")
  for name, data in photos.items():
    (root / "photos" / name).write_bytes(data)
  rows = [{"image": f"photos/{name}", "caption": f"a photo called {name}"} for name in photos]
  (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  report = prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": len(photos)} and report["skipped"] == {}, report
  _check_pixels(_stored(str(tmp_path / "tfds"), "image_text"), photos, os.path.basename)
  assert report["converted"] == EXPECTED_CONVERTED, report.get("converted")
  again = prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))  # reused: the counts live with it
  assert again["source"].startswith("reused") and again["converted"] == EXPECTED_CONVERTED


def test_shards_read_every_image_suffix_and_store_what_a_viewer_shows(photos, tmp_path):
  os.makedirs(tmp_path / "shards")
  with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
    for k, (name, data) in enumerate(photos.items()):
      ext = os.path.splitext(name)[1]
      for member, content in ((f"{k:03d}{ext}", data), (f"{k:03d}.txt", name.encode())):
        info = tarfile.TarInfo(member)
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    for member, content in (("100.heic", b"\0" * 10), ("100.txt", b"a photo in a format vlrep does not read")):
      info = tarfile.TarInfo(member)
      info.size = len(content)
      tar.addfile(info, io.BytesIO(content))
  report = prepare.prepare("image_text", str(tmp_path / "shards"), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": len(photos)}, report
  # The .heic sample: named for what it is, not as a caption without an image.
  assert list(report["skipped"]) == [next(r for r in report["skipped"] if r.startswith("image in a format"))]
  assert ".heic" in next(iter(report["skipped"])) and report["row_fields"]["ignored"] == {"shard member *.heic": 1}
  names = dict(enumerate(photos))
  _check_pixels(_stored(str(tmp_path / "tfds"), "image_text"), photos, lambda key: names[int(key[-3:])])
  assert report["converted"] == EXPECTED_CONVERTED


def test_labelled_folders_store_what_a_viewer_shows(photos, tmp_path):
  names = sorted(photos)
  for k, name in enumerate(names):  # four images per class: each class gives one to val and one to test
    folder = tmp_path / "labelled" / ("cats" if k % 2 else "dogs")
    os.makedirs(folder, exist_ok=True)
    (folder / name).write_bytes(photos[name])
  report = prepare.prepare("image_folder", str(tmp_path / "labelled"), str(tmp_path / "tfds"))
  assert sum(report["splits"].values()) == len(photos) and report["skipped"] == {}, report
  _check_pixels(_stored(str(tmp_path / "tfds"), "image_folder"), photos, os.path.basename)
  assert report["converted"] == EXPECTED_CONVERTED


# ---------------------------------------------------------------------------------------------------- #
# No caption dropped, duplicates merged, every field named.
# ---------------------------------------------------------------------------------------------------- #
def _captions(data_dir) -> dict[str, list[str]]:
  builder = pipeline.get_builder("image_text", str(data_dir))
  return {
    e["key"].numpy().decode(): [c.decode() for c in e["captions"].numpy()]
    for e in records.examples(builder, "train", decode_images=False)
  }


def _photo(name: str) -> bytes:
  return _save(Image.fromarray(getattr(skdata, name)()[::4, ::4]), "JPEG", quality=90)


def test_caption_and_captions_together_keep_all_and_every_field_is_named(tmp_path):
  root = tmp_path / "mine"
  os.makedirs(root)
  (root / "a.jpg").write_bytes(_photo("coffee"))
  (root / "b.jpg").write_bytes(_photo("chelsea"))
  rows = [
    {"image": "a.jpg", "caption": "an orange dahlia", "captions": ["a flower with many petals", "a dahlia"]},
    {"image": "b.jpg", "caption": "a cat", "url": "https://example.com/b.jpg", "width": 451},
  ]
  (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  report = prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))
  assert _captions(tmp_path / "tfds") == {
    "a.jpg": ["an orange dahlia", "a flower with many petals", "a dahlia"],
    "b.jpg": ["a cat"],
  }
  assert report["row_fields"] == {
    "read": {"caption": 2, "captions": 1, "image": 2},
    "ignored": {"url": 1, "width": 1},
  }
  # A shard: the narration as KEY.json's caption beside its captions list and KEY.txt all kept; KEY.txt equal to
  # KEY.json's caption (img2dataset's layout) is one caption.
  os.makedirs(tmp_path / "shards")
  members = {
    "000.jpg": _photo("coffee"),
    "000.txt": b"a cup of coffee",
    "000.json": json.dumps({"caption": "in this picture a cup", "captions": ["a saucer", "a spoon"]}).encode(),
    "001.jpg": _photo("chelsea"),
    "001.txt": b"a cat",
    "001.json": json.dumps({"caption": "a cat", "key": "001", "status": "success"}).encode(),
  }
  with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
    for member, content in members.items():
      info = tarfile.TarInfo(member)
      info.size = len(content)
      tar.addfile(info, io.BytesIO(content))
  report = prepare.prepare("image_text", str(tmp_path / "shards"), str(tmp_path / "shard_tfds"))
  assert _captions(tmp_path / "shard_tfds") == {
    "00000.tar/000": ["a cup of coffee", "in this picture a cup", "a saucer", "a spoon"],
    "00000.tar/001": ["a cat"],
  }
  assert report["row_fields"] == {
    "read": {"caption": 2, "captions": 1, "shard member *.txt": 2},
    "ignored": {"key": 1, "status": 1},
  }
  assert report.get("merged", {}) == {}


def test_rows_naming_one_file_are_one_example_and_repeated_captions_kept_once(tmp_path):
  root = tmp_path / "mine"
  os.makedirs(root / "photos")
  (root / "photos" / "good_1.jpg").write_bytes(_photo("coffee"))
  (root / "photos" / "good_2.jpg").write_bytes(_photo("chelsea"))
  os.link(root / "photos" / "good_2.jpg", root / "photos" / "same_as_2.jpg")  # a hard link: the same file
  rows = [
    {"image": "photos/good_1.jpg", "caption": "a cup of coffee"},
    {"image": "./photos/good_1.jpg", "caption": "coffee on a saucer"},
    {"image": "photos/../photos//good_1.jpg", "caption": "a cup of coffee"},  # the same caption again
    {"image": "photos/good_2.jpg", "caption": "a cat"},
    {"image": "photos/same_as_2.jpg", "caption": "a ginger cat"},
  ]
  (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  report = prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 2}, report
  assert _captions(tmp_path / "tfds") == {
    "photos/good_1.jpg": ["a cup of coffee", "coffee on a saucer"],
    "photos/good_2.jpg": ["a cat", "a ginger cat"],
  }
  assert report["merged"] == {image_text.SAME_FILE: 3, image_text.DUPLICATE_CAPTION: 1}
  # labels.csv: the same image under two spellings is listed once (the second row counted).
  labelled = tmp_path / "labelled"
  for k in range(6):
    os.makedirs(labelled / ("a" if k % 2 else "b"), exist_ok=True)
    Image.fromarray(skdata.astronaut()[k * 40 : k * 40 + 60, :60]).save(labelled / ("a" if k % 2 else "b") / f"{k}.png")
  lines = [f"{'a' if k % 2 else 'b'}/{k}.png,{'a' if k % 2 else 'b'}" for k in range(6)] + ["./a/1.png,b"]
  (labelled / "labels.csv").write_text("image,label\n" + "\n".join(lines) + "\n")
  report = prepare.prepare("image_folder", str(labelled), str(tmp_path / "labelled_tfds"))
  assert sum(report["splits"].values()) == 6
  assert report["skipped"] == {"image listed a second time (its first row kept)": 1}


# ---------------------------------------------------------------------------------------------------- #
# An interrupted prepare leaves nothing behind.
# ---------------------------------------------------------------------------------------------------- #
SLOW_PREPARE = """
import sys, time
from vlrep.data import prepare
from vlrep.data.builders import image_text
example = image_text._example
def slow(*args):
  time.sleep(0.2)
  return example(*args)
image_text._example = slow
prepare.prepare("image_text", sys.argv[1], sys.argv[2])
"""


def _own_folder(root, n: int) -> None:
  os.makedirs(root)
  jpeg = _photo("coffee")
  for k in range(n):
    (root / f"{k}.jpg").write_bytes(jpeg)
  (root / "captions.jsonl").write_text(
    "".join(json.dumps({"image": f"{k}.jpg", "caption": f"cup {k}"}) + "\n" for k in range(n))
  )


def test_sigterm_during_prepare_leaves_nothing_and_leftovers_are_removed(tmp_path):
  _own_folder(tmp_path / "mine", 40)
  dataset_folder = tmp_path / "tfds" / "image_text"
  proc = subprocess.Popen(
    [sys.executable, "-c", SLOW_PREPARE, str(tmp_path / "mine"), str(tmp_path / "tfds")],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
  )
  try:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
      if dataset_folder.is_dir() and any(n.startswith("incomplete.") for n in os.listdir(dataset_folder)):
        break
      time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
    time.sleep(0.5)  # generating: a few examples written into the incomplete folder
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0].decode()
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
  assert os.listdir(dataset_folder) == [], os.listdir(dataset_folder)  # no incomplete.*, no half version

  # What a kill that no handler sees (SIGKILL, a power cut) leaves: TFDS's incomplete folder. The next prepare
  # removes it and says so; a folder of another name is not touched.
  leftover = dataset_folder / "incomplete.ABC123_1.1.0"
  os.makedirs(leftover)
  (leftover / "image_text-train.array_record-00000-of-00001").write_bytes(b"half")
  os.makedirs(dataset_folder / "mine_keep")
  report = prepare.prepare("image_text", str(tmp_path / "mine"), str(tmp_path / "tfds"))
  assert report["removed_leftovers"] == ["incomplete.ABC123_1.1.0"] and report["splits"] == {"train": 40}
  assert sorted(os.listdir(dataset_folder)) == ["1.1.0", "mine_keep"]
