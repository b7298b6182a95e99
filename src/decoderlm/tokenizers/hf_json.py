"""Hugging Face `tokenizer.json` documents for the char, byte and GPT-2 tokenizers.

A run directory's tokenizer.json is in the format of the `tokenizers` library (the file
`transformers.PreTrainedTokenizerFast(tokenizer_file=...)` and `AutoTokenizer` read), built
here as plain JSON so writing it needs neither package. Every tokenizer is a BPE model:

    char    vocab = the characters (id i = i-th character), no merges, no pre-tokenizer; the
            unknown token (if any) is the model's unk_token; decoder Fuse (ids -> characters
            joined with nothing)
    byte    vocab = the 256 bytes in GPT-2's byte-to-unicode alphabet, no merges; ByteLevel
            pre-tokenizer without its regex and ByteLevel decoder
    gpt2    OpenAI's encoder.json and vocab.bpe merges with the ByteLevel pre-tokenizer (GPT-2's
            regex) and decoder: the layout of Hugging Face's own GPT-2 tokenizer.json

Special tokens are "added_tokens" with "special": true. Hugging Face matches their strings in
any text by default, where this project's `Tokenizer.encode` follows tiktoken (an error unless
allowed); `encode(text, allowed_special="all")` gives Hugging Face's ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

__all__ = ["byte_to_unicode", "hf_tokenizer_json"]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (Radford et al. 2019, encoder.py):
    the printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other
    68 bytes, in increasing order, take the characters U+0100, U+0101, ..."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(0x100 + n) for n, b in enumerate(others)})
    return table


def _added(special_tokens: dict[str, int]) -> list[dict]:
    return [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s, i in special_tokens.items()
    ]


def _byte_level(use_regex: bool) -> dict:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _document(
    vocab: dict[str, int],
    merges: list[str],
    special_tokens: dict[str, int],
    unk_token: str | None = None,
    pre_tokenizer: dict | None = None,
    decoder: dict | None = None,
) -> dict:
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(special_tokens),
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": decoder,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk_token,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def hf_tokenizer_json(
    kind: str,
    special_tokens: dict[str, int],
    chars: list[str] | None = None,
    unk_token: str | None = None,
    bpe_dir: Path | None = None,
) -> dict:
    """The tokenizer.json document (a dict to write as JSON) of a tokenizer.

    Args:
        kind: "char" | "byte" | "gpt2".
        special_tokens: {string: id} of its special tokens.
        chars, unk_token: a char tokenizer's vocabulary and unknown token.
        bpe_dir: GPT-2's directory with encoder.json and vocab.bpe.

    Raises:
        UserError: an unknown kind.
    """
    if kind == "char":
        vocab = {c: i for i, c in enumerate(chars or [])}
        return _document(vocab, [], special_tokens, unk_token, decoder={"type": "Fuse"})
    if kind == "byte":
        vocab = {c: b for b, c in byte_to_unicode().items()}
        return _document(vocab, [], special_tokens, None, _byte_level(False), _byte_level(False))
    if kind == "gpt2" and bpe_dir is not None:
        vocab = json.loads((bpe_dir / "encoder.json").read_text(encoding="utf-8"))
        lines = (bpe_dir / "vocab.bpe").read_text(encoding="utf-8").splitlines()
        merges = [line for line in lines[1:] if line]  # the first line is "#version: 0.2"
        return _document(vocab, merges, special_tokens, None, _byte_level(True), _byte_level(True))
    raise UserError(f"no Hugging Face tokenizer.json for a {kind!r} tokenizer")
