"""File helpers shared by the package: atomic writes, JSON, settings files, text files, fsync.

Every file decoderlm writes goes through `atomic_write`: a temporary file in the same
directory, fsync-ed, then renamed over the target, so a crash leaves either the old file or
the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import torch
import yaml

from .errors import MissingFileError, UserError

__all__ = [
    "atomic_write",
    "write_json",
    "json_text",
    "read_json",
    "read_settings",
    "read_text",
    "make_temp_dir",
    "torch_save",
    "fsync_dir",
]

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


def json_text(data: Any) -> str:
    """`data` as indented JSON text (non-ASCII characters as they are)."""
    return json.dumps(data, indent=2, ensure_ascii=False)


def write_json(path: str | Path, data: Any) -> None:
    """Write `data` as indented JSON to `path`, atomically."""
    text = json_text(data) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def read_json(path: str | Path) -> Any:
    """Read a JSON file; MissingFileError / UserError name the file on failure."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid UTF-8 JSON: {e}") from None


def _existing_file(path: str | Path, flag: str) -> Path:
    """Path(path) if it is a file; MissingFileError / UserError naming `flag` otherwise."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file")
    if not path.exists():
        raise MissingFileError(f"{flag} {path} not found")
    return path


def read_settings(path: str | Path, flag: str, example: str) -> dict:
    """The mapping in a settings file: TOML if its name ends in .toml, JSON if in .json (whose
    1e-05 is a number), else YAML.

    Raises:
        MissingFileError / UserError: (one line naming `flag` or the file) missing, a
            directory, not UTF-8 text, does not parse, empty or not a mapping (`example`
            shows one).
    """
    path = _existing_file(path, flag)
    try:
        text = path.read_bytes().decode("utf-8")
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except UnicodeDecodeError:
        raise UserError(f"settings file {path} is not UTF-8 text") from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        mark = getattr(e, "problem_mark", None)  # YAML's: where the problem is
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, yaml.YAMLError) and getattr(e, "problem", None):
            first = e.problem
        raise UserError(f"the settings file does not parse: {path}: {first}{where}") from None
    if not isinstance(data, dict):
        what = "is empty" if data is None else f"holds a {type(data).__name__}"
        raise UserError(
            f"a settings file must map settings to values; {path} {what} (write e.g. `{example}`)"
        )
    return data


def read_text(path: str | Path, flag: str) -> str:
    """The text of the UTF-8 file given to `flag` (a byte-order mark dropped).

    Raises:
        MissingFileError / UserError: (naming `flag`) missing, a directory, not UTF-8.
    """
    path = _existing_file(path, flag)
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None


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
