"""`vlrep.data.prepare` given a manual_dir crafted against it (issue 76): rows naming files outside manual_dir,
gzip shards and PNGs of a few kilobytes that decompress to gigabytes, index and annotation files that are not what
they claim, a symlink planted at the report's name. Each is refused with exit status 2 and one message, or skipped
and counted under a reason that names the limit; nothing outside is read or written; memory stays bounded.

The command-line cases run in one subprocess (tests/ cannot afford a TensorFlow start per case): it parses the
real flags and calls `prepare.main` per case, as `python -m vlrep.data.prepare` does, and reports each case's exit
status, stderr and its own peak RSS (ru_maxrss is a high-water mark, so a case's peak is bounded by the peak read
after it). The first case is a valid source of real photos: the baseline every later peak is compared to.
"""

import gzip
import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import zlib

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from vlrep.data import manual_files, prepare
from vlrep.errors import UserError

MB = 1 << 20
_ALLOW = {"allow_outside_manual_dir": True}
# Real photographs (scikit-image's samples), cropped small so that preparing them is quick.
PHOTOS = {
  "astronaut.jpg": lambda: skdata.astronaut()[::4, ::4],  # 128 x 128
  "coffee.jpg": lambda: skdata.coffee()[::4, ::4],  # 100 x 150
  "chelsea.png": lambda: skdata.chelsea()[::3, ::3],  # 100 x 151, PNG
  "camera.jpg": lambda: skdata.camera()[::4, ::4],  # grayscale 128 x 128
}
CAPTIONS = {
  "astronaut.jpg": "an astronaut holding a helmet",
  "coffee.jpg": "a cup of coffee",
  "chelsea.png": "a ginger cat",
  "camera.jpg": "a man with a camera",
}


def _photo_bytes(name: str) -> bytes:
  out = io.BytesIO()
  Image.fromarray(np.ascontiguousarray(PHOTOS[name]())).save(out, "PNG" if name.endswith(".png") else "JPEG")
  return out.getvalue()


def _jsonl(*rows) -> str:
  return "".join(json.dumps(r) + "\n" for r in rows)


def _photo_folder(root, names=tuple(PHOTOS)) -> list[dict]:
  """ROOT/images/NAME for each photo; returns their captions.jsonl rows."""
  os.makedirs(os.path.join(root, "images"), exist_ok=True)
  for name in names:
    with open(os.path.join(root, "images", name), "wb") as f:
      f.write(_photo_bytes(name))
  return [{"image": f"images/{name}", "caption": CAPTIONS[name]} for name in names]


# ---------------------------------------------------------------------------------------------------------------
# Crafted files, generated on the fly in milliseconds.


def _gz_zeros(n: int) -> bytes:
  """A gzip stream of n zero bytes (n a multiple of 1 MiB): one gzip member of 1 MiB of zeros (~1 kB) repeated;
  a gzip file may hold many members, read as one stream."""
  one = gzip.compress(b"\0" * MB, compresslevel=9, mtime=0)
  return one * (n // MB)


def _tar_prefix(members: dict[str, bytes]) -> bytes:
  """The tar bytes of `members` without the end-of-archive blocks (so that more members can follow)."""
  out = io.BytesIO()
  tar = tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT)
  for name, data in members.items():
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
  end = tar.offset
  return out.getvalue()[:end]


def _sample(key: str, photo: str) -> dict[str, bytes]:
  return {f"{key}.jpg": _photo_bytes(photo), f"{key}.txt": CAPTIONS[photo].encode()}


def bomb_shard(path: str, size: int, header_type: bytes = tarfile.REGTYPE) -> None:
  """A gzip shard: two real samples, then `size` bytes of zeros (a member 'bomb.jpg' of that size, or with
  header_type=XHDTYPE a pax header record that long), then another real sample. A few hundred kB on disk."""
  info = tarfile.TarInfo("bomb.jpg" if header_type == tarfile.REGTYPE else "././@PaxHeader")
  info.type, info.size = header_type, size
  with open(path, "wb") as f:
    before = _tar_prefix({**_sample("000", "astronaut.jpg"), **_sample("001", "camera.jpg")})
    f.write(gzip.compress(before + info.tobuf(tarfile.USTAR_FORMAT), mtime=0))
    f.write(_gz_zeros(size))
    f.write(gzip.compress(_tar_prefix(_sample("002", "coffee.jpg")) + b"\0" * 1024, mtime=0))


def _png_chunk(kind: bytes, data: bytes) -> bytes:
  return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int, height: int) -> bytes:
  """A 1-bit grayscale PNG of width x height black pixels, written row by row (never held whole): 20000 x 20000
  is ~50 kB on disk and 400 MB (1 byte per pixel in PIL) to 1.2 GB (as RGB) decoded."""
  compress, idat = zlib.compressobj(9), []
  row = b"\0" * (1 + (width + 7) // 8)  # filter byte 0, then the packed bits
  block = row * 256
  for _ in range(height // 256):
    idat.append(compress.compress(block))
  idat.append(compress.compress(row * (height % 256)) + compress.flush())
  ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
  return (
    b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", b"".join(idat)) + _png_chunk(b"IEND", b"")
  )


def test_the_crafted_files_are_what_they_claim():
  """The generators make what the attacks need: a tar whose member declares the size, a valid PNG of that size."""
  with tarfile.open(fileobj=io.BytesIO(_tar_prefix({"a.txt": b"xyz"}) + b"\0" * 1024)) as tar:
    assert [(m.name, m.size) for m in tar] == [("a.txt", 3)]
  assert len(_gz_zeros(4 * MB)) < 20_000 and gzip.decompress(_gz_zeros(4 * MB)) == b"\0" * 4 * MB
  png = bomb_png(20000, 20000)
  assert len(png) < 200_000
  with Image.open(io.BytesIO(bomb_png(300, 200))) as im:  # small enough to decode here
    im.load()
    assert im.size == (300, 200) and im.mode == "1"


# ---------------------------------------------------------------------------------------------------------------
# Rows naming files outside manual_dir (in-process: prepare() raises the UserError that main turns into exit 2).


def _outside_source(tmp_path):
  """manual_dir with four good rows and three escaping it: an absolute path, a '../' path, a symlink."""
  outside = tmp_path / "outside"
  outside.mkdir()
  for name in ("secret1.jpg", "secret2.jpg", "secret3.jpg"):
    (outside / name).write_bytes(_photo_bytes("coffee.jpg"))
  root = tmp_path / "mine"
  rows = _photo_folder(root)
  os.symlink(outside / "secret3.jpg", root / "images" / "link.jpg")
  rows += [
    {"image": str(outside / "secret1.jpg"), "caption": "an absolute path"},
    {"image": "../outside/secret2.jpg", "caption": "a relative path out"},
    {"image": "images/link.jpg", "caption": "a symlink out"},
  ]
  return root, rows


@pytest.mark.parametrize("index", ["jsonl", "csv"])
def test_rows_outside_manual_dir_are_refused_naming_them_and_read_with_the_flag(tmp_path, index):
  root, rows = _outside_source(tmp_path)
  if index == "jsonl":
    (root / "captions.jsonl").write_text(_jsonl(*rows))
  else:
    (root / "captions.csv").write_text("image,caption\n" + "".join(f"{r['image']},{r['caption']}\n" for r in rows))
  data_dir = tmp_path / "tfds"
  with pytest.raises(manual_files.OutsideManualDir) as refused:
    prepare.prepare("image_text", str(root), str(data_dir))
  message = str(refused.value)
  assert "3 files named by captions." in message and "--allow_outside_manual_dir" in message, message
  for named in (str(tmp_path / "outside" / "secret1.jpg"), "../outside/secret2.jpg", "images/link.jpg"):
    assert repr(named) in message, (named, message)
  assert not data_dir.exists()  # refused before anything is written

  limits = manual_files.Limits(allow_outside_manual_dir=True)
  report = prepare.prepare("image_text", str(root), str(data_dir), limits=limits)
  assert report["splits"] == {"train": 7} and report["skipped"] == {}, report
  assert report["outside_manual_dir"]["files"] == 3, report
  assert set(report["outside_manual_dir"]["first"]) == {
    str(tmp_path / "outside" / "secret1.jpg"),
    "../outside/secret2.jpg",
    "images/link.jpg",
  }


def test_a_shard_symlinked_from_outside_is_refused(tmp_path):
  outside, root = tmp_path / "outside", tmp_path / "mine"
  outside.mkdir()
  root.mkdir()
  for name, sample in (("00000.tar", _sample("000", "astronaut.jpg")), ("00001.tar", _sample("001", "coffee.jpg"))):
    where = outside if name == "00001.tar" else root
    (where / name).write_bytes(_tar_prefix(sample) + b"\0" * 1024)
  os.symlink(outside / "00001.tar", root / "00001.tar")
  with pytest.raises(manual_files.OutsideManualDir, match=r"1 file named by the shard listing .*: '00001.tar' -> "):
    prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))
  assert not (tmp_path / "tfds").exists()
  report = prepare.prepare("image_text", str(root), str(tmp_path / "tfds"), limits=manual_files.Limits(**_ALLOW))
  assert report["splits"] == {"train": 2} and report["outside_manual_dir"] == {"files": 1, "first": ["00001.tar"]}


def test_labelled_images_outside_manual_dir_are_refused(tmp_path):
  """image_folder: a labels.csv row with '../', a class folder that is a symlink out (not walked: it may be /)
  and a file symlinked out of a class folder."""
  outside, root = tmp_path / "outside", tmp_path / "labelled"
  (outside / "dogs").mkdir(parents=True)
  for k in range(3):
    (outside / "dogs" / f"{k}.jpg").write_bytes(_photo_bytes("chelsea.png"))
  for label in ("cat", "cup"):
    (root / label).mkdir(parents=True)
    for k in range(3):
      (root / label / f"{k}.jpg").write_bytes(_photo_bytes("coffee.jpg" if label == "cup" else "chelsea.png"))
  os.symlink(outside / "dogs", root / "dog")
  with pytest.raises(manual_files.OutsideManualDir, match=r"named by the class folders .*'dog' -> .*outside/dogs"):
    prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"))
  os.unlink(root / "dog")
  os.symlink(outside / "dogs" / "0.jpg", root / "cat" / "3.jpg")
  with pytest.raises(manual_files.OutsideManualDir, match=r"1 file named by the class folders .*'cat/3.jpg' -> "):
    prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"))
  os.unlink(root / "cat" / "3.jpg")
  rows = [f"{label}/{k}.jpg,{label}" for label in ("cat", "cup") for k in range(3)] + ["../outside/dogs/1.jpg,cat"]
  (root / "labels.csv").write_text("image,label\n" + "\n".join(rows) + "\n")
  with pytest.raises(manual_files.OutsideManualDir, match=r"1 file named by labels.csv .*'../outside/dogs/1.jpg' -> "):
    prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"))
  report = prepare.prepare("image_folder", str(root), str(tmp_path / "tfds"), limits=manual_files.Limits(**_ALLOW))
  assert sum(report["splits"].values()) == 7 and report["outside_manual_dir"]["files"] == 1, report


def test_a_symlink_planted_at_the_reports_name_is_replaced_not_followed(tmp_path):
  root = tmp_path / "mine"
  (root).mkdir()
  (root / "captions.jsonl").write_text(_jsonl(*_photo_folder(root, ("astronaut.jpg", "coffee.jpg"))))
  data_dir, victim = tmp_path / "tfds", tmp_path / "bashrc"
  data_dir.mkdir()
  victim.write_text("export PATH=/usr/bin\n")
  os.symlink(victim, data_dir / "image_text_prepare_report.json")
  report = prepare.prepare("image_text", str(root), str(data_dir))
  assert victim.read_text() == "export PATH=/usr/bin\n"  # untouched
  written = data_dir / "image_text_prepare_report.json"
  assert not written.is_symlink() and json.loads(written.read_text())["splits"] == report["splits"] == {"train": 2}


# ---------------------------------------------------------------------------------------------------------------
# The command: exit status, message, no traceback, and peak memory, one subprocess for every case.

DRIVER = r"""
import contextlib, io, json, os, resource, sys, traceback
from absl import flags
from vlrep.data import prepare

FLAGS = flags.FLAGS
for case in json.loads(sys.argv[1]):
  FLAGS.unparse_flags()
  FLAGS(["prepare"] + case["argv"])
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      prepare.main([])
      code = 0
    except SystemExit as e:
      code = e.code
    except BaseException:
      traceback.print_exc()
      code = "traceback"
  report_path = os.path.join(FLAGS.data_dir, FLAGS.dataset + "_prepare_report.json")
  report = json.load(open(report_path)) if code == 0 and os.path.exists(report_path) else None
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print("CASE " + json.dumps({"name": case["name"], "code": code, "stderr": err.getvalue()[-3000:], "report": report,
                             "peak": peak}), flush=True)
"""


def _write(root, files: dict) -> None:
  os.makedirs(root, exist_ok=True)
  for name, content in files.items():
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(content.encode() if isinstance(content, str) else content)


def _cases(tmp) -> list[dict]:
  """(name, argv, files written) for each command-line case; the first is the baseline."""
  photos = {f"images/{name}": _photo_bytes(name) for name in PHOTOS}
  rows = [{"image": f"images/{name}", "caption": CAPTIONS[name]} for name in PHOTOS]
  cases = {}

  def case(name, dataset="image_text", files=None, flags=()):
    root = os.path.join(tmp, name)
    _write(root, files or {})
    argv = [f"--dataset={dataset}", f"--manual_dir={root}", f"--data_dir={os.path.join(tmp, name + '_tfds')}"]
    cases[name] = {"name": name, "argv": argv + list(flags)}
    return root

  case("baseline", files={**photos, "captions.jsonl": _jsonl(*rows)})
  # Memory bombs: a 600 MB member and a 600 MB pax header in gzip shards of under 1 MB; a 400-megapixel PNG.
  bomb_shard(os.path.join(case("shard_member_600mb"), "00000.tar"), 600 * MB)
  bomb_shard(os.path.join(case("shard_pax_header_600mb"), "00000.tar"), 600 * MB, tarfile.XHDTYPE)
  bomb = {"images/bomb.png": bomb_png(20000, 20000)}
  case(
    "png_bomb", files={**photos, **bomb, "captions.jsonl": _jsonl(*rows, {"image": "images/bomb.png", "caption": "x"})}
  )
  case("pixels_flag", files={**photos, "captions.jsonl": _jsonl(*rows)}, flags=["--max_image_pixels=16000"])
  # Malformed index files: a folder, a FIFO, lines nested too deep, an integer too long to read, a CSV field over
  # the csv module's limit, a header that is not UTF-8.
  case("index_is_a_folder", files={"captions.jsonl/x": "", **photos})
  fifo_root = case("index_is_a_fifo", files=photos)
  os.mkfifo(os.path.join(fifo_root, "captions.jsonl"))
  bad_lines = "[" * 100000 + "\n" + '{"image": "images/coffee.jpg", "caption": ' + "1" * 5000 + "}\n"
  case("jsonl_deep_and_long_int", files={**photos, "captions.jsonl": bad_lines + _jsonl(*rows)})
  csv_rows = "".join(f"{r['image']},{r['caption']}\n" for r in rows) + "images/coffee.jpg," + "x" * 200_000 + "\n"
  case("csv_field_over_limit", files={**photos, "captions.csv": "image,caption\n" + csv_rows})
  case("csv_header_not_utf8", files={**photos, "captions.csv": b"im\xffage,caption\nimages/coffee.jpg,a cup\n"})
  # Shards: a gzip shard cut short, one whose deflate data is corrupt (both keep the sample before the damage).
  good = gzip.compress(_tar_prefix({**_sample("000", "astronaut.jpg"), **_sample("001", "coffee.jpg")}) + b"\0" * 1024)
  case("gzip_shard_truncated", files={"00000.tar": good[: len(good) - 40]})
  corrupt = bytearray(good)
  corrupt[len(good) * 3 // 4 : len(good) * 3 // 4 + 64] = b"\xff" * 64  # in sample 001
  case("gzip_shard_corrupt", files={"00000.tar": bytes(corrupt)})
  # Official formats: a COCO annotation file nested too deep, an LN JSONL line that is not UTF-8.
  coco = {"annotations/captions_val2017.json": "[" * 100000, "val2017/x.jpg": photos["images/coffee.jpg"]}
  case("coco_deep_json", dataset="coco_captions2017", files=coco)
  ln_line = {"image_id": "1", "caption": "a cup", "timed_caption": [], "traces": [[{"x": 0.5, "y": 0.5, "t": 0}]]}
  ln_text = b"\xff\xfe not utf-8\n" + json.dumps(ln_line).encode() + b"\n"
  ln = {
    "localized_narratives/coco_train_localized_narratives.jsonl": ln_text,
    "train2017/000000000001.jpg": photos["images/coffee.jpg"],
  }
  case("ln_line_not_utf8", dataset="localized_narratives", files=ln, flags=["--config_name=coco"])
  return list(cases.values())


def test_the_command_refuses_or_skips_every_crafted_file_in_bounded_memory(tmp_path):
  cases = _cases(str(tmp_path))
  out = subprocess.run(
    [sys.executable, "-c", DRIVER, json.dumps(cases)],
    capture_output=True,
    text=True,
    env={**os.environ, "PYTHONPATH": os.getcwd()},
    timeout=600,
  )
  results = {r["name"]: r for r in (json.loads(x[5:]) for x in out.stdout.splitlines() if x.startswith("CASE "))}
  assert len(results) == len(cases), out.stdout[-3000:] + out.stderr[-5000:]
  assert "Traceback" not in out.stderr, out.stderr[-5000:]
  for name, result in results.items():
    assert "Traceback" not in result["stderr"] and result["code"] in (0, 2), (name, result)

  base = results["baseline"]
  assert base["code"] == 0 and base["report"]["splits"] == {"train": 4}, base

  def skipped(name):
    result = results[name]
    assert result["code"] == 0, result
    return result["report"]["skipped"], result["report"]["splits"]["train"]

  def refused(name, *words):
    result = results[name]
    assert result["code"] == 2 and "ERROR: " in result["stderr"], result
    for word in words:
      assert word in result["stderr"], (name, word, result["stderr"])

  # The bombs: skipped under a reason naming the limit, the real samples around them kept.
  assert skipped("shard_member_600mb") == ({"shard member over 256 MiB (--max_file_bytes; its sample skipped)": 1}, 3)
  # A break in a shard keeps the samples before it, less the one open at the break (it may have had more files).
  assert skipped("shard_pax_header_600mb") == ({"shard header record over 1 MiB (rest of the shard skipped)": 1}, 1)
  reason = "image over 178,956,970 pixels (--max_image_pixels; a decompression bomb?)"
  assert skipped("png_bomb") == ({reason: 1}, 4)
  # --max_image_pixels=16000: the 128 x 128 photos (16384 pixels) are over it, the 100 x 150 ones are not.
  assert skipped("pixels_flag") == ({"image over 16,000 pixels (--max_image_pixels; a decompression bomb?)": 2}, 2)
  # Peak memory: the 600 MB member or header is never held, the 400-megapixel PNG never decoded.
  for name in ("shard_member_600mb", "shard_pax_header_600mb", "png_bomb"):
    assert results[name]["peak"] < base["peak"] + 500 * MB, (name, results[name]["peak"] / MB, base["peak"] / MB)

  # Malformed index files: one message naming the file, or the bad lines skipped and counted.
  refused("index_is_a_folder", "captions.jsonl: cannot be read as a text index")
  refused("index_is_a_fifo", "captions.jsonl: cannot be read as a text index (NotRegularFile")
  assert skipped("jsonl_deep_and_long_int") == ({"line not JSON": 2}, 4)
  assert skipped("csv_field_over_limit") == ({"line not CSV (field larger than field limit (131072))": 1}, 4)
  refused("csv_header_not_utf8", "captions.csv: no header on line 1")
  assert skipped("gzip_shard_truncated") == ({"unreadable shard or shard tail (EOFError)": 1}, 1)
  skips, _ = skipped("gzip_shard_corrupt")
  assert len(skips) == 1 and next(iter(skips)).startswith("unreadable shard or shard tail ("), skips
  refused("coco_deep_json", "captions_val2017.json: cannot be read as a COCO captions annotation file: it nests deeper")
  assert skipped("ln_line_not_utf8") == ({"line not UTF-8": 1}, 1)


def test_limits_are_flags_with_generous_defaults():
  """The defaults hold real photos: a 150-megapixel camera's image, a 256 MiB file, an 8 MiB caption line."""
  limits = manual_files.Limits()
  assert limits.max_image_pixels >= 150_000_000 and limits.max_file_bytes == 256 * MB
  assert limits.max_text_bytes == 8 * MB and not limits.allow_outside_manual_dir
  for flag in ("max_file_bytes", "max_text_bytes", "max_image_pixels", "allow_outside_manual_dir"):
    assert flag in prepare.FLAGS, flag


def test_an_index_is_a_user_error_when_it_cannot_be_read_as_a_file(tmp_path):
  root = tmp_path / "mine"
  _photo_folder(root)
  (root / "captions.jsonl").mkdir()
  with pytest.raises(UserError, match=r"captions.jsonl: cannot be read as a text index \(NotRegularFile"):
    prepare.prepare("image_text", str(root), str(tmp_path / "tfds"))


def test_official_formats_refuse_images_outside_and_malformed_files(tmp_path):
  """The official-format builders check each image as they read it (the first outside manual_dir stops prepare);
  a file that is not the format's is one UserError naming it."""
  outside = tmp_path / "outside.jpg"
  outside.write_bytes(_photo_bytes("coffee.jpg"))
  coco = tmp_path / "coco"
  (coco / "annotations").mkdir(parents=True)
  (coco / "val2017").mkdir()
  annotations = {
    "images": [{"id": 1, "file_name": "../../outside.jpg"}],
    "annotations": [{"id": 1, "image_id": 1, "caption": "a cup of coffee"}],
  }
  (coco / "annotations" / "captions_val2017.json").write_text(json.dumps(annotations))
  with pytest.raises(manual_files.OutsideManualDir, match=r"named by the dataset's annotations .*'../outside.jpg' -> "):
    prepare.prepare("coco_captions2017", str(coco), str(tmp_path / "tfds"))
  assert not list((tmp_path / "tfds").glob("**/dataset_info.json"))  # TFDS removed its unfinished output
  (coco / "annotations" / "captions_val2017.json").write_text(json.dumps({"images": 3}))
  with pytest.raises(UserError, match=r"captions_val2017.json: cannot be read as a COCO captions annotation file"):
    prepare.prepare("coco_captions2017", str(coco), str(tmp_path / "tfds"))

  cc = tmp_path / "cc"
  cc.mkdir()
  (cc / "Validation_GCC-1.1.0-Validation.tsv").write_bytes(b"a cup\thttp://x\n\xff\xfe\thttp://y\n")
  with pytest.raises(UserError, match=r"Validation.tsv: cannot be read as a Conceptual Captions TSV \(UnicodeDecode"):
    prepare.prepare("conceptual_captions", str(cc), str(tmp_path / "tfds"))
