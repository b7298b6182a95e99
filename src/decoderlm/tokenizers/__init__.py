"""Tokenizers: text <-> token ids behind one interface (`Tokenizer`, base.py): characters
(char.py), UTF-8 bytes (byte.py), GPT-2's BPE (gpt2.py) and Hugging Face's tokenizers library
(huggingface.py: a Hugging Face directory's tokenizer, hf_dir.py; a GGUF file's vocabulary,
gguf_vocab.py), saved in a run directory and read back from it (load.py: any kind); hf_json
writes the Hugging Face tokenizer.json of the first three."""

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
from .gguf_vocab import gguf_tokenizer
from .gpt2 import GPT2_BPE_DIR, GPT2Tokenizer
from .hf_dir import read_hf_tokenizer
from .huggingface import HFTokenizer
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
    "HFTokenizer",
    "Tokenizer",
    "UnknownCharacterError",
    "disallowed_special_error",
    "gguf_tokenizer",
    "make_tokenizer",
    "read_end_of_text_id",
    "read_hf_tokenizer",
    "read_tokenizer",
    "tokenizer_from_dict",
]
