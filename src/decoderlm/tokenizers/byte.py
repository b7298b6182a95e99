"""`ByteTokenizer`: 256 ids, the bytes of the UTF-8 encoding, so every string encodes."""

from __future__ import annotations

from collections.abc import Iterable

from .base import Tokenizer, _checked_ids, _numbered_specials

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
