"""Corpora and batches.

The package ships the first 300,000 characters of the WikiText-2 (raw) validation split
(`EMBEDDED_CORPUS`, CC BY-SA 3.0; see corpora/README.md) so the default run needs no network.
Text becomes token ids, the ids are split into train (first 90%) and validation (last 10%)
as the seed notebook does, and batches are random contiguous windows of block_size + 1 tokens.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import torch

__all__ = ["EMBEDDED_CORPUS", "load_text", "split_ids", "get_batch", "windows", "check_split",
           "SEED_CROP_CHARS"]

EMBEDDED_CORPUS = files("decoderlm") / "corpora" / "wikitext2_valid_300k.txt"
SEED_CROP_CHARS = 300_000
WIKITEXT_FILES = ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (invalid byte at offset {e.start}); "
                         f"convert it to UTF-8 first") from None


def load_text(path: str | Path | None = None, max_chars: int | None = None,
              dataset: str | None = None) -> tuple[str, str]:
    """Load a training corpus.

    Args:
        path: None for the embedded WikiText-2 crop; a UTF-8 text file; or a directory holding
            the original WikiText files (wiki.train.raw, ...), of which the train split is read.
        max_chars: keep only the first max_chars characters (None or 0: all of it). The seed
            notebook uses the first 300,000 characters of the train split.
        dataset: instead of a path, "wikitext-2-raw-v1" (or another config of the `wikitext`
            dataset) through the optional Hugging Face `datasets` package; this needs it
            installed and the network.

    Returns:
        (text, description) where description says where the text came from.

    Raises:
        FileNotFoundError: the path does not exist, or a directory lacks wiki.train.raw.
        ValueError: the file is not UTF-8, or the text is empty.
        RuntimeError: `dataset` is given but `datasets` is not installed or cannot fetch it.
    """
    if dataset is not None and path is not None:
        raise ValueError("give either a data path or a dataset name, not both")
    if dataset is not None:
        text, source = _load_hf_wikitext(dataset), f"Hugging Face dataset wikitext/{dataset}"
    elif path is None:
        text, source = EMBEDDED_CORPUS.read_text(encoding="utf-8"), (
            "embedded corpus: first 300,000 characters of WikiText-2 raw, validation split")
    else:
        path = Path(path)
        if path.is_dir():
            train = path / WIKITEXT_FILES[0]
            if not train.is_file():
                raise FileNotFoundError(
                    f"directory {path} has no {WIKITEXT_FILES[0]}; pass a UTF-8 text file, or a "
                    f"directory holding the WikiText files {list(WIKITEXT_FILES)}")
            path = train
        elif not path.exists():
            raise FileNotFoundError(f"data file {path} not found")
        elif not path.is_file():
            raise ValueError(f"{path} is not a regular file; pass a UTF-8 text file")
        text, source = _read_utf8(path), str(path)
    if max_chars:
        text = text[:max_chars]
        source += f" (first {len(text):,} characters)"
    if not text:
        raise ValueError(f"the corpus ({source}) is empty")
    return text, source


def _load_hf_wikitext(config_name: str) -> str:
    try:
        import datasets  # optional, never needed by the default path or the tests
    except ImportError:
        raise RuntimeError("--dataset needs the Hugging Face `datasets` package "
                           "(pip install datasets) and the network; or pass --data PATH") from None
    try:
        rows = datasets.load_dataset("wikitext", config_name, split="train")["text"]
    except Exception as e:  # network, unknown config, ...: report it as the user's problem
        raise RuntimeError(f"could not load wikitext/{config_name} with `datasets`: {e}") from e
    # The loader yields "" for the blank lines, which are " \n" in the raw file.
    return "".join(r if r else " \n" for r in rows)


def split_ids(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split [N] token ids into train (the first 1 - val_fraction) and validation (the rest)."""
    n_train = int((1.0 - val_fraction) * len(ids))
    return ids[:n_train], ids[n_train:]


def check_split(name: str, data: torch.Tensor, block_size: int) -> None:
    """Raise ValueError unless split `name` holds at least block_size + 1 tokens (one window)."""
    if len(data) <= block_size:
        raise ValueError(f"the {name} split has {len(data)} tokens but one training window "
                         f"needs block_size + 1 = {block_size + 1}; use a longer corpus or a "
                         f"smaller block_size (now {block_size})")


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample random contiguous windows for next-token prediction.

    Args:
        data: [N] int64 token ids, N > block_size.
        batch_size: B.
        block_size: T.
        generator: torch RNG for the window starts (uniform over 0..N-T-1).

    Returns:
        (x, y): [B, T] int64 each, y[b, t] = x[b, t + 1] (the window shifted by one).

    Raises:
        ValueError: N <= block_size.
    """
    check_split("data", data, block_size)
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    return windows(data, starts, block_size)


def windows(data: torch.Tensor, starts: torch.Tensor, block_size: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) [len(starts), block_size]: the windows data[s : s + block_size + 1] split into
    inputs and next-token targets."""
    window = data[starts[:, None] + torch.arange(block_size + 1)]
    return window[:, :-1], window[:, 1:]
