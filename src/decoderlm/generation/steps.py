"""The forward passes of decoding, shared by `generate` and the server's `Scheduler`: the
prefill, the one-token step and the context slide of a batch's rows.

- `prefill`: one forward pass over prompts (or windows of them) into a new `KVCache`; `generate`
  slides its context with it too (a pass over the last tokens gives the cache and the next
  logits at once).
- `decode_step`: the function computing one new token per row from a cache.
- `slide`: a row of a running batch whose context reaches max_positions gets its cache rebuilt
  from the tokens before its newest (the last keep - 1); the newest token then joins the
  batch's one-token step, so that it sees the last keep tokens: the tokens of rerunning the
  model on them.
"""

from __future__ import annotations

import sys
import time
import types
import warnings
import weakref

import torch

from ..allocator import give_back_freed_memory
from ..model.kv_cache import KVCache
from . import cpu_decode
from .precision import activation_dtype, decoding_setup

__all__ = ["prefill", "slide", "decode_step", "fixed_capacity"]


def prefill(
    model,
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    capacity=None,
    past: KVCache | None = None,
) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """One forward pass over ids into a new KVCache (in the model's activation dtype), or
    into `past` after the tokens it holds.

    Args:
        model: a DecoderLM.
        ids: [B, T] int64, T <= max_positions (past.length + T with past).
        attention_mask: [B, T] bool, False for left padding (positions then count real
            tokens only), or None (no padding); None with past.
        capacity: the new cache's positions (`KVCache`), >= T; None: max_positions + 1.
            The compiled prompt pass (`_prompt_compiles`) takes at least T + 1.
        past: a KVCache of B rows holding the past.length tokens before ids in every row
            (a prefix whose keys and values were kept, `prefix_cache.PrefixCache`), with room
            for T more; it is the cache returned. None: a new cache.

    Returns:
        (cache holding the tokens, positions [B, T] int64 of the new tokens, logits [B,
        vocab_size] of the token after the last one, in the model's dtype).
    """
    B, T = ids.shape
    start = 0 if past is None else past.length
    if attention_mask is None:
        positions = torch.arange(start, start + T, device=ids.device).expand(B, -1)
    else:
        positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    compiled = past is None and attention_mask is None and _prompt_compiles(model, ids)
    if compiled and capacity is not None:  # a spare position, as `fixed_capacity` explains
        capacity = max(capacity, T + 1)
    cache = past
    if cache is None:
        cache = KVCache(model.config, B, ids.device, activation_dtype(model), capacity)
    if compiled:
        # ids copied: a window of a longer row (`slide`) keeps that row's strides, and the
        # graph would be traced again for them
        ids = ids.clone(memory_format=torch.contiguous_format)
        with cpu_decode.prompt_graph():
            logits = _timed_first_call(model, "prompt", ids, cache, positions)
        cache.advance(T)
    else:
        logits = model.forward_cached(ids, cache, positions, attention_mask, last_only=True)
    return cache, positions, logits[:, -1]


def _prompt_compiles(model, ids: torch.Tensor) -> bool:
    """Whether `prefill` runs ids through the model's compiled prompt pass: a CPU model
    whose decoding step is compiled (`precision.DecodingSetup`), one prompt of two tokens or
    more into a new cache, without padding, autograd or forward hooks. Its tokens are
    traced as a dynamic length, so every other such prompt runs the same graph (one of a
    single token would compile another: it runs eagerly)."""
    setup = decoding_setup(model)
    return (
        setup is not None
        and setup.compile
        and model.device.type == "cpu"
        and ids.size(0) == 1
        and ids.size(1) > 1
        and not torch.is_grad_enabled()
        and not _hooked(model)
    )


def slide(
    model, ids: torch.Tensor, keep: int, attention_mask: torch.Tensor | None = None
) -> tuple[KVCache, torch.Tensor]:
    """The context slide: a KVCache rebuilt from the keep - 1 tokens before each row's newest
    token, for the newest token's step to follow (it then sees the last keep tokens).

    Args:
        model: a DecoderLM.
        ids: [B, n] int64, each row's tokens so far (its newest last), n >= keep.
        keep: the tokens the newest one sees, 1 <= keep <= max_positions.
        attention_mask: [B, n] bool, False for left padding, or None (no padding).

    Returns:
        (cache holding ids[:, n - keep : n - 1], positions [B, 1] int64 of the newest token:
        the real tokens before it in the window).
    """
    window, mask = ids[:, ids.size(1) - keep : -1], None
    if attention_mask is not None:
        mask = attention_mask[:, ids.size(1) - keep : -1]
    if window.size(1) == 0:  # the newest token alone
        cache = KVCache(model.config, ids.size(0), ids.device, activation_dtype(model))
        return cache, torch.zeros(ids.size(0), 1, dtype=torch.long, device=ids.device)
    cache, _, _ = prefill(model, window, mask)
    if mask is None:
        newest = torch.full((ids.size(0), 1), window.size(1), device=ids.device)
    else:
        newest = mask.long().sum(1, keepdim=True)
    return cache, newest


def _one_token(model, idx, cache, positions, key_mask=None):
    return model.forward_cached(idx, cache, positions, key_mask, last_only=True)


def _fixed_one_token(model, idx, cache, positions, key_mask=None):
    return model.forward_cached(idx, cache, positions, key_mask, last_only=True, advance=False)


def _prompt_pass(model, ids, cache, positions):
    return model.forward_cached(ids, cache, positions, None, last_only=True, advance=False)


_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {kind: step}

# inductor's options for a CPU model's step: the weights frozen into the graph as constants,
# so that each product gets the fastest of inductor's CPU GEMM templates and oneDNN's or
# MKL's packed products, timed once at compile (max-autotune); its timing tables unprinted.
# Never read from or written to inductor's graph cache: a cached frozen graph keeps the
# packed weights of the model first compiled, and a later model of the same shapes (another
# seed, a fine-tuned copy, in this process or the next) would decode with them. The graph's
# calls stay Python's: made from C++ (inductor's cpp_wrapper) they took 15-20 s more to
# compile and decoded no faster (`python benchmarks/step_options.py`, benchmarks/README.md).
# Products that read the same input (a SwiGLU MLP's gate and up) are concatenated into one
# product over the frozen weights, which are one matrix in the graph: one GEMM fewer a layer
CPU_OPTIONS = {
    "freezing": True,
    "cpp.enable_concat_linear": True,
    "fx_graph_cache": False,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def _compiled_step(model, kind: str):
    """The torch.compile'd form of a step function for this model, built on first use.

    Two kinds, "fixed" (a `KVCache`'s: `generate`'s) and "slots" (a `SlotKVCache`'s: the
    server's), are fixed-shape steps, traced without duck sizing and, on the CPU, compiled
    with `CPU_OPTIONS` (`_configured`): the weights are frozen into the graph (a packed copy
    of each matrix where a template wants one), each product the fastest that max-autotune
    times (benchmarks/README.md, "The compiled step on an AVX2 CPU"). The third, "prompt"
    (`prefill`'s, on the CPU), is one prompt's pass with its length traced as a symbol and
    inductor's default options (nothing frozen), called inside `cpu_decode.prompt_graph`:
    each product is the layer's own eager one (`cpu_decode.eager_product`), and inductor
    fuses what lies between them (benchmarks/README.md, "The compiled prompt pass").

    Its guards on the model's modules are left out (torch's
    `skip_guard_on_all_nn_modules_unsafe`): thousands for a model of 30 layers, checked at
    every call (their cost: benchmarks/README.md, "The fixed-shape compiled step"). That is
    safe here because the modules of a prepared model do not change but for hooks, which
    `_compiled_one_token` checks itself, and because each model's step is a copy of the
    function with its own code object, where torch.compile keeps its graphs: a graph is
    never run on another model. The prompt pass's graph holds no weights (they are its
    inputs, and its products find their layers by number, `cpu_decode.number_layers`), so
    torch's graph cache may serve it to a later process compiling the same model.
    """
    steps = _compiled.setdefault(model, {})
    if kind not in steps:
        function = _prompt_pass if kind == "prompt" else _fixed_one_token
        code, names = function.__code__.replace(), function.__globals__
        own = types.FunctionType(code, names, kind)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        inductor = CPU_OPTIONS if model.device.type == "cpu" and kind != "prompt" else {}
        options |= {key: value for key, value in inductor.items() if key != "freezing"}
        if kind == "prompt":  # its products: the layers' eager ones, called by number
            cpu_decode.number_layers(model)
        compiled = torch.compile(own, dynamic=True, options=options)
        steps[kind] = _configured(compiled, inductor.get("freezing", False))
        # every module's hook dicts (registering a hook adds to them in place), for
        # `_hooked`; not the model's own: a value holding its key would keep it alive
        steps["hooks"] = _hook_dicts(m for m in model.modules() if m is not model)
    return steps[kind]


def _configured(compiled, freezing: bool):
    """compiled, called with the configuration its tracing needs: inductor's `freezing` (the
    weights traced as constants: TorchDynamo reads it from the global config when it traces,
    not from torch.compile's options, which give inductor the rest of `CPU_OPTIONS`); floats
    traced as constants (no guards on a norm's eps) and no duck sizing, under which a cache
    capacity equal to head_dim at the first call (64 and 64, say) would share its symbol and
    be specialized to that value, compiling the step again for every other capacity. The
    three patches are built once, and entered at every call."""
    import torch._dynamo.config as dynamo_config  # imported by torch.compile anyway
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as shape_config

    patches = (
        inductor_config.patch(freezing=freezing),
        shape_config.patch(use_duck_shape=False),
        dynamo_config.patch(specialize_float=True),
    )

    def step(*args):
        with patches[0], patches[1], patches[2]:
            return compiled(*args)

    return step


def _hooked(model) -> bool:
    """Whether a forward hook is attached to any module of the model (its compiled step,
    built without guards on them, would not run the hook: the step then runs eagerly). For
    a compiled model it looks through the hook dicts listed once (`_compiled_step`): a
    30-layer model has about 1,000 modules, which a walk in Python takes 0.5 ms to check at
    every token."""
    listed = _compiled.get(model, {}).get("hooks")
    if listed is None:
        listed = _hook_dicts(m for m in model.modules() if m is not model)
    return any(_hook_dicts([model])) or any(listed)


def _hook_dicts(modules) -> list[dict]:
    """The forward and forward-pre hook dicts of each of `modules`."""
    return [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


def _compiled_one_token(model, idx, cache, positions, key_mask=None):
    """The compiled step, with fixed shapes for a `KVCache` (`KVCache.fix`) and a
    `SlotKVCache` alike; the eager step while a forward hook is attached to the model."""
    if _hooked(model):
        return _one_token(model, idx, cache, positions, key_mask)
    if isinstance(cache, KVCache):
        kind = "fixed"
        cache.fix()
        if key_mask is not None:  # [B, length + 1] -> [B, window], False past the new token
            full = key_mask.new_zeros(key_mask.size(0), cache.window)
            full[:, : key_mask.size(1)] = key_mask
            key_mask = full
    else:  # a `SlotKVCache`, whose steps have fixed shapes of their own
        kind = "slots"
        _static_slot_dims(cache)
    logits = _timed_first_call(model, kind, idx, cache, positions, key_mask)
    cache.advance(idx.size(1))
    return logits


_marked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SlotKVCache -> k[0]


def _static_slot_dims(cache) -> None:
    """A `SlotKVCache`'s buffers traced with static sizes but for their rows
    (torch._dynamo.mark_static): n_kv_heads, the positions and head_dim never change for a
    cache, and traced as symbols of their own (a set for each of a model's 2 x n_layers
    buffers) they took TorchDynamo minutes of reasoning about the window's strides. The
    rows grow as sequences join; buffers are marked again once they have grown."""
    if _marked.get(cache) is cache.k[0]:
        return
    import torch._dynamo  # imported by torch.compile anyway

    for buffer in (*cache.k, *cache.v):
        torch._dynamo.mark_static(buffer, [1, 2, 3])
    _marked[cache] = cache.k[0]


def _timed_first_call(model, kind: str, *args):
    """The compiled step of this kind called on args; its first call for a model, which
    compiles, says so on stderr with the seconds it took (torch keeps the compiled kernels
    in its cache directory, so a later process compiles the same step faster), then hands
    the memory compiling freed back to the operating system
    (`decoderlm.allocator.give_back_freed_memory`; figures: benchmarks/README.md, "Memory
    of a loaded model")."""
    first = kind not in _compiled.get(model, {})
    step = _compiled_step(model, kind)
    if not first:
        return step(model, *args)
    name = "prompt pass" if kind == "prompt" else "decoding step"
    print(f"decoderlm: compiling the {name} (once per model in this process)...", file=sys.stderr)
    start = time.perf_counter()
    with warnings.catch_warnings():  # inductor's autotuning reads a deprecated storage API
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        out = step(model, *args)
    seconds = time.perf_counter() - start
    print(f"decoderlm: {name} compiled in {seconds:.1f} s", file=sys.stderr)
    give_back_freed_memory()  # the traced graphs, autotuning's buffers and the like
    return out


def decode_step(compile: bool = False):
    """The function that computes the logits of one new token per row from a KV cache, as
    `generate` and the server's `Scheduler` call it at each decoding step.

    The function returned is step(model, idx, cache, positions, key_mask=None) -> logits:
    idx [B, 1] int64 (each row's newest token), cache a `KVCache` or `SlotKVCache` holding the
    tokens before it (the new token's keys and values are appended), positions [B, 1] int64
    (the new token's position in each row), key_mask [B, L + 1] bool or None (False marks
    padding among the cached tokens and the new one; None: no padding); logits [B, 1,
    vocab_size] in the model's dtype.

    Args:
        compile: False: a plain call of model.forward_cached(idx, cache, positions, key_mask,
            last_only=True); True: the same under torch.compile, built on a model's first
            use for that model (the first call compiles, saying so on stderr with its
            seconds: minutes for a model of 30 layers on 2 cores; needs a C++ compiler on
            the CPU). What is compiled is the model as it is then (on the CPU its weights
            are frozen into the graph, packed copies beside the model's own: see
            `CPU_OPTIONS`): a model whose weights or layers later change must be prepared
            afresh; while a forward hook is attached
            the step runs eagerly, so that the hook runs. A `KVCache` is switched to fixed
            shapes (`KVCache.fix`): every step attends under a mask over a window of the
            cache, its filled positions rounded up to a multiple of 64, so the step's
            shapes change once every 64 tokens and the attention reads at most 63
            positions more than the filled ones; a `SlotKVCache` steps over a window of its
            own the same way (its longest row's). Both are compiled with dynamic shapes,
            so a new window, capacity or batch size does not compile again, but for a
            batch of one row, which torch compiles apart from larger ones. The decoding
            paths take
            compile from the model's `precision.DecodingSetup` (`prepare_for_decoding(...,
            compile=True)`).
    """
    return _compiled_one_token if compile else _one_token


def fixed_capacity(model, tokens: int) -> int:
    """The KV cache capacity a compiled step's cache gets for `tokens` positions: rounded up
    to a multiple of `KVCache.WINDOW`, plus a spare position, at most max_positions + 1. The
    spare keeps every window a strict slice of the buffers: a window as long as the buffers
    would make the graph compiled for it guard on that equality (a slice that is the whole
    buffer is contiguous, a shorter one is not), compiling the step again for the others."""
    return min(model.config.max_positions + 1, KVCache.whole_windows(tokens) + 1)
