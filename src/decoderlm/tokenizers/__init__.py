"""Tokenizers: text <-> token ids behind one interface (`Tokenizer`): characters, UTF-8 bytes
and GPT-2's BPE, saved in a run directory and loaded from it; hf_json writes the Hugging Face
tokenizer.json of each."""

from .base import (
    DEFAULT_UNK_TOKEN,
    END_OF_TEXT,
    GPT2_BPE_DIR,
    HF_TOKENIZER_NAME,
    TOKENIZER_KINDS,
    TOKENIZER_NAME,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    UnknownCharacterError,
    disallowed_special_error,
    load_tokenizer,
    make_tokenizer,
    tokenizer_from_dict,
)

__all__ = [
    "DEFAULT_UNK_TOKEN",
    "END_OF_TEXT",
    "GPT2_BPE_DIR",
    "HF_TOKENIZER_NAME",
    "TOKENIZER_KINDS",
    "TOKENIZER_NAME",
    "ByteTokenizer",
    "CharTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "UnknownCharacterError",
    "disallowed_special_error",
    "load_tokenizer",
    "make_tokenizer",
    "tokenizer_from_dict",
]
