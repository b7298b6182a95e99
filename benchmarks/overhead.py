"""The fixed cost of `decoderlm train`: a short run's whole process against
`python -c "import torch"`, alternated (A B A B ...), and where the time goes.

    python benchmarks/overhead.py [--repeats 5] [--steps 10] [--breakdown] [--train-flags="..."]

Prints the median wall time of each and their ratio (a 10-step run against the bare torch
import). --breakdown adds one run under `python -X importtime` (the slowest
top-level imports) and one under cProfile (cumulative seconds of the phases: imports, the
training loop, evaluation, checkpoints, plots, the sample). The plots are drawn by a child
process while the report and the sample are made; cProfile sees the wait for it.
"""

from __future__ import annotations

import pstats
import statistics
import sys
import tempfile
from pathlib import Path

from common import TRAIN_FLAGS, arguments, run_main, timed

PHASES = {
    "training/run.py:.*run_experiment": "run_experiment (all but imports and parsing)",
    "training/loop.py:.*\\(train\\)": "train (the loop, its evaluations and checkpoints)",
    "training/loop.py:.*train_step": "train_step (forward, backward, optimizer)",
    "evaluate.py:.*\\(evaluate\\)": "evaluate (estimates and the final whole split)",
    "training/state.py:.*\\(save\\)": "checkpoint writes",
    "plots.py:.*plot_run": "loss.png + attention.png: starting the child process",
    "plots.py:.*\\(wait\\)": "loss.png + attention.png: waiting for the child process",
    "generate.py:.*\\(generate\\)": "samples.txt (generation)",
    "training/optim.py:.*configure_optimizer": "building the optimizer (imports torch._dynamo)",
    "training/artifacts.py:.*_write_report": "report.html / report.json (the lens report)",
    "training/run.py:.*_save_run": "model.safetensors and the tokenizer files",
    "training/artifacts.py:.*write_artifacts": "plots, sample and report after training",
    "training/metrics.py:.*peak_flops": "mfu peak (CPU matmul measured once)",
    "training/metrics.py:.*bytes_per_token": "val_bpb bytes count",
}


def train_command(out: Path, steps: int, flags: list) -> list:
    """`decoderlm train` of the default recipe for `steps` steps (then `flags`), as strings."""
    command = [sys.executable, "-m", "decoderlm", "train", "--max-steps", steps, "--out", out]
    return [str(c) for c in [*command, "--no-progress", *flags]]


def breakdown(work: Path, steps: int, flags: list) -> None:
    """One run under -X importtime and one under cProfile, summarised."""
    import re
    import subprocess

    result = subprocess.run(
        [sys.executable, "-X", "importtime", *train_command(work / "imports", steps, flags)[1:]],
        capture_output=True,
        text=True,
    )
    rows = []
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)", line)
        if match and len(match[2]) <= 2:  # top-level imports and their first level
            rows.append((int(match[1]) / 1e6, match[3]))
    print("\nslowest imports (cumulative s, -X importtime):")
    for seconds, name in sorted(rows, reverse=True)[:12]:
        print(f"  {seconds:7.2f}  {name}")
    profile = work / "profile.out"
    timed(
        [
            sys.executable,
            "-m",
            "cProfile",
            "-o",
            profile,
            *train_command(work / "p", steps, flags)[1:],
        ]
    )
    stats = pstats.Stats(str(profile))
    print("\nphases (cumulative s under cProfile, which slows many small calls):")
    for pattern, label in PHASES.items():
        total = sum(
            row[3]
            for (path, line, name), row in stats.stats.items()
            if re.search(pattern, f"{path}:{line}({name})")
        )
        print(f"  {total:7.2f}  {label}")


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="training steps of the short run")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--train-flags", **TRAIN_FLAGS)
    args = parser.parse_args()
    flags = args.train_flags
    if args.repeats < 1 or args.steps < 1:
        raise SystemExit("error: --repeats and --steps must be positive")
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        torch_s, train_s = [], []
        for i in range(args.repeats):  # A B A B ...
            torch_s.append(timed([sys.executable, "-c", "import torch"])[0])
            train_s.append(timed(train_command(work / f"run{i}", args.steps, flags))[0])
            print(f"round {i + 1}: import torch {torch_s[-1]:.2f} s, train {train_s[-1]:.2f} s")
        a, b = statistics.median(torch_s), statistics.median(train_s)
        print(f"\nmedian `python -c 'import torch'`: {a:.2f} s")
        print(f"median `decoderlm train --max-steps {args.steps}`: {b:.2f} s  ({b / a:.2f}x)")
        if args.breakdown:
            breakdown(work, args.steps, flags)


if __name__ == "__main__":
    run_main(main)
