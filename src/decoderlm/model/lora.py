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
layer. The projections of Hugging Face's Llama-family models have their names too, as peft's
target_modules give them (`TARGET_ALIASES`): q, k, v (or q_proj, k_proj, v_proj), o (o_proj,
= attn.proj), gate (gate_proj, = mlp.gate), up (up_proj, = mlp.fc), down (down_proj, =
mlp.proj). q, k and v are row ranges of the fused ``attn.qkv`` (q: n_heads head_dim rows, k
and v: n_kv_heads head_dim rows each, `qkv_rows`), so an adapter on "q,v" is one `LoRALinear`
on ``attn.qkv`` with a separate A and B per part (``attn.qkv.q``, ``attn.qkv.v`` in a
config.json's list of adapted modules): the update peft's adapters on q_proj and v_proj make.
`merge_lora` folds W + (alpha / r) B A back into plain nn.Linear layers.
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
    "TARGET_ALIASES",
    "qkv_rows",
    "adapted_names",
]

LORA_KEYS = ("lora_A", "lora_B")  # the adapter tensors' names inside an adapted layer
QKV_PARTS = ("q", "k", "v")
TARGET_ALIASES = {
    **{p: f"qkv.{p}" for p in QKV_PARTS},
    **{f"{p}_proj": f"qkv.{p}" for p in QKV_PARTS},
    "o": "attn.proj",
    "o_proj": "attn.proj",
    "gate_proj": "mlp.gate",
    "up": "mlp.fc",
    "up_proj": "mlp.fc",
    "down": "mlp.proj",
    "down_proj": "mlp.proj",
}
"""Hugging Face Llama's projection names (peft's target_modules), as decoderlm's targets."""


def is_lora_key(key: str) -> bool:
    """Whether a state-dict key names an adapter tensor (``...lora_A`` or ``...lora_B``)."""
    return key.rsplit(".", 1)[-1] in LORA_KEYS


class LoRALinear(nn.Linear):
    """An nn.Linear plus a low-rank update: forward(x [..., d_in]) -> [..., d_out] is
    F.linear(x, weight, bias) + scale * dropout(x) @ lora_A^T @ lora_B^T, scale = alpha / rank.

    With `rows` ({part: (start, stop)}, ranges of the output in row order, e.g. the q and v
    parts of a fused qkv) each range p has its own rank-r update B_p A_p on those rows only,
    the other rows unchanged: lora_A stacks the A_p [len(rows) * rank, d_in], lora_B the B_p
    [sum of the ranges' lengths, rank].

    Attributes:
        weight [d_out, d_in], bias [d_out] | None: the base layer's (frozen by `apply_lora`).
        lora_A [rank, d_in]: Kaiming-uniform initialised. lora_B [d_out, rank]: zeros.
        rows: None (the whole layer), or {part name: its (start, stop) rows}, in row order.
        scale: alpha / rank (float).
    """

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        rows: dict[str, tuple[int, int]] | None = None,
    ):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.rows = None if rows is None else {p: tuple(span) for p, span in rows.items()}
        spans = [(0, self.out_features)] if rows is None else list(self.rows.values())
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank * len(spans), self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(sum(b - a for a, b in spans), rank, **like))
        if base.weight.device.type != "meta":
            for A in self.lora_A.data.split(rank):
                nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # nn.Linear's own init
        self.lora_dropout = nn.Dropout(dropout)

    def _parts(self):
        """(start, stop, A_p [rank, d_in], B_p [stop - start, rank]) of each adapted range."""
        spans = [(0, self.out_features)] if self.rows is None else list(self.rows.values())
        Bs = self.lora_B.split([b - a for a, b in spans])
        return [
            (a, b, A, B)
            for (a, b), A, B in zip(spans, self.lora_A.split(self.rank), Bs, strict=True)
        ]

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        h = self.lora_dropout(x)
        if self.rows is None:
            return y + self.scale * F.linear(F.linear(h, self.lora_A), self.lora_B)
        pieces, at = [], 0
        for a, b, A, B in self._parts():
            if a > at:  # rows no adapter touches
                pieces.append(y.new_zeros(*y.shape[:-1], a - at))
            pieces.append(F.linear(F.linear(h, A), B))
            at = b
        if at < self.out_features:
            pieces.append(y.new_zeros(*y.shape[:-1], self.out_features - at))
        return y + self.scale * torch.cat(pieces, dim=-1)

    def delta_weight(self) -> Tensor:
        """scale * B A as a [d_out, d_in] float32 matrix (zero outside the adapted rows)."""
        delta = torch.zeros(self.out_features, self.in_features, device=self.weight.device)
        for a, b, A, B in self._parts():
            delta[a:b] = self.scale * (B.float() @ A.float())
        return delta

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
            linear.weight.copy_(self.weight.float() + self.delta_weight())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        rows = "" if self.rows is None else f", rows={self.rows}"
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}{rows}"


def qkv_rows(attention: nn.Module) -> dict[str, tuple[int, int]]:
    """The (start, stop) output rows of q, k and v in a `CausalSelfAttention`'s fused qkv:
    q [0, n_heads head_dim), k and v n_kv_heads head_dim rows each after it."""
    H, D = attention.n_heads, attention.head_dim
    H_kv = getattr(attention, "n_kv_heads", H)
    q, kv = H * D, H_kv * D
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}


def parse_targets(targets: str | list[str]) -> list[str]:
    """ "qkv,proj" (or ["qkv", "proj"]) -> ["qkv", "proj"], each alias of `TARGET_ALIASES`
    ("q_proj", "up", ...) replaced by decoderlm's name; UserError if none is given."""
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [TARGET_ALIASES.get(n.strip(), n.strip()) for n in names if n.strip()]
    if not names:
        raise UserError("lora_targets names no layer; give e.g. qkv or qkv,proj,fc (or q,v)")
    return names


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _split_part(target: str) -> tuple[str, str | None]:
    """ "blocks.0.attn.qkv.q" -> ("blocks.0.attn.qkv", "q"); a target without a part -> (it,
    None)."""
    layer, _, part = target.rpartition(".")
    if part in QKV_PARTS and (layer == "qkv" or layer.endswith(".qkv")):
        return layer, part
    return target, None


def _target_layers(model: nn.Module, targets: list[str]) -> dict[str, tuple[nn.Linear, set]]:
    """{module name: (the nn.Linear, the q/k/v parts asked for, empty for the whole layer)} of
    the layers the targets name; UserError for a target that matches none, for a layer named
    both whole and by parts, or for the unembedding when it shares its weight with the
    embedding."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen: dict[str, tuple[nn.Linear, set]] = {}
    for target in targets:
        layer_target, part = _split_part(target)
        found = {n: m for n, m in linears.items() if _matches(n, layer_target)}
        if not found:
            names = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise UserError(
                f"LoRA target {target!r} matches no linear layer; the layers are named "
                f"{names} (or by a longer suffix such as attn.proj, mlp.proj, blocks.0.attn.qkv; "
                f"or q, k, v, o, gate, up, down)"
            )
        for n, m in found.items():
            chosen.setdefault(n, (m, set()))[1].add(part)
    both = [n for n, (_, parts) in chosen.items() if None in parts and len(parts) > 1]
    if both:
        raise UserError(
            f"LoRA targets name {both[0]} both whole and by its q/k/v parts; give qkv or "
            f"some of q, k, v"
        )
    chosen = {n: (m, parts - {None}) for n, (m, parts) in chosen.items()}
    embedding = getattr(getattr(model, "tok_emb", None), "weight", None)
    tied = [n for n, (m, _) in chosen.items() if m.weight is embedding]
    if tied:
        raise UserError(
            f"cannot adapt {tied[0]}: it shares its weight with the token embedding "
            f"(tie_embeddings), and merging an update into it would change the embedding too"
        )
    return chosen


def _rows_of(model: nn.Module, name: str, parts: set) -> dict[str, tuple[int, int]] | None:
    """{part: its row range} of `parts` in layer `name`, in row order (None: the whole
    layer)."""
    if not parts:
        return None
    rows = qkv_rows(model.get_submodule(name.rpartition(".")[0]))
    return {p: span for p, span in rows.items() if p in parts}


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
    already = [n for n, (m, _) in chosen.items() if isinstance(m, LoRALinear)]
    if already:
        raise UserError(f"{already[0]} already has LoRA adapters")
    rows = {n: _rows_of(model, n, parts) for n, (_, parts) in chosen.items()}
    widths = {
        n: min(
            m.in_features, *((b - a for a, b in rows[n].values()) if rows[n] else (m.out_features,))
        )
        for n, (m, _) in chosen.items()
    }
    name = min(widths, key=widths.get)
    if rank > widths[name]:
        raise UserError(
            f"lora_rank {rank} is above min(d_out, d_in) = {widths[name]} of {name}, "
            f"the highest rank its update B A can have; give at most {widths[name]}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, (layer, _) in chosen.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, LoRALinear(layer, rank, alpha, dropout, rows[name]))
    return adapted_names(model)


def adapted_names(model: nn.Module) -> list[str]:
    """The adapted layers' names in model order, a layer adapted on q/k/v parts once per part
    ("blocks.0.attn.qkv.q"): targets that `apply_lora` turns into the same adapters."""
    names = []
    for n, m in model.named_modules():
        if isinstance(m, LoRALinear):
            names += [n] if m.rows is None else [f"{n}.{p}" for p in m.rows]
    return names


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
