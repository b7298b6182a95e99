"""Faster one-row products for decoding on the CPU, installed on a model from outside.

Decoding multiplies one row (one new token) by every weight matrix: a matrix-vector product
that reads each weight once, so its speed is the memory read rate. PyTorch's CPU F.linear
reads one-row products well below that rate; the two forms here read faster (the figures are
in benchmarks/README.md, from benchmarks/gemv.py):

- `rowwise_linear`: the product as a two-way batched matmul over halves of the weight's rows
  (float32, large weights);
- `reduction_linear`: the product as a multiply-and-sum that torch.compile fuses into one
  pass over the weight (any dtype, while compiling).

`install(model)` turns every nn.Linear of a model into a `DecodeLinear`, which uses them for
few-row products without autograd on the CPU and is exactly nn.Linear everywhere else
(training included). `decoderlm.generation.precision.prepare_for_decoding` installs them on a
CPU model (a model never prepared decodes with nn.Linear).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["rowwise_linear", "reduction_linear", "DecodeLinear", "install"]

ROWWISE_MIN_WEIGHT = 2**19  # elements; smaller weights gain nothing from the split
ROWWISE_MAX_ROWS = 4  # rows of x up to which the split wins for every such weight
ROWWISE_WIDE_WEIGHT = 2**24  # elements: vocabulary-sized weights (unembeddings) ...
ROWWISE_WIDE_MAX_ROWS = 16  # ... win up to this many rows (continuous batching's steps)


def rowwise_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as a two-way batched matmul over halves of the rows
    of weight [out, in]; x [..., in] with few rows -> [..., out], in x's dtype."""
    rows, d = x.numel() // x.size(-1), x.size(-1)
    flat = x.reshape(rows, d)
    even = weight.size(0) - weight.size(0) % 2
    halves = weight[:even].view(2, even // 2, d)
    y = torch.bmm(halves, flat.T.expand(2, d, rows)).reshape(even, rows).T
    if even < weight.size(0):
        y = torch.cat([y, flat @ weight[even:].T], dim=1)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.size(0))


def reduction_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) written as a multiply-and-sum over `in`, accumulated in float32
    and returned in x's dtype; x [..., in], weight [out, in] -> [..., out].

    Meant for torch.compile, which fuses it into one pass over weight per output row (one
    kernel, no [out, in] temporary). Eagerly it is correct but builds the [..., out, in]
    product, so `DecodeLinear` uses it only while compiling.
    """
    y = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class DecodeLinear(nn.Linear):
    """nn.Linear with the decoding products on the CPU without autograd: float32 with a weight
    of 2^19 elements or more and at most 4 rows, or of 2^24 elements or more (an unembedding)
    and at most 16 rows, runs as `rowwise_linear` (`benchmarks/gemv.py --rows N` measures
    where it wins); any other one-row product under torch.compile runs as `reduction_linear`.
    Everything else is nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and not torch.is_grad_enabled():
            if x.dtype == torch.float32 and self._rowwise_wins(x.numel() // x.size(-1)):
                return rowwise_linear(x, self.weight, self.bias)
            if x.numel() == x.size(-1) and torch.compiler.is_compiling():
                return reduction_linear(x, self.weight, self.bias)
        return super().forward(x)

    def _rowwise_wins(self, rows: int) -> bool:
        size = self.weight.numel()
        if size >= ROWWISE_WIDE_WEIGHT:
            return rows <= ROWWISE_WIDE_MAX_ROWS
        return size >= ROWWISE_MIN_WEIGHT and rows <= ROWWISE_MAX_ROWS


def install(model: nn.Module) -> nn.Module:
    """Make every nn.Linear of `model` a `DecodeLinear`, in place (same parameters, same
    state dict, same results up to float rounding); idempotent. Returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
    return model
