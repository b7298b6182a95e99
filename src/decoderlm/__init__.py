"""decoderlm: decoder-only (GPT-style) transformer language models in PyTorch.

    from decoderlm import DecoderLM, ModelConfig, generate
    model = DecoderLM(ModelConfig(vocab_size=65, block_size=64, n_layers=2, n_heads=4,
                                  d_model=64))
    logits, loss = model(idx, targets)        # idx, targets: [B, T] int64
    out = generate(model, idx, max_new_tokens=20)

The names below are the public API; each lives in its subsystem's package (model, tokenizers,
data, io, finetune, generation, serve, lens, training) and is imported from there on first use,
so `import decoderlm` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "ModelConfig": "config",
    "TrainConfig": "config",
    "PRESETS": "presets",
    "get_preset": "presets",
    "UserError": "errors",
    "DecoderLM": "model.model",
    "run_with_cache": "model.hooks",
    "count_parameters": "model.analysis",
    "flops_per_token": "model.analysis",
    "memory_bytes": "model.analysis",
    "Tokenizer": "tokenizers",
    "CharTokenizer": "tokenizers",
    "ByteTokenizer": "tokenizers",
    "GPT2Tokenizer": "tokenizers",
    "UnknownCharacterError": "tokenizers",
    "load_tokenizer": "io.load",
    "make_tokenizer": "tokenizers",
    "load_gpt2": "io.hf_gpt2",
    "save_gpt2": "io.hf_gpt2",
    "load_model": "io.load",
    "load_model_and_tokenizer": "io.load",
    "generate": "generation.generate",
    "stream_text": "generation.generate",
    "SamplingParams": "generation.params",
    "prepare_for_decoding": "generation.precision",
    "evaluate_run": "evaluate",
    "train": "training.loop",
    "run_experiment": "training.run",
}
__all__ = [
    "ModelConfig",
    "TrainConfig",
    "PRESETS",
    "get_preset",
    "UserError",
    "DecoderLM",
    "run_with_cache",
    "count_parameters",
    "flops_per_token",
    "memory_bytes",
    "Tokenizer",
    "CharTokenizer",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "UnknownCharacterError",
    "load_tokenizer",
    "make_tokenizer",
    "load_gpt2",
    "save_gpt2",
    "load_model",
    "load_model_and_tokenizer",
    "generate",
    "stream_text",
    "SamplingParams",
    "prepare_for_decoding",
    "evaluate_run",
    "train",
    "run_experiment",
    "__version__",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports lazily
    from .config import ModelConfig, TrainConfig
    from .errors import UserError
    from .evaluate import evaluate_run
    from .generation.generate import generate, stream_text
    from .generation.params import SamplingParams
    from .generation.precision import prepare_for_decoding
    from .io.hf_gpt2 import load_gpt2, save_gpt2
    from .io.load import load_model, load_model_and_tokenizer, load_tokenizer
    from .model.analysis import count_parameters, flops_per_token, memory_bytes
    from .model.hooks import run_with_cache
    from .model.model import DecoderLM
    from .presets import PRESETS, get_preset
    from .tokenizers import (
        ByteTokenizer,
        CharTokenizer,
        GPT2Tokenizer,
        Tokenizer,
        UnknownCharacterError,
        make_tokenizer,
    )
    from .training.loop import train
    from .training.run import run_experiment


def __getattr__(name: str):
    """Import a public name from its module on first use (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'decoderlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
