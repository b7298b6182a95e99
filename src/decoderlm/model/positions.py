"""Position information: the sinusoidal table (Vaswani et al. 2017) and rotary embeddings
(Su et al. 2021) with Llama 3's rescaled frequencies, and the permutations between the two
rotary layouts of q and k weights (interleaved pairs, as Meta's Llama and llama.cpp;
half-split, as decoderlm and Hugging Face)."""

from __future__ import annotations

import math

import torch

__all__ = [
    "sinusoidal_positions",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope",
    "rope_interleaved_to_half",
    "rope_half_to_interleaved",
]


def sinusoidal_positions(T: int, d_model: int) -> torch.Tensor:
    """The fixed position table of Vaswani et al. 2017, section 3.5, [T, d_model] float32:
    PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i + 1) = cos(pos / 10000^(2i /
    d_model))."""
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    angle = pos / 10000.0 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(T, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.float()


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """theta_i = base^(-2i / head_dim), i = 0..head_dim/2 - 1, [head_dim / 2] float64; with
    Llama 3's `scaling` (ModelConfig.rope_scaling) rescaled as `rope_inv_freq` says."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)  # 0 at original / low, 1 at / high
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, between)
    return torch.where(wavelen < original / high, inv_freq, scaled)


def rope_inv_freq(config) -> torch.Tensor:
    """The rotary inverse frequencies of a ModelConfig, [head_dim / 2] float64.

    theta_i = rope_base^(-2i / head_dim) (Su et al. 2021, eq. 15). With config.rope_scaling
    (Llama 3's, the same at every length; transformers' `_compute_llama3_parameters`), with
    wavelength w_i = 2 pi / theta_i, L = original_max_position_embeddings: theta_i / factor
    where w_i > L / low_freq_factor, theta_i where w_i < L / high_freq_factor, and between
    them (1 - s) theta_i / factor + s theta_i, s = (L / w_i - low_freq_factor) /
    (high_freq_factor - low_freq_factor).
    """
    return _inv_freq(config.head_dim, config.rope_base, config.rope_scaling)


def rope_cos_sin(
    T: int, head_dim: int, base: float = 10000.0, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles m * theta_i, theta_i = base^(-2i / head_dim)
    (Su et al. 2021, eq. 15; rescaled by Llama 3's `scaling`, see `rope_inv_freq`), for
    positions m = 0..T-1: two [T, head_dim / 2] float32."""
    angle = torch.arange(T, dtype=torch.float64)[:, None] * _inv_freq(head_dim, base, scaling)
    return torch.cos(angle).float(), torch.sin(angle).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by position (cos, sin: [T, head_dim / 2]).

    Half-split layout (GPT-NeoX, Hugging Face Llama): feature j of the first half and feature
    j of the second half form the pair rotated by angle m * theta_j.
    """
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rope_interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute the rows of a q or k projection weight [n_heads * head_dim, d_in] trained with
    the interleaved rotary layout (pairs 2j, 2j + 1; Meta's Llama, RoFormer) into the
    half-split layout `apply_rope` uses (pairs j, j + head_dim / 2). Scores q.k, and so the
    logits, are unchanged."""
    head_dim = weight.size(0) // n_heads
    rows = torch.arange(weight.size(0)).view(n_heads, head_dim // 2, 2).transpose(1, 2)
    return weight[rows.reshape(-1)]


def rope_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `rope_interleaved_to_half`: the rows of a q or k projection weight
    [n_heads * head_dim, ...] in the half-split rotary layout (decoderlm, Hugging Face Llama)
    permuted into the interleaved one llama.cpp computes with (its converter's `permute`).
    Scores q.k are unchanged when the rotation pairs follow the rows."""
    head_dim = weight.size(0) // n_heads
    rows = torch.arange(weight.size(0)).view(n_heads, 2, head_dim // 2).transpose(1, 2)
    return weight[rows.reshape(-1)]
