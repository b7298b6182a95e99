"""The optimiser and its learning-rate schedule.

Training minimises the mean next-token cross-entropy with AdamW, a linear warm-up then cosine
decay of the learning rate (`lr_at`), and gradient-norm clipping (in `loop.train_step`).
"""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig

__all__ = ["lr_at", "set_lr", "configure_optimizer"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based).

    "constant": cfg.lr. "cosine": linear warm-up lr * (step + 1) / warmup_steps over the first
    warmup_steps steps, then min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 with
    progress going from 0 to 1 over the steps up to decay_steps (default max_steps), then 1
    (Loshchilov & Hutter 2017, eq. 5).
    """
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, (cfg.decay_steps or cfg.max_steps) - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Give every parameter group learning rate `lr`; returns lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) with decoupled weight decay on every parameter of 2 or
    more dimensions and none on biases and norm gains (1-D).

    Embeddings are decayed too, as in nanoGPT: with tied weights the token embedding is also
    the unembedding matrix, a weight matrix like any other, and the learned position table is
    a [block_size, d_model] matrix whose unused rows decay towards 0 instead of staying at
    their random initial values. Biases and gains are not decayed: pulling a LayerNorm gain
    towards 0 rather than 1 would fight the normalisation.

    The fused AdamW kernel (one kernel for all parameters) is used on CPU and CUDA; FSDP's
    sharded parameters use the default multi-tensor implementation.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = not cfg.fsdp and all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2), fused=fused)
