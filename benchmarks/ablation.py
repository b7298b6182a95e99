"""The training options of modern recipes, each alone and together, at equal wall time.

On the shipped WikiText-2 crop (the default data) with the default preset as the base: for
each variant a short calibration run measures its steady training rate on this machine, then
the variant trains for as many steps as fit in --seconds of training (its schedule spans
those steps), with --seeds seeds. Variants and seeds alternate (A B C ... A B C ...). The
score is the final validation loss over the whole validation split (nats/char).

    python benchmarks/ablation.py [--seconds 120] [--seeds 1337 1 2] [--variants ...]
                                  [--train-flags="--dtype float32"]

--train-flags go to every run. Prints a Markdown table: variant, its
flags, steps, mean ± half-range of the validation loss over the seeds, and the difference
from the base.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from common import TRAIN_FLAGS, arguments, decoderlm_train, run_main, spread, steady_tokens_per_s

OPTIONS = {
    "muon": ["--optimizer", "muon"],
    "qk-norm": ["--qk-norm"],
    "relu2": ["--mlp", "relu2"],
    "zero-init": ["--zero-init-proj"],
    "softcap-15": ["--logit-softcap", "15"],
    "wsd": ["--schedule", "wsd", "--cooldown-fraction", "0.4"],
    "dropout-0.1": ["--dropout", "0.1"],
    "resid-dropout-0.15": ["--resid-dropout", "0.15"],
}
VARIANTS = {
    "base": [],
    **OPTIONS,
    "all": [f for name, flags in OPTIONS.items() if "dropout" not in name for f in flags],
}


def steps_for(name: str, seconds: float, flags: list, work: Path, calibration: int) -> int:
    """Optimizer steps of `name` that fit in `seconds` of training, from a short run."""
    probe = ["--max-steps", calibration, "--log-interval", 5, "--eval-interval", calibration]
    run = decoderlm_train(work / f"calibrate-{name}", [*probe, *VARIANTS[name], *flags])
    tokens_per_step = run["records"][0]["tokens"] / run["records"][0]["step"]
    return max(1, int(seconds * steady_tokens_per_s(run["records"]) / tokens_per_step))


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=120.0, help="training seconds per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--calibration-steps", type=int, default=30)
    parser.add_argument("--train-flags", **TRAIN_FLAGS)
    args = parser.parse_args()
    flags = args.train_flags
    if args.seconds <= 0 or args.calibration_steps < 15:
        raise SystemExit("error: --seconds must be positive and --calibration-steps >= 15")
    losses = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        steps = {n: steps_for(n, args.seconds, flags, work, args.calibration_steps) for n in losses}
        print("steps in", args.seconds, "s:", steps, file=sys.stderr)
        for seed in args.seeds:
            for name in args.variants:
                run_flags = ["--max-steps", steps[name], "--seed", seed, *VARIANTS[name], *flags]
                run = decoderlm_train(work / "run", run_flags)
                losses[name].append(run["val_loss"])
                print(f"seed {seed} {name}: {run['val_loss']:.4f}", file=sys.stderr)
    base = statistics.fmean(losses["base"]) if "base" in losses else None
    print(f"\n| variant | flags | steps in {args.seconds:g} s | val loss (nats/char) | vs base |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in losses.items():
        delta = "" if base is None else f"{statistics.fmean(values) - base:+.4f}"
        flag_text = " ".join(VARIANTS[name]) or "(default preset)"
        print(f"| {name} | `{flag_text}` | {steps[name]} | {spread(values)} | {delta} |")


if __name__ == "__main__":
    run_main(main)
