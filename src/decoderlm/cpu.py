"""What this machine's CPU multiplies natively, for the kernels chosen by it (decoding's
products and attention, training's autocast and optimizer states)."""

from __future__ import annotations

import functools

import torch

__all__ = ["native_bfloat16"]


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively: oneDNN's bfloat16 kernels
    (AVX-512 with BF16, or AMX). Elsewhere (AVX2) torch's bfloat16 matrix products convert
    every element in a slow generic loop."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
