"""Two checkouts of decoderlm against each other: training and decoding tokens/s, as whole
processes, alternated (A B A B ...), with the ratio B / A of each pair.

    python benchmarks/versions.py OLD_SRC NEW_SRC [--repeats 3]

OLD_SRC and NEW_SRC are the `src` directories of the two checkouts (e.g. a `git worktree` of
an earlier commit); each process imports decoderlm from its own through PYTHONPATH.

train-bf16, train-fp32: `python -m decoderlm train` with the default preset for 300 steps
    (bfloat16 autocast as the preset says, then float32), no evaluation before the end and no
    checkpoints; the figure is the tokens/s the command prints (training steps only).
decode-4x256, decode-gpt2: greedy decoding with the KV cache of a randomly initialised model
    (4 layers x 256 wide, 8 heads, vocabulary 50,257, block_size 1,024; and GPT-2 small's
    shape), float32, 256 new tokens after a 32-token prompt, after one warm-up call; the
    figure is new tokens / s of the timed call.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

DECODE = """
import time, torch
from decoderlm import DecoderLM, ModelConfig
from decoderlm.generate import generate
torch.manual_seed(0)
model = DecoderLM(ModelConfig(vocab_size=50257, block_size=1024, n_layers={n_layers},
                              n_heads={n_heads}, d_model={d_model})).eval()
prompt = torch.randint(0, 50257, (1, 32))
generate(model, prompt, 32, do_sample=False)
start = time.perf_counter()
generate(model, prompt, 256, do_sample=False)
print(f"{{256 / (time.perf_counter() - start):.1f}} tokens/s")
"""

TRAIN = [
    "-m",
    "decoderlm",
    "train",
    "--max-steps",
    "300",
    "--eval-interval",
    "100000",
    "--checkpoint-interval",
    "0",
    "--sample-chars",
    "0",
    "--no-progress",
    "--overwrite",
]

CASES = {
    "train-bf16": TRAIN,
    "train-fp32": TRAIN + ["--dtype", "float32"],
    "decode-4x256": ["-c", DECODE.format(n_layers=4, n_heads=8, d_model=256)],
    "decode-gpt2": ["-c", DECODE.format(n_layers=12, n_heads=12, d_model=768)],
}


def run(src: str, args: list[str], out_dir: str) -> float:
    """tokens/s printed by one process importing decoderlm from `src`."""
    env = {**os.environ, "PYTHONPATH": src}
    extra = ["--out", out_dir] if "train" in args else []
    done = subprocess.run(
        [sys.executable, *args, *extra], env=env, capture_output=True, text=True, check=True
    )
    found = re.findall(r"([\d,.]+) tokens/s", done.stdout)
    if not found:
        raise RuntimeError(f"no tokens/s in the output of {args[:3]}:\n{done.stdout[-2000:]}")
    return float(found[-1].replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_src")
    parser.add_argument("new_src")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            old, new, ratios = [], [], []
            for _ in range(args.repeats):
                old.append(run(args.old_src, CASES[case], f"{tmp}/run"))
                new.append(run(args.new_src, CASES[case], f"{tmp}/run"))
                ratios.append(new[-1] / old[-1])
            print(
                f"{case:13s} old {statistics.median(old):9,.1f}  new "
                f"{statistics.median(new):9,.1f} tokens/s (medians)  new/old per pair "
                f"{', '.join(f'{r:.3f}' for r in ratios)}  median {statistics.median(ratios):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
