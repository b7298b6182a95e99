"""`CharTokenizer`: the character-level tokenizer of the seed experiment.

The vocabulary is the sorted set of characters of the corpus (code-point order), id i is the
i-th character; optionally one more entry, an explicit unknown token, after them (see
`CharTokenizer.from_text`).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import UserError
from .base import (
    Tokenizer,
    UnknownCharacterError,
    checked_ids,
    malformed_tokenizer_error,
    numbered_specials,
)

__all__ = ["CharTokenizer"]


class CharTokenizer(Tokenizer):
    """Character-level tokenizer.

    Args:
        chars: the vocabulary, one distinct single character per id.
        unk_token: None (no unknown token: text with characters outside the vocabulary cannot
            be encoded) or one of `chars`, the token that encode(text, unknown="unk") gives
            every unknown character. Saved with the vocabulary; a saved vocabulary without
            this field loads with None.
        special_tokens: strings (e.g. [END_OF_TEXT]) that take the ids after `chars`, in
            order (default: none); see `Tokenizer.encode` for how text holding them encodes.

    Raises:
        UserError: chars is empty, holds duplicates or strings that are not one character, or
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
        self._special = numbered_specials(special_tokens, len(chars))

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
            UserError: the text is empty.
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

    @classmethod
    def from_dict(cls, data: dict, source: str = "tokenizer") -> CharTokenizer:
        """The tokenizer `to_dict()` described: {"type": "char", "chars": [...], "unk_token":
        ..., "special_tokens": [...]}.

        Raises:
            UserError: no "chars" list, a "special_tokens" that is not a list, or fields the
                constructor refuses.
        """
        special = data.get("special_tokens", [])
        if not isinstance(data.get("chars"), list) or not isinstance(special, list):
            raise malformed_tokenizer_error(source, data)
        return cls(data["chars"], data.get("unk_token"), special)

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
            UserError: an id is outside [0, vocab_size).
        """
        ids = checked_ids(ids, self.vocab_size, "this character tokenizer")
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
