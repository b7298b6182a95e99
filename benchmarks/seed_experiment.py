"""The seed experiment's figures: wall time and final validation loss of `decoderlm train`.

Runs each preset as a user would (`decoderlm train --preset NAME`, a fresh process, the
embedded corpus), alternating the presets (A B A B ...) so a noisy neighbour hits both alike,
and prints wall time (process start to exit, so it includes start-up, evaluation, plots and
sampling), training time, tokens/s and the final validation loss over the whole validation
split in nats and bits per character.

    python benchmarks/seed_experiment.py [--repeats N] [--presets default seed-notebook]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(preset: str, out: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "decoderlm",
            "train",
            "--preset",
            preset,
            "--out",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    m = re.search(
        r"final validation loss ([\d.]+) nats/char = ([\d.]+) bits/char .*?"
        r"([\d.]+) s of training at ([\d,]+) tokens/s",
        proc.stdout,
    )
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return {
        "preset": preset,
        "wall_s": wall,
        "train_s": float(m.group(3)),
        "tokens_per_s": float(m.group(4).replace(",", "")),
        "val_loss": float(m.group(1)),
        "val_bpc": float(m.group(2)),
        "last_train_loss": last["train_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--presets", nargs="+", default=["default", "seed-notebook"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for preset in args.presets:
                row = run(preset, Path(tmp) / f"{preset}-{r}")
                rows.append(row)
                print(
                    f"{row['preset']:>14}  wall {row['wall_s']:6.1f} s  train "
                    f"{row['train_s']:6.1f} s  {row['tokens_per_s']:>8,.0f} tok/s  "
                    f"val {row['val_loss']:.4f} nats/char = {row['val_bpc']:.3f} bits/char  "
                    f"(last train loss {row['last_train_loss']:.3f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
