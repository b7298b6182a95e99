"""Which parameters train: `prepare_trainable` adds LoRA adapters (`decoderlm.model.lora`) and
freezes parameter groups as a `FinetuneConfig` (TrainConfig.finetune) asks; `trainable_counts`
counts the result."""

from __future__ import annotations

import fnmatch
import re

import torch.nn as nn

from ..config import FinetuneConfig
from ..errors import UserError
from ..model.lora import LoRALinear, adapted_names, apply_lora, is_lora_key, parse_targets
from ..model.model import DecoderLM, RMSNorm

FREEZE_GROUPS = ("embeddings", "head", "norms", "blocks", "blocks:I", "blocks:I-J")


def _freeze_group(model: DecoderLM, item: str) -> list[nn.Parameter]:
    """The parameters one --freeze item names (see `freeze`)."""
    if item == "embeddings":
        return [p for m in (model.tok_emb, model.pos_emb) if m is not None for p in m.parameters()]
    if item == "head":
        return [model.lm_head.weight]
    if item == "norms":
        norms = (nn.LayerNorm, RMSNorm)
        return [p for m in model.modules() if isinstance(m, norms) for p in m.parameters()]
    span = re.fullmatch(r"blocks(?::(\d+)(?:-(\d+))?)?", item)
    if span:
        n = len(model.blocks)
        first = int(span[1]) if span[1] else 0
        last = int(span[2]) if span[2] else (first if span[1] else n - 1)
        if not first <= last < n:
            raise UserError(
                f"--freeze {item}: the model has {n} blocks, numbered 0 to {n - 1}; give "
                f"blocks:I-J with I <= J <= {n - 1}"
            )
        return [p for b in model.blocks[first : last + 1] for p in b.parameters()]
    if "*" in item or "." in item:
        named = model.named_parameters(remove_duplicate=False)
        return [p for name, p in named if fnmatch.fnmatchcase(name, item)]
    raise UserError(
        f"--freeze {item!r} is not a group; use a comma-separated list of "
        f"{', '.join(FREEZE_GROUPS)} or parameter-name patterns such as blocks.*.attn.*"
    )


def freeze(model: DecoderLM, spec: str) -> int:
    """Set requires_grad=False on the parameters `spec` names: comma-separated items, each
    "embeddings" (tok_emb, pos_emb; with tied weights also the unembedding), "head"
    (lm_head), "norms" (every LayerNorm / RMSNorm), "blocks" (all), "blocks:I" or
    "blocks:I-J" (0-based, inclusive), or a parameter-name pattern with * (fnmatch).

    Returns:
        The number of parameter elements frozen by this call or earlier.

    Raises:
        UserError: an item is not in the grammar, matches no parameter, or names blocks the
            model does not have.
    """
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        found = _freeze_group(model, item)
        if not found:
            raise UserError(
                f"--freeze {item!r} matches no parameter of this model (e.g. "
                f"{next(iter(dict(model.named_parameters())))})"
            )
        for p in found:
            p.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def prepare_trainable(model: DecoderLM, ft: FinetuneConfig) -> list[str]:
    """Add LoRA adapters (ft.lora_rank; unless the model already has them) and freeze
    parameters (ft.freeze) as `ft` (a TrainConfig's finetune section) asks, in place. The new
    adapters' A matrices draw from torch's global RNG.

    Returns:
        The names of the adapted layers ([] without LoRA).

    Raises:
        UserError: bad targets or freeze items (see `decoderlm.model.lora.apply_lora`,
            `freeze`), or nothing left to train.
    """
    adapted = adapted_names(model)
    if ft.lora_rank is not None and not adapted:
        alpha = ft.lora_alpha if ft.lora_alpha is not None else float(ft.lora_rank)
        adapted = apply_lora(
            model, ft.lora_rank, alpha, parse_targets(ft.lora_targets), ft.lora_dropout
        )
    if ft.freeze:
        freeze(model, ft.freeze)
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"--freeze {ft.freeze} leaves no parameter to train")
    return adapted


def lora_entry(model: nn.Module, ft: FinetuneConfig) -> dict | None:
    """config.json's "lora" entry of a model with adapters (None without): rank, alpha,
    dropout, targets (as given) and modules (the adapted layers' names)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not layers:
        return None
    first = layers[0][1]
    return {
        "rank": first.rank,
        "alpha": first.alpha,
        "dropout": ft.lora_dropout,
        "targets": ft.lora_targets,
        "modules": adapted_names(model),
    }


def trainable_counts(model: nn.Module) -> dict[str, int]:
    """{"total": unique parameters, "trainable": those with requires_grad, "adapters": LoRA
    parameters}."""
    params = list(model.parameters())
    return {
        "total": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "adapters": sum(p.numel() for n, p in model.named_parameters() if is_lora_key(n)),
    }
