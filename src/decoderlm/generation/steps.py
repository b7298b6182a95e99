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

import torch

from ..model.kv_cache import KVCache
from .precision import activation_dtype

__all__ = ["prefill", "slide", "decode_step"]


def prefill(
    model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """One forward pass over ids into a new KVCache (in the model's activation dtype).

    Args:
        model: a DecoderLM.
        ids: [B, T] int64, T <= max_positions.
        attention_mask: [B, T] bool, False for left padding (positions then count real
            tokens only), or None (no padding).

    Returns:
        (cache holding the T tokens, positions [B, T] int64 of the tokens, logits [B,
        vocab_size] of the token after the last one, in the model's dtype).
    """
    B, T = ids.shape
    if attention_mask is None:
        positions = torch.arange(T, device=ids.device).expand(B, -1)
    else:
        positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    cache = KVCache(model.config, B, ids.device, activation_dtype(model))
    logits = model.forward_cached(ids, cache, positions, attention_mask, last_only=True)
    return cache, positions, logits[:, -1]


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


_compiled_one_token = None


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
            last_only=True); True: the same under torch.compile, built on first use and
            shared by every caller, with dynamic shapes so that the growing cache does not
            recompile at every step (the first calls compile: seconds; needs a C++ compiler
            on the CPU). The decoding paths take it from the model's
            `precision.DecodingSetup` (`prepare_for_decoding(..., compile=True)`).
    """
    global _compiled_one_token
    if not compile:
        return _one_token
    if _compiled_one_token is None:
        _compiled_one_token = torch.compile(_one_token, dynamic=True)
    return _compiled_one_token
