"""The whole model: causal self-attention, MLP, decoder block and `DecoderLM`.

A GPT-2-style decoder-only transformer (Radford et al. 2019), read top to bottom:

    x = tok_emb(idx) + pos_emb(0..T-1)                 # [B, T, d_model]
    for each block:  x = x + attn(ln_1(x))             # pre-norm residual branches
                     x = x + mlp(ln_2(x))
    logits = lm_head(ln_f(x))                          # [B, T, vocab_size]

Attention is scaled dot-product attention (Vaswani et al. 2017, eq. 1):
softmax(q k^T / sqrt(head_dim) + causal mask) v, with future positions set to -inf before
the softmax so they get exactly zero weight.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig

__all__ = ["DecoderLM", "CausalSelfAttention", "MLP", "Block", "causal_attention"]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal scaled dot-product attention, written out, returning the probabilities too.

    Args:
        q, k, v: [B, n_heads, T, head_dim], any floating dtype.
        dropout_p: dropout on the attention probabilities (pass 0.0 in eval mode).

    Returns:
        (y, att): y [B, n_heads, T, head_dim] in q's dtype; att [B, n_heads, T, T] float32,
        the softmax probabilities before dropout. Row t sums to 1 and att[..., t, s] == 0 for
        every s > t.

    q is scaled by 1/sqrt(head_dim) *before* the matmul and the scores and softmax are
    computed in float32, so float16 inputs with large q.k do not overflow.
    """
    T = q.size(-2)
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = scores.float().masked_fill(future, float("-inf")).softmax(dim=-1)
    y = F.dropout(att, dropout_p) if dropout_p > 0 else att
    return (y.to(v.dtype) @ v), att


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection.

    forward(x [B, T, d_model], need_weights=False) -> (y [B, T, d_model], att | None).
    The default path calls `F.scaled_dot_product_attention(is_causal=True)` (fused kernels);
    with need_weights=True it runs `causal_attention` and also returns att [B, n_heads, T, T].
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, need_weights: bool = False):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            y, att = causal_attention(q, k, v, dropout_p)
        else:
            y, att = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                    is_causal=True), None
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y)), att


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(d_model, d_ff) -> GELU (exact, erf) -> Linear(d_ff,
    d_model) -> dropout. x [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm decoder block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, need_weights: bool = False):
        a, att = self.attn(self.ln_1(x), need_weights)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, att


class DecoderLM(nn.Module):
    """A GPT-2-style decoder-only language model.

    Args:
        config: the `ModelConfig`.

    Initialisation follows GPT-2: every Linear and Embedding weight ~ N(0, 0.02), biases 0,
    and the two residual output projections of each block (attn.proj, mlp.proj) ~
    N(0, 0.02 / sqrt(2 * n_layers)), since 2 * n_layers residual branches add into the stream.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _check_input(self, idx: torch.Tensor) -> None:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an int64 tensor of shape [B, T], got dtype "
                             f"{idx.dtype} and shape {tuple(idx.shape)}")
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length T={T} exceeds block_size={self.config.block_size}; "
                             f"pass at most block_size tokens (generate() crops the context)")
        if T == 0:
            raise ValueError("idx has no tokens (T=0); pass at least one token id")
        if not torch.compiler.is_compiling():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must be in [0, vocab_size={self.config.vocab_size}), "
                                 f"got ids from {lo} to {hi}; was the input encoded with this "
                                 f"model's tokenizer?")

    def _run(self, idx: torch.Tensor, need_weights: bool):
        self._check_input(idx)
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        atts = []
        for block in self.blocks:
            x, att = block(x, need_weights)
            atts.append(att)
        return self.lm_head(self.ln_f(x)), atts

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for every position, and the next-token loss when targets are given.

        Args:
            idx: [B, T] int64 token ids, T <= block_size.
            targets: [B, T] int64, the token that follows each position (idx shifted left by
                one); -1 marks a position to ignore. None skips the loss.

        Returns:
            (logits [B, T, vocab_size] float32 (or the autocast dtype), loss): loss is the mean
            cross-entropy over non-ignored positions, a float32 scalar in nats, or None.

        Raises:
            ValueError: idx is not [B, T] integer, T is 0 or exceeds block_size, or an id is
                outside [0, vocab_size).
        """
        logits, _ = self._run(idx, need_weights=False)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                   targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def forward_with_attention(self, idx: torch.Tensor):
        """Logits and every layer's attention probabilities, through the explicit path.

        Args:
            idx: [B, T] int64 token ids.

        Returns:
            (logits [B, T, vocab_size], att [n_layers, B, n_heads, T, T] float32), where
            att[l, b, h, t] is the distribution over key positions 0..t of query t in layer l,
            head h. Slower than `forward`; meant for analysis and plots.
        """
        logits, atts = self._run(idx, need_weights=True)
        return logits, torch.stack(atts)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of unique parameters (a tied matrix counts once).

        non_embedding=True leaves out the position table (the nanoGPT convention: the token
        embedding stays in because it is also the unembedding when tied).
        """
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx [B, T]; see `decoderlm.generate`."""
        from .generate import generate
        return generate(self, idx, max_new_tokens, **kwargs)

    def save_pretrained(self, directory: str | Path, extra_config: dict | None = None) -> None:
        """Write model.safetensors and config.json into `directory` (created if missing).

        extra_config: more top-level entries for config.json (the trainer stores its
        TrainConfig under "train").
        """
        from .checkpoint import save_model
        save_model(self, directory, extra_config)

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str = "cpu") -> "DecoderLM":
        """Load a model written by `save_pretrained` (or `decoderlm train`), in eval mode.

        Raises:
            FileNotFoundError: config.json or model.safetensors is missing.
            ValueError: the files do not describe a matching model.
        """
        from .checkpoint import load_model
        return load_model(directory, map_location)
