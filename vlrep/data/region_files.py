"""Region features read from files: the Faster R-CNN feature dumps that VisualBERT / ViLBERT studies train on.

vlrep's format (one file per image, written by `python -m vlrep.tools.convert_regions`):
  DIR/<image_id>.npz   features      float16/float32 [N, D]  (D = 2048 for the paper's ResNeXt-152 fc6)
                       boxes         float32 [N, 4]  x1, y1, x2, y2 in pixels (Faster R-CNN's convention)
                       image_width, image_height   scalars (pixels)
                       labels        int32 [N]  optional: each region's detected class (argmax of cls_prob)
                       cls_prob      float32 [N, C]  optional: the detector's class distribution
MMF's dumps (`<name>.npy` features + `<name>_info.npy`, a pickled dict with bbox, num_boxes, image_width,
image_height, objects, cls_prob) convert with `--format=mmf`. Their info files are read with vlrep's restricted
unpickler (vlrep.torch_files): numpy arrays and plain containers only; an info file that asks for anything else
(a payload) stops the conversion with an error naming it, and nothing in it runs. Every .npy / .npz header is
checked against the bytes the file holds before anything is allocated (`load_npy`, `load_npz`): plain numeric
arrays only, no pickle outside an info file; a malformed dump is skipped and counted, a malformed region file is
a `vlrep.errors.BadFile` naming it.

The `region_features(DIR, max_regions, class_probs=False)` host op looks features up by `image_id`: `regions`
[R, D], `boxes` [R, 4] normalised (ymin, xmin, ymax, xmax, TFDS order), `box_mask`, `region_labels` (-1
unknown), and with class_probs=True `region_probs` [R, C] (the detector's cls_prob, the target of ViLBERT's
masked-region KL; a file without cls_prob, or with another C, is an error naming it). An image without a file gets
no regions (box_mask all False), is counted in `stat_no_features`, and trains on its text.
"""

from __future__ import annotations

import io
import math
import os
import zipfile

import numpy as np

from vlrep import errors, safe_files, torch_files
from vlrep.data import registry
from vlrep.errors import BadFile


def load_npy(path: str, pickled: bool = False):
  """An .npy file's array, its header checked against the file before anything is allocated: a plain numeric dtype
  (bool, int, uint, float, complex) whose shape x itemsize the rest of the file holds. With `pickled`, an
  object-dtype file's pickle is read through vlrep's restricted unpickler (`vlrep.torch_files.load_pickle`:
  numpy
  arrays and plain containers, bounded; any other global is an `UnsafeFile` naming the file and the global, and
  nothing in the file runs). Any malformed file is a `vlrep.errors.BadFile` naming it."""
  with errors.reading(path, what=".npy file"), open(path, "rb") as f:
    return _read_npy(f, path, os.fstat(f.fileno()).st_size, pickled)


def _read_npy(f, path: str, size: int, pickled: bool):
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
  elif version == (2, 0):
    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
  else:
    raise BadFile(f"{path}: .npy format version {version[0]}.{version[1]}; vlrep reads 1.0 and 2.0.")
  if dtype.hasobject:
    if not pickled:
      raise BadFile(f"{path} holds pickled Python objects (dtype {dtype}), where vlrep reads a numeric array.")
    return torch_files.load_pickle(f, path)
  if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
    raise BadFile(f"{path}: an array of dtype {dtype}; vlrep reads plain numeric arrays only.")
  if not all(isinstance(n, int) and n >= 0 for n in shape):
    raise BadFile(f"{path}: its header declares the shape {shape}.")
  nbytes, left = math.prod(shape) * dtype.itemsize, size - f.tell()
  if nbytes > left:  # checked before a buffer of that size is allocated
    raise BadFile(f"{path}: its header declares shape {shape} of {dtype} ({nbytes:,} bytes); {left:,} bytes follow.")
  buf = bytearray(nbytes)
  if f.readinto(buf) != nbytes:
    raise BadFile(f"{path} is truncated.")
  return np.frombuffer(buf, dtype).reshape(shape, order="F" if fortran else "C")


def load_pickled_npy(path: str):
  """The object stored in an .npy file written with allow_pickle (MMF's `_info.npy` dicts), through vlrep's
  restricted unpickler (`load_npy(path, pickled=True)`); a numeric .npy file's array as it is."""
  obj = load_npy(path, pickled=True)
  # np.save of a dict stores a 0-d object array.
  return obj.item() if isinstance(obj, np.ndarray) and obj.shape == () and obj.dtype.hasobject else obj


def load_npz(path: str) -> dict[str, np.ndarray]:
  """Every array of an .npz file (a zip of .npy files), each member's declared size checked before it is read (at
  most 4 x the file's size + 256 MiB in all: a deflated bomb is refused) and each read as `load_npy` reads one:
  plain numeric arrays only, no pickles. A malformed file is a `vlrep.errors.BadFile` naming it."""
  with errors.reading(path, what=".npz file"), zipfile.ZipFile(path) as archive:
    size = os.path.getsize(path)
    left = torch_files.BUDGET_PER_FILE_BYTE * size + torch_files.BUDGET_BASE
    out = {}
    for info in archive.infolist():
      if not info.filename.endswith(".npy"):
        continue
      if info.file_size > left:
        raise BadFile(
          f"{path}: its member {info.filename} declares {info.file_size:,} bytes decompressed, more than a file of "
          f"{size:,} bytes may hold (4 x its size + 256 MiB in all)."
        )
      left -= info.file_size
      data = archive.read(info)
      out[info.filename[: -len(".npy")]] = _read_npy(io.BytesIO(data), f"{path} ({info.filename})", len(data), False)
    return out


def write_regions(
  path: str, features, boxes_xyxy, width: float, height: float, labels=None, cls_prob=None, root: str | None = None
) -> None:
  """DIR/<image_id>.npz (the module docstring's format), written atomically (inside `root` when given)."""
  features = np.asarray(features)
  boxes = np.asarray(boxes_xyxy, np.float32).reshape(-1, 4)
  if features.ndim != 2 or len(features) != len(boxes):
    raise ValueError(f"{path}: features {features.shape} and boxes {boxes.shape} do not describe the same regions.")
  extra = {}
  if labels is not None:
    extra["labels"] = np.asarray(labels, np.int32)
  if cls_prob is not None:
    extra["cls_prob"] = np.asarray(cls_prob, np.float32)
  with safe_files.open_atomic(path, "wb", root=root) as f:  # a fresh temporary file, then renamed: no link followed
    np.savez(f, features=features, boxes=boxes, image_width=width, image_height=height, **extra)


def convert_mmf(src: str, dst: str) -> dict[str, int]:
  """MMF-style `<name>.npy` + `<name>_info.npy` files -> `<name>.npz`; returns counts (converted, skipped)."""
  safe_files.make_dirs(dst)
  counts = {"converted": 0, "skipped_no_info": 0, "skipped_bad": 0}
  for fname in sorted(os.listdir(src)):
    if not fname.endswith(".npy") or fname.endswith("_info.npy"):
      continue
    name = fname[:-4]
    info_path = os.path.join(src, f"{name}_info.npy")
    if not os.path.exists(info_path):
      counts["skipped_no_info"] += 1
      continue
    try:
      feats = load_npy(os.path.join(src, fname))
      info = load_pickled_npy(info_path)
      if not isinstance(info, dict):
        raise ValueError(f"{info_path} holds a {type(info).__name__}, not MMF's info dict.")
      n = int(info.get("num_boxes", len(feats)))
      cls_prob = info.get("cls_prob")
      labels = info.get("objects")
      if labels is None and cls_prob is not None:
        labels = np.argmax(cls_prob, -1)
      write_regions(
        os.path.join(dst, f"{name}.npz"),
        feats[:n],
        np.asarray(info["bbox"])[:n],
        float(info["image_width"]),
        float(info["image_height"]),
        None if labels is None else np.asarray(labels)[:n],
        None if cls_prob is None else np.asarray(cls_prob)[:n],
        root=dst,
      )
      counts["converted"] += 1
    except torch_files.UnsafeFile:
      raise  # a payload, not a damaged record: the dump is not to be trusted
    except (KeyError, ValueError, TypeError, IndexError) as e:  # the record's values: a damaged dump, counted
      counts["skipped_bad"] += 1
      print(f"skipped {name}: {e}")
  return counts


class RegionStore:
  """Reads DIR/<image_id>.npz into fixed-size, normalised arrays (kept in memory after the first read)."""

  def __init__(self, directory: str, max_regions: int, class_probs: bool = False):
    directory = os.path.expanduser(directory)
    if not os.path.isdir(directory):
      raise torch_files.MissingFile(
        f"Region feature directory {directory!r} does not exist (see vlrep.data.region_files)."
      )
    self.directory, self.max_regions, self.class_probs = directory, max_regions, class_probs
    self._cache: dict[str, tuple] = {}
    first = next((f for f in sorted(os.listdir(directory)) if f.endswith(".npz")), None)
    if first is None:
      raise torch_files.MissingFile(f"{directory} holds no <image_id>.npz region files.")
    first_path = os.path.join(directory, first)
    with errors.reading(first_path, what="region-feature file (.npz)", hint=_HINT):
      z = load_npz(first_path)
      self.dim = int(z["features"].shape[1])
      self.num_classes = int(z["cls_prob"].shape[1]) if class_probs and "cls_prob" in z else 0
    if class_probs and not self.num_classes:
      raise ValueError(_NO_PROBS.format(path=os.path.join(directory, first)))

  def get(self, image_id) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    key = str(int(image_id))
    if key in self._cache:
      return self._cache[key]
    path = os.path.join(self.directory, f"{key}.npz")
    if not os.path.exists(path):
      return None
    r = self.max_regions
    with errors.reading(path, what="region-feature file (.npz)", hint=_HINT):
      z = load_npz(path)
      feats = np.asarray(z["features"], np.float32)[:r]
      if feats.shape[1] != self.dim:
        raise ValueError(f"{path}: features have {feats.shape[1]} dims, other files {self.dim}.")
      x0, y0, x1, y1 = np.asarray(z["boxes"], np.float32)[:r].T
      w, h = float(z["image_width"]), float(z["image_height"])
      boxes = np.clip(np.stack([y0 / h, x0 / w, y1 / h, x1 / w], -1), 0.0, 1.0)
      labels = np.asarray(z["labels"], np.int32)[:r] if "labels" in z else np.full(len(feats), -1, np.int32)
      probs = None
      if self.class_probs:
        if "cls_prob" not in z:
          raise ValueError(_NO_PROBS.format(path=path))
        probs = np.asarray(z["cls_prob"], np.float32)[:r]
        if probs.shape != (len(feats), self.num_classes):
          raise ValueError(f"{path}: cls_prob is {probs.shape}, expected ({len(feats)}, {self.num_classes}).")
    n = len(feats)
    out = (
      np.pad(feats, ((0, r - n), (0, 0))),
      np.pad(boxes, ((0, r - n), (0, 0))),
      np.arange(r) < n,
      np.pad(labels, (0, r - n), constant_values=-1),
    )
    if probs is not None:
      out = out + (np.pad(probs, ((0, r - n), (0, 0))),)
    self._cache[key] = out
    return out


_HINT = "Convert the dumps again with `python -m vlrep.tools.convert_regions` (see vlrep.data.region_files)."
_NO_PROBS = (
  "{path} has no cls_prob (the detector's class distribution), which method.region_target='distribution' "
  "(ViLBERT's masked-region KL) needs: convert dumps that carry it, or set method.region_target='classes'."
)


@registry.register_host
def get_region_features(
  directory: str, max_regions: int = 36, class_probs: bool = False, key: str = "image_id", context=None
):
  """Region features of each image from DIR/<image_id>.npz (see the module docstring)."""
  del context
  store = RegionStore(directory, max_regions, class_probs)

  def fn(batch):
    batch = dict(batch)
    ids = np.asarray(batch[key]).reshape(-1)
    b, r = len(ids), max_regions
    regions = np.zeros((b, r, store.dim), np.float32)
    boxes = np.zeros((b, r, 4), np.float32)
    mask = np.zeros((b, r), bool)
    labels = np.full((b, r), -1, np.int32)
    probs = np.zeros((b, r, store.num_classes), np.float32)
    missing = np.zeros((b,), bool)
    for i, image_id in enumerate(ids):
      got = store.get(image_id)
      if got is None:
        missing[i] = True
        continue
      regions[i], boxes[i], mask[i], labels[i] = got[:4]
      if store.class_probs:
        probs[i] = got[4]
    batch.update(regions=regions, boxes=boxes, box_mask=mask, region_labels=labels, stat_no_features=missing)
    if store.class_probs:
      batch["region_probs"] = probs
    return batch

  outputs = ("regions", "boxes", "box_mask", "region_labels", "stat_no_features")
  return registry.HostOp((key,), outputs + (("region_probs",) if class_probs else ()), fn)
