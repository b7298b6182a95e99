"""One-row float32 and bfloat16 products on this CPU: F.linear (MKL's matrix-vector product) against
`decoderlm.model.rowwise_linear` (the same product as a 2-way batched matmul), for the
unembeddings and block matrices of the decoding benchmark. Prints milliseconds per product
(best of 30 after a warm-up) and the weight bytes read per second.

    python benchmarks/gemv.py
"""

import time

import torch
import torch.nn.functional as F

from decoderlm.model import rowwise_linear

SHAPES = [(50257, 768), (50257, 256), (3072, 768), (768, 3072), (2304, 768)]  # [out, in]


def best_ms(fn, n=30) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    print(f"{'dtype':>9} {'weight [out, in]':>18} {'F.linear ms':>12} {'GB/s':>6} "
          f"{'rowwise ms':>11} {'GB/s':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for out, inp in SHAPES:
            w, x = torch.randn(out, inp, dtype=dtype), torch.randn(1, inp, dtype=dtype)
            gb = w.numel() * w.element_size() / 1e9
            a = best_ms(lambda: F.linear(x, w))
            b = best_ms(lambda: rowwise_linear(x, w))
            print(f"{str(dtype)[6:]:>9} {str([out, inp]):>18} {a:12.3f} {gb / a * 1e3:6.1f} "
                  f"{b:11.3f} {gb / b * 1e3:6.1f}")


if __name__ == "__main__":
    main()
