"""Training throughput on this machine: the nanoGPT CPU recipe, model FLOP utilisation of a
larger model, and tokens/s and peak memory as the context grows.

    python benchmarks/train_speed.py --data data/input.txt                 # all three parts
    python benchmarks/train_speed.py --part recipe --data data/input.txt   # or mfu, or context

--data is Tiny Shakespeare's input.txt (the recipe part's corpus; the other parts need none):
    curl -L -o data/input.txt \
        https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt

recipe: nanoGPT's Shakespeare-character CPU recipe (n_layers 4, n_heads 4, d_model 128,
    block_size 64, batch 12, lr 1e-3 with 100 warm-up steps and cosine decay to 1e-4 over
    2,000 steps, weight decay 0.1, beta2 0.99, clipping 1.0, dropout 0, no biases) trained with
    `decoderlm train` on Tiny Shakespeare prepared by `decoderlm prepare --tokenizer char`
    (the same 90/10 split as nanoGPT's prepare.py), in float32 and bfloat16 autocast, eager and
    with torch.compile, and once more with rotary positions instead of the learned table.
    Each run is a fresh process. Figures: steady-state tokens/s (steps 100 to
    2,000, without the evaluation), the wall time of the whole training call, and the final
    validation loss over the whole validation split (nats/char).
mfu: n_layers 8, d_model 512, n_heads 8, block_size 256, batch 8, character vocabulary: tokens/s
    over 10 steps after 3 warm-up steps, and MFU = training FLOPs per token (Kaplan et al. 2020,
    table 1: 6 N + 6 n_layers T d_model, `decoderlm.model.analysis.flops_per_token`) x tokens/s over
    the matmul peak this script measures (a 2048 x 2048 x 2048 torch.mm, best of 20).
context: the recipe's model at 16,384 tokens per step, block_size 128 ... 4,096 (batch 128 ...
    4), float32, default attention path (scaled_dot_product_attention): tokens/s over 5 steps
    and the peak resident memory (VmHWM, reset after start-up) of a fresh process over its
    resident memory before building the model, during 3 training steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import SHAKESPEARE_HINT, prepare_chars, require_file

RECIPE = [  # nanoGPT's architecture and optimizer (learned positions, GELU, AdamW)
    "--preset",
    "classic",
    "--n-layers",
    "4",
    "--n-heads",
    "4",
    "--d-model",
    "128",
    "--block-size",
    "64",
    "--batch-size",
    "12",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--warmup-steps",
    "100",
    "--schedule",
    "cosine",
    "--weight-decay",
    "0.1",
    "--beta2",
    "0.99",
    "--grad-clip",
    "1",
    "--dropout",
    "0",
    "--bias",
    "false",
    "--max-steps",
    "2000",
    "--eval-interval",
    "2000",
    "--log-interval",
    "100",
    "--checkpoint-interval",
    "0",
    "--seed",
    "1337",
    "--no-progress",
]
VARIANTS = [("float32", "false"), ("bfloat16", "false"), ("float32", "true"), ("bfloat16", "true")]


def recipe(data: Path, work: Path) -> None:
    tokens = prepare_chars(data, work / "shakespeare_char")
    print("nanoGPT CPU recipe, Tiny Shakespeare characters, 2,000 steps of 768 tokens")
    print(
        f"{'dtype':<10} {'compile':<8} {'tokens/s':>9} {'ms/step':>8} {'wall s':>7} {'val loss':>9}"
    )
    for dtype, compiled, extra in [(d, c, []) for d, c in VARIANTS] + [
        ("bfloat16", "false", ["--pos-encoding", "rope"])
    ]:
        out = work / f"run-{dtype}-{compiled}-{len(extra)}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "decoderlm",
                "train",
                "--data",
                str(tokens),
                "--out",
                str(out),
                *RECIPE,
                "--dtype",
                dtype,
                "--compile",
                compiled,
                *extra,
            ],
            check=True,
            capture_output=True,
        )
        records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        first, last = records[0], records[-1]  # steps 100 and 2,000
        rate = (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])
        val = _final_val_loss(out)
        print(
            f"{dtype:<10} {compiled:<8} {rate:9,.0f} {768 / rate * 1000:8.1f} "
            f"{last['elapsed_s']:7.1f} {val:9.4f}  {' '.join(extra)}",
            flush=True,
        )


def _final_val_loss(run: Path) -> float:
    from decoderlm.evaluate import evaluate_run

    return evaluate_run(run, split="val")["nats_per_token"]


def matmul_peak(dtype) -> float:
    """FLOP/s of a 2048^3 matrix product, best of 20 (after 3 warm-up products)."""
    import torch

    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best


def _steps_per_s(model, cfg_dtype: str, compiled: bool, batch: int, steps: int, warmup: int):
    import torch

    from decoderlm.config import TrainConfig
    from decoderlm.training.optim import configure_optimizer

    ADAMW = dict(optimizer="adamw", lr=1e-4, schedule="constant")
    optimizer = configure_optimizer(model, TrainConfig.from_dict(ADAMW))
    step_model = torch.compile(model) if compiled else model
    T, V = model.config.block_size, model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def step():
        x = torch.randint(0, V, (batch, T), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg_dtype == "bfloat16"):
            _, loss = step_model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - start)


def mfu_part() -> None:
    import torch

    from decoderlm import DecoderLM, ModelConfig
    from decoderlm.model.analysis import flops_per_token

    cfg = ModelConfig(
        vocab_size=66, block_size=256, n_layers=8, n_heads=8, d_model=512, dropout=0.0
    )
    flops = flops_per_token(cfg, 256)["training"]
    peaks = {"float32": matmul_peak(torch.float32), "bfloat16": matmul_peak(torch.bfloat16)}
    print(
        f"\n8 x 512, block 256, batch 8 (2,048 tokens/step), {flops / 1e6:.1f} MFLOP/token "
        f"(Kaplan); matmul peak: float32 {peaks['float32'] / 1e9:.0f} GFLOP/s, bfloat16 "
        f"{peaks['bfloat16'] / 1e9:.0f} GFLOP/s ({torch.get_num_threads()} threads)"
    )
    print(f"{'dtype':<10} {'compile':<8} {'tokens/s':>9} {'GFLOP/s':>8} {'MFU':>6}")
    for dtype, compiled in VARIANTS:
        torch.manual_seed(0)
        rate = 2048 * _steps_per_s(DecoderLM(cfg).train(), dtype, compiled == "true", 8, 10, 3)
        achieved = flops * rate
        print(
            f"{dtype:<10} {compiled:<8} {rate:9,.0f} {achieved / 1e9:8.1f} "
            f"{achieved / peaks[dtype]:6.1%}",
            flush=True,
        )


CONTEXT_CHILD = r"""
import json, sys, time
import torch
from decoderlm import DecoderLM, ModelConfig
from decoderlm.config import TrainConfig
from decoderlm.training.optim import configure_optimizer
def status(key):  # bytes, from /proc/self/status
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
ADAMW = dict(optimizer="adamw", lr=1e-4, schedule="constant")
tiny = DecoderLM(ModelConfig(vocab_size=8, block_size=8, n_layers=1, n_heads=1, d_model=8))
tiny(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
T = int(sys.argv[1]); B = 16384 // T
model = DecoderLM(ModelConfig(vocab_size=66, block_size=T, n_layers=4, n_heads=4, d_model=128,
                              bias=False)).train()
opt = configure_optimizer(model, TrainConfig.from_dict(ADAMW))
g = torch.Generator().manual_seed(0)
def step():
    x = torch.randint(0, 66, (B, T), generator=g)
    _, loss = model(x, x)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3):
    step()
peak = status("VmHWM") - base
start = time.perf_counter()
for _ in range(5):
    step()
print(json.dumps({"tokens_per_s": 5 * 16384 / (time.perf_counter() - start), "peak": peak}))
"""


def context_part() -> None:
    print("\nthe recipe's model, 16,384 tokens per step, float32, default attention path")
    print(f"{'block_size':>10} {'batch':>6} {'tokens/s':>9} {'peak MiB':>9}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for T in (128, 256, 512, 1024, 2048, 4096):
        out = subprocess.run(
            [sys.executable, "-c", CONTEXT_CHILD, str(T)],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        ).stdout
        r = json.loads(out)
        print(
            f"{T:>10} {16384 // T:>6} {r['tokens_per_s']:9,.0f} {r['peak'] / 2**20:9.1f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["recipe", "mfu", "context", "all"], default="all")
    parser.add_argument(
        "--data", type=Path, help="Tiny Shakespeare's input.txt (the recipe part needs it)"
    )
    args = parser.parse_args()
    if args.part in ("recipe", "all"):
        require_file(args.data, SHAKESPEARE_HINT)
        with tempfile.TemporaryDirectory() as work:
            recipe(args.data, Path(work))
    if args.part in ("mfu", "all"):
        mfu_part()
    if args.part in ("context", "all"):
        context_part()


if __name__ == "__main__":
    main()
