"""The DecoderLM forward pass in plain NumPy: a test oracle and a teaching aid.

Written from the formulas, not from the torch code, in float64, for every ModelConfig option:

    LayerNorm(x)   = (x - mean) / sqrt(var + eps) * g + b           (Ba et al. 2016)
    RMSNorm(x)     = x / sqrt(mean(x^2) + eps) * g                   (Zhang & Sennrich 2019)
    Attention(Q,K,V) = softmax(Q K^T / sqrt(d_k) + M) V,  M[t, s] = -inf for s > t
                                                            (Vaswani et al. 2017, eq. 1)
    GELU(x)        = x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))      (Hendrycks & Gimpel 2016)
    GELU_tanh(x)   = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    SwiGLU(x)      = (SiLU(x W_gate) * x W_fc) W_proj, SiLU(z) = z / (1 + e^-z)  (Shazeer 2020)
    ReLU^2 MLP(x)  = max(0, x W_fc)^2 W_proj                         (So et al. 2021)
    QK-norm:       q and k of each head divided by their RMS over d_k (no gain)  (Henry et al.)
    soft-cap:      logits -> c tanh(logits / c)                      (Gemma 2)
    sinusoidal PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)  (Vaswani 3.5)
    RoPE: the pair (x_j, x_{j + d_k/2}) read as the complex number x_j + i x_{j + d_k/2} is
          multiplied by e^(i m theta_j), theta_j = base^(-2j / d_k)   (Su et al. 2021, eq. 12)
    Llama 3 rope scaling: with wavelength w_j = 2 pi / theta_j and L the original context,
          theta_j / factor if w_j > L / low, theta_j if w_j < L / high, else the blend
          (1 - s) theta_j / factor + s theta_j, s = (L / w_j - low) / (high - low)
          (Meta's llama-models, apply_scaling)
    Grouped-query attention: query head h uses key/value head h // (H / H_kv)
                                                            (Ainslie et al. 2023)

Usage:
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    logits = reference.forward(params, model.config, idx.numpy())
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "forward",
    "layer_norm",
    "rms_norm",
    "gelu",
    "gelu_tanh",
    "silu",
    "relu_squared",
    "softmax",
    "sinusoidal_table",
    "rope",
    "rope_frequencies",
    "causal_self_attention",
]

_erf = np.vectorize(math.erf)


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray | None, eps: float = 1e-5):
    """Normalise the last axis of x to zero mean and unit (biased) variance, then scale/shift."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * g
    return y if b is None else y + b


def rms_norm(x: np.ndarray, g: np.ndarray, eps: float = 1e-5):
    """Divide the last axis of x by its root mean square, then scale."""
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * g


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """The tanh approximation of GELU used by GPT-2."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU (Swish with beta 1): x * sigmoid(x)."""
    return x / (1.0 + np.exp(-x))


def relu_squared(x: np.ndarray) -> np.ndarray:
    """The squared ReLU: max(0, x)^2."""
    return np.maximum(x, 0.0) ** 2


def sinusoidal_table(T: int, d: int) -> np.ndarray:
    """[T, d]: column 2i is sin(pos / 10000^(2i/d)), column 2i+1 is cos of the same angle."""
    pe = np.zeros((T, d))
    for pos in range(T):
        for col in range(d):
            angle = pos / 10000.0 ** ((col - col % 2) / d)
            pe[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return pe


def rope_frequencies(d_k: int, base: float, scaling: dict | None = None) -> np.ndarray:
    """theta_j = base^(-2j / d_k), j < d_k / 2, rescaled by Llama 3's `scaling` if given."""
    theta = base ** (-2.0 * np.arange(d_k // 2) / d_k)
    if scaling is None:
        return theta
    L, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for t in theta:
        wavelength = 2 * math.pi / t
        if wavelength < L / high:
            out.append(t)
        elif wavelength > L / low:
            out.append(t / factor)
        else:
            s = (L / wavelength - low) / (high - low)
            out.append((1 - s) * t / factor + s * t)
    return np.array(out)


def rope(x: np.ndarray, base: float, scaling: dict | None = None) -> np.ndarray:
    """Rotate x [B, H, T, d_k] by position, as complex multiplication of the half-split pairs
    (frequencies: `rope_frequencies`)."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    theta = rope_frequencies(x.shape[-1], base, scaling)
    z = z * np.exp(1j * np.arange(x.shape[-2])[:, None] * theta[None, :])
    return np.concatenate([z.real, z.imag], axis=-1)


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


def causal_self_attention(
    x: np.ndarray,
    params: dict,
    prefix: str,
    n_heads: int,
    rope_base: float | None = None,
    qk_norm_eps: float | None = None,
    n_kv_heads: int | None = None,
    d_k: int | None = None,
    rope_scaling: dict | None = None,
):
    """x [B, T, d_model] -> (y [B, T, d_model], att [B, n_heads, T, T]).

    The fused projection's outputs are q (n_heads d_k), k and v (n_kv_heads d_k each;
    n_kv_heads None: n_heads), d_k None meaning d_model / n_heads; query head h attends with
    key/value head h // (n_heads / n_kv_heads). qk_norm_eps set means q and k are divided by
    their RMS over d_k first, rope_base set means they are then rotated by position (with
    Llama 3's rope_scaling if given)."""
    B, T, C = x.shape
    H, H_kv = n_heads, n_kv_heads or n_heads
    d_k = d_k or C // n_heads
    qkv = _linear(x, params, f"{prefix}.qkv")
    widths = np.cumsum([0, H * d_k, H_kv * d_k, H_kv * d_k])
    q, k, v = (
        qkv[..., widths[i] : widths[i + 1]].reshape(B, T, -1, d_k).transpose(0, 2, 1, 3)
        for i in range(3)
    )
    if qk_norm_eps is not None:
        q, k = (t / np.sqrt((t**2).mean(axis=-1, keepdims=True) + qk_norm_eps) for t in (q, k))
    if rope_base is not None:
        q, k = rope(q, rope_base, rope_scaling), rope(k, rope_base, rope_scaling)
    group = np.arange(H) // (H // H_kv)  # the key/value head of each query head
    k, v = k[:, group], v[:, group]
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d_k)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    att = softmax(np.where(future, -np.inf, scores))
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, H * d_k)
    return _linear(y, params, f"{prefix}.proj"), att


def forward(params: dict[str, np.ndarray], config, idx: np.ndarray) -> np.ndarray:
    """Logits of a DecoderLM computed with NumPy.

    Args:
        params: the model's state dict as NumPy arrays (keys as in `DecoderLM.state_dict()`;
            if "lm_head.weight" is absent, the token embedding is used: tied weights; rows
            past vocab_size are padding and get no logits).
        config: the ModelConfig.
        idx: [B, T] integer token ids, T <= max_positions (block_size for learned positions).

    Returns:
        [B, T, vocab_size] float64 logits.
    """
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    T = idx.shape[1]

    def norm(x, name):
        if config.norm == "rmsnorm":
            return rms_norm(x, p[f"{name}.weight"], config.norm_eps)
        return layer_norm(x, p[f"{name}.weight"], p.get(f"{name}.bias"), config.norm_eps)

    def mlp(x, pre):
        if config.mlp == "swiglu":
            h = silu(_linear(x, p, f"{pre}.mlp.gate")) * _linear(x, p, f"{pre}.mlp.fc")
        elif config.mlp == "relu2":
            h = relu_squared(_linear(x, p, f"{pre}.mlp.fc"))
        else:
            act = gelu_tanh if config.activation == "gelu_tanh" else gelu
            h = act(_linear(x, p, f"{pre}.mlp.fc"))
        return _linear(h, p, f"{pre}.mlp.proj")

    x = p["tok_emb.weight"][idx]
    if config.pos_encoding == "learned":
        x = x + p["pos_emb.weight"][:T]
    elif config.pos_encoding == "sinusoidal":
        x = x + sinusoidal_table(T, config.d_model)
    rope_base = config.rope_base if config.pos_encoding == "rope" else None
    qk_eps = config.norm_eps if config.qk_norm else None

    def attention(x, pre):
        return causal_self_attention(
            x,
            p,
            f"{pre}.attn",
            config.n_heads,
            rope_base,
            qk_eps,
            config.n_kv_heads,
            config.head_dim,
            config.rope_scaling,
        )[0]

    for i in range(config.n_layers):
        pre = f"blocks.{i}"
        if config.norm_position == "pre":
            x = x + attention(norm(x, f"{pre}.ln_1"), pre)
            x = x + mlp(norm(x, f"{pre}.ln_2"), pre)
        else:
            x = norm(x + attention(x, pre), f"{pre}.ln_1")
            x = norm(x + mlp(x, pre), f"{pre}.ln_2")
    if config.norm_position == "pre":
        x = norm(x, "ln_f")
    logits = (x @ p.get("lm_head.weight", p["tok_emb.weight"]).T)[..., : config.vocab_size]
    cap = config.logit_softcap
    return logits if cap is None else cap * np.tanh(logits / cap)
