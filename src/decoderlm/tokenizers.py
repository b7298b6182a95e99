"""Tokenizers: text <-> token ids.

`CharTokenizer` is the seed notebook's character-level tokenizer: the vocabulary is the sorted
set of characters of the corpus (code-point order), id i is the i-th character.
`GPT2Tokenizer` is OpenAI's GPT-2 byte-level BPE (50,257 ids, `<|endoftext|>` = 50256), run by
tiktoken from the encoder.json and vocab.bpe files the package ships (no network).
Both have encode / decode / vocab_size / save_pretrained / from_pretrained; a tokenizer is
saved with the model as tokenizer.json, so a checkpoint always decodes with its own vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import read_json, write_json

__all__ = ["CharTokenizer", "GPT2Tokenizer", "UnknownCharacterError", "load_tokenizer"]

TOKENIZER_NAME = "tokenizer.json"
GPT2_BPE_DIR = Path(__file__).parent / "bpe"
# sha256 of OpenAI's originals, as tiktoken pins them
_GPT2_HASHES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}


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


class _Saved:
    """save_pretrained / from_pretrained through tokenizer.json, shared by the tokenizers."""

    kind = ""

    def _saved_fields(self) -> dict:
        return {}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write tokenizer.json ({"type": kind, ...}) into `directory` (created if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / TOKENIZER_NAME, {"type": self.kind, **self._saved_fields()})

    @classmethod
    def from_pretrained(cls, directory: str | Path):
        """Read tokenizer.json from `directory`.

        Raises:
            FileNotFoundError: no tokenizer.json. ValueError: it holds another kind.
        """
        tok = load_tokenizer(directory)
        if not isinstance(tok, cls):
            raise ValueError(f"{directory} holds a {tok.kind!r} tokenizer, not {cls.kind!r}")
        return tok


class CharTokenizer(_Saved):
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

    def _saved_fields(self) -> dict:
        return {"chars": self.chars}

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class GPT2Tokenizer(_Saved):
    """GPT-2's byte-level BPE (Radford et al. 2019), through tiktoken.

    Args:
        bpe_dir: a directory holding encoder.json and vocab.bpe (default: the copies shipped
            in the package; their sha256 must match OpenAI's originals).

    encode(text) -> list[int] treats "<|endoftext|>" in the text as the special token 50256;
    every other string encodes (byte-level: no unknown characters).

    Raises:
        FileNotFoundError: a BPE file is missing. ValueError: a file's hash does not match.
    """

    kind = "gpt2"
    eot_token = 50256

    def __init__(self, bpe_dir: str | Path | None = None):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str

        bpe_dir = Path(bpe_dir) if bpe_dir is not None else GPT2_BPE_DIR
        for name in _GPT2_HASHES:
            if not (bpe_dir / name).is_file():
                raise FileNotFoundError(f"{bpe_dir / name} not found; the GPT-2 tokenizer needs "
                                        f"encoder.json and vocab.bpe")
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(bpe_dir / "vocab.bpe"), str(bpe_dir / "encoder.json"),
            vocab_bpe_hash=_GPT2_HASHES["vocab.bpe"],
            encoder_json_hash=_GPT2_HASHES["encoder.json"])
        self.encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str,
                                          mergeable_ranks=ranks,
                                          special_tokens={"<|endoftext|>": self.eot_token},
                                          explicit_n_vocab=50257)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (ints in [0, 50257))."""
        return self.encoding.encode(text, allowed_special={"<|endoftext|>"})

    def decode(self, ids) -> str:
        """Text of token ids; bytes that do not form valid UTF-8 become U+FFFD.

        Raises:
            ValueError: an id is outside [0, 50257).
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, {self.vocab_size}) for GPT-2")
        return self.encoding.decode(ids)

    def __repr__(self) -> str:
        return "GPT2Tokenizer(vocab_size=50257)"


def load_tokenizer(directory: str | Path) -> CharTokenizer | GPT2Tokenizer:
    """Load the tokenizer saved in a run directory (tokenizer.json).

    Raises:
        FileNotFoundError: no tokenizer.json in `directory`.
        ValueError: the file names an unknown tokenizer type or is malformed.
    """
    data = read_json(Path(directory) / TOKENIZER_NAME)
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == "char" and isinstance(data.get("chars"), list):
        return CharTokenizer(data["chars"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"{Path(directory) / TOKENIZER_NAME}: unknown or malformed tokenizer "
                     f"(type {kind!r})")
