"""Making a loaded model decode-ready, in one place: lower-precision weights (bfloat16,
weight-only int8, int8 weights with 8-bit activations), the CPU's one-row kernels, compile.

`prepare_for_decoding(model, dtype, quantize, compile)` is the one function that changes a
model for decoding; it records what it did in `model.decoding_setup` (a `DecodingSetup`),
which the decoding paths read (`generate` and the server's `Scheduler` take `compile` from it
and change nothing themselves). A model never prepared decodes as it is: eager, in its dtype,
with nn.Linear's products.

Decoding one token multiplies one row by every weight matrix, so its time is the bytes of
weights it reads: 4 per parameter in float32, 2 in bfloat16, 1 in int8.
`prepare_for_decoding` turns a loaded model into one that reads fewer of them, in place:

- dtype "bfloat16": every weight and activation, and so the KV cache, in bfloat16. On a CPU
  with oneDNN's bfloat16 kernels every matrix (the unembedding included) is repacked once into
  oneDNN's blocked layout (`PackedLinear`): a one-row product then reads the weight at the
  memory's rate, where F.linear on the plain layout reads it at about half of it
  (`python benchmarks/decode_profile.py` names the operators a token's time goes to).
- quantize "int8": the block matrices and the unembedding become `Int8Linear` (int8 weights,
  one float scale per output row, symmetric: w ~ scale[o] * q[o, i], |q| <= 127), multiplied by
  torch's `aten._weight_int8pack_mm`; the embeddings, norms and biases stay in the activation
  dtype (bfloat16 unless dtype says float32), and so does the KV cache.
- quantize "w8a8": the same int8 weights (`W8A8Linear`), multiplied by oneDNN's int8 products
  with each product's input quantised to 8 bits on the fly, as llama.cpp's q8_0 does: the
  products run on integers (VNNI), where int8 weights converted to floats one by one cost
  more arithmetic than a memory read on a 2-core machine.

On the CPU every remaining nn.Linear then becomes a `cpu_decode.DecodeLinear` (the faster
one-row products; exactly nn.Linear for training and many-row products), float32 included. A
model prepared with a lower precision decodes (`generate`, the server) and evaluates
(`decoderlm.evaluate`) but does not train: its matrices are no longer parameters.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..allocator import give_back_freed_memory
from ..arguments import DecodeDType, Quantize
from ..errors import UserError
from . import cpu_decode

__all__ = [
    "DTYPES",
    "INT8_MULTIPLE",
    "DecodingSetup",
    "Int8Linear",
    "PackedLinear",
    "W8A8Linear",
    "dequantised_product",
    "activation_levels",
    "w8a8_available",
    "packing_available",
    "compiler_available",
    "prepare_for_decoding",
    "decoding_setup",
    "quantize_int8",
    "activation_dtype",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INT8_MULTIPLE = 16  # _weight_int8pack_mm reads the input width in blocks of 16 (others crash)
INT8_GEMV_MAX_ROWS = 8  # rows up to which _weight_int8pack_mm beats dequantise-then-multiply


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 quantisation of weight [out, in] (any float dtype).

    Returns:
        (q [out, in] int8, scales [out] bfloat16) with weight ~ scales[:, None] * q: each
        row's scale is its largest |weight| / 127, rounded to bfloat16 first so that q is
        rounded against the scale the product uses (an all-zero row gets scale 1 and q 0).
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).bfloat16()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q.contiguous(), scales


def dequantised_product(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """x @ (scales[:, None] * weight).T for many rows (a prompt, an evaluation), computed as
    (x @ weight.T) * scales: the int8 weight converted to `cpu_decode.prompt_dtype()` (exact:
    |w| <= 127) and multiplied by `cpu_decode.many_row_linear`, the per-row scales applied to
    the product's columns, a pass over [rows, out] instead of one over the [out, in] weight.

    x [rows, in] (any float dtype), weight [out, in] int8, scales [out] -> [rows, out] in
    prompt_dtype().
    """
    dtype = cpu_decode.prompt_dtype()
    return cpu_decode.many_row_linear(x.to(dtype), weight.to(dtype)) * scales.to(dtype)


class Int8Linear(nn.Module):
    """y = x @ (scales[:, None] * weight).T + bias with int8 weights, for inference.

    x [..., in_features] in float32 or bfloat16 -> y [..., out_features] in x's dtype; the
    product runs in bfloat16 (x is cast to it). Up to 8 rows (decoding) it is
    `torch.ops.aten._weight_int8pack_mm`, which reads each int8 weight once, accumulates in
    float32 and supports in_features that are multiples of 16 only (`prepare_for_decoding`
    refuses others); with more rows (a prompt, an evaluation), whose cost in that kernel grows
    with the rows, it is `dequantised_product`, in `cpu_decode.prompt_dtype()` (bfloat16
    where the CPU multiplies it natively, else float32); under torch.compile (a compiled
    step of more than 8 rows) it is F.linear on the weight in bfloat16, as asking the CPU for
    prompt_dtype() would break the graph, and inductor cannot compile the rest of such a
    step; traced into a compiled prompt pass (`cpu_decode.in_prompt_graph`) it is what it
    is eagerly, run from the graph (`cpu_decode.eager_product`). A layer that packs its prompts
    (`packs_prompts`, set by `prepare_for_decoding` for a model whose decoding step is
    compiled) multiplies them, eagerly on the CPU without autograd
    (`cpu_decode.eager_inference`) where bfloat16 is native, by oneDNN's packed copy of the
    weight in bfloat16 (`cpu_decode.packed_copy`, `cpu_decode.prompt_copy_dtype`; exact:
    |q| <= 127): the same sums as `dequantised_product`'s, without converting the weight at
    every prompt, for one bfloat16 copy of the weight in memory.

    Buffers: weight [out, in] int8, scales [out] bfloat16; bias [out] (the activation dtype)
    or None.
    """

    packs_prompts = False
    eager_in_prompt_graph = True  # a compiled prompt pass runs forward eagerly (cpu_decode)

    def __init__(self, linear: nn.Linear, bias_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        bias = None if linear.bias is None else linear.bias.detach().to(bias_dtype).clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_decode.in_prompt_graph():
            return cpu_decode.eager_product(self, x)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if flat.size(0) <= INT8_GEMV_MAX_ROWS:  # decoding: one pass over the int8 weight
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        elif torch.compiler.is_compiling():  # a compiled step of many rows (see above)
            y = F.linear(flat, self.weight.to(torch.bfloat16)) * self.scales
        else:  # a prompt or an evaluation: the kernel's time grows with the rows
            y = self._many_rows(flat, x)
        y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _many_rows(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The product of many rows flat [rows, in] bfloat16 (x reshaped) -> [rows, out]
        (class docstring): from the packed copy where the layer packs its prompts, x is
        multiplied eagerly (`cpu_decode.eager_inference`) and the CPU keeps a copy
        (`cpu_decode.prompt_copy_dtype`), else `dequantised_product`; the same sums."""
        dtype = cpu_decode.prompt_copy_dtype(self.weight) if self.packs_prompts else None
        if dtype is None or not cpu_decode.eager_inference(x):
            return dequantised_product(flat, self.weight, self.scales)
        packed = cpu_decode.packed_copy(self, self.weight, dtype)
        return cpu_decode.packed_product(flat.to(dtype), packed) * self.scales.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class W8A8Linear(nn.Module):
    """y = x @ (scales[:, None] * weight).T + bias with int8 weights and int8 activations,
    for inference on an x86 CPU: x [..., in_features] (float32 or bfloat16) -> [...,
    out_features] in x's dtype.

    Up to 8 rows (decoding), x is quantised on the fly to uint8 with one scale and zero point
    for all its rows (asymmetric, over their min and max; `activation_levels` steps: 255, or
    127 on a CPU whose int8 product would saturate) and multiplied by oneDNN's int8
    product (`torch.ops.onednn.qlinear_pointwise`, VNNI instructions, int32 accumulation):
    as in llama.cpp's q8_0 products, the dot products run on 8-bit integers, so no weight is
    converted to a float. With more rows (a prompt, an evaluation) the same rounding runs
    written out, each row quantised with its own scale, then multiplied by the weight
    (`dequantised_product`; oneDNN's int8 product takes one scale for all rows).

    Traced into a compiled prompt pass (`cpu_decode.in_prompt_graph`) it is what it is
    eagerly, run from the graph (`cpu_decode.eager_product`).

    Buffers: weight [out, in] int8, scales [out] float32, bias [out] (the activation dtype) or
    None; `packed` is oneDNN's copy of weight (an opaque layout).
    """

    eager_in_prompt_graph = True  # a compiled prompt pass runs forward eagerly (cpu_decode)

    def __init__(self, linear: nn.Linear, bias_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.float())
        self.packed = torch.ops.onednn.qlinear_prepack(q, [1, self.in_features])
        cpu_decode.eager_only(_w8a8_product)  # made before any torch.compile traces forward
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        bias = None if linear.bias is None else linear.bias.detach().to(bias_dtype).clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_decode.in_prompt_graph():
            return cpu_decode.eager_product(self, x)
        flat = x.reshape(-1, self.in_features).float()
        if flat.size(0) <= INT8_GEMV_MAX_ROWS:
            product = cpu_decode.eager_only(_w8a8_product)  # opaque to torch.compile
            y = product(flat, self.packed, self.scales, self._zero_points, x.dtype)
        else:
            levels = activation_levels()
            lo = flat.amin(1, keepdim=True).clamp(max=0)
            hi = flat.amax(1, keepdim=True).clamp(min=0)
            scale = ((hi - lo) / levels).clamp(min=1e-12)
            zero = (-lo / scale).round()
            fake = ((flat / scale + zero).round().clamp(0, levels) - zero) * scale
            y = dequantised_product(fake, self.weight, self.scales).to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


def _w8a8_product(flat, packed, scales, zero_points, dtype):
    """oneDNN's int8 product of flat [rows, in] float32, quantised here with one scale."""
    levels = activation_levels()
    lo, hi = (float(v) for v in torch.aminmax(flat))
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / levels or 1.0
    zero = min(levels, max(0, round(-lo / scale)))
    xq = flat.div(scale).add_(zero).round_().clamp_(0, levels).to(torch.uint8)
    return _onednn_product(xq, scale, zero, packed, scales, zero_points, dtype)


def _onednn_product(xq, scale, zero, packed, scales, zero_points, dtype):
    return torch.ops.onednn.qlinear_pointwise(
        xq, scale, zero, packed, scales, zero_points, None, 1.0, 0, dtype, "none", [], ""
    )


@functools.cache
def activation_levels() -> int:
    """The largest uint8 activation W8A8Linear quantises to on this CPU: 255 where oneDNN's
    uint8 x int8 product accumulates exactly (VNNI or AMX: int32 sums), 127 where it adds
    pairs of products in int16 first (AVX2 or AVX-512 without VNNI: 255 * 127 * 2 overflows
    32,767 and saturates), as FBGEMM's reduce_range does. Found once by the product of 64
    inputs of 255 with 64 weights of 127, whose sum is known."""
    weight = torch.full((1, 64), 127, dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(weight, [1, 64])
    xq = torch.full((1, 64), 255, dtype=torch.uint8)
    zeros = torch.zeros(1, dtype=torch.long)
    y = _onednn_product(xq, 1.0, 0, packed, torch.ones(1), zeros, torch.float32)
    return 255 if float(y) == 255 * 127 * 64 else 127


def w8a8_available() -> bool:
    """Whether this torch has oneDNN's int8 products (W8A8Linear): x86 CPUs."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")


class PackedLinear(nn.Module):
    """nn.Linear whose bfloat16 weight is repacked once into oneDNN's blocked layout, for
    inference on the CPU: x [..., in_features] bfloat16 -> [..., out_features] bfloat16,
    through `torch.ops.mkldnn._linear_pointwise`, the kernel torch.compile's CPU freezing
    uses. `weight` is the packed tensor (bfloat16, an opaque layout: products only); `bias`
    [out] bfloat16 or None.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        self.weight = cpu_decode.pack(weight)
        cpu_decode.eager_only(cpu_decode.packed_product)  # before any torch.compile trace
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_decode.eager_only(cpu_decode.packed_product)(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def packing_available() -> bool:
    """Whether this torch has oneDNN's bfloat16 products on this CPU (PackedLinear)."""
    return cpu_decode.native_bfloat16()


def compiler_available() -> bool:
    """Whether torch.compile's CPU backend finds its C++ compiler: $CXX, else g++ (clang++ on
    macOS), as torch's inductor searches."""
    default = "clang++" if sys.platform == "darwin" else "g++"
    return shutil.which(os.environ.get("CXX", default)) is not None


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of a model's activations and KV cache: that of its token embedding (a
    prepared model's matrices may be int8 or packed)."""
    return model.tok_emb.weight.dtype


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every nn.Linear of the model (DecodeLinear included)."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]


def _check_int8(model: nn.Module, linears, quantize: str) -> None:
    if model.device.type != "cpu":
        raise UserError(
            f"--quantize {quantize} decodes on the CPU only (the model is on {model.device}); "
            "use --device cpu, or --dtype bfloat16 on this device"
        )
    if quantize == "w8a8":
        if not w8a8_available():
            raise UserError(
                "--quantize w8a8 needs oneDNN's int8 products, which this torch or CPU lacks; "
                "use --quantize int8"
            )
        return
    odd = sorted({layer.in_features for _, _, layer in linears} - {0})
    odd = [n for n in odd if n % INT8_MULTIPLE]
    if odd:
        c = model.config
        raise UserError(
            f"--quantize int8 needs every matrix's input width to be a multiple of "
            f"{INT8_MULTIPLE}; this model's d_model={c.d_model}, d_ff={c.d_ff} give {odd}; "
            "decode it with --dtype bfloat16 instead"
        )


@dataclass(frozen=True)
class DecodingSetup:
    """What `prepare_for_decoding` did to a model (its `decoding_setup` attribute).

    Attributes:
        dtype: the activations' (and KV cache's) dtype after preparing: bfloat16 as asked, or
            the model's own (float32 asks for no change).
        quantize: None, "int8" or "w8a8": the matrices' int8 form.
        compile: decode with the torch.compile'd one-token step (`steps.decode_step`).
        cpu_kernels: the model's nn.Linear layers are `cpu_decode.DecodeLinear`s (a CPU model).
    """

    dtype: torch.dtype
    quantize: str | None
    compile: bool
    cpu_kernels: bool


def decoding_setup(model: nn.Module) -> DecodingSetup | None:
    """What `prepare_for_decoding` did to `model`; None for a model never prepared (it decodes
    as it is: eager, not compiled)."""
    return getattr(model, "decoding_setup", None)


@torch.no_grad()
def prepare_for_decoding(
    model: nn.Module,
    dtype: DecodeDType | None = None,
    quantize: Quantize | None = None,
    compile: bool = False,
) -> nn.Module:
    """Make a loaded DecoderLM decode-ready, in place, and record it; returns the model.

    Lower-precision matrices read fewer bytes per decoded token (see the module docstring),
    a CPU model gets `cpu_decode`'s one-row kernels, and `model.decoding_setup` records the
    `DecodingSetup`, whose `compile` the decoding paths (`generate`, the `Scheduler`) read.
    Preparing a prepared model again with the same settings does nothing. The float32
    weights a lower precision replaces are freed and their memory handed back to the
    operating system (`decoderlm.allocator.give_back_freed_memory`).

    Args:
        model: a DecoderLM (eval mode, any device; int8 only on the CPU).
        dtype: "float32" or "bfloat16", the weights' and activations' dtype; None: float32,
            or bfloat16 with quantize="int8".
        quantize: None; "int8": weight-only int8 block matrices and unembedding (see the
            module docstring); "w8a8": the same int8 weights, multiplied with activations
            quantised to 8 bits on the fly (`W8A8Linear`, x86 CPUs).
        compile: decode with the torch.compile'd one-token step (`steps.decode_step`; the
            first steps compile), and on the CPU a prompt's pass compiled too
            (`steps.prefill`; the first prompt compiles it). On a CPU without a C++
            compiler (`compiler_available`) it says so in one line on stderr and decodes
            eagerly (the setup records compile=False). bfloat16 matrices stay plain
            tensors, which the compiled step freezes and packs for inductor's own products
            (a weight packed outside it would run outside the compiled graph); a prompt's
            products (each the layer's eager one, in its compiled pass too) multiply a
            packed copy of each (`cpu_decode.packed_linear`) where bfloat16 is native, of
            each float32 block matrix where oneDNN wins (`cpu_decode.install`'s
            pack_float32), and of each int8 matrix in bfloat16 where that is native
            (`Int8Linear`'s packs_prompts); on an AMD CPU without native bfloat16 (AVX2)
            a float32 copy of each bfloat16 matrix of 2^18 elements or more that a prompt
            multiplies by 16 rows or more (`cpu_decode.prompt_copy_dtype`), twice its
            bytes: one more copy of the matrices in memory.

    Returns:
        The model. In float32 its weights and state dict are unchanged (on the CPU its
        nn.Linear layers become DecodeLinear, the same products faster). Otherwise it decodes
        and evaluates but cannot be trained or saved (its matrices are buffers).

    Raises:
        UserError: an unknown dtype or quantize; int8 or w8a8 for a model off the CPU; int8
            with a matrix whose input width (d_model, d_ff) is not a multiple of 16; w8a8
            without oneDNN's int8 products; a model already prepared with other settings.
    """
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if quantize not in (None, "int8", "w8a8"):
        raise UserError(f"unknown quantization {quantize!r}; use int8 or w8a8")
    target = DTYPES[dtype or ("bfloat16" if quantize else "float32")]
    kept = target == torch.float32 and not quantize  # float32 alone changes no dtype
    cpu = model.device.type == "cpu"
    if compile and cpu and not compiler_available():
        print(
            "decoderlm: no C++ compiler found (g++, or $CXX), so the decoding step runs "
            "eagerly, not compiled",
            file=sys.stderr,
        )
        compile = False
    setup = DecodingSetup(activation_dtype(model) if kept else target, quantize, compile, cpu)
    done = decoding_setup(model)
    if done is not None:
        if done == setup:
            return model
        raise UserError(
            f"this model is already prepared for decoding ({done}); prepare a freshly "
            f"loaded one for {setup}"
        )
    if not kept:
        _lower_precision(model, target, quantize, compile)
        give_back_freed_memory()  # the float32 weights just replaced
    if cpu:
        cpu_decode.install(model, pack_float32=compile)
    model.decoding_setup = setup
    return model


def _lower_precision(model: nn.Module, target: torch.dtype, quantize, compile: bool) -> None:
    """Turn the model's matrices into `target` (int8 / packed ones where asked), in place."""
    linears = _linears(model)
    if quantize:
        _check_int8(model, linears, quantize)
    pack = not (quantize or compile) and model.device.type == "cpu" and packing_available()
    if quantize or pack:
        _untie(model)
        # built from the float32 weights, before the rest of the model changes dtype
        kind = {"int8": Int8Linear, "w8a8": W8A8Linear}.get(quantize)
        new = [(p, n, kind(x, target) if kind else PackedLinear(x)) for p, n, x in linears]
        for _, _, layer in new if quantize == "int8" and compile else []:
            layer.packs_prompts = True  # a compiled model's prompts: a packed copy, where kept
    model.to(target)  # embeddings, norms, biases, position tables: the activation dtype
    for parent, name, layer in new if quantize or pack else []:
        setattr(parent, name, layer)


def _untie(model: nn.Module) -> None:
    """Give lm_head its own weight when tied to tok_emb, so that it can be replaced while the
    embedding keeps a plain table to look rows up in."""
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight is model.tok_emb.weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
