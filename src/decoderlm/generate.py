"""Sampling from a DecoderLM: temperature, top-k, top-p, greedy, seeds.

The loop feeds the model the last block_size tokens of the running sequence (a sliding
context), so any number of new tokens can be generated without an index error.
"""

from __future__ import annotations

import math

import torch

__all__ = ["generate", "sample_next", "filter_logits"]


def filter_logits(logits: torch.Tensor, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Set the logits of tokens outside the top-k / nucleus to -inf.

    Args:
        logits: [B, V] float.
        top_k: keep the k largest logits per row (None: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p
            (Holtzman et al. 2019); the most likely token is always kept, so top_p -> 0
            behaves as greedy decoding.

    Returns:
        [B, V] float, the filtered logits (a new tensor).
    """
    logits = logits.clone()
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        logits[drop_sorted.scatter(1, order, drop_sorted)] = float("-inf")
    return logits


def _check_controls(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got "
                         f"{temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1] or None, got {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Choose the next token of each row from last-position logits.

    Args:
        logits: [B, V] float, finite.
        temperature: divide the logits by this before the softmax; 0 picks the argmax
            (greedy), as do temperatures so small that the softmax is one-hot.
        top_k, top_p: see `filter_logits`.
        generator: torch RNG for the draw.

    Returns:
        [B] int64 token ids.

    Raises:
        ValueError: temperature < 0, top_k < 1, top_p outside [0, 1], or non-finite logits.
    """
    _check_controls(temperature, top_k, top_p)
    if not torch.isfinite(logits).all():
        raise ValueError("the model produced non-finite logits (NaN or inf)")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
    if not torch.isfinite(probs).all():  # temperature so small that logits/temperature overflow
        return logits.argmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
             seed: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend idx by max_new_tokens tokens sampled from `model`.

    Args:
        model: a DecoderLM; it runs in eval mode here (no dropout) and its mode is restored.
        idx: [B, T] int64 prompt ids, T >= 1 (T may exceed block_size: only the last
            block_size tokens are seen).
        max_new_tokens: number of tokens to append, >= 0.
        temperature, top_k, top_p: see `sample_next`; do_sample=False is greedy decoding.
        seed: seeds a fresh torch.Generator so the same call gives the same tokens.
        generator: a torch.Generator to draw from instead (ignored when seed is given).

    Returns:
        [B, T + max_new_tokens] int64.

    Raises:
        ValueError: bad controls, an empty prompt, non-finite logits (the message names the
            step), or a sampled id outside the vocabulary.
    """
    _check_controls(temperature, top_k, top_p)
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be [B, T] with T >= 1, got shape {tuple(idx.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not do_sample:
        temperature = 0.0
    if seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    block_size, vocab_size = model.config.block_size, model.config.vocab_size
    was_training = model.training
    model.eval()
    try:
        for step in range(max_new_tokens):
            logits, _ = model(idx[:, -block_size:])
            try:
                nxt = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
            except ValueError as e:
                raise ValueError(f"step {step}: {e}") from None
            if int(nxt.min()) < 0 or int(nxt.max()) >= vocab_size:
                raise ValueError(f"step {step}: sampled token id {nxt.tolist()} is outside "
                                 f"[0, {vocab_size})")
            idx = torch.cat([idx, nxt[:, None]], dim=1)
    finally:
        model.train(was_training)
    return idx
