"""Named activations: `HookPoint` modules placed where the model computes them.

A `HookPoint` is an identity module. The model calls it on an activation, so the activation
gets a name (its module path, e.g. ``blocks.0.attn.hook_pattern``) and PyTorch's forward hooks
can read or replace it. With nothing attached, calling it returns its input and costs one
Python call; under torch.compile it disappears.

    logits, cache = run_with_cache(model, idx, names_filter=["hook_pattern"])
    cache["blocks.0.attn.hook_pattern"]          # [B, n_heads, T, T] float32

The names and layouts are TransformerLens's (`HookedTransformer`, and its `TransformerBridge`
on a GPT-2): an activation cached here under a TransformerLens name has TransformerLens's
shape, e.g. hook_q/hook_k/hook_v/hook_z as [batch, pos, head_index, d_head] (`HeadsHookPoint`),
so code written for TransformerLens indexes the same axes. The hook points of
`decoderlm.model.model.DecoderLM` are listed in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..errors import UserError

__all__ = [
    "HookPoint",
    "HeadsHookPoint",
    "ActivationCache",
    "hook_points",
    "hooks",
    "run_with_cache",
]


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


class HeadsHookPoint(HookPoint):
    """A HookPoint on a per-head activation that the model computes as [B, heads, T,
    head_dim] (heads: n_heads for queries, n_kv_heads for keys and values): its hooks see it,
    and return a replacement, as [B, T, heads, head_dim] (TransformerLens's [batch, pos,
    head_index, d_head]). With nothing attached it returns its input as it is, without a
    transpose.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._forward_hooks or self._forward_pre_hooks:
            return super().__call__(x.transpose(1, 2)).transpose(1, 2)
        return x


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """{name: HookPoint} of every hook point in `model`, in forward order (module order)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, HookPoint)}


Selector = str | Callable[[str], bool]
"""A hook-point name (whole, or its last part: every layer's) or a predicate on the full name."""


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
    wanted = [names] if isinstance(names, str) else list(names)
    chosen = {n: p for n, p in points.items() if any(n == w or n.endswith("." + w) for w in wanted)}
    unknown = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in points)]
    if unknown:
        raise UserError(f"no hook point named {unknown}; the model has {sorted(points)}")
    return chosen


@contextmanager
def hooks(
    model: nn.Module, fns: dict[str, Callable] | Iterable[tuple[Selector, Callable]]
) -> Iterator[None]:
    """Attach forward hooks by hook-point name for the duration of a ``with`` block.

        with hooks(model, [("hook_pattern", read), (lambda n: "resid" in n, patch)]):
            logits, _ = model(idx)

    Args:
        model: a module holding HookPoints.
        fns: [(selector, fn)] or {name: fn}; a selector is a name (whole, or a last part that
            selects it in every layer) or a predicate on the full name. fn(activation, name)
            -> None keeps the activation, a tensor (same shape) replaces it. Several
            functions on one hook point run in the order given.

    The hooks are removed on leaving the block, also when it raises. Attaching one to
    hook_attn_scores or hook_pattern makes that layer's attention compute its scores and
    probabilities (the explicit path) while attached, and one to a norm's hook_scale or
    hook_normalized writes that norm out; with nothing attached the fused kernels run.

    Raises:
        UserError: a name matches no hook point (nothing is attached then).
    """
    pairs = list(fns.items()) if isinstance(fns, dict) else list(fns)
    chosen = [(_selected(model, sel if callable(sel) else [sel]), fn) for sel, fn in pairs]
    handles = []
    try:
        for points, fn in chosen:
            for name, point in points.items():
                handles.append(
                    point.register_forward_hook(
                        lambda module, args, out, fn=fn, name=name: fn(out, name)
                    )
                )
        yield
    finally:
        for handle in handles:
            handle.remove()


class ActivationCache(dict):
    """{full hook-point name: activation tensor} kept by `run_with_cache`, in forward order.

    A plain dict (iteration, ``cache[name]``) with two shortcuts:
    ``cache["hook_pattern", 1]`` is ``cache["blocks.1.attn.hook_pattern"]`` (the layer's
    hook point whose name ends in the given part), and `stack` / `accumulated_resid`.
    """

    def __getitem__(self, key):
        if isinstance(key, tuple):
            part, layer = key
            prefix = f"blocks.{layer}."
            names = [n for n in self if n.startswith(prefix) and n.endswith(part)]
            if len(names) != 1:
                raise KeyError(f"no single cached hook point of layer {layer} ends in {part!r}")
            key = names[0]
        return super().__getitem__(key)

    def stack(self, part: str) -> torch.Tensor:
        """The cached activations whose names end in `part`, stacked in layer order:
        [n_layers_cached, *activation shape].

        Raises:
            KeyError: none is cached.
        """
        found = [v for n, v in self.items() if n == part or n.endswith("." + part)]
        if not found:
            raise KeyError(f"no cached hook point ends in {part!r}; cache it first")
        return torch.stack(found)

    def accumulated_resid(self) -> torch.Tensor:
        """The residual stream entering the first block and after each block:
        [n_layers + 1, B, T, d_model] = blocks.0.hook_resid_pre (the embedding, positions
        included), then each blocks.l.hook_resid_post, as TransformerLens's
        `accumulated_resid` stacks them (cache both with names_filter=["hook_resid_pre",
        "hook_resid_post"]).

        Raises:
            KeyError: one of them is not cached.
        """
        if "blocks.0.hook_resid_pre" not in self:
            raise KeyError("blocks.0.hook_resid_pre is not cached; add it to names_filter")
        return torch.cat([self["blocks.0.hook_resid_pre"][None], self.stack("hook_resid_post")])


@torch.no_grad()
def run_with_cache(
    model: nn.Module, idx: torch.Tensor, names_filter: Iterable[str] | Selector | None = None
):
    """Run model(idx) and keep the activations at the selected hook points, and only those.

    Args:
        model: e.g. a DecoderLM (in whatever mode it is in; call .eval() for no dropout).
        idx: [B, T] int64 token ids.
        names_filter: hook-point names: full ("blocks.0.attn.hook_pattern"), or a last part
            that selects it in every layer ("hook_pattern"), a list of these, or a predicate
            on the full name; None keeps every hook point.

    Returns:
        (what model(idx) returns: the hooks only read, so the logits are those of model(idx),
        up to float rounding when hook_attn_scores, hook_pattern or a norm's hook points are
        cached, because attention or the norm then takes its explicit path instead of the
        fused kernel), `ActivationCache` {full name: activation
        tensor, detached}.

    Raises:
        UserError: a name matches no hook point.
    """
    cache = ActivationCache()
    selected = _selected(model, names_filter)

    def keep(activation, name):
        cache[name] = activation.detach()

    with hooks(model, dict.fromkeys(selected, keep)):
        out = model(idx)
    return out, cache
