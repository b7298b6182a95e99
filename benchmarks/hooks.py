"""What the hook points cost when nothing is attached to them, and what the lens costs.

    python benchmarks/hooks.py                 # both parts
    python benchmarks/hooks.py --part report   # only the lens timings
    python benchmarks/hooks.py --quick         # tiny settings, to check that it runs

Times one call of a `HookPoint` with nothing attached (best of 5 rounds of 10^6 calls, the
empty loop subtracted), counts the hook-point calls of greedy decoding (4 x 256 model,
vocabulary 50,257, 32-token prompt, 64 new tokens, float32) and of one training step
(forward + backward, the default preset's shape, batch 32), and prints their share of the
measured time of each (median of 5).

The lens part times (median of 3, after one warm-up) what training adds at each evaluation
(`decoderlm.lens.lens.probe_metrics` on the repeated probe) and at the end (`build_report` +
`write_report` on the first validation tokens), for the default preset's model (3 x 128,
vocabulary 139, context 96, 96 tokens), and the report of a randomly initialised model of
GPT-2 small's shape (12 x 768, vocabulary 50,257, 128 tokens) without and with --corrupt.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import median_seconds
from decoderlm import CharTokenizer, DecoderLM, GPT2Tokenizer, ModelConfig
from decoderlm.generation.generate import generate
from decoderlm.generation.precision import prepare_for_decoding
from decoderlm.lens.lens import default_probe, probe_metrics
from decoderlm.lens.report import build_report, write_report
from decoderlm.model.hooks import HeadsHookPoint, HookPoint


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
    plain = {cls: cls.__call__ for cls in (HookPoint, HeadsHookPoint)}

    def counter(cls):
        def counting(self, x):
            count[0] += 1
            return plain[cls](self, x)

        return counting

    for cls in plain:
        cls.__call__ = counter(cls)
    try:
        job()
    finally:
        for cls, call in plain.items():
            cls.__call__ = call
    times = []
    for _ in range(5):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return count[0], statistics.median(times)


def lens_part(quick: bool) -> None:
    """Print the lens timings (see the module docstring)."""
    torch.manual_seed(0)
    chars = CharTokenizer([chr(32 + i) for i in range(138)], unk_token=None)
    seed = DecoderLM(
        ModelConfig(vocab_size=139, block_size=96, n_layers=3, n_heads=4, d_model=128)
    ).eval()
    gpt2_shape = (
        dict(n_layers=2, n_heads=4, d_model=64)
        if quick
        else dict(n_layers=12, n_heads=12, d_model=768)
    )
    gpt2 = DecoderLM(ModelConfig(vocab_size=50257, block_size=1024, **gpt2_shape)).eval()
    probe = default_probe(139, 96)
    print(
        f"training, each evaluation: probe {probe.shape[0]} x {probe.shape[1]}: "
        f"{median_seconds(lambda: probe_metrics(seed, probe)) * 1e3:.1f} ms"
    )
    ids = torch.randint(0, 138, (96,)).tolist()
    gpt2_ids = torch.randint(0, 50257, (128,)).tolist()
    corrupted = gpt2_ids[:-1] + [(gpt2_ids[-1] + 1) % 50257]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {
            "seed model, 96 tokens (what training writes)": (seed, chars, ids, None),
            f"GPT-2 small shape {gpt2_shape}, 128 tokens": (gpt2, GPT2Tokenizer(), gpt2_ids, None),
            "the same with --corrupt": (gpt2, GPT2Tokenizer(), gpt2_ids, corrupted),
        }
        for label, (model, tok, x, bad) in jobs.items():
            path = Path(tmp) / "report.html"

            def job():
                write_report(build_report(model, tok, x, corrupted=bad), path)

            seconds = median_seconds(job, 1 if quick else 3)
            print(f"report, {label}: {seconds:.2f} s, {path.stat().st_size:,} bytes")


def hooks_part() -> None:
    """Print the cost of hook points with nothing attached (see the module docstring)."""
    torch.manual_seed(0)
    per_call = call_ns()
    print(f"one hook-point call, nothing attached: {per_call:.0f} ns")
    decoder = prepare_for_decoding(  # as the commands decode: the CPU's one-row kernels
        DecoderLM(
            ModelConfig(vocab_size=50257, block_size=1024, n_layers=4, n_heads=8, d_model=256)
        ).eval()
    )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["hooks", "report", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="tiny settings (a smoke test)")
    args = parser.parse_args()
    if args.part in ("hooks", "all"):
        hooks_part()
    if args.part in ("report", "all"):
        lens_part(args.quick)


if __name__ == "__main__":
    main()
