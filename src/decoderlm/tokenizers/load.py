"""Saving and loading tokenizers, and building one by kind.

A tokenizer is saved with the model as decoderlm_tokenizer.json ({"type": kind, ...fields}),
so a checkpoint always decodes with its own vocabulary, and beside it as tokenizer.json in
Hugging Face's format (see `hf_tokenizer`: `transformers.PreTrainedTokenizerFast(
tokenizer_file=...)` gives the same ids). `load_tokenizer` reads decoderlm_tokenizer.json, or,
in a run directory of the first format (which has none), the {"type": ...} document it keeps
under tokenizer.json; `make_tokenizer` builds one by kind.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import UserError
from ..files import read_json
from .base import (
    DEFAULT_UNK_TOKEN,
    END_OF_TEXT,
    HF_TOKENIZER_NAME,
    TOKENIZER_KINDS,
    TOKENIZER_NAME,
    Tokenizer,
)
from .byte import ByteTokenizer
from .char import CharTokenizer
from .gpt2 import GPT2_EOT_ID, GPT2Tokenizer

__all__ = ["end_of_text_id", "load_tokenizer", "make_tokenizer", "tokenizer_from_dict"]


def tokenizer_from_dict(data, source: str = "tokenizer") -> Tokenizer:
    """The tokenizer described by `to_dict()`'s output ({"type": "char", "chars": [...],
    "unk_token": ...} | {"type": "byte"} | {"type": "gpt2"}).

    Raises:
        ValueError: an unknown type or malformed fields (the message names `source`).
    """
    kind = data.get("type") if isinstance(data, dict) else None
    special = data.get("special_tokens", []) if isinstance(data, dict) else None
    if not isinstance(special, list):
        kind = None
    if kind == "char" and isinstance(data.get("chars"), list):
        return CharTokenizer(data["chars"], data.get("unk_token"), special)
    if kind == "byte":
        return ByteTokenizer(special)
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"{source}: unknown or malformed tokenizer (type {kind!r})")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Load the tokenizer saved in a directory: char, byte or gpt2, from its
    decoderlm_tokenizer.json, or, where that file is missing, from a tokenizer.json that holds
    {"type": ...} (a run directory of the first format).

    Raises:
        FileNotFoundError: neither file in `directory`.
        ValueError: the file names an unknown tokenizer type or is malformed, or the
            directory has only a Hugging Face tokenizer.json (not one of ours).
    """
    path, old = Path(directory) / TOKENIZER_NAME, Path(directory) / HF_TOKENIZER_NAME
    if not path.is_file() and old.is_file():
        data = read_json(old)
        if isinstance(data, dict) and "type" not in data and "model" in data:
            raise UserError(
                f"{old} is a Hugging Face tokenizer and {path.name} is missing; "
                f"decoderlm reads its own {path.name} (written with every run)"
            )
        return tokenizer_from_dict(data, str(old))
    return tokenizer_from_dict(read_json(path), str(path))


def end_of_text_id(directory: str | Path) -> int | None:
    """The id of <|endoftext|> in the tokenizer saved in `directory` (see `load_tokenizer`),
    or None when the directory has none of ours (none, or only a Hugging Face tokenizer.json)
    or its vocabulary has no such token. A GPT-2 tokenizer's is known without building its
    BPE tables.

    Raises:
        ValueError: the tokenizer file is malformed.
    """
    path, old = Path(directory) / TOKENIZER_NAME, Path(directory) / HF_TOKENIZER_NAME
    if not path.is_file() and not old.is_file():
        return None
    data = read_json(path if path.is_file() else old)
    if not isinstance(data, dict) or "type" not in data:
        return None if not path.is_file() else load_tokenizer(directory).eot_token
    if data["type"] == "gpt2":
        return GPT2_EOT_ID
    return load_tokenizer(directory).eot_token


def make_tokenizer(
    kind: str,
    text: str | Iterable[str] | None = None,
    unk_token: str | None = DEFAULT_UNK_TOKEN,
    eot: bool = False,
) -> Tokenizer:
    """A new tokenizer of `kind` ("char" | "byte" | "gpt2").

    text: the corpus (a string or an iterable of chunks) a "char" vocabulary is built from;
        unused by the others. unk_token: the char vocabulary's unknown token (default U+FFFD,
        appended after the corpus's characters; None for none), see `CharTokenizer.from_text`.
    eot: give a char or byte vocabulary the end-of-text token END_OF_TEXT as its last id
        (GPT-2 always has it).

    Raises:
        ValueError: an unknown kind, or "char" without text.
    """
    special = [END_OF_TEXT] if eot else []
    if kind == "char":
        if text is None:
            raise UserError("a char tokenizer is built from text; pass text")
        return CharTokenizer.from_text(text, unk_token, special)
    if kind == "byte":
        return ByteTokenizer(special)
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"unknown tokenizer kind {kind!r}; use one of {list(TOKENIZER_KINDS)}")
