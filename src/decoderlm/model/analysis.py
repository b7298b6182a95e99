"""Counts from hyperparameters alone, checked in the tests against the real modules."""

from __future__ import annotations

import contextlib
import re

from ..config import ModelConfig
from ..errors import UserError
from ..options import canonical_dtype

__all__ = [
    "count_parameters",
    "matmul_parameters",
    "flops_per_token",
    "mfu",
    "activation_bytes_per_token",
    "memory_bytes",
    "is_out_of_memory",
    "out_of_memory_as_user_error",
    "DTYPE_BYTES",
]


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Closed-form parameter count of a DecoderLM, with a breakdown.

    With d = d_model, V = vocab_rows (padded_vocab_size when set, else vocab_size; padded
    rows are parameters too), L = n_layers, f = d_ff, b = 1 if bias else 0, b_qkv = 1 if
    bias or qkv_bias else 0, q = n_heads head_dim, kv = n_kv_heads head_dim:
        embeddings = V d (+ block_size d for a learned position table; sinusoidal and rotary
                     positions have no parameters)
        attention  = L ((d + b_qkv) (q + 2 kv) + q d + b d)  (fused QKV + output projection;
                     3 d^2 + 3 b d + d^2 + b d for multi-head attention with head_dim d / H)
        mlp        = L (2 d f + b f + b d)       for "gelu", "relu2"  (fc + proj)
                     L (3 d f + 2 b f + b d)     for "swiglu"  (gate + fc + proj)
        norms      = n_norms (d + b d) for LayerNorm, n_norms d for RMSNorm, where
                     n_norms = 2 L + 1 with pre-norm (the final norm) and 2 L with post-norm
        head       = 0 if tie_embeddings else V d           (the unembedding)

    Returns:
        dict with keys embeddings, attention, mlp, norms, head, total (unique parameters; a
        tied matrix counts once) and non_embedding (total minus the learned position table).
    """
    d, V, L, b, f = (
        config.d_model,
        config.vocab_rows,
        config.n_layers,
        int(config.bias),
        config.d_ff,
    )
    position_table = config.block_size * d if config.pos_encoding == "learned" else 0
    n_norms = 2 * L + (1 if config.norm_position == "pre" else 0)
    per_norm = d if config.norm == "rmsnorm" else d + b * d
    mlp = 3 * d * f + 2 * b * f + b * d if config.mlp == "swiglu" else 2 * d * f + b * f + b * d
    q, kv = _attention_widths(config)
    b_qkv = int(config.bias or config.qkv_bias)
    counts = {
        "embeddings": V * d + position_table,
        "attention": L * ((d + b_qkv) * (q + 2 * kv) + q * d + b * d),
        "mlp": L * mlp,
        "norms": n_norms * per_norm,
        "head": 0 if config.tie_embeddings else V * d,
    }
    counts["total"] = sum(counts.values())
    counts["non_embedding"] = counts["total"] - position_table
    return counts


def _attention_widths(config: ModelConfig) -> tuple[int, int]:
    """(n_heads head_dim, n_kv_heads head_dim): the widths of q and of each of k and v."""
    return config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # by torch's name (canonical_dtype)


def _bytes_per_element(dtype: str) -> int:
    """Bytes of one element of a number format (any name of DtypeName; UserError else)."""
    return DTYPE_BYTES[canonical_dtype(dtype)]


def matmul_parameters(config: ModelConfig) -> int:
    """N of the FLOP formulas: the parameters a token's forward pass multiplies with, i.e.
    every parameter except the position table and, when untied, the token embedding (a table
    lookup). With tied weights this is the nanoGPT "non-embedding" count."""
    counts = count_parameters(config)
    lookup_only = 0 if config.tie_embeddings else config.vocab_rows * config.d_model
    return counts["non_embedding"] - lookup_only


def _seq_len(config: ModelConfig, seq_len: int | None) -> int:
    """seq_len, or block_size when None; raises UserError outside 1..max_positions (the
    longest sequence the model takes: block_size unless its config allows more)."""
    T = config.block_size if seq_len is None else seq_len
    if not 1 <= T <= config.max_positions:
        raise UserError(f"seq_len must be in 1..{config.length_limit}, got {T}")
    return T


def flops_per_token(
    config: ModelConfig, seq_len: int | None = None, convention: str = "kaplan"
) -> dict[str, int]:
    """FLOPs (multiply-adds count 2) per token and per sequence of length seq_len.

    forward = 2 N + attention, training (forward + backward) = 3 x forward, with N =
    `matmul_parameters(config)` and L = n_layers, T = seq_len, d_attn = n_heads head_dim
    (d_model unless head_dim is set; grouped key/value heads do not change it: every query
    head still scores T keys and sums T values):
        "kaplan" (Kaplan et al. 2020, table 1; causal attention, each query sees T/2 keys on
                 average):  attention = 2 L T d_attn, so training = 6N + 6 L T d_attn
        "palm"   (Chowdhery et al. 2022, appendix B; full T x T attention, as nanoGPT's MFU):
                 attention = 4 L T d_attn, so training = 6N + 12 L T d_attn (= 6N + 12 L H Q T)

    Returns:
        dict: n_matmul_params, forward, training (per token), forward_per_sequence,
        training_per_sequence, all FLOPs.

    Raises:
        UserError: an unknown convention, or seq_len outside 1..max_positions.
    """
    T = _seq_len(config, seq_len)
    factor = {"kaplan": 2, "palm": 4}.get(convention)
    if factor is None:
        raise UserError(f"convention must be 'kaplan' or 'palm', got {convention!r}")
    N = matmul_parameters(config)
    forward = 2 * N + factor * config.n_layers * T * _attention_widths(config)[0]
    return {
        "n_matmul_params": N,
        "forward": forward,
        "training": 3 * forward,
        "forward_per_sequence": forward * T,
        "training_per_sequence": 3 * forward * T,
    }


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s (flops_per_token * tokens_per_s) over the peak."""
    return flops_per_token * tokens_per_s / peak_flops_per_s


def activation_bytes_per_token(
    config: ModelConfig, seq_len: int, dtype: str = "fp32"
) -> dict[str, int]:
    """Bytes autograd keeps per token for the backward pass of this implementation.

    Per block, with dropout 0 (the fused scaled_dot_product_attention path, which keeps no
    T x T matrix, so memory is linear in T), in elements of `dtype`, with q = n_heads
    head_dim and kv = n_kv_heads head_dim (both d for multi-head attention with head_dim
    d / n_heads): the two norms' inputs and outputs (4 d), q, k, v (q + 2 kv), the attention
    output and its log-sum-exp (q + n_heads), and the MLP hidden activations: pre- and
    post-GELU (2 d_ff) or, for SwiGLU, gate, up, SiLU and product (4 d_ff). Rotary positions
    add the rotated q and k and their contiguous copies (2 q + 2 kv). With dropout > 0,
    attention runs the explicit path, which keeps scores, probabilities, dropped
    probabilities (3 n_heads T elements) and a byte mask (n_heads T bytes), plus two
    residual-dropout byte masks (2 d bytes): that part grows as T^2.
    Outside the blocks: the embedding sum and the final norm's output (2 d elements) and the
    logits and their log-softmax (2 vocab_size float32 elements).

    Returns:
        dict: per_layer, blocks (n_layers x per_layer), outside_blocks, logits; bytes per token.
    """
    b = _bytes_per_element(dtype)
    d, f, H = config.d_model, config.d_ff, config.n_heads
    q, kv = _attention_widths(config)
    per_layer = (
        4 * d
        + 2 * q
        + 2 * kv
        + H
        + (4 * f if config.mlp == "swiglu" else 2 * f)
        + (2 * q + 2 * kv if config.pos_encoding == "rope" else 0)
    ) * b
    if config.dropout > 0:
        per_layer += 3 * H * seq_len * b + H * seq_len + 2 * d
    return {
        "per_layer": per_layer,
        "blocks": config.n_layers * per_layer,
        "outside_blocks": 2 * d * b,
        "logits": 2 * config.vocab_size * 4,
    }


def memory_bytes(
    config: ModelConfig,
    batch_size: int = 1,
    seq_len: int | None = None,
    dtype: str = "fp32",
    activation_checkpointing: bool = False,
) -> dict[str, int]:
    """Memory of training and inference, in bytes.

    weights, gradients: P parameters x bytes per element; adamw: two moments per parameter,
    kept in the parameters' dtype as torch.optim.AdamW does; activations: B T x
    `activation_bytes_per_token` (logits in float32, the rest in dtype); with activation
    checkpointing only each block's input (d per token per layer) is kept, plus one block's
    activations while it is recomputed. kv_cache: 2 n_layers B T n_kv_heads head_dim x bytes
    (Pope et al. 2022; 2 n_layers B T d_model for multi-head attention with head_dim d_model /
    n_heads), what inference keeps for T cached positions (a `KVCache`'s buffers).
    training_total = weights + gradients + adamw + activations. training_peak adds
    loss_backward_transient: at the start of backward the gradients of the log-probabilities
    and of the logits (2 B T vocab_size float32) live beside all the activations; with a
    large vocabulary this is the step's high-water mark.

    Raises:
        UserError: unknown dtype, or seq_len outside 1..max_positions.
    """
    T = _seq_len(config, seq_len)
    b = _bytes_per_element(dtype)
    P = count_parameters(config)["total"]
    act = activation_bytes_per_token(config, T, dtype)
    blocks = (
        config.n_layers * config.d_model * b + act["per_layer"]
        if activation_checkpointing
        else act["blocks"]
    )
    activations = batch_size * T * (blocks + act["outside_blocks"] + act["logits"])
    out = {
        "weights": P * b,
        "gradients": P * b,
        "adamw": 2 * P * b,
        "activations": activations,
        "kv_cache": 2 * config.n_layers * batch_size * T * _attention_widths(config)[1] * b,
    }
    out["training_total"] = out["weights"] + out["gradients"] + out["adamw"] + activations
    out["loss_backward_transient"] = 2 * batch_size * T * config.vocab_size * 4
    out["training_peak"] = out["training_total"] + out["loss_backward_transient"]
    return out


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is torch failing to allocate memory (CPU or accelerator)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "DefaultCPUAllocator" in text or "out of memory" in text.lower()
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:,.3f} GiB"


@contextlib.contextmanager
def out_of_memory_as_user_error(
    what: str, config: ModelConfig | None = None, batch_size: int = 1, params_flags: str = ""
):
    """Turn torch's allocation failure inside the block into one UserError line: what could
    not be done, the bytes torch asked for, the estimate of `decoderlm params` (weights, and
    with a batch size the float32 training peak, from `memory_bytes`) and the command that
    gives the figures.

    Args:
        what: what the block does, e.g. "build the model".
        config: the model's settings, for the estimate (None: no estimate).
        batch_size: sequences per batch of the training estimate; 0 gives weights only.
        params_flags: the flags of `decoderlm params` that name the model (e.g. "--run DIR").

    Raises:
        UserError: the block ran out of memory; other exceptions pass unchanged.
    """
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not (isinstance(e, MemoryError) or is_out_of_memory(e)):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(e))
        parts = [f"not enough memory to {what}"]
        if asked:
            parts.append(f"torch asked for {_gib(int(asked.group(1)))}")
        if config is not None:
            est = memory_bytes(config, batch_size=max(batch_size, 1))
            size = f"the model's weights are {_gib(est['weights'])}"
            if batch_size:
                size += f", training at batch size {batch_size} about {_gib(est['training_peak'])}"
            parts.append(size)
        flags = f" {params_flags}" if params_flags else ""
        parts.append(f"`decoderlm params{flags}` gives the figures; choose a smaller model")
        raise UserError("; ".join(parts)) from None
