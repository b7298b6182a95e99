"""The optimiser and its learning-rate schedule.

Training minimises the mean next-token cross-entropy with AdamW (or Muon for the hidden
weight matrices and AdamW for the rest: `MuonWithAdamW`), a learning-rate schedule (`lr_at`:
constant, warm-up + cosine, or warm-up-stable-decay), and gradient-norm clipping (in
`loop.train_step`).
"""

from __future__ import annotations

import math

import torch

from ..config import OptimConfig, TrainConfig
from ..cpu import native_bfloat16
from ..errors import UserError

__all__ = [
    "lr_at",
    "set_lr",
    "configure_optimizer",
    "MuonWithAdamW",
    "muon_parameters",
    "muon_dtype",
    "newton_schulz",
]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based).

    cfg.optim.lr is the peak; cfg.steps holds the schedule and its lengths.
    "constant": lr. "cosine": linear warm-up lr * (step + 1) / warmup_steps over the first
    warmup_steps steps, then min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 with
    progress going from 0 to 1 over the steps up to decay_steps (default max_steps), then 1
    (Loshchilov & Hutter 2017, eq. 5). "wsd": the same warm-up, then lr until the last
    cooldown = max(1, round(cooldown_fraction * decay_steps)) steps before decay_steps, over
    which it falls linearly, lr + (min_lr - lr) * (step - start + 1) / cooldown, reaching
    min_lr at step decay_steps - 1 and staying there.
    """
    lr, s = cfg.optim.lr, cfg.steps
    if s.schedule == "constant":
        return lr
    if step < s.warmup_steps:
        return lr * (step + 1) / s.warmup_steps
    if s.schedule == "wsd":
        total = s.decay_steps or s.max_steps
        cooldown = max(1, round(s.cooldown_fraction * total))
        progress = min(1.0, max(0, step - (total - cooldown) + 1) / cooldown)
        return lr + (s.min_lr - lr) * progress
    decay_steps = max(1, (s.decay_steps or s.max_steps) - 1 - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / decay_steps)
    return s.min_lr + 0.5 * (lr - s.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Give every parameter group learning rate `lr` (times the group's "lr_scale", which
    `MuonWithAdamW` sets on Muon's group); returns lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) with decoupled weight decay on every parameter of 2 or
    more dimensions and none on biases and norm gains (1-D).

    Embeddings are decayed too, as in nanoGPT: with tied weights the token embedding is also
    the unembedding matrix, a weight matrix like any other, and the learned position table is
    a [block_size, d_model] matrix whose unused rows decay towards 0 instead of staying at
    their random initial values. Biases and gains are not decayed: pulling a LayerNorm gain
    towards 0 rather than 1 would fight the normalisation.

    The fused AdamW kernel (one kernel for all parameters) is used on CPU and CUDA; FSDP's
    sharded parameters use the default multi-tensor implementation.

    cfg.optim.optimizer "muon": `MuonWithAdamW`, Muon for `muon_parameters(model)` and the above for
    the rest.

    Raises:
        UserError: "muon" and the model has no trainable weight matrix inside its blocks.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = not cfg.compute.fsdp and all(p.device.type in ("cpu", "cuda") for p in params)
    if cfg.optim.optimizer == "muon":
        hidden = muon_parameters(model)
        if not hidden:
            raise UserError(
                "optimizer 'muon' needs trainable weight matrices inside the blocks (attention "
                "and MLP Linear layers) and this model has none; use --optimizer adamw"
            )
        hidden_ids = {id(p) for p in hidden}
        rest = [p for p in params if id(p) not in hidden_ids]
        return MuonWithAdamW(hidden, _adamw_groups(rest, cfg.optim), cfg, fused)
    return torch.optim.AdamW(
        _adamw_groups(params, cfg.optim),
        lr=lr_at(0, cfg),
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        fused=fused,
    )


def _adamw_groups(params: list, optim: OptimConfig) -> list[dict]:
    """AdamW's two groups: weight decay on parameters of 2 or more dimensions, none on 1-D."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def muon_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights Muon trains: the trainable weight matrix of every nn.Linear inside
    model.blocks (attention qkv and proj, MLP fc, gate and proj), chosen by module, so that
    embeddings, the (possibly tied) unembedding, norm gains and biases stay with AdamW."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.Module):
        return []
    return [
        m.weight
        for m in blocks.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.requires_grad
    ]


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # a, b, c of Muon's quintic iteration
NS_STEPS = 5


def muon_dtype(device: torch.device) -> torch.dtype:
    """The dtype of Muon's Newton-Schulz products on `device`: bfloat16 on CUDA and on CPUs
    that multiply it natively (`decoderlm.cpu.native_bfloat16`), else float32 (there, bfloat16
    products are converted element by element: 567 against 17 ms per step for the default
    preset's 12 matrices on a 2-core AVX2 EPYC)."""
    if device.type == "cpu" and not native_bfloat16():
        return torch.float32
    return torch.bfloat16


def newton_schulz(update: torch.Tensor, dtype: torch.dtype, steps: int = NS_STEPS) -> torch.Tensor:
    """Muon's approximate orthogonalisation of update [rows, cols] (Jordan et al. 2024, the
    iteration and coefficients of torch.optim.Muon): X = G / ||G||_F (transposed when rows >
    cols, so that X X^T is the smaller Gram matrix), then `steps` times
    X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = NS_COEFFICIENTS, in `dtype`.

    The result has the singular vectors of G and singular values near 1 (about 0.7 to 1.2,
    not exactly 1). Returns [rows, cols] in `dtype`.
    """
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer that steps Muon on the hidden matrices and torch.optim.AdamW on the rest.

    Its param_groups are Muon's group (first: lr, weight_decay, momentum, and "lr_scale" =
    muon_lr / lr for `set_lr`) followed by AdamW's groups, and its state holds both
    optimizers' per-parameter state (Muon's momentum_buffer, AdamW's step / exp_avg /
    exp_avg_sq), so `state_dict()`, `load_state_dict()`, a GradScaler and
    torch.distributed.checkpoint treat it as any single optimizer.

    Muon (Jordan et al. 2024; the update of torch.optim.Muon with nesterov=True and
    adjust_lr_fn "original"): for a weight W [rows, cols] with gradient G, the momentum buffer
    M <- momentum M + (1 - momentum) G, the Nesterov update U = momentum M + (1 - momentum) G
    orthogonalised by `newton_schulz` (in `muon_dtype`: torch.optim.Muon always multiplies in
    bfloat16, slow on CPUs without native bfloat16), then W <- W (1 - lr weight_decay) -
    lr sqrt(max(1, rows / cols)) U.

    Args:
        hidden: the 2-D weights for Muon (`muon_parameters`).
        adamw_groups: AdamW's parameter groups (weight decay set per group).
        cfg: the TrainConfig: its optim section (lr, muon_lr, muon_momentum, weight_decay,
            beta1, beta2) and the schedule (`lr_at`).
        fused: use the fused AdamW kernel.
    """

    def __init__(self, hidden: list, adamw_groups: list[dict], cfg: TrainConfig, fused: bool):
        optim = cfg.optim
        self.lr_scale = optim.muon_lr / optim.lr
        lr = lr_at(0, cfg)
        muon = {
            "params": hidden,
            "lr": lr * self.lr_scale,
            "lr_scale": self.lr_scale,
            "weight_decay": optim.weight_decay,
            "momentum": optim.muon_momentum,
        }
        self.adamw = torch.optim.AdamW(
            adamw_groups, lr=lr, betas=(optim.beta1, optim.beta2), fused=fused
        )
        super().__init__([muon, *self.adamw.param_groups], defaults={})
        self._link()

    def _link(self) -> None:
        """Let AdamW step on this optimizer's groups after Muon's and on its state (again after
        load_state_dict, which replaces them)."""
        self.adamw.param_groups = self.param_groups[1:]
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state_dict(); Muon's lr_scale stays this run's muon_lr / lr."""
        super().load_state_dict(state_dict)
        self._link()
        self.param_groups[0]["lr_scale"] = self.lr_scale

    @torch.no_grad()
    def step(self, closure=None):
        """One step of both optimizers (closure: re-evaluates the loss, as in any optimizer)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step(self.param_groups[0])
        self.adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        """Muon's update (see the class) of every weight in `group` that has a gradient."""
        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = newton_schulz(p.grad.lerp(buf, momentum), muon_dtype(p.device))
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * math.sqrt(max(1, p.size(0) / p.size(1))))
