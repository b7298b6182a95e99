"""The interface every tokenizer has (`Tokenizer`: text <-> token ids), its error for
characters outside a vocabulary, and the special-token rules the tokenizers share.

Special tokens follow tiktoken: every tokenizer has `special_tokens` ({string: id}, empty when
none) and `eot_token` (the id of END_OF_TEXT = "<|endoftext|>", or None). GPT-2 always has
it (50256); a char or byte tokenizer has it only when built with `special_tokens=[END_OF_TEXT]`
(it then takes the next id after the ordinary ones). `encode(text, allowed_special=...,
disallowed_special=...)` has tiktoken's meaning and defaults: by default text that contains a
special token's string is an error (UserError, a ValueError); allowed_special="all" (or a set
of strings) turns those strings into their ids; disallowed_special=() encodes them as ordinary text
(`encode_ordinary(text)` is the same). Hugging Face tokenizers differ: they turn a special
token's string in the text into its id by default.

The tokenizers themselves: `CharTokenizer` (char.py), `ByteTokenizer` (byte.py),
`GPT2Tokenizer` (gpt2.py), `HFTokenizer` (huggingface.py: Hugging Face's tokenizers library,
for the models read from Hugging Face directories and GGUF files). Each is saved by
`save_pretrained` and read back by its class's `from_pretrained` (through
`read_tokenizer_dict`, here); reading one of any kind: load.py.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from pathlib import Path

from ..errors import UserError
from ..files import read_json, write_json
from .hf_json import hf_tokenizer_json

__all__ = [
    "DEFAULT_UNK_TOKEN",
    "END_OF_TEXT",
    "HF_TOKENIZER_NAME",
    "TOKENIZER_KINDS",
    "TOKENIZER_NAME",
    "Tokenizer",
    "UnknownCharacterError",
    "checked_ids",
    "disallowed_special_error",
    "malformed_tokenizer_error",
    "numbered_specials",
    "read_tokenizer_dict",
]

TOKENIZER_NAME = "decoderlm_tokenizer.json"
# Hugging Face's format; a run directory of the first format holds {"type": ...} under this name
HF_TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_KINDS = ("char", "byte", "gpt2")  # the kinds `make_tokenizer` builds (and "hf", read)
END_OF_TEXT = "<|endoftext|>"
DEFAULT_UNK_TOKEN = "\ufffd"  # U+FFFD REPLACEMENT CHARACTER, what decoders print for "unknown"


class UnknownCharacterError(UserError):
    """Text holds characters that are not in the tokenizer's vocabulary.

    Attributes:
        unknown: list of (character, first position in the text) pairs, in order of position.
    """

    def __init__(self, unknown: list[tuple[str, int]], hint: str = ""):
        self.unknown, self.hint = unknown, hint
        shown = ", ".join(f"{c!r} at position {i}" for c, i in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        hint = hint or "remove them from the text or train on a corpus that contains them"
        super().__init__(
            f"{len(unknown)} character(s) not in the vocabulary: {shown}{more}; {hint}"
        )

    def shifted(self, offset: int) -> UnknownCharacterError:
        """The same error with every position moved by `offset` (a piece of a longer text)."""
        return UnknownCharacterError([(c, i + offset) for c, i in self.unknown], self.hint)


class Tokenizer:
    """The interface every tokenizer has.

    encode(text, unknown="error", *, allowed_special=(), disallowed_special="all") ->
    list[int]; encode_ordinary(text); decode(ids) -> str; vocab_size (int); kind ("char" |
    "byte" | "gpt2" | "hf"); special_tokens ({string: id}, empty when none); eot_token (the id of
    "<|endoftext|>", or None); count_unknown(text) -> int; save_pretrained(directory);
    from_pretrained(directory); to_dict() -> {"type": kind, ...the fields that rebuild it};
    from_dict(data, source) (its inverse, on each concrete class).
    """

    kind = ""

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def special_tokens(self) -> dict[str, int]:
        """{string: id} of the special tokens (tiktoken's `_special_tokens`); {} when none."""
        return {}

    @property
    def eot_token(self) -> int | None:
        """The id of the end-of-text token "<|endoftext|>" (tiktoken's name), None without one."""
        return self.special_tokens.get(END_OF_TEXT)

    def encode(
        self,
        text: str,
        unknown: str = "error",
        *,
        allowed_special: AbstractSet[str] | str = frozenset(),
        disallowed_special: Collection[str] | str = "all",
    ) -> list[int]:
        """Token ids of `text`, ints in [0, vocab_size).

        Args:
            unknown: "error" (raise UnknownCharacterError on characters outside the
                vocabulary) or "unk" (map them to the unknown token); only a CharTokenizer
                has unknowns.
            allowed_special: "all" or a set of special-token strings that become their ids
                where the text holds them (tiktoken's meaning; default: none).
            disallowed_special: "all" (the default: every special token not allowed) or the
                strings whose presence in the text is an error; () encodes them as ordinary
                text.

        Raises:
            UserError (a ValueError, as tiktoken's): the text holds a disallowed special
                token's string.
        """
        _check_unknown_mode(unknown)
        return self._encode(text, unknown, allowed_special, disallowed_special)

    def _encode(self, text, unknown, allowed_special, disallowed_special) -> list[int]:
        """`encode` after its checks: the special tokens cut out, the rest by
        `_encode_ordinary`."""
        ids: list[int] = []
        at = 0  # where the piece starts in the text
        for piece, special in _split_special(
            text, self.special_tokens, allowed_special, disallowed_special
        ):
            try:
                ids += [special] if special is not None else self._encode_ordinary(piece, unknown)
            except UnknownCharacterError as e:
                raise e.shifted(at) from None
            at += len(piece)
        return ids

    def encode_ordinary(self, text: str, unknown: str = "error") -> list[int]:
        """Token ids of `text` with special-token strings taken as ordinary text (tiktoken's
        `encode_ordinary`; the same as encode(text, disallowed_special=()))."""
        return self.encode(text, unknown, disallowed_special=())

    def _encode_ordinary(self, text: str, unknown: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def count_unknown(self, text: str) -> int:
        """How many characters of `text` are outside the vocabulary (0 unless char-level)."""
        return 0

    def _saved_fields(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        """{"type": kind, ...fields}: what tokenizer.json and a token directory's meta.json
        hold; `tokenizer_from_dict` rebuilds the tokenizer from it."""
        return {"type": self.kind, **self._saved_fields()}

    @classmethod
    def from_dict(cls, data: dict, source: str = "tokenizer") -> Tokenizer:
        """The tokenizer of this class that `to_dict()`'s output describes.

        Raises:
            UserError: malformed fields (the message names `source`).
        """
        raise NotImplementedError

    def to_hf_json(self) -> dict:
        """This tokenizer as a Hugging Face tokenizer.json document (see
        `decoderlm.tokenizers.hf_json.hf_tokenizer_json`)."""
        return hf_tokenizer_json(self.kind, self.special_tokens, **self._hf_fields())

    def _hf_fields(self) -> dict:
        return {}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write decoderlm_tokenizer.json (`to_dict()`) and tokenizer.json (`to_hf_json()`)
        into `directory` (created if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / HF_TOKENIZER_NAME, self.to_hf_json())
        write_json(directory / TOKENIZER_NAME, self.to_dict())

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        """Read the tokenizer of this class saved in `directory` (`save_pretrained`; any
        kind: `decoderlm.tokenizers.read_tokenizer`).

        Raises:
            MissingFileError: no tokenizer file. UserError: it holds another kind, or is
                malformed.
        """
        data, source = read_tokenizer_dict(directory)
        kind = data.get("type") if isinstance(data, dict) else None
        if not cls.kind:  # the interface itself: any kind is `read_tokenizer`'s job
            raise UserError("Tokenizer.from_pretrained reads one kind; use read_tokenizer")
        if kind != cls.kind:
            raise UserError(f"{directory} holds a {kind!r} tokenizer, not {cls.kind!r}")
        return cls.from_dict(data, source)


def read_tokenizer_dict(directory: str | Path) -> tuple[object, str]:
    """(the document `to_dict()` wrote, the path it came from) of the tokenizer saved in
    `directory`: its decoderlm_tokenizer.json, or, where that file is missing, a
    tokenizer.json that holds {"type": ...} (a run directory of the first format).

    Raises:
        MissingFileError: neither file in `directory`.
        UserError: a file that is not JSON, or the directory has only a Hugging Face
            tokenizer.json (not one of ours).
    """
    path, old = Path(directory) / TOKENIZER_NAME, Path(directory) / HF_TOKENIZER_NAME
    if not path.is_file() and old.is_file():
        data = read_json(old)
        if isinstance(data, dict) and "type" not in data and "model" in data:
            raise UserError(
                f"{old} is a Hugging Face tokenizer and {path.name} is missing; "
                f"decoderlm reads its own {path.name} (written with every run)"
            )
        return data, str(old)
    return read_json(path), str(path)


def malformed_tokenizer_error(source: str, data) -> UserError:
    """The error for a tokenizer document that names an unknown type or has bad fields."""
    kind = data.get("type") if isinstance(data, dict) else None
    return UserError(f"{source}: unknown or malformed tokenizer (type {kind!r})")


def _check_unknown_mode(unknown: str) -> None:
    if unknown not in ("error", "unk"):
        raise UserError(f"unknown must be 'error' or 'unk', got {unknown!r}")


def disallowed_special_error(token: str) -> UserError:
    """The error tiktoken raises for a disallowed special token's string in the text."""
    return UserError(
        f"Encountered text corresponding to disallowed special token {token!r}.\n"
        "If you want this text to be encoded as a special token, pass it to "
        f"`allowed_special`, e.g. `allowed_special={{{token!r}, ...}}`.\n"
        "If you want this text to be encoded as normal text, disable the check for this "
        f"token by passing `disallowed_special=(enc.special_tokens_set - {{{token!r}}})`.\n"
        "To disable this check for all special tokens, pass `disallowed_special=()`.\n"
    )


def _special_sets(
    special_tokens: dict[str, int],
    allowed_special: AbstractSet[str] | str,
    disallowed_special: Collection[str] | str,
) -> tuple[frozenset[str], frozenset[str]]:
    """(allowed, disallowed) as tiktoken resolves them: "all" means every special token, and
    disallowed "all" leaves out the allowed ones."""
    names = frozenset(special_tokens)
    allowed = names if allowed_special == "all" else frozenset(allowed_special)
    disallowed = names - allowed if disallowed_special == "all" else frozenset(disallowed_special)
    return allowed, disallowed


def _split_special(
    text: str,
    special_tokens: dict[str, int],
    allowed_special: AbstractSet[str] | str,
    disallowed_special: Collection[str] | str,
) -> list[tuple[str, int | None]]:
    """`text` cut into (ordinary piece, None) and (special string, its id) parts in order.

    Raises:
        UserError: the text holds a disallowed special token's string (tiktoken's message).
    """
    allowed, disallowed = _special_sets(special_tokens, allowed_special, disallowed_special)
    if disallowed and (m := _alternation(disallowed).search(text)):
        raise disallowed_special_error(m.group())
    allowed &= frozenset(special_tokens)
    if not allowed:
        return [(text, None)]
    parts: list[tuple[str, int | None]] = []
    start = 0
    for m in _alternation(allowed).finditer(text):
        parts += [(text[start : m.start()], None), (m.group(), special_tokens[m.group()])]
        start = m.end()
    parts.append((text[start:], None))
    return [(piece, i) for piece, i in parts if piece or i is not None]


def _alternation(strings: AbstractSet[str]) -> re.Pattern:
    """A regex matching any of `strings`, the longest first where one is a prefix of another."""
    return re.compile("|".join(map(re.escape, sorted(strings, key=len, reverse=True))))


def numbered_specials(strings: Iterable[str], first_id: int) -> dict[str, int]:
    """{string: first_id + i} of special-token strings.

    Raises:
        UserError: a string is empty or not a str, or one is given twice.
    """
    strings = list(strings)
    if any(not isinstance(x, str) or not x for x in strings):
        raise UserError(f"special tokens must be non-empty strings, got {strings!r}")
    if len(set(strings)) != len(strings):
        raise UserError(f"special tokens {strings!r} hold duplicates")
    return {x: first_id + i for i, x in enumerate(strings)}


def checked_ids(ids, vocab_size: int, name: str) -> list[int]:
    """ids (a list or 1-D tensor) as ints. Raises UserError: one is outside [0, vocab_size)."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"token ids {bad[:5]} are outside [0, {vocab_size}) for {name}")
    return ids
