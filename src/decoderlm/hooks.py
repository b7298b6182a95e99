"""Named activations: `HookPoint` modules placed where the model computes them.

A `HookPoint` is an identity module. The model calls it on an activation, so the activation
gets a name (its module path, e.g. ``blocks.0.attn.hook_pattern``) and PyTorch's forward hooks
can read or replace it. With nothing attached, calling it returns its input and costs one
Python call; under torch.compile it disappears.

    logits, cache = run_with_cache(model, idx, names=["hook_pattern"])
    cache["blocks.0.attn.hook_pattern"]          # [B, n_heads, T, T] float32

The hook points of `decoderlm.model.DecoderLM` are listed in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

__all__ = ["HookPoint", "hook_points", "hooks", "run_with_cache"]


class HookPoint(nn.Module):
    """An identity module whose forward hooks see (and may replace) one activation.

    forward(x) -> x, any shape and dtype. `register_forward_hook(fn)` works as on any module:
    fn(module, (x,), x) returning None keeps x, returning a tensor replaces it.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # skip nn.Module's dispatch when no hook is attached: the default path stays fast
        if self._forward_hooks or self._forward_pre_hooks:
            return super().__call__(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def has_hooks(self) -> bool:
        """Whether a forward hook or pre-hook is attached (the model then computes activations
        it would otherwise skip, such as the attention pattern)."""
        return bool(self._forward_hooks or self._forward_pre_hooks)


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """{name: HookPoint} of every hook point in `model`, in forward order (module order)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, HookPoint)}


def _selected(
    model: nn.Module, names: Iterable[str] | Callable[[str], bool] | None
) -> dict[str, HookPoint]:
    """The hook points whose name is in `names`, ends with ``.`` + one of them (so
    "hook_pattern" selects every layer's), or passes the predicate; all when names is None."""
    points = hook_points(model)
    if names is None:
        return points
    if callable(names):
        return {n: p for n, p in points.items() if names(n)}
    wanted = list(names)
    chosen = {n: p for n, p in points.items() if any(n == w or n.endswith("." + w) for w in wanted)}
    unknown = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in points)]
    if unknown:
        raise ValueError(f"no hook point named {unknown}; the model has {sorted(points)}")
    return chosen


@contextmanager
def hooks(model: nn.Module, fns: dict[str, Callable]) -> Iterator[None]:
    """Attach forward hooks by hook-point name for the duration of a ``with`` block.

    Args:
        model: a module holding HookPoints.
        fns: {name: fn(activation, name) -> None | tensor}; a name selects as in
            `run_with_cache`. A returned tensor replaces the activation.

    Raises:
        ValueError: a name matches no hook point.
    """
    handles = []
    try:
        for key, fn in fns.items():
            for name, point in _selected(model, [key]).items():
                handles.append(
                    point.register_forward_hook(
                        lambda module, args, out, fn=fn, name=name: fn(out, name)
                    )
                )
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def run_with_cache(
    model: nn.Module, idx: torch.Tensor, names: Iterable[str] | Callable[[str], bool] | None = None
):
    """Run model(idx) and keep the activations at the selected hook points.

    Args:
        model: e.g. a DecoderLM (in whatever mode it is in; call .eval() for no dropout).
        idx: [B, T] int64 token ids.
        names: hook-point names: full ("blocks.0.attn.hook_pattern"), or a last part that
            selects it in every layer ("hook_pattern"), or a predicate on the full name;
            None keeps every hook point.

    Returns:
        (what model(idx) returns, {full name: activation tensor, detached}).

    Raises:
        ValueError: a name matches no hook point.
    """
    cache: dict[str, torch.Tensor] = {}
    selected = _selected(model, names)

    def keep(activation, name):
        cache[name] = activation.detach()

    with hooks(model, dict.fromkeys(selected, keep)):
        out = model(idx)
    return out, cache
