"""Dropout (Srivastava et al. 2014, inverted: kept elements scaled by 1 / (1 - p)) whose mask
costs less to draw on the CPU.

torch's CPU dropout draws one random number per element (`bernoulli_`), which is most of its
time and, with the default preset's dropout, a large part of a training step (the profile in
benchmarks/README.md, "The main job on an AMX Xeon"). Here each element reads 16 random
bits instead, four elements to one 64-bit draw of torch's default CPU generator, so the mask
costs about a quarter as many draws; the drop probability is p rounded to a multiple of
2^-16 (`keep_probability`), and the kept elements are scaled by the inverse of the
probability actually used, so the expectation of the output is x exactly. Runs are as
reproducible as with `F.dropout`: the bits come from the same generator, seeded by
`torch.manual_seed` and saved in a checkpoint's RNG state.

Off the CPU, and under torch.compile (which draws its own masks in the generated kernel),
it is `F.dropout`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Dropout", "dropout", "keep_probability"]

LANES = 2**16  # values of one element's 16 random bits


def keep_probability(p: float) -> float:
    """The probability that the CPU mask keeps an element: 1 - round(p * 2^16) / 2^16."""
    return 1.0 - round(p * LANES) / LANES


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """F.dropout(x, p, training) with the CPU mask described in the module docstring.

    x: any shape, any floating dtype. Returns a tensor of x's shape and dtype: in training
    with 0 < p < 1, each element kept with probability `keep_probability(p)` and then
    divided by it, else zero; x itself when not training or p == 0. Differentiable (the
    gradient is the mask times the same scale). Raises ValueError for p outside [0, 1], as
    F.dropout does.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p == 1.0 or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    keep = keep_probability(p)
    return torch.where(_kept(x.shape, p), x * (1.0 / keep), 0)


def _kept(shape: torch.Size, p: float) -> Tensor:
    """bool [shape]: True where an element is kept, from 16 bits of the default generator
    each (uniform over [-2^15, 2^15), dropped below -2^15 + round(p * 2^16))."""
    n = shape.numel()
    words = torch.empty(-(-n // 4), dtype=torch.int64).random_(-(2**63), None)  # all 64 bits
    bits = words.view(torch.int16)[:n].view(shape)
    return bits >= round(p * LANES) - LANES // 2


class Dropout(nn.Dropout):
    """nn.Dropout whose forward is `dropout` (same p, same training flag, same state dict:
    none); x itself in eval mode, p unread (nn.Dropout checked it when built), so that a
    compiled inference step holds no guard on p."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        return dropout(x, self.p, self.training)
