"""`HFTokenizer`: a tokenizer of the Hugging Face `tokenizers` library (a tokenizer.json) behind
decoderlm's `Tokenizer` interface, with what a model's other tokenizer files say about it: its
begin-of-text id, its end-of-text ids, whether a prompt starts with BOS, its chat template.

It tokenizes the models decoderlm loads from Hugging Face directories (`hf_dir.py`) and GGUF
files (`gguf_vocab.py`) that are not GPT-2's vocabulary. Its special tokens are the added
tokens marked special; encode follows tiktoken's allowed_special / disallowed_special rules as
every decoderlm tokenizer does (`Tokenizer.encode`), so encode(text, allowed_special="all")
gives the ids Hugging Face's `Tokenizer.encode(text, add_special_tokens=False)` gives. Added
tokens not marked special (llama.cpp's "user-defined" tokens) are matched in any text, as both
Hugging Face and llama.cpp match them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path

from ..errors import MissingFileError, UserError
from .base import (
    HF_TOKENIZER_NAME,
    TOKENIZER_NAME,
    Tokenizer,
    _special_sets,
    checked_ids,
    malformed_tokenizer_error,
)

__all__ = ["HFTokenizer", "tokenizers_package"]


def tokenizers_package():
    """The Hugging Face `tokenizers` package (the [models] extra).

    Raises:
        UserError: it is not installed (one line saying how to install it).
    """
    try:
        import tokenizers
    except ImportError as e:
        raise UserError(
            f"this model's tokenizer needs Hugging Face's tokenizers package: "
            f"pip install 'decoderlm[models]' ({e})"
        ) from None
    return tokenizers


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (Hugging Face's library) as a decoderlm `Tokenizer`.

    Args:
        tokenizer: a `tokenizers.Tokenizer`, or the path of a tokenizer.json file. It is copied
            (the caller's object is left as it is), without truncation or padding.
        bos_token_id: the begin-of-text id, or None.
        eos_token_ids: the end-of-text ids, the model's own end-of-sequence token first
            (Hugging Face: tokenizer_config.json's eos_token, then generation_config.json's
            eos_token_id, which may be a list; GGUF: tokenizer.ggml.eos_token_id, then the
            end-of-turn ids).
        add_bos: whether a prompt starts with `bos_token_id` (transformers' and llama.cpp's
            add_bos_token). `encode` never adds it; the caller prepends it.
        chat_template: the Jinja chat template, or None.

    vocab_size is the largest id + 1, added tokens included (ids the vocabulary skips decode
    to nothing). `eot_token` is the first of `eos_token_ids` (where text generation stops),
    or "<|endoftext|>"'s id when there are none. `to_dict()` holds the whole tokenizer.json
    document (key "tokenizer") and the four fields above, so a run directory, a token
    directory's meta.json and a GGUF export rebuild it with no other file.

    Raises:
        UserError: the tokenizers package is missing, an unreadable tokenizer.json, or an id
            (bos or eos) outside the vocabulary.
    """

    kind = "hf"

    def __init__(
        self,
        tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        tokenizers = tokenizers_package()
        if isinstance(tokenizer, str | Path):
            document = _read_document(Path(tokenizer))
        elif isinstance(tokenizer, tokenizers.Tokenizer):
            document = tokenizer.to_str()
        else:
            raise TypeError(f"expected a tokenizers.Tokenizer or a path, got {type(tokenizer)}")
        self.tokenizer = _from_document(tokenizers, document, "tokenizer")
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self._lock = threading.Lock()  # encode_special_tokens is set around each encode
        added = self.tokenizer.get_added_tokens_decoder()
        self._special = {t.content: i for i, t in sorted(added.items()) if t.special}
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self._vocab_size = max(ids, default=-1) + 1
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        for name, i in [("bos_token_id", self.bos_token_id)] + [
            ("eos_token_ids", i) for i in self.eos_token_ids
        ]:
            if i is not None and not 0 <= i < self._vocab_size:
                raise UserError(f"{name} {i} is outside the vocabulary [0, {self._vocab_size})")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        """{string: id} of the added tokens marked special."""
        return dict(self._special)

    @property
    def eot_token(self) -> int | None:
        """The model's end-of-text id: the first of `eos_token_ids`, else "<|endoftext|>"'s id
        (None without either)."""
        return self.eos_token_ids[0] if self.eos_token_ids else super().eot_token

    def _encode(self, text, unknown, allowed_special, disallowed_special) -> list[int]:
        """The library's own encode when every special token is allowed (it honours each
        added token's lstrip / rstrip flags), else `Tokenizer._encode`'s cut around the
        allowed ones; `unknown` is unused."""
        allowed, disallowed = _special_sets(self._special, allowed_special, disallowed_special)
        if not disallowed and allowed >= self._special.keys():
            return self._ids(text, special=True)
        return super()._encode(text, unknown, allowed_special, disallowed_special)

    def _encode_ordinary(self, text: str, unknown: str) -> list[int]:
        return self._ids(text, special=False)

    def _ids(self, text: str, special: bool) -> list[int]:
        """The library's ids of `text` without its post-processor (no BOS/EOS added);
        special: match the special tokens' strings (else they are ordinary text)."""
        with self._lock:
            self.tokenizer.encode_special_tokens = not special
            return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of token ids, special tokens included as their strings; bytes that do not
        form valid UTF-8 become U+FFFD.

        Raises:
            UserError: an id is outside [0, vocab_size).
        """
        ids = checked_ids(ids, self._vocab_size, "this tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def to_hf_json(self) -> dict:
        """The tokenizer.json document of the wrapped tokenizer."""
        return json.loads(self.tokenizer.to_str())

    def _saved_fields(self) -> dict:
        return {
            "tokenizer": self.to_hf_json(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "tokenizer") -> HFTokenizer:
        """The tokenizer `to_dict()` described: {"type": "hf", "tokenizer": {tokenizer.json},
        "bos_token_id": int | None, "eos_token_ids": [int], "add_bos": bool,
        "chat_template": str | None}.

        Raises:
            UserError: malformed fields (the message names `source`).
        """
        bos, eos = data.get("bos_token_id"), data.get("eos_token_ids", [])
        template, add_bos = data.get("chat_template"), data.get("add_bos", False)
        if (
            not isinstance(data.get("tokenizer"), dict)
            or not (bos is None or _is_id(bos))
            or not (isinstance(eos, list) and all(map(_is_id, eos)))
            or not isinstance(add_bos, bool)
            or not (template is None or isinstance(template, str))
        ):
            raise malformed_tokenizer_error(source, data)
        tokenizer = _from_document(tokenizers_package(), json.dumps(data["tokenizer"]), source)
        return cls(
            tokenizer, bos_token_id=bos, eos_token_ids=eos, add_bos=add_bos, chat_template=template
        )

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> HFTokenizer:
        """The tokenizer saved in `directory` by `save_pretrained` (decoderlm_tokenizer.json),
        or, in a Hugging Face directory without that file, the one its tokenizer.json,
        tokenizer_config.json and generation_config.json describe (`read_hf_tokenizer`).

        Raises:
            MissingFileError: neither file. UserError: another kind, or a malformed file.
        """
        if (Path(directory) / TOKENIZER_NAME).is_file():
            return super().from_pretrained(directory)
        from .hf_dir import read_hf_tokenizer

        return read_hf_tokenizer(directory)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(vocab_size={self._vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids}, add_bos={self.add_bos})"
        )


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_document(path: Path) -> str:
    if not path.is_file():
        raise MissingFileError(
            f"{path} not found; a Hugging Face tokenizer is a {HF_TOKENIZER_NAME}"
        )
    return path.read_text(encoding="utf-8")


def _from_document(tokenizers, document: str, source: str):
    """A `tokenizers.Tokenizer` from tokenizer.json text. Raises UserError: it does not load."""
    try:
        return tokenizers.Tokenizer.from_str(document)
    except Exception as e:  # the library raises its own Exception for a malformed document
        raise UserError(
            f"{source}: not a tokenizer.json the tokenizers package reads ({e})"
        ) from None
