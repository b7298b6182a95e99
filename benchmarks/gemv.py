"""One-row products on this CPU, the core of decoding one token (--rows N: N-row products,
decoding N sequences together as `decoderlm serve` does, or a prompt): F.linear (MKL's
product in float32, oneDNN's in bfloat16), `decoderlm.generation.cpu_decode.onednn_linear`
(oneDNN's product on the weight as stored), `decoderlm.generation.cpu_decode.packed_product`
(oneDNN's product on the weight packed into its blocked layout once, `cpu_decode.pack`),
`decoderlm.generation.cpu_decode.rowwise_linear` (a 2-way batched matmul) and
`decoderlm.generation.cpu_decode.reduction_linear` under torch.compile (one fused
multiply-and-sum kernel), against torch.sum over the same weights (a pure read), for the
unembeddings and block matrices of the decoding benchmark, float32 and bfloat16 (on a CPU
without native bfloat16, AVX2, torch's oneDNN has no bfloat16 product: there the bfloat16
rows' oneDNN cells are a bfloat16 prompt's products, run in float32: "oneDNN" on the weight
converted at each call, "oneDNN packed" on a packed float32 copy made beforehand, what a
compiled model's prompt reads there).

Each shape cycles through enough copies of its weight (>= 256 MiB) that every product reads
it from memory, not from the 32 MiB L3, as decoding a real model does. Prints milliseconds
per product (best of 5 passes, after a warm-up) and the weight bytes read per second.

    python benchmarks/gemv.py [--rows 1]
    python benchmarks/gemv.py --int8

--int8: the products of int8 weights (one bfloat16 scale per output row, as `--quantize int8`
stores them) with bfloat16 inputs of 1 to 512 rows: torch's `_weight_int8pack_mm` (which
`Int8Linear` runs up to `INT8_GEMV_MAX_ROWS` rows), `dequantised_product` (its many-row
product: (x @ q.T) * scales in `prompt_dtype()`), the weight dequantised first
(F.linear(x, scales[:, None] * q)) and oneDNN's product on a packed copy of q in
prompt_dtype() made beforehand (in bfloat16, what a compiled int8 model's prompts read where
it is native, `Int8Linear.packs_prompts`; in float32, the copy such a model does not keep
on a CPU without it, `cpu_decode.prompt_copy_dtype`), for GPT-2 small's block matrices and
unembedding; milliseconds per product (best of 3 passes), and which is fastest at each row
count.
"""

import time

import torch
import torch.nn.functional as F

from common import arguments, refuse
from decoderlm.cpu import native_bfloat16
from decoderlm.generation.cpu_decode import (
    onednn_linear,
    pack,
    packed_product,
    prompt_dtype,
    reduction_linear,
    rowwise_linear,
)
from decoderlm.generation.precision import dequantised_product, quantize_int8

SHAPES = [(50257, 768), (50257, 256), (3072, 768), (768, 3072), (2304, 768)]  # [out, in]
# a bfloat16 prompt's products where bfloat16 is not native: the weight converted to
# float32 at each call (`DecodeLinear` in prompt_dtype()), or a packed float32 copy of it
# (a compiled model's, `cpu_decode.prompt_copy_dtype`)
IN_FLOAT32 = {
    "oneDNN": (lambda x, w: onednn_linear(x.float(), w.float()).bfloat16(), None),
    "oneDNN packed": (
        lambda x, packed: packed_product(x.float(), packed).bfloat16(),
        lambda w: pack(w.float()),
    ),
}


def best_ms(fn, n=30) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--rows", type=int, default=1, help="rows of x: sequences decoded at once")
    parser.add_argument("--int8", action="store_true", help="int8 weights by row count (below)")
    args = parser.parse_args()
    if args.rows < 1:
        refuse("--rows must be >= 1")
    torch.manual_seed(0)
    if args.int8:
        return int8_rows()
    compiled = torch.compile(reduction_linear, dynamic=True)
    contenders = {  # name: (product, what it multiplies: the weight, or its packed copy)
        "torch.sum": (lambda x, w: w.sum(), None),
        "F.linear": (F.linear, None),
        "oneDNN": (onednn_linear, None),
        "oneDNN packed": (packed_product, pack),
        "rowwise": (rowwise_linear, None),
        "compiled reduction": (compiled, None),
    }
    if not torch.backends.mkldnn.is_available():
        del contenders["oneDNN"], contenders["oneDNN packed"]
    print(
        f"{'dtype':>9} {'weight [out, in]':>16} "
        + " ".join(f"{name + ' ms':>22} {'GB/s':>5}" for name in contenders)
    )
    for dtype in (torch.float32, torch.bfloat16):
        for out, inp in SHAPES:
            x = torch.randn(args.rows, inp, dtype=dtype)
            nbytes = out * inp * torch.finfo(dtype).bits // 8
            weights = [torch.randn(out, inp, dtype=dtype) for _ in range(-(-(2**28) // nbytes))]
            row = f"{str(dtype)[6:]:>9} {str([out, inp]):>16}"
            for name, (fn, prepare) in contenders.items():
                if name.startswith("oneDNN") and dtype == torch.bfloat16 and not native_bfloat16():
                    fn, prepare = IN_FLOAT32[name]  # no oneDNN bfloat16 product here (AVX2)
                operands = [prepare(w) for w in weights] if prepare else weights

                def each():
                    for w in operands:
                        fn(x, w)

                ms = best_ms(each, n=5) / len(weights)
                row += f" {ms:22.3f} {nbytes / ms / 1e6:5.1f}"
            print(row, flush=True)


INT8_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def int8_rows() -> None:
    """The --int8 table (see the module docstring)."""
    dtype = prompt_dtype()
    contenders = {
        "_weight_int8pack_mm": torch.ops.aten._weight_int8pack_mm,
        "dequantised_product": dequantised_product,
        "weight dequantised": lambda x, q, s: F.linear(
            x.to(dtype), q.to(dtype) * s.to(dtype)[:, None]
        ),
        "packed copy": lambda x, packed, s: packed_product(x.to(dtype), packed) * s.to(dtype),
    }
    if not torch.backends.mkldnn.is_available():
        del contenders["packed copy"]
    print(f"prompt_dtype: {dtype}; ms per product")
    print(f"{'weight [out, in]':>16} {'rows':>5} " + " ".join(f"{n:>20}" for n in contenders))
    for out, inp in SHAPES[:1] + SHAPES[2:]:
        q, scales = quantize_int8(torch.randn(out, inp))
        copies = [q.clone() for _ in range(-(-(2**28) // q.numel()))]  # past the L3
        packed = [pack(w.to(dtype)) for w in copies] if "packed copy" in contenders else []
        for rows in INT8_ROWS:
            x = torch.randn(rows, inp, dtype=torch.bfloat16)
            times = {}
            for name, fn in contenders.items():
                operands = packed if name == "packed copy" else copies

                def each():
                    for w in operands:
                        fn(x, w, scales)

                times[name] = best_ms(each, n=3) / len(copies)
            best = min(times, key=times.get)
            cells = " ".join(f"{ms:20.3f}" for ms in times.values())
            print(f"{str([out, inp]):>16} {rows:5d} {cells}  fastest: {best}", flush=True)


if __name__ == "__main__":
    main()
