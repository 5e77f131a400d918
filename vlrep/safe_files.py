"""Writing files so that nothing already on disk decides where the bytes go: vlrep's one way to write.

A run folder can come from someone else, and anything in it may be a symlink planted to make a writer overwrite a
file outside it (`WORKDIR/summary.json.tmp -> ~/.bashrc`). So every writer in the package writes a fresh temporary
file, created exclusively (O_EXCL: a name that exists, a symlink included, is never opened) in the target's own
folder, and then renames it over the target with `os.replace`, which replaces a symlink at the target instead of
following it. Folders are created one component at a time and a component that is a symlink is refused when the
caller names the root that must contain the file (the workdir, the `--out` the user gave).

  open_atomic(path, mode="w", root=None)   context manager: a file object; the target appears whole on success
  atomic_path(path, suffix="", root=None)  context manager: a fresh temporary path for writers that want a name
                                           (np.savez, torch.save, a library's save(path)); renamed on success
  atomic_dir(path, root=None)              context manager: a fresh temporary folder, renamed to `path` on success
  write_text / write_bytes / write_json    the one-call forms
  make_dirs(path, root=None)               os.makedirs that refuses symlinked components under `root`
  check_inside(path, root)                 refuses (UserError) a path that resolves outside `root`
  sha256_of(path)                          a file's SHA-256, read in blocks (what a run or a driver records it wrote)

A leaf module: imports only vlrep.errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from vlrep.errors import UserError


class OutsideWrite(UserError):
  """A write would land outside the folder the user named: a symlink in the way, or a path a file chose."""


def _components(root: str, path: str) -> list[str]:
  """The folders from just under `root` down to `path`, outermost first ([] when `path` is `root`)."""
  rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
  if rel == ".":
    return []
  if rel == ".." or rel.startswith(".." + os.sep) or os.path.isabs(rel):
    raise OutsideWrite(f"{path}: vlrep writes only inside {root}, and this path lies outside it.")
  parts, out = rel.split(os.sep), []
  for i in range(len(parts)):
    out.append(os.path.join(os.path.abspath(root), *parts[: i + 1]))
  return out


def check_inside(path: str, root: str) -> str:
  """`path` (absolute), refused unless it and every folder between `root` and it are real (no symlink) and under
  `root`. `root` itself may be reached through symlinks: it is the user's own choice on the command line."""
  for component in _components(root, path):
    if os.path.islink(component):
      raise OutsideWrite(
        f"{component} is a symlink (to {os.readlink(component)!r}); vlrep does not write through links inside "
        f"{root}. Remove the link, or give another folder."
      )
  return os.path.abspath(path)


def make_dirs(path: str, root: str | None = None) -> str:
  """`os.makedirs(path, exist_ok=True)`, refusing a symlinked folder between `root` and `path` (before creating
  anything beneath it)."""
  if root is not None:
    check_inside(path, root)
  os.makedirs(path, exist_ok=True)
  if root is not None:
    check_inside(path, root)  # a link planted while the folders were made
  return path


def _folder_of(path: str, root: str | None) -> str:
  folder = os.path.dirname(os.path.abspath(path))
  if root is not None:
    check_inside(folder, root)
  if os.path.islink(path) and os.path.isdir(path):
    raise OutsideWrite(f"{path} is a symlink to a folder; vlrep does not write through links. Remove it.")
  return folder


def _discard(tmp: str) -> None:
  with contextlib.suppress(FileNotFoundError):
    if os.path.isdir(tmp) and not os.path.islink(tmp):
      shutil.rmtree(tmp)
    else:
      os.unlink(tmp)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "", root: str | None = None):
  """A fresh, exclusively created temporary file's path beside `path` (ending in `suffix`, for writers that add
  one); on success it replaces `path` (a symlink there is replaced, not followed), on failure it is removed."""
  folder = _folder_of(path, root)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=f".tmp{suffix}")
  os.close(fd)
  try:
    yield tmp
    if os.path.islink(tmp) or not os.path.isfile(tmp):
      raise OutsideWrite(f"{tmp}: the temporary file was replaced by something else while it was written.")
    os.replace(tmp, path)
  except BaseException:
    _discard(tmp)
    raise


@contextlib.contextmanager
def open_atomic(path: str, mode: str = "w", root: str | None = None, **kwargs):
  """`open(path, mode)` for writing, atomically: the file object writes a fresh temporary file in `path`'s folder
  (O_EXCL, so no planted name is opened), renamed over `path` when the block ends without an error."""
  if not any(c in mode for c in "wx") or "+" in mode or "a" in mode:
    raise ValueError(f"open_atomic writes whole files: mode {mode!r}")
  folder = _folder_of(path, root)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, mode.replace("x", "w"), **kwargs) as f:
      yield f
      f.flush()
    os.replace(tmp, path)
  except BaseException:
    _discard(tmp)
    raise


@contextlib.contextmanager
def atomic_dir(path: str, root: str | None = None):
  """A fresh temporary folder beside `path`; on success it takes `path`'s place (an existing folder or link there
  is removed first, never followed), on failure it is removed."""
  folder = _folder_of(path, root)
  tmp = tempfile.mkdtemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    yield tmp
    if os.path.islink(path) or os.path.isfile(path):
      os.unlink(path)
    elif os.path.isdir(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
  except BaseException:
    _discard(tmp)
    raise


def write_bytes(path: str, data: bytes, root: str | None = None) -> None:
  with open_atomic(path, "wb", root=root) as f:
    f.write(data)


def write_text(path: str, text: str, root: str | None = None) -> None:
  with open_atomic(path, "w", root=root, encoding="utf-8") as f:
    f.write(text)


def write_json(path: str, value: Any, root: str | None = None, **dump_kwargs) -> None:
  dump_kwargs.setdefault("indent", 2)
  with open_atomic(path, "w", root=root, encoding="utf-8") as f:
    json.dump(value, f, **dump_kwargs)


def sha256_of(path: str) -> str:
  """The hex SHA-256 of the file at `path`, read in 4 MiB blocks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()
