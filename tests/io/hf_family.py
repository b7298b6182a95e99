"""Tiny Llama, Qwen2 and Mistral directories saved by transformers itself (random weights, a
300-token byte-level BPE trained here, offline): the Hugging Face loader's test models."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import byte_level_bpe

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. Hello, how are you today? I am fine, thank you.",
    "Ünïcödé café, naïve — 日本語 and emoji 🙂🚀 are text too; numbers 0123456789\tand\n",
    "  two spaces,\n\nnew lines and <|im_start|>special<|im_end|> tokens in between.",
]
TEXT = "Hello  wörld,\n\n  naïve café — 日本語 🙂🚀!<|im_start|>user\nhi<|im_end|><|endoftext|>"
BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,  # logits far from uniform, so greedy tokens vary
)


def bpe_tokenizer():
    """A byte-level BPE of 300 tokens whose first three are SPECIAL."""
    return byte_level_bpe(CORPUS, SPECIAL)


def save_family(
    directory: Path, family: str = "llama", dtype=torch.float32, shard: str | None = None, **fields
):
    """Save a random transformers `family` ("llama" | "qwen2" | "mistral") model with config
    fields BASE | fields, in `dtype` (sharded at `shard`, e.g. "20KB"), and the BPE tokenizer
    (eos <|endoftext|>, generation_config.json eos ids [0, 2]). Returns the transformers
    model, float32, in eval mode, as transformers reads the directory back."""
    transformers = pytest.importorskip("transformers")
    configs = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }
    bpe = bpe_tokenizer()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.save_pretrained(directory)
    fields = copy.deepcopy(fields)  # transformers' configs change the dicts they are given
    config = configs[family](vocab_size=bpe.get_vocab_size(), **{**BASE, **fields})
    config.bos_token_id, config.eos_token_id = 0, [0, 2]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases and norm gains away from their initial zeros and ones
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    generation = directory / "generation_config.json"
    data = json.loads(generation.read_text()) if generation.is_file() else {}
    generation.write_text(json.dumps({**data, "bos_token_id": 0, "eos_token_id": [0, 2]}))
    return transformers_model(directory)


def transformers_model(directory: Path):
    """transformers' own reading of `directory`, float32, eval mode."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def edit_config(directory: Path, **changes) -> None:
    """Change config.json's fields in place (None deletes one)."""
    path = directory / "config.json"
    data = json.loads(path.read_text())
    for k, v in changes.items():
        data.pop(k, None) if v is None else data.__setitem__(k, v)
    path.write_text(json.dumps(data))
