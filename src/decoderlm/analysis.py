"""Counts from hyperparameters alone, checked in the tests against the real modules."""

from __future__ import annotations

from .config import ModelConfig

__all__ = ["count_parameters"]


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Closed-form parameter count of a DecoderLM, with a breakdown.

    With d = d_model, V = vocab_size, L = n_layers, f = d_ff, b = 1 if bias else 0:
        embeddings = V d (+ block_size d for a learned position table; sinusoidal and rotary
                     positions have no parameters)
        attention  = L (3 d^2 + 3 b d + d^2 + b d)            (fused QKV + output projection)
        mlp        = L (2 d f + b f + b d)       for "gelu"    (fc + proj)
                     L (3 d f + 2 b f + b d)     for "swiglu"  (gate + fc + proj)
        norms      = n_norms (d + b d) for LayerNorm, n_norms d for RMSNorm, where
                     n_norms = 2 L + 1 with pre-norm (the final norm) and 2 L with post-norm
        head       = 0 if tie_embeddings else V d           (the unembedding)

    Returns:
        dict with keys embeddings, attention, mlp, norms, head, total (unique parameters; a
        tied matrix counts once) and non_embedding (total minus the learned position table).
    """
    d, V, L, b, f = (config.d_model, config.vocab_size, config.n_layers, int(config.bias),
                     config.d_ff)
    position_table = config.block_size * d if config.pos_encoding == "learned" else 0
    n_norms = 2 * L + (1 if config.norm_position == "pre" else 0)
    per_norm = d if config.norm == "rmsnorm" else d + b * d
    mlp = 3 * d * f + 2 * b * f + b * d if config.mlp == "swiglu" else 2 * d * f + b * f + b * d
    counts = {
        "embeddings": V * d + position_table,
        "attention": L * (3 * d * d + 3 * b * d + d * d + b * d),
        "mlp": L * mlp,
        "norms": n_norms * per_norm,
        "head": 0 if config.tie_embeddings else V * d,
    }
    counts["total"] = sum(counts.values())
    counts["non_embedding"] = counts["total"] - position_table
    return counts
