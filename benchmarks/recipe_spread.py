"""How far the nanoGPT recipe's final validation loss moves with the seed and with the way it is
estimated: `decoderlm train` on the recipe of benchmarks/train_speed.py (bfloat16, compiled)
with seeds 1337, 1, 2 and 3 (the last --seed given wins; whole-split validation loss of
each), and, for the seed-1337 model, nanoGPT's estimate (the mean loss of 20 random batches
of 12 validation windows) drawn with 40 different generator seeds.

    python benchmarks/recipe_spread.py --data data/input.txt   # Tiny Shakespeare's input.txt
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from common import SHAKESPEARE_HINT, arguments, prepare_chars, require_file
from train_speed import RECIPE


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", help="Tiny Shakespeare's input.txt")
    data = require_file(parser.parse_args().data, SHAKESPEARE_HINT)
    from decoderlm import DecoderLM
    from decoderlm.data.corpus import get_batch, load_token_dir
    from decoderlm.evaluate import evaluate_run

    with tempfile.TemporaryDirectory() as work:
        tokens = prepare_chars(data, Path(work) / "shakespeare_char")
        for seed in (1337, 1, 2, 3):
            out = Path(work) / f"seed-{seed}"
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
                    "--seed",
                    str(seed),
                    "--dtype",
                    "bfloat16",
                    "--compile",
                    "true",
                ],
                check=True,
                capture_output=True,
            )
            loss = evaluate_run(out, split="val")["nats_per_token"]
            print(f"seed {seed:>4}: whole-split validation loss {loss:.4f}", flush=True)
        model = DecoderLM.from_pretrained(Path(work) / "seed-1337")
        val = load_token_dir(tokens).val
        estimates = []
        with torch.no_grad():
            for g_seed in range(40):
                g = torch.Generator().manual_seed(g_seed)
                estimates.append(
                    np.mean([model(*get_batch(val, 12, 64, g))[1].item() for _ in range(20)])
                )
        print(
            f"seed 1337, 20-batch estimates over 40 draws: min {min(estimates):.4f}, "
            f"median {np.median(estimates):.4f}, max {max(estimates):.4f}"
        )


if __name__ == "__main__":
    main()
