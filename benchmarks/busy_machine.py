"""Training tokens/s on a quiet machine and with one core kept busy by another process.

For each setting (threads 1, threads 2, threads 2 with OMP_WAIT_POLICY=PASSIVE, threads auto,
no flag, and 2 data-parallel processes of 1 thread each under torchrun with half the batch
each, the same global batch) `decoderlm train` of the default recipe runs as a fresh process
(or job), quiet and busy (this
script starts a process that spins on one core for the busy runs and stops it afterwards);
settings and conditions alternate, and each is repeated. tokens/s is the steady training rate
between the first and the last metrics record that is not an evaluation.

    python benchmarks/busy_machine.py [--steps 300] [--repeats 2] [--train-flags="..."]

Prints a Markdown table: setting, quiet tokens/s, busy tokens/s, busy / quiet.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import TRAIN_FLAGS, arguments, decoderlm_train, run_main, steady_tokens_per_s

SETTINGS = {  # flags, environment, processes
    "threads 1": (["--threads", "1"], {}, 1),
    "threads 2": (["--threads", "2"], {}, 1),
    "threads 2, OMP_WAIT_POLICY=PASSIVE": (["--threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}, 1),
    "threads auto": (["--threads", "auto"], {}, 1),
    "default (no flag)": ([], {}, 1),
    "2 processes x 1 thread (DDP, half batch each)": (
        ["--threads", "1", "--batch-size", "16"],
        {"OMP_NUM_THREADS": "1"},
        2,
    ),
}


@contextlib.contextmanager
def one_core_busy(busy: bool):
    """A process spinning on one core while active (nothing when busy is False)."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--train-flags", **TRAIN_FLAGS)
    args = parser.parse_args()
    flags = args.train_flags
    if args.steps < 20 or args.repeats < 1:
        raise SystemExit("error: --steps must be at least 20 and --repeats positive")
    steps = ["--max-steps", args.steps, "--log-interval", 10, "--eval-interval", args.steps]
    rates = {(s, busy): [] for s in args.settings for busy in (False, True)}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.repeats):
            for busy in (False, True):
                for setting in args.settings:
                    extra, env, processes = SETTINGS[setting]
                    with one_core_busy(busy):
                        flags_ = [*steps, *extra, *flags]
                        run = decoderlm_train(Path(work) / "run", flags_, env, processes)
                    rates[setting, busy].append(steady_tokens_per_s(run["records"]))
                    label = "busy" if busy else "quiet"
                    print(
                        f"round {round_ + 1} {label:5} {setting}: {rates[setting, busy][-1]:,.0f}"
                    )
    print("\n| setting | quiet tokens/s | one core busy tokens/s | busy / quiet |")
    print("| --- | --- | --- | --- |")
    for setting in args.settings:
        quiet = statistics.median(rates[setting, False])
        busy = statistics.median(rates[setting, True])
        print(f"| {setting} | {quiet:,.0f} | {busy:,.0f} | {busy / quiet:.0%} |")


if __name__ == "__main__":
    run_main(main)
