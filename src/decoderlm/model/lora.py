"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's nn.Linear layers.

An adapted layer computes, for x [..., d_in],

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

(Hu et al. 2021, eq. 3, h = W0 x + B A x, with the alpha / r scaling of their section 4.1)

with W [d_out, d_in] and b frozen, A [r, d_in] initialised like a Linear weight (Kaiming
uniform) and B [d_out, r] initialised to zero, so the adapted model computes exactly what the
base model does until B has been trained. `LoRALinear` is an nn.Linear, so its base tensors keep
their names (``blocks.0.attn.qkv.weight``): a state dict is the base model's plus the adapter
tensors ``<layer>.lora_A`` / ``<layer>.lora_B``, which are what an adapter file stores.

Targets name layers by the end of their module name: "qkv" adapts every ``*.qkv``; "proj"
both ``attn.proj`` and ``mlp.proj``; "attn.proj" only the attention's; "blocks.0.attn.qkv" one
layer. `merge_lora` folds W + (alpha / r) B A back into plain nn.Linear layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError

__all__ = [
    "LoRALinear",
    "apply_lora",
    "merge_lora",
    "lora_parameter_count",
    "is_lora_key",
    "parse_targets",
    "LORA_KEYS",
]

LORA_KEYS = ("lora_A", "lora_B")  # the adapter tensors' names inside an adapted layer


def is_lora_key(key: str) -> bool:
    """Whether a state-dict key names an adapter tensor (``...lora_A`` or ``...lora_B``)."""
    return key.rsplit(".", 1)[-1] in LORA_KEYS


class LoRALinear(nn.Linear):
    """An nn.Linear plus a low-rank update: forward(x [..., d_in]) -> [..., d_out] is
    F.linear(x, weight, bias) + scale * dropout(x) @ lora_A^T @ lora_B^T, scale = alpha / rank.

    Attributes:
        weight [d_out, d_in], bias [d_out] | None: the base layer's (frozen by `apply_lora`).
        lora_A [rank, d_in]: Kaiming-uniform initialised. lora_B [d_out, rank]: zeros.
        scale: alpha / rank (float).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))
        if base.weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init
        self.lora_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scale * update

    def merged(self) -> nn.Linear:
        """A plain nn.Linear with weight W + scale * B A (float32 arithmetic, stored in W's
        dtype) and the same bias."""
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        with torch.no_grad():
            delta = self.scale * (self.lora_B.float() @ self.lora_A.float())
            linear.weight.copy_(self.weight.float() + delta)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def parse_targets(targets: str | list[str]) -> list[str]:
    """ "qkv,proj" (or ["qkv", "proj"]) -> ["qkv", "proj"]; UserError if none is given."""
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise UserError("lora_targets names no layer; give e.g. qkv or qkv,proj,fc")
    return names


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _target_layers(model: nn.Module, targets: list[str]) -> dict[str, nn.Linear]:
    """The nn.Linear layers the targets name, by module name; UserError for a target that
    matches none, or for the unembedding when it shares its weight with the embedding."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = {}
    for target in targets:
        found = {n: m for n, m in linears.items() if _matches(n, target)}
        if not found:
            names = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise UserError(
                f"LoRA target {target!r} matches no linear layer; the layers are named "
                f"{names} (or by a longer suffix such as attn.proj, mlp.proj, blocks.0.attn.qkv)"
            )
        chosen.update(found)
    embedding = getattr(getattr(model, "tok_emb", None), "weight", None)
    tied = [n for n, m in chosen.items() if m.weight is embedding]
    if tied:
        raise UserError(
            f"cannot adapt {tied[0]}: it shares its weight with the token embedding "
            f"(tie_embeddings), and merging an update into it would change the embedding too"
        )
    return chosen


def apply_lora(
    model: nn.Module, rank: int, alpha: float, targets: str | list[str], dropout: float = 0.0
) -> list[str]:
    """Replace the target nn.Linear layers of `model` by `LoRALinear`s (in place) and freeze
    every other parameter: afterwards only lora_A / lora_B have requires_grad.

    The new A matrices draw from torch's global RNG (seed it first for a reproducible run).

    Returns:
        The adapted layers' module names, in model order.

    Raises:
        UserError: rank < 1 or above a target's min(d_out, d_in), alpha <= 0, a target matches
            no linear layer (the message lists the layer names), or a target is a layer already
            adapted or tied to the embedding.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UserError(f"lora_rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise UserError(f"lora_alpha must be > 0, got {alpha!r}")
    chosen = _target_layers(model, parse_targets(targets))
    already = [n for n, m in chosen.items() if isinstance(m, LoRALinear)]
    if already:
        raise UserError(f"{already[0]} already has LoRA adapters")
    name, layer = min(chosen.items(), key=lambda item: min(item[1].weight.shape))
    if rank > min(layer.weight.shape):
        raise UserError(
            f"lora_rank {rank} is above min(d_out, d_in) = {min(layer.weight.shape)} of {name}, "
            f"the highest rank its update B A can have; give at most {min(layer.weight.shape)}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, layer in chosen.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, LoRALinear(layer, rank, alpha, dropout))
    return list(chosen)


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every `LoRALinear` of `model` by its merged nn.Linear (W + (alpha / r) B A), in
    place; returns the model, whose state dict then has the base model's keys only."""
    for name, layer in list(model.named_modules()):
        if isinstance(layer, LoRALinear):
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, layer.merged())
    return model


def lora_parameter_count(shapes: list[tuple[int, int]], rank: int) -> int:
    """Closed-form count of adapter parameters: rank * (d_in + d_out) for each adapted matrix
    of shape (d_out, d_in) (A is [rank, d_in], B is [d_out, rank])."""
    return sum(rank * (d_in + d_out) for d_out, d_in in shapes)
