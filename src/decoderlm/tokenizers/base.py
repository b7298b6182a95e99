"""Tokenizers: text <-> token ids, behind one interface (`Tokenizer`).

`CharTokenizer` is the seed experiment's character-level tokenizer: the vocabulary is the sorted
set of characters of the corpus (code-point order), id i is the i-th character; optionally one
more entry, an explicit unknown token, after them (see `CharTokenizer.from_text`).
`ByteTokenizer` has 256 ids, the bytes of the UTF-8 encoding: every string encodes.
`GPT2Tokenizer` is OpenAI's GPT-2 byte-level BPE (50,257 ids, `<|endoftext|>` = 50256), run by
tiktoken from the encoder.json and vocab.bpe files the package ships (no network).
A tokenizer is saved with the model as decoderlm_tokenizer.json ({"type": kind, ...fields}),
so a checkpoint always decodes with its own vocabulary, and beside it as tokenizer.json in
Hugging Face's format (see `hf_tokenizer`: `transformers.PreTrainedTokenizerFast(
tokenizer_file=...)` gives the same ids). `load_tokenizer` reads decoderlm_tokenizer.json, or
the tokenizer.json of a directory written before it existed ({"type": ...} under that name);
`make_tokenizer` builds one by kind.

Special tokens follow tiktoken: every tokenizer has `special_tokens` ({string: id}, empty when
none) and `eot_token` (the id of END_OF_TEXT = "<|endoftext|>", or None). GPT-2 always has
it (50256); a char or byte tokenizer has it only when built with `special_tokens=[END_OF_TEXT]`
(it then takes the next id after the ordinary ones). `encode(text, allowed_special=...,
disallowed_special=...)` has tiktoken's meaning and defaults: by default text that contains a
special token's string is an error (ValueError); allowed_special="all" (or a set of strings)
turns those strings into their ids; disallowed_special=() encodes them as ordinary text
(`encode_ordinary(text)` is the same). Hugging Face tokenizers differ: they turn a special
token's string in the text into its id by default.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from pathlib import Path

from ..errors import MissingFileError, UserError
from ..files import read_json, write_json
from .hf_json import hf_tokenizer_json

__all__ = [
    "DEFAULT_UNK_TOKEN",
    "END_OF_TEXT",
    "TOKENIZER_KINDS",
    "ByteTokenizer",
    "CharTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "UnknownCharacterError",
    "load_tokenizer",
    "make_tokenizer",
    "tokenizer_from_dict",
]

TOKENIZER_NAME = "decoderlm_tokenizer.json"
HF_TOKENIZER_NAME = "tokenizer.json"  # Hugging Face's format; our own format before issue 11
TOKENIZER_KINDS = ("char", "byte", "gpt2")
END_OF_TEXT = "<|endoftext|>"
DEFAULT_UNK_TOKEN = "\ufffd"  # U+FFFD REPLACEMENT CHARACTER, what decoders print for "unknown"
GPT2_BPE_DIR = Path(__file__).parent / "bpe"
# sha256 of OpenAI's originals, as tiktoken pins them
_GPT2_HASHES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


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
    "byte" | "gpt2"); special_tokens ({string: id}, empty when none); eot_token (the id of
    "<|endoftext|>", or None); count_unknown(text) -> int; save_pretrained(directory);
    from_pretrained(directory); to_dict() -> {"type": kind, ...the fields that rebuild it}.
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
            ValueError: the text holds a disallowed special token's string (tiktoken's error).
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

    def to_hf_json(self) -> dict:
        """This tokenizer as a Hugging Face tokenizer.json document (see `hf_tokenizer`)."""
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
    def from_pretrained(cls, directory: str | Path):
        """Read the tokenizer of `directory` (see `load_tokenizer`).

        Raises:
            FileNotFoundError: no tokenizer file. ValueError: it holds another kind.
        """
        tok = load_tokenizer(directory)
        if not isinstance(tok, cls):
            raise UserError(f"{directory} holds a {tok.kind!r} tokenizer, not {cls.kind!r}")
        return tok


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
        ValueError: the text holds a disallowed special token's string (tiktoken's message).
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


class CharTokenizer(Tokenizer):
    """Character-level tokenizer.

    Args:
        chars: the vocabulary, one distinct single character per id.
        unk_token: None (no unknown token: text with characters outside the vocabulary cannot
            be encoded) or one of `chars`, the token that encode(text, unknown="unk") gives
            every unknown character. Saved in tokenizer.json; files written before it existed
            load with None.
        special_tokens: strings (e.g. [END_OF_TEXT]) that take the ids after `chars`, in
            order (default: none); see `Tokenizer.encode` for how text holding them encodes.

    Raises:
        ValueError: chars is empty, holds duplicates or strings that are not one character, or
            unk_token is not one of them; special_tokens holds duplicates or empty strings.
    """

    kind = "char"

    def __init__(
        self,
        chars: list[str] | str,
        unk_token: str | None = None,
        special_tokens: Iterable[str] = (),
    ):
        chars = list(chars)
        if not chars:
            raise UserError("a CharTokenizer needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise UserError(f"vocabulary entries must be single characters, got {bad[:5]}")
        if len(set(chars)) != len(chars):
            raise UserError("vocabulary has duplicate characters")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        if unk_token is not None and unk_token not in self.stoi:
            raise UserError(f"unk_token {unk_token!r} is not in the vocabulary")
        self.unk_token = unk_token
        self._special = _numbered_specials(special_tokens, len(chars))

    @classmethod
    def from_text(
        cls,
        text: str | Iterable[str],
        unk_token: str | None = None,
        special_tokens: Iterable[str] = (),
    ) -> CharTokenizer:
        """The vocabulary of `text` (a string, or an iterable of string chunks read in turn):
        its distinct characters in code-point order.

        unk_token: None (the default: the characters alone), or a character to use as
            the explicit unknown token (e.g. DEFAULT_UNK_TOKEN, U+FFFD). It is appended after
            the sorted characters, so every character of the text keeps the id it has without
            it (id vocab_size - 1 is the unknown); if the text already holds that character it
            keeps its sorted place and doubles as the unknown token.
        special_tokens: strings appended after those (see the class).

        Raises:
            ValueError: the text is empty.
        """
        seen: set[str] = set()
        for chunk in [text] if isinstance(text, str) else text:
            seen.update(chunk)
        if not seen:
            raise UserError("cannot build a character vocabulary from empty text")
        chars = sorted(seen)
        if unk_token is not None and unk_token not in seen:
            chars.append(unk_token)
        return cls(chars, unk_token, special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + len(self._special)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    @property
    def unk_id(self) -> int | None:
        """The id of unk_token (None without one)."""
        return None if self.unk_token is None else self.stoi[self.unk_token]

    def _encode_ordinary(self, text: str, unknown: str) -> list[int]:
        """Token ids of `text`, one per character (`encode` adds the special tokens).

        Args:
            unknown: "error" (the default) or "unk": map characters outside the vocabulary to
                unk_id (count them with `count_unknown`).

        Raises:
            UnknownCharacterError (a ValueError): unknown="error" (or "unk" without an
                unk_token) and the text has characters outside the vocabulary; it names each
                of them and the position where it first occurs.
        """
        stoi = self.stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            if unknown == "unk" and self.unk_token is not None:
                unk = self.stoi[self.unk_token]
                return [stoi.get(c, unk) for c in text]
            seen: dict[str, int] = {}
            for i, c in enumerate(text):
                if c not in stoi and c not in seen:
                    seen[c] = i
            hint = (
                "this character vocabulary has no unknown token to map them to (it was "
                "built without unk_token); remove them from the text or use a model "
                "whose vocabulary has one"
                if unknown == "unk"
                else ""
            )
            raise UnknownCharacterError(list(seen.items()), hint) from None

    def count_unknown(self, text: str) -> int:
        stoi = self.stoi
        return sum(1 for c in text if c not in stoi)

    def decode(self, ids) -> str:
        """Text of token ids (a list or a 1-D tensor of ints); unk_id decodes to unk_token,
        a special token's id to its string.

        Raises:
            ValueError: an id is outside [0, vocab_size).
        """
        ids = _checked_ids(ids, self.vocab_size, "this character tokenizer")
        pieces = self.chars + list(self._special)
        return "".join(pieces[i] for i in ids)

    def _hf_fields(self) -> dict:
        return {"chars": self.chars, "unk_token": self.unk_token}

    def _saved_fields(self) -> dict:
        fields = {"chars": self.chars, "unk_token": self.unk_token}
        return {**fields, "special_tokens": list(self._special)} if self._special else fields

    def __repr__(self) -> str:
        return (
            f"CharTokenizer(vocab_size={self.vocab_size}, unk_token={self.unk_token!r}, "
            f"special_tokens={list(self._special)})"
        )


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer: 256 ids, id b is the byte b of the text's UTF-8 encoding.

    Every string encodes (there are no unknown characters); a character takes 1-4 ids.
    decode(ids) decodes the bytes as UTF-8 with errors="replace": a sequence that is not valid
    UTF-8 (e.g. a sample cut in the middle of a character) becomes U+FFFD instead of raising.

    Args:
        special_tokens: strings (e.g. [END_OF_TEXT]) that take ids 256, 257, ... in order
            (default: none, 256 ids); see `Tokenizer.encode` for how text holding them encodes.

    Raises:
        ValueError: special_tokens holds duplicates or empty strings.
    """

    kind = "byte"

    def __init__(self, special_tokens: Iterable[str] = ()):
        self._special = _numbered_specials(special_tokens, 256)

    @property
    def vocab_size(self) -> int:
        return 256 + len(self._special)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def _encode_ordinary(self, text: str, unknown: str) -> list[int]:
        """The UTF-8 bytes of `text` as ints in [0, 256) (`unknown` is accepted and unused)."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Text of byte ids; invalid UTF-8 becomes U+FFFD (errors="replace"); a special token's
        id decodes to its string.

        Raises:
            ValueError: an id is outside [0, vocab_size).
        """
        ids = _checked_ids(ids, self.vocab_size, "the byte tokenizer")
        names = {i: s for s, i in self._special.items()}
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out += [run.decode("utf-8", errors="replace"), names[i]]
            run = bytearray()
        return "".join([*out, run.decode("utf-8", errors="replace")])

    def _saved_fields(self) -> dict:
        return {"special_tokens": list(self._special)} if self._special else {}

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, special_tokens={list(self._special)})"


class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-level BPE (Radford et al. 2019), through tiktoken.

    Args:
        bpe_dir: a directory holding encoder.json and vocab.bpe (default: the copies shipped
            in the package; their sha256 must match OpenAI's originals).

    Its one special token is "<|endoftext|>" = 50256 (`eot_token`); encode(text) follows
    tiktoken's rules for it (see `Tokenizer.encode`: by default its string in the text is an
    error). Every other string encodes (byte-level: no unknown characters).

    Raises:
        FileNotFoundError: a BPE file is missing. ValueError: a file's hash does not match.
    """

    kind = "gpt2"

    def __init__(self, bpe_dir: str | Path | None = None):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str

        self.bpe_dir = bpe_dir = Path(bpe_dir) if bpe_dir is not None else GPT2_BPE_DIR
        for name in _GPT2_HASHES:
            if not (bpe_dir / name).is_file():
                raise MissingFileError(
                    f"{bpe_dir / name} not found; the GPT-2 tokenizer needs "
                    f"encoder.json and vocab.bpe"
                )
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(bpe_dir / "vocab.bpe"),
            str(bpe_dir / "encoder.json"),
            vocab_bpe_hash=_GPT2_HASHES["vocab.bpe"],
            encoder_json_hash=_GPT2_HASHES["encoder.json"],
        )
        self.encoding = tiktoken.Encoding(
            name="gpt2",
            pat_str=r50k_pat_str,
            mergeable_ranks=ranks,
            special_tokens={END_OF_TEXT: 50256},
            explicit_n_vocab=50257,
        )

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def special_tokens(self) -> dict[str, int]:
        return {s: self.encoding.encode_single_token(s) for s in self.encoding.special_tokens_set}

    def _encode(self, text, unknown, allowed_special, disallowed_special) -> list[int]:
        """tiktoken's `Encoding.encode` with the same allowed_special / disallowed_special
        (ids in [0, 50257)); `unknown` is unused: every string encodes."""
        return self.encoding.encode(
            text, allowed_special=allowed_special, disallowed_special=disallowed_special
        )

    def decode(self, ids) -> str:
        """Text of token ids; bytes that do not form valid UTF-8 become U+FFFD.

        Raises:
            ValueError: an id is outside [0, 50257).
        """
        return self.encoding.decode(_checked_ids(ids, self.vocab_size, "GPT-2"))

    def _hf_fields(self) -> dict:
        return {"bpe_dir": self.bpe_dir}

    def __repr__(self) -> str:
        return "GPT2Tokenizer(vocab_size=50257)"


def _numbered_specials(strings: Iterable[str], first_id: int) -> dict[str, int]:
    """{string: first_id + i} of special-token strings.

    Raises:
        ValueError: a string is empty or not a str, or one is given twice.
    """
    strings = list(strings)
    if any(not isinstance(x, str) or not x for x in strings):
        raise UserError(f"special tokens must be non-empty strings, got {strings!r}")
    if len(set(strings)) != len(strings):
        raise UserError(f"special tokens {strings!r} hold duplicates")
    return {x: first_id + i for i, x in enumerate(strings)}


def _checked_ids(ids, vocab_size: int, name: str) -> list[int]:
    """ids (a list or 1-D tensor) as ints. Raises ValueError: one is outside [0, vocab_size)."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"token ids {bad[:5]} are outside [0, {vocab_size}) for {name}")
    return ids


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
    decoderlm_tokenizer.json, or from the tokenizer.json ({"type": ...}) of a directory
    written before that file existed.

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
