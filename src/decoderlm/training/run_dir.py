"""A run directory (`decoderlm train --out DIR`): the files a run writes there, a free name
for a new one, the checks before training, getting it ready, and writing the trained model
into it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import UserError
from ..files import atomic_write
from ..model.model import DecoderLM
from ..tokenizers import Tokenizer

__all__ = ["RUN_FILES", "check_run_dir", "free_run_dir", "prepare_run_dir", "run_files", "save_run"]

# every file or directory a run writes into its run directory (and only those are replaced)
RUN_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "decoderlm_tokenizer.json",
    "metrics.jsonl",
    "metrics.csv",
    "tensorboard",
    "loss.png",
    "attention.png",
    "samples.txt",
    "report.html",
    "report.json",
    "checkpoints",
    "adapter.safetensors",
    "merged",
)


def free_run_dir(name: str, root: Path = Path("runs")) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... if it is taken: never overwrite a run."""
    candidate, n = root / name, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{name}-{n}"
    return candidate


def check_run_dir(out_dir: Path, overwrite: bool, resuming: bool) -> None:
    """Refuse an --out that is a file, is not writable, or holds an earlier run (unless
    overwrite or resuming it).

    Raises:
        UserError: one of those, saying what to do instead.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file, not a directory")
    held = [name for name in RUN_FILES if (out_dir / name).exists()]
    if not resuming and held and not overwrite:
        raise UserError(
            f"{out_dir} already holds a run ({', '.join(held)}); pass --resume "
            f"{out_dir} to continue it, --overwrite to replace it, or choose "
            f"another --out"
        )
    existing = next(p for p in (out_dir / "checkpoints", out_dir, *out_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write into {existing} (permission denied); choose another "
            f"--out or fix its permissions"
        )


def prepare_run_dir(out_dir: Path, resumed_step: int | None, log) -> None:
    """Make out_dir ready (rank 0). A new run (resumed_step None) deletes the files of an
    earlier run there (only those: other files in the directory stay); a resumed run keeps
    metrics.jsonl up to the checkpoint's step, dropping later records and a line torn by a
    crash (with a warning through `log`)."""
    if resumed_step is None:
        for name in RUN_FILES:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
        return
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        kept = []
        for line in metrics.read_bytes().decode("utf-8", errors="replace").splitlines(True):
            try:
                if json.loads(line).get("step", 0) <= resumed_step:
                    kept.append(line)
            except (ValueError, AttributeError):  # torn or damaged: left out, said once
                log(f"warning: dropping an unreadable line of {metrics}: {line[:60]!r}")
        atomic_write(metrics, lambda tmp: Path(tmp).write_text("".join(kept), encoding="utf-8"))


def save_run(model: DecoderLM, tokenizer: Tokenizer, out_dir: Path, extra: dict) -> None:
    """Write the trained model (model.safetensors, or adapter.safetensors for LoRA; config.json
    with the `extra` entries) and its tokenizer files into out_dir (rank 0)."""
    model.save_pretrained(out_dir, extra)
    tokenizer.save_pretrained(out_dir)


def run_files(out_dir: Path) -> list[str]:
    """The run's files in out_dir, in `RUN_FILES` order, directories with a trailing "/"."""
    return [
        f"{name}/" if (out_dir / name).is_dir() else name
        for name in RUN_FILES
        if (out_dir / name).exists()
    ]
