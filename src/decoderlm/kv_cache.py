"""The key-value cache of cached decoding: per-layer buffers, their length, updates and the
attention mask over cached keys."""

from __future__ import annotations

import torch

from .config import ModelConfig

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of every layer for decoding.

    k[l], v[l]: [B, n_heads, max_positions + 1, head_dim] in `dtype`, of which the first
    `length` (<= max_positions) positions are filled. The spare position keeps even a full
    cache a strict slice of the buffers, so one compiled decoding step serves every length (a
    slice that is the whole buffer would be compiled again).

    Args:
        config: the model's ModelConfig.
        batch_size: B.
        device, dtype: those of the model's weights.
    """

    def __init__(self, config: ModelConfig, batch_size: int, device, dtype):
        shape = (batch_size, config.n_heads, config.max_positions + 1, config.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.length = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values k, v [B, n_heads, T, head_dim] of `layer` at positions
        length..length + T - 1 and return all of them, [B, n_heads, length + T, head_dim]
        each. `length` itself moves on in `advance`, once every layer has been updated."""
        start, T = self.length, k.size(-2)
        self.k[layer][:, :, start : start + T] = k
        self.v[layer][:, :, start : start + T] = v
        return self.k[layer][:, :, : start + T], self.v[layer][:, :, : start + T]

    def advance(self, T: int) -> None:
        """Count T more filled positions (after a forward pass over T new tokens)."""
        self.length += T

    def attention_mask(self, T: int, key_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask of T new queries over the length + T keys, bool [B, 1, T, length + T],
        True where a query may attend: causal, and never to padding.

        Args:
            T: the number of new tokens.
            key_mask: [B, length + T] bool, False for padding; None means no padding.

        Returns:
            None when no mask is needed (no padding, and one new token or an empty cache, so
            the plain causal rule of scaled_dot_product_attention applies).
        """
        start = self.length
        if key_mask is None and (T == 1 or start == 0):
            return None
        S, device = start + T, self.k[0].device
        if key_mask is None:
            key_mask = torch.ones(self.k[0].size(0), S, dtype=torch.bool, device=device)
        causal = torch.ones(T, S, dtype=torch.bool, device=device).tril(start)
        # a padding query may see no key at all; letting every query see itself keeps every
        # softmax row finite (no NaN); the outputs at padding are never used
        itself = torch.arange(S, device=device) == (torch.arange(T, device=device) + start)[:, None]
        return ((causal[None] & key_mask[:, None, :]) | itself[None])[:, None]
