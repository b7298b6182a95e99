"""Tiny model directories (written by save_model, with their tokenizer) for the export tests."""

from __future__ import annotations

import torch

from decoderlm.config import ModelConfig
from decoderlm.model.model import DecoderLM
from decoderlm.model.weights import save_model
from decoderlm.tokenizers import ByteTokenizer, CharTokenizer, GPT2Tokenizer

MIXED_TEXT = "Hello  wörld,\n\n  naïve café — 日本語!\t<|endoftext|>The end.\n"
SHAPES = {
    "gpt2": dict(activation="gelu_tanh"),
    "gpt2-untied-exact": dict(activation="gelu", tie_embeddings=False),
    "llama": dict(
        pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False
    ),
    "llama-tied": dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False),
}


def tokenizer_of(kind: str):
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "byte":
        return ByteTokenizer(["<|endoftext|>"])
    return CharTokenizer.from_text(
        MIXED_TEXT.replace("<|endoftext|>", ""), "\ufffd", ["<|endoftext|>"]
    )


def make_model_dir(path, shape: str = "gpt2", kind: str = "gpt2", seed: int = 0, **fields):
    """A model directory: a random DecoderLM of `shape` (weights scaled up so that logits
    spread over several nats, as a trained model's do) and a `kind` tokenizer."""
    torch.manual_seed(seed)
    tok = tokenizer_of(kind)
    base = dict(block_size=32, n_layers=2, n_heads=2, d_model=32)
    base["d_ff"] = 64 if "llama" in shape else None
    config = ModelConfig(vocab_size=tok.vocab_size, **{**base, **SHAPES[shape], **fields})
    model = DecoderLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(5.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    save_model(model, path)
    tok.save_pretrained(path)
    return model, tok


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy next tokens of a DecoderLM (full forward at each step, no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    return ids[len(prompt) :]
