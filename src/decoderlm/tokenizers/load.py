"""A saved tokenizer of any kind read back, and a new one built by kind.

A tokenizer is saved with the model as decoderlm_tokenizer.json ({"type": kind, ...fields}),
so a checkpoint always decodes with its own vocabulary, and beside it as tokenizer.json in
Hugging Face's format (see `decoderlm.tokenizers.hf_json.hf_tokenizer_json`:
`transformers.PreTrainedTokenizerFast(tokenizer_file=...)` gives the same ids).
`read_tokenizer` reads decoderlm_tokenizer.json, or, in a run directory of the first format
(which has none), the {"type": ...} document it keeps under tokenizer.json;
`tokenizer_from_dict` picks the class a document names; `make_tokenizer` builds one by kind.
Loading the tokenizer of any model source (a run, a Hugging Face directory, a GGUF file):
`decoderlm.io.load.load_tokenizer`.
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
    malformed_tokenizer_error,
    read_tokenizer_dict,
)
from .byte import ByteTokenizer
from .char import CharTokenizer
from .gpt2 import GPT2_EOT_ID, GPT2Tokenizer
from .huggingface import HFTokenizer

__all__ = ["make_tokenizer", "read_end_of_text_id", "read_tokenizer", "tokenizer_from_dict"]

_CLASSES = {cls.kind: cls for cls in (CharTokenizer, ByteTokenizer, GPT2Tokenizer, HFTokenizer)}


def tokenizer_from_dict(data, source: str = "tokenizer") -> Tokenizer:
    """The tokenizer described by `to_dict()`'s output ({"type": "char", "chars": [...],
    "unk_token": ...} | {"type": "byte"} | {"type": "gpt2"} | {"type": "hf", "tokenizer": ...}).

    Raises:
        UserError: an unknown type or malformed fields (the message names `source`).
    """
    kind = data.get("type") if isinstance(data, dict) else None
    if kind not in _CLASSES:
        raise malformed_tokenizer_error(source, data)
    return _CLASSES[kind].from_dict(data, source)


def read_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in a directory: char, byte, gpt2 or hf, from its
    decoderlm_tokenizer.json, or, where that file is missing, from a tokenizer.json that holds
    {"type": ...} (a run directory of the first format).

    Raises:
        MissingFileError: neither file in `directory`.
        UserError: the file names an unknown tokenizer type or is malformed, or the
            directory has only a Hugging Face tokenizer.json (not one of ours).
    """
    return tokenizer_from_dict(*read_tokenizer_dict(directory))


def read_end_of_text_id(directory: str | Path) -> int | None:
    """The id of <|endoftext|> in the tokenizer saved in `directory` (see `read_tokenizer`),
    or None when the directory has none of ours (none, or only a Hugging Face tokenizer.json)
    or its vocabulary has no such token. A GPT-2 tokenizer's is known without building its
    BPE tables.

    Raises:
        UserError: the tokenizer file is malformed.
    """
    path, old = Path(directory) / TOKENIZER_NAME, Path(directory) / HF_TOKENIZER_NAME
    if not path.is_file() and not old.is_file():
        return None
    data = read_json(path if path.is_file() else old)
    if not isinstance(data, dict) or "type" not in data:  # only Hugging Face's tokenizer.json
        return None if not path.is_file() else read_tokenizer(directory).eot_token
    if data["type"] == "gpt2":
        return GPT2_EOT_ID
    return read_tokenizer(directory).eot_token


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
        UserError: an unknown kind, or "char" without text.
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
