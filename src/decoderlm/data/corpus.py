"""Corpora and batches.

The package ships the first 300,000 characters of the WikiText-2 (raw) validation split
(`EMBEDDED_CORPUS`, CC BY-SA 3.0; see corpora/README.md) so the default run needs no network.
Text becomes token ids, the ids are split into train (first 90%) and validation (last 10%)
(the seed experiment's split), and batches are random contiguous windows of block_size + 1 tokens.

Token ids are either a torch tensor or a NumPy array; a prepared token directory
(`decoderlm prepare`, see prepare.py) is read with `load_token_dir` as read-only np.memmap
arrays, so a corpus larger than memory trains: `get_batch` and `windows` copy only the windows
they return. A conversations file (*.jsonl, `decoderlm.data.conversations`) becomes
`Conversations` split by conversation, whose windows are whole conversations trained on their
replies only; `window_count`, `windows`, `scored_windows` and `check_split` take either.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch

from ..errors import MissingFileError, UserError
from ..files import read_json
from ..tokenizers import DEFAULT_UNK_TOKEN, CharTokenizer, tokenizer_from_dict
from ..tokenizers.chat_template import chat_template_of
from .conversations import Conversations, is_conversation_file, read_conversations

__all__ = [
    "EMBEDDED_CORPUS",
    "load_text",
    "split_ids",
    "get_batch",
    "windows",
    "window_count",
    "window_length",
    "token_stream",
    "scored_windows",
    "check_split",
    "SEED_CROP_CHARS",
    "iter_text_chunks",
    "TokenDir",
    "load_token_dir",
    "is_token_dir",
    "META_NAME",
    "TOKEN_DTYPES",
    "data_spec",
    "load_corpus",
]

EMBEDDED_CORPUS = files("decoderlm.data") / "corpora" / "wikitext2_valid_300k.txt"
SEED_CROP_CHARS = 300_000
WIKITEXT_FILES = ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")
# (train, valid, test) file names of the split layouts a data directory may have
SPLIT_LAYOUTS = (WIKITEXT_FILES, ("train.txt", "valid.txt", "test.txt"))


META_NAME = "meta.json"
TOKEN_DTYPES = ("uint16", "uint32")
_SPLITS = ("train", "val")


_TRAIN_BYTES_HINT = (
    "convert it to UTF-8, or train on its bytes: `decoderlm prepare --data FILE "
    "--tokenizer byte --out DIR`, then `decoderlm train --data DIR`"
)


def _not_utf8(path: Path, offset: int, hint: str = _TRAIN_BYTES_HINT) -> UserError:
    return UserError(f"{path} is not UTF-8 text (invalid byte at offset {offset}); {hint}")


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e.start) from None


def iter_text_chunks(
    path: str | Path, chunk_bytes: int = 1 << 20, hint: str = _TRAIN_BYTES_HINT
) -> Iterator[str]:
    """The text of a UTF-8 file, read `chunk_bytes` bytes at a time, as consecutive strings.

    Newlines are translated as `load_text` (Python's universal newlines) does: "\r\n" and "\r"
    become "\n", so "".join(chunks) equals the file read with `_read_utf8`. A chunk never ends
    inside a multi-byte character; chunks can be empty.

    Raises:
        UserError: the file is not UTF-8; the message gives the byte offset of the first
            invalid byte in the file, and `hint`.
    """
    path = Path(path)
    utf8 = codecs.getincrementaldecoder("utf-8")()
    decoder = io.IncrementalNewlineDecoder(utf8, translate=True)
    consumed = 0  # bytes of the file passed to the decoder so far
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk_bytes)
            pending = len(utf8.getstate()[0])
            try:
                yield decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise _not_utf8(path, consumed - pending + e.start, hint) from None
            consumed += len(data)
            if not data:
                return


def load_text(
    path: str | Path | None = None, max_chars: int | None = None, dataset: str | None = None
) -> tuple[str, str]:
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
        UserError: the file is not UTF-8, or the text is empty.
        RuntimeError: `dataset` is given but `datasets` is not installed or cannot fetch it.
    """
    if dataset is not None and path is not None:
        raise UserError("give either a data path or a dataset name, not both")
    if dataset is not None:
        text, source = _load_hf_wikitext(dataset), f"Hugging Face dataset wikitext/{dataset}"
    elif path is None:
        text, source = (
            EMBEDDED_CORPUS.read_text(encoding="utf-8"),
            ("embedded corpus: first 300,000 characters of WikiText-2 raw, validation split"),
        )
    else:
        path = Path(path)
        if path.is_dir():
            trains = [path / names[0] for names in SPLIT_LAYOUTS]
            if not any(p.is_file() for p in trains):
                raise MissingFileError(
                    f"directory {path} has no {' or '.join(p.name for p in trains)}; pass a "
                    f"UTF-8 text file, or a directory holding the WikiText files "
                    f"{list(WIKITEXT_FILES)} (or train.txt, valid.txt, test.txt)"
                )
            path = next(p for p in trains if p.is_file())
        elif not path.exists():
            raise MissingFileError(f"data file {path} not found")
        elif not path.is_file():
            raise UserError(f"{path} is not a regular file; pass a UTF-8 text file")
        text, source = _read_utf8(path), str(path)
    if max_chars:
        text = text[:max_chars]
        source += f" (first {len(text):,} characters)"
    if not text:
        raise UserError(f"the corpus ({source}) is empty")
    return text, source


def _check_hub_reachable(timeout: float = 3.0) -> None:
    """UserError (one line, at once) when the Hugging Face Hub cannot be reached, rather than
    the minute of retries `datasets` spends offline. Skipped where the user has said how to
    reach it or not to: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (`datasets` then reads its cache
    only) or an HTTPS proxy; HF_ENDPOINT names the Hub to try."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy")
    if any(os.environ.get(name) for name in names):
        return
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or 443
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise UserError(
            f"--dataset needs the network and cannot reach {host}:{port} ({e.strerror or e}); "
            "pass --data PATH, or set HF_HUB_OFFLINE=1 to use a copy `datasets` has cached"
        ) from None


def _load_hf_wikitext(config_name: str) -> str:
    try:
        import datasets  # optional, never needed by the default path or the tests
    except ImportError:
        raise UserError(
            "--dataset needs the Hugging Face `datasets` package "
            "(pip install datasets) and the network; or pass --data PATH"
        ) from None
    _check_hub_reachable()
    try:
        rows = datasets.load_dataset("wikitext", config_name, split="train")["text"]
    except Exception as e:  # network, unknown config, ...: report it as the user's problem
        raise UserError(f"could not load wikitext/{config_name} with `datasets`: {e}") from e
    # The loader yields "" for the blank lines, which are " \n" in the raw file.
    return "".join(r if r else " \n" for r in rows)


def split_ids(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split [N] token ids into train (the first 1 - val_fraction) and validation (the rest)."""
    n_train = int((1.0 - val_fraction) * len(ids))
    return ids[:n_train], ids[n_train:]


def check_split(name: str, data, block_size: int) -> None:
    """Raise UserError unless split `name` (a [N] tensor or array of token ids) holds at
    least block_size + 1 tokens (one window); for `Conversations`, unless it holds one
    conversation and each has a reply token within its window (`Conversations.check_fits`)."""
    if isinstance(data, Conversations):
        data.check_fits(name, block_size)
        return
    if len(data) <= block_size:
        raise UserError(
            f"the {name} split has {len(data)} tokens but one training window "
            f"needs block_size + 1 = {block_size + 1}; use a longer corpus or a "
            f"smaller block_size (now {block_size})"
        )


def get_batch(
    data: torch.Tensor | np.ndarray,
    batch_size: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample random contiguous windows for next-token prediction.

    Args:
        data: [N] token ids, N > block_size: an int64 tensor, or an integer NumPy array or
            np.memmap (e.g. `TokenDir.train`), of which only the sampled windows are read.
        batch_size: B.
        block_size: T.
        generator: torch RNG for the window starts (uniform over 0..N-T-1); the same generator
            state gives the same starts for a tensor and an array.

    Returns:
        (x, y): [B, T] int64 tensors on the CPU, y[b, t] = x[b, t + 1] (the window shifted by one).

    Raises:
        UserError: N <= block_size.
    """
    check_split("data", data, block_size)
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    return windows(data, starts, block_size)


def window_count(data, block_size: int) -> int:
    """How many windows training draws from (uniformly, `windows`' starts 0..count-1): the
    N - block_size window starts of a [N] token stream, or the C conversations of
    `Conversations`."""
    if isinstance(data, Conversations):
        return data.count
    return len(data) - block_size


def window_length(data, block_size: int) -> int:
    """The tokens of one window: block_size, or `Conversations.window_length` (the longest
    conversation's, at most block_size)."""
    if isinstance(data, Conversations):
        return data.window_length(block_size)
    return block_size


def scored_windows(data, block_size: int) -> torch.Tensor:
    """The starts of the windows an evaluation scores, in order: the non-overlapping windows
    0, T, 2T, ... of a token stream ((N - 1) // T of them), or every conversation."""
    if isinstance(data, Conversations):
        return torch.arange(data.count)
    return torch.arange((len(data) - 1) // block_size) * block_size


def token_stream(data):
    """The [N] token ids of a split: the ids themselves, or `Conversations`' ids one
    conversation after the other."""
    return data.tokens() if isinstance(data, Conversations) else data


def windows(data, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) [len(starts), block_size] int64: the windows data[s : s + block_size + 1] split
    into inputs and next-token targets. `data` is a [N] tensor or a NumPy array / np.memmap,
    from which only these windows are gathered (fancy indexing) and converted to int64.
    x and y are contiguous: torch.compile's CPU graph for strided inputs is slower. For
    `Conversations`, `starts` are conversation indices and the windows are theirs
    (`Conversations.windows`: [len(starts), W], the targets outside replies -1)."""
    if isinstance(data, Conversations):
        return data.windows(starts, block_size)
    if isinstance(data, np.ndarray):
        index = starts.numpy()[:, None] + np.arange(block_size + 1)
        window = torch.from_numpy(data[index].astype(np.int64))
    else:
        window = data[starts[:, None] + torch.arange(block_size + 1)].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


@dataclass
class TokenDir:
    """A prepared token directory (written by `decoderlm prepare`), opened read-only.

    Attributes:
        path: the directory.
        train, val: [N_train], [N_val] token ids as read-only np.memmap arrays of meta's dtype
            (np.uint16 or np.uint32; an empty split is an empty array), for get_batch /
            windows / `decoderlm.evaluate.evaluate`, which read only the windows they need.
        meta: meta.json: tokenizer, vocab_size, dtype, tokens {"train", "val"}, val_fraction,
            sources, unknown_characters, ...
        tokenizer: the tokenizer the ids were made with (rebuilt from meta["tokenizer"]).
    """

    path: Path
    train: np.ndarray
    val: np.ndarray
    meta: dict
    tokenizer: object

    def split(self, name: str) -> np.ndarray:
        """The split called `name` ("train" | "val"); UserError for another name."""
        if name not in _SPLITS:
            raise UserError(f"unknown split {name!r}; use 'train' or 'val'")
        return getattr(self, name)


def is_token_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding meta.json, train.bin and val.bin."""
    path = Path(path)
    return all((path / name).is_file() for name in (META_NAME, "train.bin", "val.bin"))


def load_token_dir(path: str | Path) -> TokenDir:
    """Open a prepared token directory: meta.json, train.bin, val.bin (see prepare.py).

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        UserError: meta.json is not valid JSON or lacks its fields, its dtype is not uint16 /
            uint32 or cannot hold vocab_size, its tokenizer does not have vocab_size ids, or a
            .bin file's size is not its token count times the dtype's size (a truncated file,
            or one written with another dtype).
    """
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"token directory {path} not found (or not a directory)")
    meta = read_json(path / META_NAME)
    bad = f"{path / META_NAME} is not a decoderlm token directory's meta.json"
    if not isinstance(meta, dict) or not isinstance(meta.get("tokens"), dict):
        raise UserError(f"{bad} (no 'tokens' entry)")
    dtype, vocab_size = meta.get("dtype"), meta.get("vocab_size")
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"{bad}: dtype {dtype!r} is not one of {list(TOKEN_DTYPES)}")
    if not isinstance(vocab_size, int) or not 0 < vocab_size <= np.iinfo(dtype).max + 1:
        raise UserError(f"{bad}: vocab_size {vocab_size!r} does not fit dtype {dtype}")
    tokenizer = tokenizer_from_dict(meta.get("tokenizer"), str(path / META_NAME))
    if tokenizer.vocab_size != vocab_size:
        raise UserError(
            f"{bad}: its tokenizer has {tokenizer.vocab_size} ids but vocab_size is {vocab_size}"
        )
    itemsize = np.dtype(dtype).itemsize
    arrays = {}
    for name in _SPLITS:
        count, file = meta["tokens"].get(name), path / f"{name}.bin"
        if not isinstance(count, int) or count < 0:
            raise UserError(f"{bad}: tokens[{name!r}] is {count!r}, not a token count")
        if not file.is_file():
            raise MissingFileError(f"{file} not found")
        size = file.stat().st_size
        if size != count * itemsize:
            raise UserError(
                f"{file} has {size:,} bytes but meta.json says {count:,} {dtype} "
                f"tokens = {count * itemsize:,} bytes; the file is truncated, or "
                f"was written with another dtype; prepare the data again"
            )
        if count:
            arrays[name] = np.memmap(file, dtype=dtype, mode="r")
        else:  # mmap cannot map an empty file
            arrays[name] = np.empty(0, dtype=dtype)
            arrays[name].flags.writeable = False
    return TokenDir(path, arrays["train"], arrays["val"], meta, tokenizer)


def data_spec(
    data: str | Path | None, dataset: str | None, max_chars: int | None, val_fraction: float
) -> dict:
    """Where a run's corpus comes from, as stored in config.json["data_spec"] and read back by
    `load_corpus` (`decoderlm train --resume`, `decoderlm eval`).

    Returns:
        {"path": the resolved data path or None (the embedded corpus), "dataset",
        "max_chars" (300,000 by default for a WikiText directory or dataset, else None: all),
        "token_dir": the path when it is a prepared token directory, else None,
        "val_fraction"}.
    """
    if max_chars is None and (
        dataset is not None or (data is not None and Path(data).is_dir() and not is_token_dir(data))
    ):
        max_chars = SEED_CROP_CHARS
    path = None if data is None else str(Path(data).resolve())
    token_dir = path if data is not None and is_token_dir(data) else None
    return {
        "path": path,
        "dataset": dataset,
        "max_chars": max_chars or None,
        "token_dir": token_dir,
        "val_fraction": val_fraction,
    }


def load_corpus(spec: dict, tokenizer=None):
    """The corpus of a data_spec (see `data_spec`): (tokenizer, train ids, validation ids,
    description, fingerprint).

    A conversations file (*.jsonl) gives `Conversations` (`_load_conversations`). A prepared
    token directory (`decoderlm prepare`) is memory-mapped and brings its own
    tokenizer and split; text is encoded with `tokenizer` (a new CharTokenizer of the text,
    with an unknown-character id, when None) and split by spec["val_fraction"] (the last part
    is validation); spec["unknown"] = "unk" (fine-tuning runs) maps characters outside a char
    vocabulary to its unknown token, counted in the description. The fingerprint is the
    sha256 of the text, or of the token directory's meta.json (which holds its sources' sha256
    and counts): `--resume` compares it with the checkpoint's to notice a corpus that changed.

    Raises:
        UserError: a token directory without validation tokens (and see `load_text`,
            `load_token_dir`).
    """
    if spec.get("token_dir"):
        tokens = load_token_dir(spec["token_dir"])
        if len(tokens.val) == 0:
            raise UserError(
                f"token directory {spec['token_dir']} has no validation tokens (it "
                f"was prepared with --val-fraction 0); training scores a "
                f"validation split: run `decoderlm prepare` again with "
                f"--val-fraction 0.1"
            )
        fingerprint = hashlib.sha256((Path(spec["token_dir"]) / META_NAME).read_bytes())
        return (
            tokens.tokenizer,
            tokens.train,
            tokens.val,
            f"{spec['token_dir']} (prepared {type(tokens.tokenizer).__name__} tokens)",
            fingerprint.hexdigest(),
        )
    if is_conversation_file(spec["path"]):
        return _load_conversations(spec, tokenizer)
    text, source = load_text(spec["path"], spec["max_chars"], spec["dataset"])
    if tokenizer is None:
        tokenizer = CharTokenizer.from_text(text, unk_token=DEFAULT_UNK_TOKEN)
    unknown = spec.get("unknown", "error")
    ids = torch.tensor(tokenizer.encode_ordinary(text, unknown), dtype=torch.long)  # a corpus
    train_ids, val_ids = split_ids(ids, spec["val_fraction"])
    n_unknown = tokenizer.count_unknown(text) if unknown == "unk" else 0
    unknown_note = (
        f", {n_unknown:,} of them outside the vocabulary (mapped to the unknown token "
        f"{getattr(tokenizer, 'unk_token', None)!r})"
        if n_unknown
        else ""
    )
    return (
        tokenizer,
        train_ids,
        val_ids,
        f"{source}: {len(text):,} characters{unknown_note}",
        hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )


def _load_conversations(spec: dict, tokenizer):
    """load_corpus of a conversations file: rendered with `tokenizer`'s chat template and
    split by conversation (the last val_fraction of them is validation)."""
    path = spec["path"]
    template = chat_template_of(tokenizer) if tokenizer is not None else None
    if template is None:
        raise UserError(
            f"{path} holds conversations, which are rendered with a model's chat template; "
            f"fine-tune a chat model on them: --init-from MODEL (a Hugging Face directory, "
            f"Hub id or GGUF file with a chat template)"
        )
    conversations = Conversations.encode(read_conversations(path), template, path)
    train, val = conversations.split(spec["val_fraction"])
    description = (
        f"{path}: {conversations.count:,} conversations, {len(conversations):,} tokens, "
        f"{conversations.trained_tokens:,} of them in replies (the loss covers those)"
    )
    fingerprint = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return tokenizer, train, val, description, fingerprint
