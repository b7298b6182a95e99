"""Where a training step of a preset's model spends its time: torch.profiler over --steps
optimizer steps, as `decoderlm train --preset NAME` takes them on the CPU (its dtype, its
attention kernel, its optimizer, gradient clipping), on random character batches.

    python benchmarks/train_profile.py [--preset default] [--dtype auto|float32|bfloat16]

Prints the dtype training resolves to, milliseconds per step (the median of --timed steps
after 10 warm-up steps, unprofiled), then the operators that took the most time (self CPU
time over --steps profiled steps; divide by --steps for a step's share).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import arguments
from decoderlm import DecoderLM, ModelConfig
from decoderlm.config import TrainConfig
from decoderlm.presets import PRESETS
from decoderlm.training.loop import autocast_for, resolve_dtype
from decoderlm.training.optim import configure_optimizer
from decoderlm.training.parallel import choose_attention

VOCAB = 139  # the shipped corpus's characters and an unknown-character id


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--preset", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=5, help="profiled steps")
    parser.add_argument("--timed", type=int, default=40, help="timed steps")
    parser.add_argument("--rows", type=int, default=20, help="operators listed")
    args = parser.parse_args()
    preset = PRESETS.get(args.preset)
    if preset is None or not preset.model:
        print(
            f"train_profile.py: error: no model preset {args.preset!r}; use one of "
            f"{', '.join(n for n, p in PRESETS.items() if p.model)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    torch.manual_seed(0)
    device = torch.device("cpu")
    train = resolve_dtype(TrainConfig.from_dict({**preset.train, "dtype": args.dtype}), device)
    model = DecoderLM(ModelConfig(**{**preset.model, "vocab_size": VOCAB})).train()
    choose_attention(model, train, device)
    optimizer = configure_optimizer(model, train)
    autocast = autocast_for(train, device)
    batch = (train.data.batch_size, model.config.block_size)
    x, y = torch.randint(0, VOCAB, batch), torch.randint(0, VOCAB, batch)

    def step() -> None:
        with autocast():
            _, loss = model(x, y)
        loss.backward()
        if train.optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    times = []
    for _ in range(args.timed):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(
        f"preset {args.preset}, dtype {train.compute.dtype}, batch {batch[0]} x {batch[1]}, "
        f"{torch.get_num_threads()} threads: {statistics.median(times) * 1e3:.1f} ms a step"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
