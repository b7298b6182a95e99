"""Peak memory of a CPU training step, measured, beside `decoderlm.model.analysis.memory_bytes`.

Each configuration runs in a fresh process: the peak resident set size (ru_maxrss) after a
warm-up step of a tiny model is the baseline; the model is built, AdamW takes three float32 steps
(zero_grad(set_to_none=True), forward, backward, step), and the peak RSS growth over the
baseline is compared with the estimate's training_peak (weights + gradients + AdamW moments +
activations + the loss's backward transient, 2 B T vocab_size float32).

    python benchmarks/memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import arguments

CONFIGS = [
    dict(
        name="char, 4 x 256, T 512, batch 16",
        model=dict(vocab_size=138, block_size=512, n_layers=4, n_heads=4, d_model=256),
        batch_size=16,
    ),
    dict(
        name="GPT-2 vocabulary, 6 x 384, T 256, batch 8",
        model=dict(vocab_size=50257, block_size=256, n_layers=6, n_heads=6, d_model=384),
        batch_size=8,
    ),
    dict(
        name="llama-style, 4 x 512, T 256, batch 8",
        model=dict(
            vocab_size=32000,
            block_size=256,
            n_layers=4,
            n_heads=8,
            d_model=512,
            pos_encoding="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            tie_embeddings=False,
        ),
        batch_size=8,
    ),
]

CHILD = r"""
import json, resource, sys
import torch
from decoderlm import DecoderLM, ModelConfig
# warm up the runtime (autograd engine, kernels, thread pools) on a tiny model first
tiny = DecoderLM(ModelConfig(vocab_size=8, block_size=8, n_layers=1, n_heads=1, d_model=8))
torch.optim.AdamW(tiny.parameters())
tiny(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
spec = json.loads(sys.argv[1])
cfg = ModelConfig(**spec["model"])
model = DecoderLM(cfg).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(0)
for _ in range(3):
    idx = torch.randint(0, cfg.vocab_size, (spec["batch_size"], cfg.block_size), generator=g)
    opt.zero_grad(set_to_none=True)
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"measured": peak - base}))
"""


def main() -> None:
    arguments(__doc__).parse_args()
    from decoderlm import ModelConfig
    from decoderlm.model.analysis import memory_bytes

    mib = 2**20
    print(
        f"{'configuration':<45} {'measured MiB':>13} {'estimate MiB':>13} {'estimate/measured':>18}"
    )
    for spec in CONFIGS:
        # glibc: serve every block of 64 KiB or more by mmap, so freed tensors leave the
        # resident set at once and the RSS high-water mark follows the live bytes
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(spec)],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        ).stdout
        measured = json.loads(out)["measured"]
        cfg = ModelConfig(**spec["model"])
        est = memory_bytes(cfg, spec["batch_size"], cfg.block_size, "fp32")
        print(
            f"{spec['name']:<45} {measured / mib:13.1f} {est['training_peak'] / mib:13.1f} "
            f"{est['training_peak'] / measured:18.3f}   (weights {est['weights'] / mib:.0f}, "
            f"activations {est['activations'] / mib:.0f} MiB)",
            flush=True,
        )


if __name__ == "__main__":
    main()
