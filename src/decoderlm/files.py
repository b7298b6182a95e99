"""File helpers shared by the package: atomic writes, JSON, fsync.

Every file decoderlm writes goes through `atomic_write`: a temporary file in the same
directory, fsync-ed, then renamed over the target, so a crash leaves either the old file or
the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .errors import MissingFileError, UserError

__all__ = ["atomic_write", "write_json", "read_json", "make_temp_dir", "torch_save", "fsync_dir"]

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: str | Path, write) -> None:
    """Create `path` by calling write(tmp_path) on a temporary file in the same directory,
    fsync-ing it, then renaming it over `path`: a crash leaves either the old file or the new
    one, never a torn one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the usual file mode
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """Write `data` as indented JSON to `path`, atomically."""
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def read_json(path: str | Path) -> Any:
    """Read a JSON file; FileNotFoundError / ValueError name the file on failure."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid UTF-8 JSON: {e}") from None


def make_temp_dir(parent: Path, prefix: str, suffix: str = "") -> Path:
    """A new empty directory in `parent` (tempfile.mkdtemp) with the usual mode (the umask's,
    not mkdtemp's 0700), to be renamed into place once complete."""
    path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix, suffix=suffix))
    os.chmod(path, 0o777 & ~_UMASK)
    return path


def torch_save(obj, path) -> None:
    """torch.save, with its C++ write errors (disk full, file-size limit) as an OSError."""
    try:
        torch.save(obj, path)
    except RuntimeError as e:
        raise OSError(
            f"could not write {path} ({str(e).splitlines()[0]}): is the disk full "
            f"or a file-size limit reached?"
        ) from None


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
