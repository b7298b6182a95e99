"""Tokenizers: text <-> token ids behind one interface (`Tokenizer`, base.py): characters
(char.py), UTF-8 bytes (byte.py) and GPT-2's BPE (gpt2.py), saved in a run directory and read
back from it (load.py: any kind); hf_json writes the Hugging Face tokenizer.json of each."""

from .base import (
    DEFAULT_UNK_TOKEN,
    END_OF_TEXT,
    HF_TOKENIZER_NAME,
    TOKENIZER_KINDS,
    TOKENIZER_NAME,
    Tokenizer,
    UnknownCharacterError,
    disallowed_special_error,
)
from .byte import ByteTokenizer
from .char import CharTokenizer
from .gpt2 import GPT2_BPE_DIR, GPT2Tokenizer
from .load import make_tokenizer, read_end_of_text_id, read_tokenizer, tokenizer_from_dict

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
    "make_tokenizer",
    "read_end_of_text_id",
    "read_tokenizer",
    "tokenizer_from_dict",
]
