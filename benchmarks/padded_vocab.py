"""Training-step time with GPT-2's 50,257-token vocabulary, unpadded and padded to 50,304 rows.

nanoGPT pads the vocabulary to a multiple of 64 for faster matmuls; decoderlm keeps the padded
rows in the embedding and unembedding and drops their logits (`ModelConfig.padded_vocab_size`).
This measures whether that pays here: one AdamW step (forward, backward, step) of the same model
shape with each vocabulary, alternated, after warm-up steps; it prints the median milliseconds
per step of each and their ratio.

    python benchmarks/padded_vocab.py --device cuda --dtype bfloat16
    python benchmarks/padded_vocab.py --n-layers 1 --d-model 64 --n-heads 2 --block-size 32 \
        --batch-size 2 --steps 3 --repeats 2          # a quick try on a CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each repeat")
    p.add_argument("--repeats", type=int, default=3, help="alternations of the two models")
    p.add_argument("--padded", type=int, default=50304, help="rows of the padded model")
    return p.parse_args(argv)


def step_times(model, args, n: int, generator) -> list[float]:
    """Seconds of each of n AdamW steps of `model` on random tokens."""
    import torch

    device = torch.device(args.device)
    opt = model.optimizer
    times = []
    for _ in range(n):
        idx = torch.randint(0, 50257, (args.batch_size, args.block_size + 1), generator=generator)
        idx = idx.to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, getattr(torch, args.dtype), args.dtype != "float32"):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from decoderlm import DecoderLM, ModelConfig

    try:
        device = torch.device(args.device)
        shape = dict(
            vocab_size=50257,
            block_size=args.block_size,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            d_model=args.d_model,
        )
        models = {}
        for name, rows in (("50257", None), (str(args.padded), args.padded)):
            torch.manual_seed(0)
            model = DecoderLM(ModelConfig(**shape, padded_vocab_size=rows)).to(device).train()
            model.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            models[name] = model
    except (ValueError, RuntimeError) as e:
        print(f"padded_vocab.py: error: {e}", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(0)
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            step_times(model, args, args.warmup, generator)
            times[name] += step_times(model, args, args.steps, generator)
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    for name, ms in medians.items():
        print(f"vocabulary rows {name:>6}: {ms:9.2f} ms per step (median of {len(times[name])})")
    names = list(medians)
    print(f"padded / unpadded: {medians[names[1]] / medians[names[0]]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
