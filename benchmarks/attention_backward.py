"""Why bfloat16 CPU training with short contexts writes attention out: forward + backward of
scaled_dot_product_attention (the fused flash kernel) against attention written out
(`decoderlm.model.model.attention_pattern` @ v), float32 and bfloat16, at the nanoGPT recipe's shape
(B 12, 4 heads, T 64, head_dim 32). Prints milliseconds per forward + backward, best of 50.

    python benchmarks/attention_backward.py
"""

import torch
import torch.nn.functional as F

from common import arguments
from decoderlm.model.model import attention_pattern
from gemv import best_ms


def main() -> None:
    arguments(__doc__).parse_args()
    torch.manual_seed(0)
    print(f"{'dtype':<9} {'fused (ms)':>10} {'written out (ms)':>17}")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(12, 4, 64, 32, dtype=dtype, requires_grad=True) for _ in range(3))
        fused = best_ms(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), n=50
        )
        explicit = best_ms(lambda: (attention_pattern(q, k).to(v.dtype) @ v).sum().backward(), n=50)
        print(f"{str(dtype)[6:]:<9} {fused:10.3f} {explicit:17.3f}")


if __name__ == "__main__":
    main()
