"""The official-format builders (COCO Captions, VOC2007, Localized Narratives, the V&L datasets) and the detection
worker decode images as a viewer shows them, through vlrep.data.images (issue 77): an upright RGB JPEG is stored
byte for byte; an EXIF-rotated or CMYK JPEG is stored converted and counted in the prepare report. Real pixels:
crops of scikit-image's photos."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from PIL import Image, ImageOps
from skimage import data as skdata

from vlrep.data import images, manual_files, pipeline, prepare, records
from vlrep.data.builders import voc2007

MAX_MEAN_ABS = 2.0  # of 255: what a quality-97 4:4:4 JPEG re-encoding keeps


def _jpeg(image: Image.Image, **kw) -> bytes:
  out = io.BytesIO()
  image.save(out, "JPEG", quality=92, **kw)
  return out.getvalue()


def _photos() -> dict[str, bytes]:
  """An ordinary RGB JPEG, a phone's portrait JPEG (stored 300 x 200 wide, EXIF orientation 6: shown 200 wide x
  300 high) and a print CMYK JPEG."""
  exif = Image.Exif()
  exif[ImageOps.ExifTags.Base.Orientation] = 6
  return {
    "ordinary": _jpeg(Image.fromarray(skdata.astronaut()[100:300, 100:400])),
    "portrait": _jpeg(Image.fromarray(skdata.chelsea()[50:250, 50:350]), exif=exif),
    "cmyk": _jpeg(Image.fromarray(skdata.coffee()[100:300, 150:450]).convert("CMYK")),
  }


def _shown(data: bytes) -> np.ndarray:
  """What a viewer shows, computed without vlrep: PIL's exif_transpose and RGB conversion."""
  return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"), np.float64)


def _mean_abs(a: np.ndarray, b: np.ndarray) -> float:
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.abs(a.astype(np.float64) - b).mean())


@pytest.fixture(scope="module")
def photos():
  return _photos()


def _stored(data_dir: str, dataset: str, key: str) -> dict:
  """{example[key]: (stored bytes, pixels as training decodes them)} of every split."""
  builder = pipeline.get_builder(dataset, data_dir)
  out = {}
  for split in builder.info.splits:
    encoded = {e[key].numpy(): e["image"].numpy() for e in records.examples(builder, split)}
    for e in records.examples(builder, split, decode_images=True):
      k = e[key].numpy()
      out[k.decode() if isinstance(k, bytes) else int(k)] = (encoded[k], e["image"].numpy())
  return out


def _check(stored: dict, photos: dict, name_of) -> None:
  for key, (encoded, pixels) in stored.items():
    name = name_of(key)
    if name == "ordinary":
      assert encoded == photos[name]  # an upright RGB JPEG: the file itself
    assert _mean_abs(pixels, _shown(photos[name])) <= MAX_MEAN_ABS, name
  assert stored[next(k for k in stored if name_of(k) == "portrait")][1].shape == (300, 200, 3)  # upright


CONVERTED = {images.NOTE_CMYK: 1, images.NOTE_ORIENTATION: 1}


def test_the_fixtures_are_what_they_claim(photos):
  for name, mode in (("ordinary", "RGB"), ("portrait", "RGB"), ("cmyk", "CMYK")):
    im = Image.open(io.BytesIO(photos[name]))
    assert (im.format, im.mode) == ("JPEG", mode)
  assert Image.open(io.BytesIO(photos["portrait"])).size == (300, 200)
  # The stored pixels as the old storage (the raw file) decode them are sideways: the test can see it.
  assert np.asarray(Image.open(io.BytesIO(photos["portrait"]))).shape == (200, 300, 3)


def test_coco_captions_stores_what_a_viewer_shows(photos, tmp_path):
  root = tmp_path / "coco"
  os.makedirs(root / "annotations")
  os.makedirs(root / "train2017")
  ids = {"ordinary": 1, "portrait": 2, "cmyk": 3, "large": 4}
  photos = {**photos, "large": _jpeg(Image.fromarray(skdata.astronaut()))}  # 512 x 512: over the pixel limit
  entries = []
  for name, i in ids.items():
    (root / "train2017" / f"{i:012d}.jpg").write_bytes(photos[name])
    entries.append({"id": i, "file_name": f"{i:012d}.jpg"})
  anns = [{"id": 10 + i, "image_id": i, "caption": f"a photo number {i}"} for i in ids.values()]
  (root / "annotations" / "captions_train2017.json").write_text(json.dumps({"images": entries, "annotations": anns}))
  limits = manual_files.Limits(max_image_pixels=100_000)  # --max_image_pixels still applies
  report = prepare.prepare("coco_captions2017", str(root), str(tmp_path / "tfds"), limits=limits)
  assert report["splits"] == {"train": 3} and report["skipped"] == {manual_files.image_too_large(100_000): 1}
  assert report["converted"] == CONVERTED
  by_id = {i: name for name, i in ids.items()}
  _check(_stored(str(tmp_path / "tfds"), "coco_captions2017", "image_id"), photos, by_id.get)
  # Found prepared, the report still counts the conversions (kept in the dataset's metadata).
  again = prepare.prepare("coco_captions2017", str(root), str(tmp_path / "tfds"))
  assert again["converted"] == CONVERTED


def _voc_xml(width: int, height: int) -> str:
  box = "<bndbox><xmin>2</xmin><ymin>3</ymin><xmax>20</xmax><ymax>22</ymax></bndbox>"
  size = f"<size><width>{width}</width><height>{height}</height><depth>3</depth></size>"
  return f"<annotation>{size}<object><name>cat</name><difficult>0</difficult>{box}</object></annotation>"


def test_voc2007_stores_what_a_viewer_shows_and_skips_boxes_drawn_on_sideways_pixels(photos, tmp_path):
  root = tmp_path / "VOCdevkit" / "VOC2007"
  for sub in ("ImageSets/Main", "Annotations", "JPEGImages"):
    os.makedirs(root / sub)
  # 000002 is annotated at its upright size (kept, turned upright); 000004, the same photo, at its stored size:
  # its boxes were drawn on the sideways pixels, so it is skipped and counted.
  files = {"000001": "ordinary", "000002": "portrait", "000003": "cmyk", "000004": "portrait"}
  for image_id, name in files.items():
    (root / "JPEGImages" / f"{image_id}.jpg").write_bytes(photos[name])
    w, h = Image.open(io.BytesIO(photos[name])).size
    w, h = (h, w) if image_id == "000002" else (w, h)
    (root / "Annotations" / f"{image_id}.xml").write_text(_voc_xml(w, h))
  (root / "ImageSets" / "Main" / "trainval.txt").write_text("\n".join(files) + "\n")
  report = prepare.prepare("voc2007", str(tmp_path / "VOCdevkit"), str(tmp_path / "tfds"))
  assert report["splits"] == {"trainval": 3}
  assert report["skipped"] == {voc2007.TURNED_ACROSS: 1}
  assert report["converted"] == {images.NOTE_CMYK: 1, images.NOTE_ORIENTATION: 2}  # 000004 converted, then skipped
  _check(_stored(str(tmp_path / "tfds"), "voc2007", "image_id"), photos, files.get)


def test_localized_narratives_and_vqa2_store_what_a_viewer_shows(photos, tmp_path):
  root = tmp_path / "ln"
  os.makedirs(root / "localized_narratives")
  os.makedirs(root / "train2017")
  ids = {"ordinary": 1, "portrait": 2, "cmyk": 3}
  lines = []
  for name, i in ids.items():
    (root / "train2017" / f"{i:012d}.jpg").write_bytes(photos[name])
    lines.append(json.dumps({"image_id": str(i), "annotator_id": 0, "caption": f"a narration of {name}"}))
  (root / "localized_narratives" / "coco_train_localized_narratives.jsonl").write_text("\n".join(lines) + "\n")
  report = prepare.prepare("localized_narratives", str(root), str(tmp_path / "tfds"))
  assert report["splits"] == {"train": 3} and report["converted"] == CONVERTED
  by_id = {str(i): name for name, i in ids.items()}
  _check(_stored(str(tmp_path / "tfds"), "localized_narratives", "image_id"), photos, by_id.get)

  vqa = tmp_path / "vqa"
  os.makedirs(vqa / "train2014")
  questions = []
  for name, i in ids.items():
    (vqa / "train2014" / f"COCO_train2014_{i:012d}.jpg").write_bytes(photos[name])
    questions.append({"image_id": i, "question": f"what is in photo {i}?", "question_id": 100 + i})
  (vqa / "v2_OpenEnded_mscoco_train2014_questions.json").write_text(json.dumps({"questions": questions}))
  answers = [{"question_id": 100 + i, "answers": [{"answer": "a cat"}] * 10} for i in ids.values()]
  (vqa / "v2_mscoco_train2014_annotations.json").write_text(json.dumps({"annotations": answers}))
  report = prepare.prepare("vqa2", str(vqa), str(tmp_path / "tfds_vqa"))
  assert report["splits"] == {"train": 3} and report["converted"] == CONVERTED
  by_int = {i: name for name, i in ids.items()}
  _check(_stored(str(tmp_path / "tfds_vqa"), "vqa2", "image_id"), photos, by_int.get)


def test_the_detection_worker_reads_images_as_a_viewer_shows_them(photos, tmp_path):
  pytest.importorskip("pycocotools")
  from vlrep.pytorch import detection_worker

  folder = tmp_path / "images"
  os.makedirs(folder)
  entries = []
  for i, name in enumerate(("ordinary", "portrait", "cmyk"), 1):
    (folder / f"{name}.jpg").write_bytes(photos[name])
    h, w = _shown(photos[name]).shape[:2]
    entries.append({"id": i, "file_name": f"{name}.jpg", "height": h, "width": w})
  anns = [
    {"id": i, "image_id": i, "category_id": 1, "bbox": [2, 3, 40, 50], "area": 2000, "iscrowd": 0,
     "segmentation": [[2, 3, 42, 3, 42, 53, 2, 53]]}
    for i in (1, 2, 3)
  ]  # fmt: skip
  coco = {"images": entries, "annotations": anns, "categories": [{"id": 1, "name": "thing"}]}
  (tmp_path / "instances.json").write_text(json.dumps(coco))
  dataset = detection_worker.CocoInstances(str(tmp_path / "instances.json"), str(folder))
  for index, name in enumerate(("ordinary", "portrait", "cmyk")):
    image, target = dataset[index]
    pixels = image.permute(1, 2, 0).numpy() * 255.0
    assert _mean_abs(pixels, _shown(photos[name])) <= 0.5, name  # decoded, not re-encoded: the same pixels
    assert target["masks"].shape[1:] == image.shape[1:]
  # Annotated at the stored (sideways) size: one message naming the file and both sizes, not misplaced boxes.
  entries[1].update(height=200, width=300)
  (tmp_path / "instances.json").write_text(json.dumps(coco))
  dataset = detection_worker.CocoInstances(str(tmp_path / "instances.json"), str(folder))
  with pytest.raises(ValueError, match=r"portrait\.jpg: the annotations give 300 x 200 .* is 200 x 300"):
    dataset[1]
