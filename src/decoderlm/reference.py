"""The DecoderLM forward pass in plain NumPy: a test oracle and a teaching aid.

Written from the formulas, not from the torch code, in float64:

    LayerNorm(x)   = (x - mean) / sqrt(var + 1e-5) * g + b         (Ba et al. 2016)
    Attention(Q,K,V) = softmax(Q K^T / sqrt(d_k) + M) V,  M[t, s] = -inf for s > t
                                                            (Vaswani et al. 2017, eq. 1)
    GELU(x)        = x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))     (Hendrycks & Gimpel 2016)

Usage:
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    logits = reference.forward(params, model.config, idx.numpy())
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["forward", "layer_norm", "gelu", "softmax", "causal_self_attention"]

_erf = np.vectorize(math.erf)


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray | None, eps: float = 1e-5):
    """Normalise the last axis of x to zero mean and unit (biased) variance, then scale/shift."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * g
    return y if b is None else y + b


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU: x times the standard normal CDF of x."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; entries of -inf get probability 0."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _linear(x, params, name):
    y = x @ params[f"{name}.weight"].T  # torch stores Linear weights as [out, in]
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + bias


def causal_self_attention(x: np.ndarray, params: dict, prefix: str, n_heads: int):
    """x [B, T, d_model] -> (y [B, T, d_model], att [B, n_heads, T, T])."""
    B, T, C = x.shape
    d_k = C // n_heads
    qkv = _linear(x, params, f"{prefix}.qkv")
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_heads, d_k).transpose(0, 2, 1, 3)
               for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d_k)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    att = softmax(np.where(future, -np.inf, scores))
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return _linear(y, params, f"{prefix}.proj"), att


def forward(params: dict[str, np.ndarray], config, idx: np.ndarray) -> np.ndarray:
    """Logits of a DecoderLM computed with NumPy.

    Args:
        params: the model's state dict as NumPy arrays (keys as in `DecoderLM.state_dict()`;
            if "lm_head.weight" is absent, the token embedding is used: tied weights).
        config: the ModelConfig (needs n_layers, n_heads).
        idx: [B, T] integer token ids, T <= block_size.

    Returns:
        [B, T, vocab_size] float64 logits.
    """
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    T = idx.shape[1]
    x = p["tok_emb.weight"][idx] + p["pos_emb.weight"][:T]
    for i in range(config.n_layers):
        pre = f"blocks.{i}"
        a, _ = causal_self_attention(
            layer_norm(x, p[f"{pre}.ln_1.weight"], p.get(f"{pre}.ln_1.bias")), p,
            f"{pre}.attn", config.n_heads)
        x = x + a
        h = layer_norm(x, p[f"{pre}.ln_2.weight"], p.get(f"{pre}.ln_2.bias"))
        x = x + _linear(gelu(_linear(h, p, f"{pre}.mlp.fc")), p, f"{pre}.mlp.proj")
    x = layer_norm(x, p["ln_f.weight"], p.get("ln_f.bias"))
    return x @ p.get("lm_head.weight", p["tok_emb.weight"]).T
