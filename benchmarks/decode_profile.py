"""Where greedy decoding spends its time: torch.profiler over 128 new tokens of the 4-layer,
256-wide GPT-2 shape (vocabulary 50,257, random weights), batch 1, 32-token prompt.

    python benchmarks/decode_profile.py [--dtype bfloat16]

Prints tokens/s (256 tokens, after a warm-up) and the operators that took the most time; the
unembedding is the aten::mm row, the block products the aten::addmm row.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from decoderlm import DecoderLM, ModelConfig
from decoderlm.generation.generate import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=50257,
        block_size=1024,
        n_layers=4,
        n_heads=4,
        d_model=256,
        activation="gelu_tanh",
    )
    model = DecoderLM(config).eval().to(getattr(torch, args.dtype))
    prompt = torch.randint(0, 50257, (1, 32))
    for _ in range(2):
        generate(model, prompt, 64, do_sample=False)
    start = time.perf_counter()
    generate(model, prompt, 256, do_sample=False)
    print(f"{args.dtype}: {256 / (time.perf_counter() - start):.1f} tokens/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, prompt, 128, do_sample=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
