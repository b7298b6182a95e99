"""Counts from hyperparameters alone, checked in the tests against the real modules."""

from __future__ import annotations

from .config import ModelConfig

__all__ = ["count_parameters"]


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Closed-form parameter count of a DecoderLM, with a breakdown.

    With d = d_model, V = vocab_size, L = n_layers, b = 1 if bias else 0:
        embeddings = V d + block_size d                     (token + learned position table)
        attention  = L (3 d^2 + 3 b d + d^2 + b d)          (fused QKV + output projection)
        mlp        = L (2 d d_ff + b d_ff + b d)            (fc + proj)
        norms      = (2 L + 1)(d + b d)                     (ln_1, ln_2 per block, final ln_f)
        head       = 0 if tie_embeddings else V d           (the unembedding)

    Returns:
        dict with keys embeddings, attention, mlp, norms, head, total (unique parameters; a
        tied matrix counts once) and non_embedding (total minus the position table).
    """
    d, V, L, b, f = (config.d_model, config.vocab_size, config.n_layers, int(config.bias),
                     config.d_ff)
    counts = {
        "embeddings": V * d + config.block_size * d,
        "attention": L * (3 * d * d + 3 * b * d + d * d + b * d),
        "mlp": L * (2 * d * f + b * f + b * d),
        "norms": (2 * L + 1) * (d + b * d),
        "head": 0 if config.tie_embeddings else V * d,
    }
    counts["total"] = sum(counts.values())
    counts["non_embedding"] = counts["total"] - config.block_size * d
    return counts
