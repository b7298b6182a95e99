"""The training options of modern recipes, each alone and together, at equal wall time.

On the shipped WikiText-2 crop (the default data), with the 'classic' preset as the base
(the default's model with every option below off: learned positions, GELU, AdamW, cosine
schedule), for each variant a short calibration run measures
its steady training rate on this machine, then the variant trains for as many steps as fit
in --seconds of training (its schedule spans those steps), with --seeds seeds. Variants and
seeds alternate (A B C ... A B C ...). The score is the final validation loss over the whole
validation split (nats/char).

    python benchmarks/ablation.py [--seconds 120] [--seeds 1337 1 2] [--variants ...]
                                  [--parallel 1] [--train-flags="--dtype float32"] [--steps N]

--steps N trains every variant for N steps (equal steps, not equal time) and skips the
calibration. The variants `default`, `default-as-llama` and `default-as-gpt2` are the
`default` preset and the smallest flag changes that make it exportable (the flags that
`decoderlm train` and `decoderlm export` name: src/decoderlm/io/targets.py).

--parallel N runs N trainings at once (calibrations included), each on one thread
(--threads 1): N cores in use, every run beside N - 1 others alike, so equal wall time means
equal wall time under that load.

--train-flags go to every run. Prints a Markdown table: variant, its
flags, steps, mean ± half-range of the validation loss over the seeds, and the difference
from the base.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import TRAIN_FLAGS, arguments, decoderlm_train, run_main, spread, steady_tokens_per_s

BASE = ["--preset", "classic"]
OPTIONS = {
    "rope": ["--pos-encoding", "rope"],
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
VARIANTS["all+dropout-0.1"] = [*VARIANTS["all"], *OPTIONS["dropout-0.1"]]
# the options that each beat the base alone in benchmarks/README.md's ablation table
VARIANTS["rope+muon+relu2+wsd"] = [f for n in ("rope", "muon", "relu2", "wsd") for f in OPTIONS[n]]
# the default preset (a later --preset replaces BASE's) and the flags that make it exportable
NOT_EXPORTABLE = ["--preset", "default", "--qk-norm", "false", "--logit-softcap", "none"]
VARIANTS["default"] = ["--preset", "default"]
VARIANTS["default-as-llama"] = [*NOT_EXPORTABLE, "--norm", "rmsnorm", "--mlp", "swiglu"]
VARIANTS["default-as-llama"] += ["--bias", "false"]
VARIANTS["default-as-gpt2"] = [*NOT_EXPORTABLE, "--pos-encoding", "learned", "--mlp", "gelu"]
VARIANTS["default-as-gpt2"] += ["--activation", "gelu_tanh"]


def steps_for(
    name: str, seconds: float, flags: list, work: Path, calibration: int, parallel: int
) -> int:
    """Optimizer steps of `name` that fit in `seconds` of training, from a short run."""
    probe = ["--max-steps", calibration, "--log-interval", 5, "--eval-interval", calibration]
    run = train(work / f"calibrate-{name}", [*probe, *BASE, *VARIANTS[name], *flags], parallel)
    tokens_per_step = run["records"][0]["tokens"] / run["records"][0]["step"]
    return max(1, int(seconds * steady_tokens_per_s(run["records"]) / tokens_per_step))


def train(out: Path, flags: list, parallel: int) -> dict:
    """decoderlm_train, on one thread when runs go in parallel."""
    if parallel == 1:
        return decoderlm_train(out, flags)
    return decoderlm_train(out, [*flags, "--threads", 1], env={"OMP_NUM_THREADS": "1"})


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=120.0, help="training seconds per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--calibration-steps", type=int, default=30)
    parser.add_argument("--steps", type=int, help="train every variant N steps (no calibration)")
    parser.add_argument("--parallel", type=int, default=1, help="trainings at once, 1 thread each")
    parser.add_argument("--train-flags", **TRAIN_FLAGS)
    args = parser.parse_args()
    flags = args.train_flags
    if (
        args.seconds <= 0
        or args.calibration_steps < 15
        or args.parallel < 1
        or (args.steps or 1) < 1
    ):
        raise SystemExit(
            "error: --seconds and --steps must be positive, --calibration-steps >= 15, "
            "--parallel >= 1"
        )
    losses = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(args.parallel) as pool:
        work = Path(work)

        def calibrate(name: str) -> int:
            if args.steps is not None:
                return args.steps
            return steps_for(name, args.seconds, flags, work, args.calibration_steps, args.parallel)

        steps = dict(zip(losses, pool.map(calibrate, losses), strict=True))
        print("steps in", args.seconds, "s:", steps, file=sys.stderr)

        def one(job: tuple[int, str]) -> tuple[str, float]:
            seed, name = job
            run_flags = ["--max-steps", steps[name], "--seed", seed, *BASE, *VARIANTS[name]]
            run_flags += flags
            run = train(work / f"run-{name}-{seed}", run_flags, args.parallel)
            print(f"seed {seed} {name}: {run['val_loss']:.4f}", file=sys.stderr, flush=True)
            return name, run["val_loss"]

        jobs = [(seed, name) for seed in args.seeds for name in args.variants]
        for name, loss in pool.map(one, jobs):
            losses[name].append(loss)
    reference = "base" if "base" in losses else args.variants[0]  # what "vs" compares with
    base = statistics.fmean(losses[reference])
    budget = "steps" if args.steps is not None else f"steps in {args.seconds:g} s"
    print(f"\n| variant | flags | {budget} | val loss (nats/char) | vs {reference} |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in losses.items():
        delta = "" if name == reference else f"{statistics.fmean(values) - base:+.4f}"
        flag_text = " ".join(VARIANTS[name]) or "(--preset classic)"
        print(f"| {name} | `{flag_text}` | {steps[name]} | {spread(values)} | {delta} |")


if __name__ == "__main__":
    run_main(main)
