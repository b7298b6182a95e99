"""What every benchmark script shares: a `--help` built from its docstring, and a one-line
failure when its data is missing.

    from common import arguments, require_file
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def arguments(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help shows the script's docstring: the first paragraph as
    the description, the rest after the flags."""
    summary, _, details = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(
        description=summary,
        epilog=details or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def require_file(path: str | Path, hint: str, directory: bool = False) -> Path:
    """`path` if it is a file (a directory with directory=True); otherwise exit with status 2
    and one line `SCRIPT: error: PATH not found; HINT` on stderr."""
    path = Path(path)
    if not (path.is_dir() if directory else path.is_file()):
        print(f"{Path(sys.argv[0]).name}: error: {path} not found; {hint}", file=sys.stderr)
        raise SystemExit(2)
    return path
