"""decoderlm: decoder-only (GPT-style) transformer language models in PyTorch.

from decoderlm import ModelConfig, DecoderLM
from decoderlm.generation.generate import generate
model = DecoderLM(ModelConfig(vocab_size=65, block_size=64, n_layers=2, n_heads=4,
                              d_model=64))
logits, loss = model(idx, targets)        # idx, targets: [B, T] int64
out = generate(model, idx, max_new_tokens=20)
"""

from .config import ModelConfig, TrainConfig
from .model.hooks import run_with_cache
from .model.model import DecoderLM
from .presets import PRESETS, get_preset
from .tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    UnknownCharacterError,
    load_tokenizer,
    make_tokenizer,
)

__version__ = "0.1.0"

__all__ = [
    "ModelConfig",
    "TrainConfig",
    "PRESETS",
    "get_preset",
    "DecoderLM",
    "CharTokenizer",
    "GPT2Tokenizer",
    "ByteTokenizer",
    "Tokenizer",
    "UnknownCharacterError",
    "load_tokenizer",
    "make_tokenizer",
    "run_with_cache",
    "__version__",
]
