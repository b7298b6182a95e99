"""Tokenizers: text <-> token ids.

`CharTokenizer` is the seed notebook's character-level tokenizer: the vocabulary is the sorted
set of characters of the corpus (code-point order), id i is the i-th character. It is saved
with the model as tokenizer.json, so a checkpoint always decodes with its own vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import read_json, write_json

__all__ = ["CharTokenizer", "UnknownCharacterError", "load_tokenizer"]

TOKENIZER_NAME = "tokenizer.json"


class UnknownCharacterError(ValueError):
    """Text holds characters that are not in the tokenizer's vocabulary.

    Attributes:
        unknown: list of (character, first position in the text) pairs, in order of position.
    """

    def __init__(self, unknown: list[tuple[str, int]]):
        self.unknown = unknown
        shown = ", ".join(f"{c!r} at position {i}" for c, i in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        super().__init__(f"{len(unknown)} character(s) not in the vocabulary: {shown}{more}; "
                         f"remove them from the text or train on a corpus that contains them")


class CharTokenizer:
    """Character-level tokenizer.

    Args:
        chars: the vocabulary, one distinct single character per id.

    Raises:
        ValueError: chars is empty, holds duplicates or strings that are not one character.
    """

    kind = "char"

    def __init__(self, chars: list[str] | str):
        chars = list(chars)
        if not chars:
            raise ValueError("a CharTokenizer needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"vocabulary entries must be single characters, got {bad[:5]}")
        if len(set(chars)) != len(chars):
            raise ValueError("vocabulary has duplicate characters")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The vocabulary of `text`: its distinct characters in code-point order."""
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, one per character.

        Raises:
            UnknownCharacterError (a ValueError): naming every unknown character and the
                position where it first occurs.
        """
        stoi = self.stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            seen: dict[str, int] = {}
            for i, c in enumerate(text):
                if c not in stoi and c not in seen:
                    seen[c] = i
            raise UnknownCharacterError(list(seen.items())) from None

    def decode(self, ids) -> str:
        """Text of token ids (a list or a 1-D tensor of ints).

        Raises:
            ValueError: an id is outside [0, vocab_size).
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, {len(self.chars)}) for this "
                             f"character tokenizer")
        return "".join(self.chars[i] for i in ids)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write tokenizer.json ({"type": "char", "chars": [...]}) into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / TOKENIZER_NAME, {"type": self.kind, "chars": self.chars})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "CharTokenizer":
        """Read tokenizer.json from `directory`; raises FileNotFoundError / ValueError."""
        tok = load_tokenizer(directory)
        if not isinstance(tok, cls):
            raise ValueError(f"{directory} holds a {tok.kind!r} tokenizer, not {cls.kind!r}")
        return tok

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(directory: str | Path) -> CharTokenizer:
    """Load the tokenizer saved in a run directory (tokenizer.json).

    Raises:
        FileNotFoundError: no tokenizer.json in `directory`.
        ValueError: the file names an unknown tokenizer type or is malformed.
    """
    data = read_json(Path(directory) / TOKENIZER_NAME)
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == "char" and isinstance(data.get("chars"), list):
        return CharTokenizer(data["chars"])
    raise ValueError(f"{Path(directory) / TOKENIZER_NAME}: unknown or malformed tokenizer "
                     f"(type {kind!r})")
