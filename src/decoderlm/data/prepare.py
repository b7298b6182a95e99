"""Prepare a corpus as token files (`decoderlm prepare`), and stream-encode text files.

A prepared token directory holds

    train.bin   the first 1 - val_fraction of the token stream (n_train = int((1 - f) * N), the
                rule of `data.split_ids`, i.e. the seed experiment's 90/10 split)
    val.bin     the rest: the last val_fraction of the stream
    meta.json   tokenizer ({"type": kind, ...its fields}), vocab_size, dtype, tokens {"train",
                "val"}, val_fraction, split, documents, sources (path, bytes, sha256 and split
                of each file), and unknown_characters (always 0 here: a char vocabulary is
                built from the corpus)

A directory in a known split layout (WikiText's wiki.{train,valid,test}.raw, or train.txt,
valid.txt, test.txt) keeps its splits: train.bin from its train file, val.bin from its valid
file (val_fraction is then unused), and its test file is never read (a test split is never
trained on); `split_sources` says which file goes where.

Documents: every file is one document. When the input has several files and the tokenizer has
an end-of-text token (GPT-2; char or byte only with eot=True), its id follows each document, as
nanoGPT's OpenWebText preparation appends it after each text. The files' own "<|endoftext|>"
strings are ordinary text (endoftext="text") unless endoftext="special" makes them that id or
endoftext="error" refuses them (tiktoken's default for text holding a special token).

The .bin files are raw little-endian np.uint16 (vocab_size <= 65,536) or np.uint32, without a
header; `data.load_token_dir` opens them as read-only np.memmap arrays. The text is read and
encoded in chunks (never the whole corpus as one string); GPT-2 BPE chunks are cut only between
a non-space character and a space or newline, where no BPE pre-token can span the cut, so the
ids equal those of encoding the whole text at once. Several files are encoded one after the
other (a file boundary is a token boundary). The directory is built under a temporary name
beside DIR and renamed into place at the end: a failed prepare leaves no half-written DIR.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from ..arguments import NotEmptyPath
from ..errors import MissingFileError, UserError, one_of
from ..files import make_temp_dir, write_json
from ..tokenizers import (
    DEFAULT_UNK_TOKEN,
    TOKENIZER_KINDS,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    UnknownCharacterError,
    make_tokenizer,
)
from .corpus import (
    META_NAME,
    SPLIT_LAYOUTS,
    WIKITEXT_FILES,
    _load_hf_wikitext,
    is_token_dir,
    iter_text_chunks,
)

__all__ = [
    "CHUNK_BYTES",
    "encode_source",
    "iter_token_chunks",
    "prepare",
    "source_files",
    "split_sources",
    "token_dtype",
]

CHUNK_BYTES = 1 << 20
_NOT_UTF8_HINT = "convert it to UTF-8, or prepare it with --tokenizer byte, which takes any bytes"


def token_dtype(vocab_size: int) -> np.dtype:
    """np.uint16 when every id fits (vocab_size <= 65,536), else np.uint32 (little-endian)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def source_files(paths: Iterable[str | Path]) -> list[Path]:
    """The text files named by `paths`, in order. A file is itself; a directory holding the
    original WikiText files gives its wiki.train.raw only (as `data.load_text` does); any
    other directory gives its *.txt files in name order.

    Raises:
        FileNotFoundError: a path does not exist, or a directory has no text files.
        UserError: a path is neither a file nor a directory, or a file is empty.
    """
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            wiki = path / WIKITEXT_FILES[0]
            found = (
                [wiki] if wiki.is_file() else sorted(p for p in path.glob("*.txt") if p.is_file())
            )
            if not found:
                raise MissingFileError(
                    f"directory {path} has no *.txt files and no {WIKITEXT_FILES[0]}"
                )
            files += found
        elif not path.exists():
            raise MissingFileError(f"data file {path} not found")
        elif not path.is_file():
            raise UserError(f"{path} is not a regular file; pass a UTF-8 text file")
        else:
            files.append(path)
    for path in files:
        if path.stat().st_size == 0:
            raise UserError(f"{path} is empty")
    return files


def split_sources(paths: Iterable[str | Path]) -> tuple[list[Path], list[Path], list[Path]]:
    """(train files, validation files, files not used) of prepare's input `paths`.

    A directory in a split layout (SPLIT_LAYOUTS: wiki.{train,valid,test}.raw, or
    {train,valid,test}.txt) gives its train file to train, its valid file (if any) to
    validation and its test file to "not used". Every other path is read as `source_files`
    reads it, into train.

    Raises:
        FileNotFoundError: a path does not exist, a directory has no text files, or a
            directory holds a test split but no train split.
        UserError: see `source_files`.
    """
    train: list[Path] = []
    val: list[Path] = []
    unused: list[Path] = []
    for path in map(Path, paths):
        layout = next(
            (n for n in SPLIT_LAYOUTS if path.is_dir() and any((path / x).is_file() for x in n)),
            None,
        )
        if layout is None:
            train += source_files([path])
            continue
        tr, va, te = (path / name for name in layout)
        if not tr.is_file():
            raise MissingFileError(
                f"directory {path} holds the test split {te.name} but no {tr.name}; a test "
                f"split is never trained on: give the files to train on, e.g. "
                f"--data {path / va.name if va.is_file() else path / '<file>'}"
            )
        train += source_files([tr])
        val += source_files([va]) if va.is_file() else []
        unused += [te] if te.is_file() else []
    return train, val, unused


def _text_chunks(source: Path | str, chunk_bytes: int) -> Iterator[str]:
    """Chunks of a file's text, or of a text given as a string."""
    if isinstance(source, Path):
        yield from iter_text_chunks(source, chunk_bytes, _NOT_UTF8_HINT)
    else:
        for i in range(0, len(source), chunk_bytes):
            yield source[i : i + chunk_bytes]


def _bpe_cut(text: str) -> int:
    """The last index i where text[i - 1] is not whitespace and text[i] is " " or "\\n" (0 if
    none). No GPT-2 pre-token holds a non-space character followed by a space, and the pattern
    has no look-behind, so encoding text[:i] and text[i:] apart gives the ids of text."""
    end = len(text)
    while True:
        i = max(text.rfind(" ", 0, end), text.rfind("\n", 0, end))
        if i <= 0:
            return 0
        if not text[i - 1].isspace():
            return i
        end = i


def _special_cut(text: str, specials: Iterable[str]) -> int:
    """len(text) less its longest suffix that begins one of `specials` (a special token cut
    by a chunk boundary waits for the next chunk)."""
    keep = 0
    for s in specials:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if s.startswith(text[-k:]):
                keep = k
                break
    return len(text) - keep


# endoftext -> the encode arguments: a special token's string is text, the token, or an error
_SPECIAL_MODES = {
    "text": {"disallowed_special": ()},
    "special": {"allowed_special": "all"},
    "error": {},
}


def iter_token_chunks(
    tokenizer: Tokenizer,
    source: Path | str,
    unknown: str = "error",
    chunk_bytes: int = CHUNK_BYTES,
    endoftext: str = "text",
) -> Iterator[tuple[np.ndarray, int]]:
    """Encode one source (a file, or a text string) piece by piece.

    Yields (ids, n_unknown): ids a 1-D integer array (int64; uint8 for a ByteTokenizer reading
    a file, whose bytes are taken as they are, without newline translation); n_unknown the
    count of characters in the piece outside a char vocabulary (mapped to its unk_id when
    unknown="unk"). The concatenated ids equal tokenizer.encode_ordinary(whole text)
    (endoftext="text"), or tokenizer.encode(whole text, allowed_special="all") ("special": the
    text's special-token strings, e.g. "<|endoftext|>", become their ids); "error" refuses a
    text holding one (tiktoken's default).

    Raises:
        UserError: a file is not UTF-8 (char and gpt2), with the byte offset; endoftext
            "error" and a special token's string in the text (one line: where).
        UnknownCharacterError: characters outside the vocabulary and unknown="error" (or no
            unk_token); positions count from the start of the source.
    """
    if tokenizer.kind == "byte" and isinstance(source, Path) and endoftext == "text":
        with open(source, "rb") as f:
            while data := f.read(chunk_bytes):
                yield np.frombuffer(data, dtype=np.uint8), 0
        return
    is_bpe, is_char = isinstance(tokenizer, GPT2Tokenizer), isinstance(tokenizer, CharTokenizer)
    specials = list(tokenizer.special_tokens) if endoftext != "text" else []
    modes = _SPECIAL_MODES[endoftext]
    carry, position = "", 0
    for chunk in [*_text_chunks(source, chunk_bytes), None]:
        if chunk is None:
            piece, carry = carry, ""
        else:
            text = carry + chunk
            cut = _bpe_cut(text) if is_bpe else _special_cut(text, specials)
            piece, carry = text[:cut], text[cut:]
        if not piece:
            continue
        try:
            ids = tokenizer.encode(piece, unknown, **modes)
        except UnknownCharacterError as e:
            raise e.shifted(position) from None
        except ValueError:  # a disallowed special token (tiktoken's message is several lines)
            at, token = min((piece.find(s), s) for s in specials if s in piece)
            raise UserError(
                f"{source} holds the special token {token!r} at character {position + at}; "
                f"read it as text (--endoftext text) or as the end-of-text token "
                f"(--endoftext special)"
            ) from None
        n_unknown = tokenizer.count_unknown(piece) if is_char and unknown == "unk" else 0
        position += len(piece)
        yield np.asarray(ids, dtype=np.int64), n_unknown


def encode_source(
    tokenizer: Tokenizer, source: Path | str, unknown: str = "error", chunk_bytes: int = CHUNK_BYTES
) -> tuple[np.ndarray, int]:
    """(ids, n_unknown) of a whole source, ids [N] in `token_dtype(tokenizer.vocab_size)`;
    see `iter_token_chunks`."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts, n_unknown = [np.empty(0, dtype)], 0
    for ids, n in iter_token_chunks(tokenizer, source, unknown, chunk_bytes):
        parts.append(ids.astype(dtype))
        n_unknown += n
    return np.concatenate(parts), n_unknown


def _file_info(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(CHUNK_BYTES):
            digest.update(data)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    if out.exists():
        if not overwrite:
            raise UserError(
                f"{out} already exists; pass --overwrite to replace it or choose another --out"
            )
        if any(out.iterdir()) and not is_token_dir(out):
            raise UserError(
                f"{out} is not a prepared token directory (no meta.json, "
                f"train.bin, val.bin); refusing to replace it, choose another --out"
            )


def _write_stream(
    path: Path,
    tok: Tokenizer,
    sources: list,
    dtype: np.dtype,
    chunk_bytes: int,
    eot: int | None,
    endoftext: str,
) -> int:
    """Write the token stream of `sources` to `path`, `eot` (unless None) after each source;
    returns its length in tokens."""
    n = 0
    with open(path, "wb") as f:
        for source in sources:
            for ids, _ in iter_token_chunks(tok, source, "error", chunk_bytes, endoftext):
                f.write(ids.astype(dtype).tobytes())
                n += len(ids)
            if eot is not None:
                f.write(np.array([eot], dtype).tobytes())
                n += 1
    return n


def _write_split(
    stage: Path, tok: Tokenizer, sources: list, dtype: np.dtype, val_fraction: float, **stream
) -> tuple[int, int]:
    """Write the token stream of `sources` to stage/train.bin, then move its last
    val_fraction to stage/val.bin; returns (train tokens, all tokens). `stream`: the
    keyword arguments of `_write_stream` after dtype."""
    n_total = _write_stream(stage / "train.bin", tok, sources, dtype, **stream)
    n_train = int((1.0 - val_fraction) * n_total)  # as data.split_ids
    if n_train == 0:
        raise UserError(
            f"the corpus has {n_total} tokens: too few for a train split "
            f"with val_fraction {val_fraction}"
        )
    with open(stage / "train.bin", "r+b") as f, open(stage / "val.bin", "wb") as g:
        f.seek(n_train * dtype.itemsize)
        shutil.copyfileobj(f, g)
        f.truncate(n_train * dtype.itemsize)
        os.fsync(f.fileno())
        os.fsync(g.fileno())
    return n_train, n_total


def _replace_dir(stage: Path, out: Path) -> None:
    """Rename the finished `stage` to `out`, replacing an existing `out` only once the new
    one is complete."""
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, old / "dir")
        os.replace(stage, out)
        shutil.rmtree(old)
    else:
        os.replace(stage, out)


def _describe(train: list, val: list, unused: list, dataset: str | None) -> list[dict]:
    """meta.json's sources: each file's path, bytes, sha256 and split."""
    if dataset is not None:
        return [{"dataset": f"wikitext/{dataset}", "split": "train"}]
    splits = [(train, "train"), (val, "val"), (unused, "not used (a test split)")]
    return [{**_file_info(p), "split": split} for files, split in splits for p in files]


def prepare(
    data: list[NotEmptyPath] | None = None,
    tokenizer: Literal["char", "byte", "gpt2"] = "char",
    out: NotEmptyPath | None = None,
    val_fraction: float = 0.1,
    overwrite: bool = False,
    dataset: str | None = None,
    eot: bool = False,
    endoftext: Literal["text", "special", "error"] = "text",
    *,
    chunk_bytes: int = CHUNK_BYTES,
    log=print,
) -> dict:
    """Tokenize text files into train.bin / val.bin.

    Stream text files through a tokenizer into DIR/train.bin (the first 1 - F of the token
    stream) and DIR/val.bin (the last F), np.uint16 or np.uint32, with DIR/meta.json; see
    decoderlm.data.prepare. A directory with train/valid/test files (train.txt, valid.txt,
    test.txt or WikiText's wiki.train.raw, ...) keeps its splits: train.bin from train,
    val.bin from valid, test never read. Each file is a document: with several files, the
    end-of-text token (GPT-2's <|endoftext|>, or --eot) follows each one.

    Args:
        data: UTF-8 text files, or directories (their *.txt files, or the splits of a
            train/valid/test directory), encoded in this order; repeat --data for each (give
            --data or --dataset).
        tokenizer: char: the corpus's characters (found in a first streaming pass) plus an
            unknown token U+FFFD appended after them; byte: the 256 UTF-8 bytes (any file);
            gpt2: GPT-2's BPE.
        out: the token directory to write (required).
        val_fraction: the last F of the tokens form val.bin, in [0, 1) (unused when the
            input has a valid file).
        overwrite: replace a token directory already in --out.
        dataset: e.g. wikitext-2-raw-v1 (train split) through the optional `datasets`
            package (needs the network; held in memory).
        eot: give a char or byte vocabulary the end-of-text token <|endoftext|> (its last
            id; GPT-2 has it always).
        endoftext: what the text's own <|endoftext|> strings are: text (ordinary
            characters, the default), special (the end-of-text token: document separators)
            or error (refused, tiktoken's default); special and error need an end-of-text
            token (gpt2, or --eot).
        chunk_bytes: bytes read (characters, for `dataset`) per chunk.
        log: prints the files read and the counts written.

    Returns:
        meta, the dict written to meta.json.

    Raises:
        UserError / MissingFileError: no `out`; not one of `data` and `dataset`; a missing or
            empty file, a file that is not UTF-8 (the byte offset; char and gpt2), a bad
            tokenizer or val_fraction, `out` a file or already there without `overwrite`, a
            corpus too short for a train split, endoftext "special" or "error" with a
            tokenizer without an end-of-text token, endoftext "error" and a file holding one,
            `dataset` without the `datasets` package.
    """
    if out is None:
        raise UserError("missing --out (the token directory to write)")
    one_of(data=data or None, dataset=dataset)
    if tokenizer not in TOKENIZER_KINDS:
        raise UserError(f"unknown tokenizer {tokenizer!r}; use one of {list(TOKENIZER_KINDS)}")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if endoftext not in _SPECIAL_MODES:
        raise UserError(f"endoftext must be one of {list(_SPECIAL_MODES)}, got {endoftext!r}")
    if endoftext != "text" and tokenizer != "gpt2" and not eot:  # nothing to make or refuse
        raise UserError(
            f"--endoftext {endoftext}: a {tokenizer} vocabulary has no end-of-text token; add --eot"
        )
    out = Path(out)
    _check_out(out, overwrite)
    train, val, unused = split_sources(data) if dataset is None else ([], [], [])
    sources = [_load_hf_wikitext(dataset)] if dataset is not None else [*train, *val]
    infos = _describe(train, val, unused, dataset)

    def all_text():
        for source in sources:
            yield from _text_chunks(source, chunk_bytes)

    tok = make_tokenizer(
        tokenizer, all_text() if tokenizer == "char" else None, DEFAULT_UNK_TOKEN, eot
    )
    separator = tok.eot_token if len(sources) > 1 else None
    dtype = token_dtype(tok.vocab_size)
    stream = dict(chunk_bytes=chunk_bytes, eot=separator, endoftext=endoftext)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = make_temp_dir(out.parent, f".{out.name}.", ".partial")
    try:
        if val:
            n_train = _write_stream(stage / "train.bin", tok, train, dtype, **stream)
            n_total = n_train + _write_stream(stage / "val.bin", tok, val, dtype, **stream)
            split = "train.bin = the train files, val.bin = the validation files"
        else:
            n_train, n_total = _write_split(stage, tok, sources, dtype, val_fraction, **stream)
            split = (
                "train.bin = the first int((1 - val_fraction) * N) tokens of the "
                "stream, val.bin = the rest"
            )
        meta = {
            "format": "decoderlm-tokens",
            "version": 1,
            "tokenizer": tok.to_dict(),
            "vocab_size": tok.vocab_size,
            "dtype": dtype.name,
            "byte_order": "little",
            "tokens": {"train": n_train, "val": n_total - n_train},
            "val_fraction": None if val else val_fraction,
            "split": split,
            "documents": {"count": len(sources), "separator": separator, "endoftext": endoftext},
            "sources": infos,
            "unknown_characters": 0,
            "newlines": "as in the files"
            if tokenizer == "byte" and endoftext == "text"
            else "universal: \\r\\n and \\r read as \\n",
        }
        write_json(stage / META_NAME, meta)
        _replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for info in infos:
        log(f"{info.get('path', info.get('dataset'))}: {info['split']}")
    separated = f", end-of-text id {separator} after each" if separator is not None else ""
    log(
        f"wrote {out}/: {n_train:,} train + {n_total - n_train:,} val tokens ({tok.kind}, "
        f"vocab_size {tok.vocab_size}, {dtype.name}) from {len(sources)} document(s){separated}"
    )
    if val_fraction == 0 and not val:
        log(
            "note: --val-fraction 0 leaves val.bin empty; `decoderlm train` needs a "
            "validation split and will refuse this directory"
        )
    return meta
