"""`GPT2Tokenizer`: OpenAI's GPT-2 byte-level BPE (50,257 ids, `<|endoftext|>` = 50256), run
by tiktoken from the encoder.json and vocab.bpe files the package ships in bpe/ (no network)."""

from __future__ import annotations

from pathlib import Path

from ..errors import MissingFileError
from .base import END_OF_TEXT, Tokenizer, checked_ids, malformed_tokenizer_error

__all__ = ["GPT2_BPE_DIR", "GPT2Tokenizer"]

GPT2_BPE_DIR = Path(__file__).parent / "bpe"
# sha256 of OpenAI's originals, as tiktoken pins them
_GPT2_HASHES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


GPT2_EOT_ID = 50256  # "<|endoftext|>"


class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-level BPE (Radford et al. 2019), through tiktoken.

    Args:
        bpe_dir: a directory holding encoder.json and vocab.bpe (default: the copies shipped
            in the package; their sha256 must match OpenAI's originals).

    Its one special token is "<|endoftext|>" = 50256 (`eot_token`); encode(text) follows
    tiktoken's rules for it (see `Tokenizer.encode`: by default its string in the text is an
    error). Every other string encodes (byte-level: no unknown characters).

    Raises:
        MissingFileError: a BPE file is missing. UserError: a file's hash does not match
            (tiktoken's error).
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
            special_tokens={END_OF_TEXT: GPT2_EOT_ID},
            explicit_n_vocab=50257,
        )

    @classmethod
    def from_dict(cls, data: dict, source: str = "tokenizer") -> GPT2Tokenizer:
        """GPT-2's BPE, which `to_dict()` describes as {"type": "gpt2"} (the shipped files).

        Raises:
            UserError: a "special_tokens" entry that is not a list.
        """
        if not isinstance(data.get("special_tokens", []), list):
            raise malformed_tokenizer_error(source, data)
        return cls()

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
            UserError: an id is outside [0, 50257).
        """
        return self.encoding.decode(checked_ids(ids, self.vocab_size, "GPT-2"))

    def _hf_fields(self) -> dict:
        return {"bpe_dir": self.bpe_dir}

    def __repr__(self) -> str:
        return "GPT2Tokenizer(vocab_size=50257)"
