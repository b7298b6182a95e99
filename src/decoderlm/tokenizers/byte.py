"""`ByteTokenizer`: 256 ids, the bytes of the UTF-8 encoding, so every string encodes."""

from __future__ import annotations

from collections.abc import Iterable

from .base import Tokenizer, checked_ids, malformed_tokenizer_error, numbered_specials

__all__ = ["ByteTokenizer"]


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer: 256 ids, id b is the byte b of the text's UTF-8 encoding.

    Every string encodes (there are no unknown characters); a character takes 1-4 ids.
    decode(ids) decodes the bytes as UTF-8 with errors="replace": a sequence that is not valid
    UTF-8 (e.g. a sample cut in the middle of a character) becomes U+FFFD instead of raising.

    Args:
        special_tokens: strings (e.g. [END_OF_TEXT]) that take ids 256, 257, ... in order
            (default: none, 256 ids); see `Tokenizer.encode` for how text holding them encodes.

    Raises:
        UserError: special_tokens holds duplicates or empty strings.
    """

    kind = "byte"

    def __init__(self, special_tokens: Iterable[str] = ()):
        self._special = numbered_specials(special_tokens, 256)

    @classmethod
    def from_dict(cls, data: dict, source: str = "tokenizer") -> ByteTokenizer:
        """The tokenizer `to_dict()` described: {"type": "byte", "special_tokens": [...]}.

        Raises:
            UserError: a "special_tokens" that is not a list of distinct strings.
        """
        special = data.get("special_tokens", [])
        if not isinstance(special, list):
            raise malformed_tokenizer_error(source, data)
        return cls(special)

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
            UserError: an id is outside [0, vocab_size).
        """
        ids = checked_ids(ids, self.vocab_size, "the byte tokenizer")
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
