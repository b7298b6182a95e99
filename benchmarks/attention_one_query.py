"""One new query's attention over a KV cache on this CPU, the attention of one decoded token:
torch's scaled_dot_product_attention in bfloat16, the same kernel on float32 copies of q, k
and v (converted at every call, as an eager bfloat16 step on a CPU without native bfloat16
kernels runs it), and `decoderlm.model.model.one_query_attention` (the written-out product)
in bfloat16, for the head layouts of SmolLM2-135M (9 query heads over 3 key/value heads) and
GPT-2 small (12 heads), head_dim 64, at cache lengths of 16 to 1,024 keys.

Prints microseconds per call (the median of --calls calls after a warm-up, in this process,
with glibc keeping the memory it frees, `decoderlm.allocator.keep_freed_memory`: a loop of
nothing but these calls otherwise hands the float32 copies' pages back at every call once
they pass its trim threshold, 1.5 MB each for GPT-2 small at 512 keys, and faults them in
again, which a decoding step, with the rest of the model's tensors allocated around them,
does not) and which is fastest; a decoded token runs one call
per layer (30 for SmolLM2, 12 for GPT-2 small). Whether this CPU has native bfloat16
kernels (`decoderlm.cpu.native_bfloat16`) decides which one the eager step takes
(`decoderlm.model.model`'s attention).

    python benchmarks/attention_one_query.py [--calls 200]
"""

import torch
import torch.nn.functional as F

from common import arguments, median_seconds, refuse
from decoderlm.allocator import keep_freed_memory
from decoderlm.cpu import native_bfloat16
from decoderlm.model.model import one_query_attention

LAYOUTS = {"SmolLM2-135M, 9 / 3 heads": (9, 3), "GPT-2 small, 12 / 12 heads": (12, 12)}
KEYS = [16, 64, 256, 512, 1024]
HEAD_DIM = 64


def contenders(q, k, v) -> dict:
    """The three ways to attend one bfloat16 query q [1, H, 1, D] over k, v [1, H_kv, S, D]."""
    grouped = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
    return {
        "sdpa bf16": lambda: F.scaled_dot_product_attention(q, k, v, **grouped),
        "sdpa on f32 copies": lambda: F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), **grouped
        ).to(v.dtype),
        "written-out bf16": lambda: one_query_attention(q, k, v, None),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per contender")
    args = parser.parse_args()
    if args.calls < 1:
        refuse("--calls must be 1 or more")
    keep_freed_memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"native bfloat16: {native_bfloat16()}; us per call, median of {args.calls}")  # fmt: skip
    for name, (heads, kv_heads) in LAYOUTS.items():
        print(f"\n{name}")
        print(f"{'keys':>5}  {'sdpa bf16':>10}  {'sdpa on f32 copies':>18}  "
              f"{'written-out bf16':>16}  fastest")  # fmt: skip
        for keys in KEYS:
            q = torch.randn(1, heads, 1, HEAD_DIM, dtype=torch.bfloat16)
            k, v = (torch.randn(1, kv_heads, keys, HEAD_DIM, dtype=torch.bfloat16) for _ in "kv")
            us = {
                label: median_seconds(fn, args.calls, warmups=10) * 1e6
                for label, fn in contenders(q, k, v).items()
            }
            cells = [f"{us[label]:{len(label) if len(label) > 10 else 10}.1f}" for label in us]
            print(f"{keys:>5}  " + "  ".join(cells) + f"  {min(us, key=us.get)}")


if __name__ == "__main__":
    main()
