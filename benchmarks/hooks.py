"""What the hook points cost when nothing is attached to them.

    python benchmarks/hooks.py

Times one call of a `HookPoint` with nothing attached (best of 5 rounds of 10^6 calls, the
empty loop subtracted), counts the hook-point calls of greedy decoding (4 x 256 model,
vocabulary 50,257, 32-token prompt, 64 new tokens, float32) and of one training step
(forward + backward, the default preset's shape, batch 32), and prints their share of the
measured time of each (median of 5).
"""

from __future__ import annotations

import statistics
import time

import torch

from common import arguments
from decoderlm import DecoderLM, ModelConfig
from decoderlm.generate import generate
from decoderlm.hooks import HookPoint


def call_ns() -> float:
    """Nanoseconds per call of a HookPoint with nothing attached."""
    point, x, n = HookPoint(), torch.zeros(1), 1_000_000
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            point(x)
        calls = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(n):
            pass
        best.append((calls - (time.perf_counter() - start)) / n)
    return min(best) * 1e9


def calls_and_seconds(job) -> tuple[int, float]:
    """(hook-point calls made by job(), median seconds of job() over 5 runs)."""
    count = [0]
    plain = HookPoint.__call__

    def counting(self, x):
        count[0] += 1
        return plain(self, x)

    HookPoint.__call__ = counting
    try:
        job()
    finally:
        HookPoint.__call__ = plain
    times = []
    for _ in range(5):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return count[0], statistics.median(times)


def main() -> None:
    arguments(__doc__).parse_args()
    torch.manual_seed(0)
    per_call = call_ns()
    print(f"one hook-point call, nothing attached: {per_call:.0f} ns")
    decoder = DecoderLM(
        ModelConfig(vocab_size=50257, block_size=1024, n_layers=4, n_heads=8, d_model=256)
    ).eval()
    prompt = torch.randint(0, 50257, (1, 32))
    small = DecoderLM(
        ModelConfig(vocab_size=139, block_size=96, n_layers=3, n_heads=4, d_model=128)
    )
    batch = torch.randint(0, 139, (32, 97))

    def train_step():
        small(batch[:, :-1], batch[:, 1:])[1].backward()

    jobs = {
        "decode 64 tokens (4 x 256)": lambda: generate(decoder, prompt, 64, do_sample=False),
        "training step (3 x 128, T 96, batch 32)": train_step,
    }
    for label, job in jobs.items():
        calls, seconds = calls_and_seconds(job)
        cost = calls * per_call * 1e-9
        print(
            f"{label}: {calls} calls, {cost * 1e3:.3f} ms of {seconds * 1e3:.1f} ms "
            f"= {100 * cost / seconds:.2f}%"
        )


if __name__ == "__main__":
    main()
