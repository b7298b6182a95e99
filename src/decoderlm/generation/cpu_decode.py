"""Faster products for decoding on the CPU, installed on a model from outside.

Decoding multiplies one row (one new token) by every weight matrix: a matrix-vector product
that reads each weight once, so its speed is the memory read rate. PyTorch's eager CPU
F.linear reads one-row float32 products below that rate on AMD CPUs (MKL's product);
`rowwise_linear`, the product as a two-way batched matmul over halves of the weight's rows,
reads faster there, and about half as fast as F.linear on Intel CPUs, where F.linear reads at
the memory's rate (`rowwise_wins_here`). A prompt's float32 products (many rows) run at
about 60-100 GFLOP/s in MKL on an AMD EPYC and 1.2-2.6x faster in oneDNN's (`onednn_linear`,
on the weight as it is stored), which `many_row_linear` takes there (`onednn_wins_here`). The
figures are in benchmarks/README.md, from benchmarks/gemv.py. Under torch.compile the
products stay F.linear: the compiled step (`steps.decode_step`) freezes the weights and lets
inductor pick its CPU GEMM templates or packed MKL products for them, which read faster
still. `reduction_linear`, the product as a multiply-and-sum that inductor fuses into one
loop, is measured there as a contender.

A prompt's many-row products of bfloat16 weights run in `prompt_dtype()`: float32 on a CPU
without native bfloat16 products (AVX2), where torch's bfloat16 matrix product is slow. Where
bfloat16 is native, a bfloat16 product run eagerly goes through oneDNN on a copy of the
weight packed into its blocked layout (`pack`, `packed_product`), 1.2-2.1x faster than F.linear
on the weight as stored: `precision.PackedLinear` holds only that copy (a model decoded
eagerly); `DecodeLinear` keeps a packed copy beside its weight (`packed_linear`), for the
eager passes of a model whose decoding step is compiled (its prompt), where the plain
weight is what the compiled step freezes; that is one more copy of each matrix in memory.
Such a model's float32 prompts read a packed copy too (`install(model, pack_float32=True)`),
where oneDNN wins (`onednn_wins_here`), and so do its bfloat16 ones on such a CPU without
native bfloat16: a packed float32 copy (twice the bfloat16 weight's bytes), not the weight
converted at every prompt (`prompt_copy_dtype`).

A compiled model's prompt pass is compiled too (`steps.prefill`): its norms, rotations,
activations and residual additions fused by inductor, its products each the layer's own
eager product as above, called from the graph as one opaque operator
(`eager_product`, while `prompt_graph` is entered, on layers numbered by `number_layers`).

`install(model)` turns every nn.Linear of a model into a `DecodeLinear`, which uses these
for products without autograd on the CPU and is exactly nn.Linear everywhere else (training
included). `decoderlm.generation.precision.prepare_for_decoding` installs them on a CPU model
(a model never prepared decodes with nn.Linear).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu import native_bfloat16

__all__ = [
    "rowwise_linear",
    "reduction_linear",
    "onednn_linear",
    "many_row_linear",
    "pack",
    "packed_product",
    "eager_only",
    "eager_inference",
    "number_layers",
    "prompt_graph",
    "in_prompt_graph",
    "eager_product",
    "packed_copy",
    "packed_linear",
    "DecodeLinear",
    "install",
    "prompt_dtype",
    "prompt_copy_dtype",
    "rowwise_wins_here",
    "onednn_wins_here",
]

ROWWISE_MIN_WEIGHT = 2**18  # elements; smaller weights gain nothing from the split (nor oneDNN)
ROWWISE_MAX_ROWS = 4  # rows of x up to which the split wins for every such weight
PROMPT_MIN_ROWS = 16  # rows from which a bfloat16 product is a prompt's (`prompt_dtype`)
PACKED_MIN_WEIGHT = 2**15  # elements; oneDNN's call costs more than it saves on smaller ones


@functools.cache
def cpu_vendor() -> str | None:
    """This CPU's vendor as /proc/cpuinfo's vendor_id gives it ("GenuineIntel",
    "AuthenticAMD"), or None where it cannot be read (another system, an ARM CPU)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def rowwise_wins_here() -> bool:
    """Whether `rowwise_linear` beats F.linear for one-row float32 products on this CPU: on
    every CPU but Intel's (`cpu_vendor`; True where it cannot be read). On an Intel Xeon
    F.linear reads a one-row product's weight at the memory's rate and the two-way split at
    about half of it; on AMD EPYCs it is the other way round (`python benchmarks/gemv.py`;
    figures in benchmarks/README.md)."""
    return cpu_vendor() != "GenuineIntel"


@functools.cache
def onednn_wins_here() -> bool:
    """Whether `onednn_linear` beats F.linear (MKL's product) for float32 products of more
    than a few rows on this CPU: on AMD CPUs (`cpu_vendor`), where torch has oneDNN. On a
    2-core AVX-512 AMD EPYC a 32-row product of a GPT-2 small block matrix takes 0.85-1.1 ms
    there against 1.3-1.9 ms in MKL, and one of 8 to 128 rows 1.2-2.6x less (`python
    benchmarks/gemv.py --rows N`; benchmarks/README.md); MKL's products are Intel's own,
    so elsewhere F.linear stays."""
    return cpu_vendor() == "AuthenticAMD" and torch.backends.mkldnn.is_available()


def prompt_dtype() -> torch.dtype:
    """The dtype in which a many-row product of bfloat16 or int8 weights (a prompt, an
    evaluation) runs on this CPU: bfloat16 where it is native (`native_bfloat16`), else
    float32, the weights converted for the product (figures: benchmarks/README.md, "The
    compiled step on an AVX2 CPU")."""
    return torch.bfloat16 if native_bfloat16() else torch.float32


def prompt_copy_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype of the packed copy (`packed_copy`) kept beside a compiled model's int8 or
    bfloat16 weight [out, in] for its prompts, or None (no copy: the weight is converted
    to `prompt_dtype()` at every prompt).

    int8: bfloat16 where it is native (`native_bfloat16`; exact: |q| <= 127), else None: a
    float32 copy would hold four times the weight's bytes and save little, converting int8
    being cheap (`python benchmarks/gemv.py --int8`, benchmarks/README.md).
    bfloat16: float32 for a weight of 2^18 elements or more where bfloat16 is not native
    and oneDNN wins (`onednn_wins_here`: an AVX2 AMD CPU), bit for bit the product
    `many_row_linear` takes on the weight converted at every prompt, for twice the weight's
    bytes; else None (where bfloat16 is native, `DecodeLinear` multiplies every eager
    product from a packed bfloat16 copy, compiled or not)."""
    if weight.dtype == torch.int8:
        return torch.bfloat16 if native_bfloat16() else None
    large = weight.numel() >= ROWWISE_MIN_WEIGHT
    if weight.dtype == torch.bfloat16 and large and not native_bfloat16() and onednn_wins_here():
        return torch.float32
    return None


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
    kernel, no [out, in] temporary); eagerly it is correct but builds the [..., out, in]
    product. `benchmarks/gemv.py` measures it against the products `DecodeLinear` uses.
    """
    y = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN's product (`torch.ops.mkldnn._linear_pointwise`,
    the kernel inductor's CPU freezing calls) on weight [out, in] as it is stored, not
    repacked: x [..., in] float32 or bfloat16 -> [..., out] in x's dtype (weight and bias in
    it too). Each call costs about 20-30 us more than MKL's, so it pays for products of 2^18
    weight elements or more (`many_row_linear`)."""
    flat = x.reshape(-1, x.size(-1))
    y = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.size(0))


def many_row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for a product of many rows (a prompt, an evaluation, a batch
    of decoded rows) without autograd: `onednn_linear` for a float32 weight of 2^18 elements
    or more where oneDNN wins (`onednn_wins_here`), else F.linear. x [..., in] -> [..., out],
    dtypes as F.linear's."""
    if x.dtype == torch.float32 and weight.numel() >= ROWWISE_MIN_WEIGHT and onednn_wins_here():
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of weight [out, in] (bfloat16 or float32) in oneDNN's blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing makes): an opaque
    tensor that only `packed_product` reads. Reordering reads and writes each element once."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def eager_inference(x: torch.Tensor) -> bool:
    """Whether a product of x may take this module's kernels: x on the CPU, autograd off
    and not under torch.compile (a packed weight cannot be traced nor differentiated)."""
    return (
        x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    )


_EAGER: dict = {}  # function -> torch.compiler.disable(function), made by eager_only


def eager_only(fn):
    """fn as torch.compile should meet it: run eagerly, outside any graph
    (`torch.compiler.disable(fn)`), for a product on a weight packed outside the graph,
    which inductor cannot lower. Made at the first call for fn and kept, so a call under
    torch.compile finds it made (one graph break): call it once when the weight is packed.
    torch.compiler.disable imports torch._dynamo (about 2 s), which a command that neither
    compiles nor decodes from a packed weight nor takes an optimizer step (`decoderlm
    sample` in float32) then does not pay at its start."""
    disabled = _EAGER.get(fn)
    if disabled is None:
        disabled = _EAGER[fn] = torch.compiler.disable(fn)
    return disabled


_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # prompt_key -> layer
_keys = itertools.count()  # the next prompt_key
_in_prompt = False  # True while `prompt_graph` is entered


def number_layers(model: nn.Module) -> None:
    """Give each layer of `model` whose class sets `eager_in_prompt_graph` (`DecodeLinear`,
    `precision.Int8Linear`, `precision.W8A8Linear`) a key of its own (its `prompt_key`: 0,
    1, ... in the order of model.modules(), counted on across the models of a process), by
    which `eager_product` finds it, and define torch.ops.decoderlm.eager_product. A layer
    keeps its key (a copy of it, which shares the number, gets another). The same model
    numbered first in two processes traces to the same graph, which torch's graph cache
    then serves."""
    _eager_product_op()
    for module in model.modules():
        if getattr(module, "eager_in_prompt_graph", False):
            key = getattr(module, "prompt_key", None)
            if key is None or _layers.get(key) is not module:
                module.prompt_key = key = next(_keys)
                _layers[key] = module


@contextlib.contextmanager
def prompt_graph():
    """A with-block inside which a compiled prompt pass is traced and run: each layer
    numbered by `number_layers` then multiplies through `eager_product` under
    torch.compile (`in_prompt_graph`), so its product is the one it takes eagerly (a packed
    copy, say), which inductor cannot lower. TorchDynamo guards on the flag this sets: a
    graph traced inside the block (the prompt pass) and one traced outside it (the decoding
    step) each run only where they were traced."""
    global _in_prompt
    _in_prompt = True
    try:
        yield
    finally:
        _in_prompt = False


def in_prompt_graph() -> bool:
    """Whether a layer's forward is being traced into a compiled prompt pass
    (`prompt_graph`), where its product is `eager_product`."""
    return _in_prompt and torch.compiler.is_compiling()


def eager_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer.forward(x) run eagerly from inside a graph that torch.compile traces: one opaque
    operator (torch.ops.decoderlm.eager_product, defined by `number_layers`) that
    inductor calls as it is. x [..., in_features] -> [..., out_features] in x's dtype, as
    the layer's own forward gives it. Only for a layer numbered by `number_layers`."""
    return torch.ops.decoderlm.eager_product(x, layer.prompt_key)


def _run_layer(x: torch.Tensor, layer: int) -> torch.Tensor:
    return _layers[layer].forward(x).contiguous()  # the layout `_product_shape` promises


def _product_shape(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _layers[layer].out_features)


@functools.cache
def _eager_product_op() -> torch.library.Library:
    """Define torch.ops.decoderlm.eager_product(Tensor x, int layer) -> Tensor (once; the
    library returned, kept by the cache, holds the definition): `_run_layer` computes it on
    the CPU, `_product_shape` gives torch.compile its output."""
    library = torch.library.Library("decoderlm", "DEF")
    library.define("eager_product(Tensor x, int layer) -> Tensor")
    library.impl("eager_product", _run_layer, "CPU")
    torch.library.register_fake("decoderlm::eager_product", _product_shape, lib=library)
    return library


def packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN's product on `pack(weight)`: x [..., in]
    -> [..., out], in the weight's dtype; bit for bit `onednn_linear` on the weight as stored
    (in bfloat16 that is F.linear). In bfloat16 1.2-2.1x faster than that for one to 32 rows
    of a decoding model's matrices, in float32 1.2-1.3x for 32 rows (`python
    benchmarks/gemv.py`, benchmarks/README.md).
    Eager only: under torch.compile call `eager_only(packed_product)`."""
    return onednn_linear(x, packed, bias)  # the same call; a packed weight keeps its shape


_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (key, packed)


def packed_copy(layer: nn.Module, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pack(weight.to(dtype))`, kept for `layer`: made at the first call and again whenever
    the layer's weight is another tensor or was changed in place (its version counter; a
    change through `.data` bypasses it, as it does autograd's checks), or dtype differs. The
    copy is kept outside the module (state dicts, copies and pickles never see it) as long
    as the layer lives; a weight made under torch.inference_mode (no version counter) is
    packed at every call, never kept. weight [out, in] (any dtype exactly representable in
    dtype: an int8 weight in bfloat16, say); dtype bfloat16 or float32."""
    if weight.is_inference():
        return pack(weight.to(dtype))
    held = _packed.get(layer)
    if held is None or held[0]() is not weight or held[1] != (weight._version, dtype):
        held = weakref.ref(weight), (weight._version, dtype), pack(weight.to(dtype))
        _packed[layer] = held
    return held[-1]


def packed_linear(
    layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """layer(x) as `packed_product` on `packed_copy` of layer.weight in dtype (None: the
    weight's own, bfloat16 or float32), x and the bias converted to it: x [..., in] ->
    [..., out] in dtype. Eagerly without autograd only (`eager_inference`; a compiled
    prompt pass runs it eagerly through `eager_product`)."""
    if dtype is None:
        dtype = layer.weight.dtype
    packed = packed_copy(layer, layer.weight, dtype)
    bias = None if layer.bias is None else layer.bias.to(dtype)
    return packed_product(x.to(dtype), packed, bias)


class DecodeLinear(nn.Linear):
    """nn.Linear with the decoding products on the CPU without autograd, run eagerly: float32
    with a weight of 2^18 elements or more runs as `rowwise_linear` up to 4 rows where the
    split wins on this CPU (`rowwise_wins_here`), and with more rows as `packed_linear` where
    the layer packs float32 (`packs_float32`) and oneDNN wins (`onednn_wins_here`), else as
    `many_row_linear`; bfloat16 with a weight of 2^15 elements or more runs as `packed_linear`
    where bfloat16 is native (`native_bfloat16`), and elsewhere with 16 rows or more (a
    prompt) in float32 (`prompt_dtype()`): as `packed_linear` on a float32 copy where the
    layer packs float32 and `prompt_copy_dtype` says float32, else through
    `many_row_linear` on the weight converted. Traced into a compiled prompt pass
    (`in_prompt_graph`) it is all of that, run eagerly from the graph (`eager_product`).
    Everything else, and everything else under torch.compile (the decoding step), is
    nn.Linear (`benchmarks/gemv.py --rows N` measures where each wins).

    packs_float32: False unless `install` was asked to pack float32 (a model whose decoding
    step is compiled: its eager passes are its prompts). The packed copy is bit for bit the
    same product as oneDNN's on the weight as stored, 1.2-1.3x faster for 32 rows of GPT-2
    small's float32 block matrices on a 2-core AVX-512 AMD EPYC (`python benchmarks/gemv.py
    --rows 32`); for a bfloat16 weight it is the same product as oneDNN's on the weight
    converted to float32. Either is one more float32 copy in memory of each matrix that a
    product of that many rows multiplies: the block matrices, and in an evaluation or a
    prompt's logprobs the unembedding too (benchmarks/README.md).
    """

    packs_float32 = False
    eager_in_prompt_graph = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if in_prompt_graph():
            return eager_product(self, x)
        if not eager_inference(x):
            return super().forward(x)
        rows = x.numel() // x.size(-1)
        if x.dtype == torch.float32 and self.weight.numel() >= ROWWISE_MIN_WEIGHT:
            if rows <= ROWWISE_MAX_ROWS and rowwise_wins_here():
                return rowwise_linear(x, self.weight, self.bias)
            if self.packs_float32 and onednn_wins_here():
                return packed_linear(self, x)
            return many_row_linear(x, self.weight, self.bias)
        if x.dtype != torch.bfloat16:
            return super().forward(x)
        weight = self.weight
        if weight.dtype == x.dtype and weight.numel() >= PACKED_MIN_WEIGHT and native_bfloat16():
            return packed_linear(self, x)
        if rows >= PROMPT_MIN_ROWS:
            if self.packs_float32 and prompt_copy_dtype(weight) == torch.float32:
                return packed_linear(self, x, torch.float32).to(x.dtype)
            dtype = prompt_dtype()
            bias = None if self.bias is None else self.bias.to(dtype)
            return many_row_linear(x.to(dtype), weight.to(dtype), bias).to(x.dtype)
        return super().forward(x)


def install(model: nn.Module, pack_float32: bool = False) -> nn.Module:
    """Make every nn.Linear of `model` a `DecodeLinear`, in place (same parameters, same
    state dict, same results up to float rounding); idempotent. pack_float32: the layers'
    eager float32 products of more than 4 rows read a packed float32 copy of a weight of
    2^18 elements or more where oneDNN wins, and so do their bfloat16 prompts on such a CPU
    without native bfloat16 (`DecodeLinear`'s packs_float32). Returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
        if isinstance(module, DecodeLinear) and pack_float32:
            module.packs_float32 = True
    return model
