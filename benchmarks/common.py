"""What every benchmark script shares: a `--help` built from its docstring, a one-line
failure when its data is missing or unreadable (`refuse`, `require_file`, `load_gguf`), and for
the whole-process benchmarks (overhead.py, busy_machine.py, ablation.py, vs_nanogpt.py):
running and timing fresh processes, `decoderlm train` runs, their metrics, and summaries of
repeated figures.

    from common import arguments, require_file
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn


def arguments(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help shows the script's docstring: the first paragraph as
    the description, the rest after the flags."""
    summary, _, details = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(
        description=summary,
        epilog=details or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def refuse(message: str) -> NoReturn:
    """Exit with status 2 and one line on stderr: `SCRIPT: error: MESSAGE`."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_file(
    path: str | Path | None, hint: str, directory: bool = False, flag: str = "--data"
) -> Path:
    """`path` if it is a file (a directory with directory=True); otherwise exit with status 2
    and one line on stderr: `SCRIPT: error: PATH not found; HINT`, or, when `path` is None (the
    flag was not given), `SCRIPT: error: FLAG is required; HINT`."""
    if path is None:
        refuse(f"{flag} is required; {hint}")
    path = Path(path)
    if not (path.is_dir() if directory else path.is_file()):
        refuse(f"{path} not found; {hint}")
    return path


def load_gguf(path: str):
    """The DecoderLM of a GGUF file (eval mode, dequantized); an unreadable file ends the
    script in one line (`refuse`)."""
    from decoderlm.errors import UserError
    from decoderlm.io.load import load_model

    try:
        return load_model(path).eval()
    except UserError as e:
        refuse(str(e))


TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
# how to get what the peer benchmarks need, for require_file's one line
SHAKESPEARE_HINT = (
    f"get Tiny Shakespeare with `curl -L -o data/input.txt {TINY_SHAKESPEARE_URL}` "
    "and pass --data data/input.txt"
)
NANOGPT_HINT = (
    "get nanoGPT with `git clone https://github.com/karpathy/nanoGPT` and pass --nanogpt DIR"
)


ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(r"final validation loss ([0-9.]+) nats")


class Failed(SystemExit):
    """A benchmark step failed: exit with one line naming the command and its last words."""

    def __init__(self, command: list[str], result: subprocess.CompletedProcess):
        last = (result.stderr or result.stdout or "").strip().splitlines()[-1:] or ["no output"]
        super().__init__(f"error: `{' '.join(map(str, command))}` failed: {last[0]}")


# parser.add_argument("--train-flags", **TRAIN_FLAGS): more `decoderlm train` flags for every
# run, as one quoted string
TRAIN_FLAGS = dict(
    type=shlex.split,
    default=[],
    metavar='"FLAGS"',
    help='more decoderlm train flags for every run, e.g. --train-flags="--dtype float32"',
)


def run_main(main) -> None:
    """Call a benchmark's main(); a Failed step ends the script with its one line."""
    try:
        main()
    except Failed as e:
        raise SystemExit(str(e)) from None


def prepare_chars(text: Path, out: Path) -> Path:
    """`decoderlm prepare --tokenizer char` of `text` into the token directory `out`."""
    command = ["prepare", "--data", str(text), "--tokenizer", "char", "--out", str(out)]
    subprocess.run([sys.executable, "-m", "decoderlm", *command], check=True, capture_output=True)
    return out


def timed(command: list, env: dict | None = None, cwd=None) -> tuple[float, str]:
    """(wall seconds, stdout) of `command` as a fresh process; Failed if it fails."""
    command = [str(c) for c in command]
    start = time.perf_counter()
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise Failed(command, result)
    return seconds, result.stdout


def decoderlm_train(out: Path, flags: list, env: dict | None = None, processes: int = 1) -> dict:
    """`python -m decoderlm train --out OUT --overwrite --no-progress FLAGS` as a fresh process
    (under torchrun with `processes` > 1): {"wall_s", "val_loss" (the whole validation split,
    nats/token), "records" (metrics.jsonl)}."""
    launcher = [sys.executable, "-m"]
    if processes > 1:
        launcher += ["torch.distributed.run", "--nproc_per_node", str(processes), "-m"]
    command = [*launcher, "decoderlm", "train", "--out", out, "--overwrite"]
    wall, stdout = timed([*command, "--no-progress", *flags], env)
    final = FINAL.search(stdout)
    return {
        "wall_s": wall,
        "val_loss": float(final[1]) if final else None,
        "records": read_records(out),
        "stdout": stdout,
    }


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run directory, one dict per line."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def steady_tokens_per_s(records: list[dict]) -> float:
    """Training tokens/s between the first and the last record that are not evaluations
    (falls back to the last record's overall tokens_per_s)."""
    plain = [r for r in records if "val_loss" not in r]
    if len(plain) >= 2 and plain[-1]["elapsed_s"] > plain[0]["elapsed_s"]:
        a, b = plain[0], plain[-1]
        return (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])
    return records[-1]["tokens_per_s"]


def median_seconds(job, rounds: int = 3, warmups: int = 1) -> float:
    """Median wall time of job() in seconds over `rounds` runs, after `warmups` untimed ones."""
    for _ in range(warmups):
        job()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def spread(values: list[float]) -> str:
    """ "mean ± half the range" of the values (± 0 for one value)."""
    if not values:
        return "n/a"
    half = (max(values) - min(values)) / 2
    return f"{statistics.fmean(values):.4f} ± {half:.4f}"


# `decoderlm train` in this process, then its peak resident set size (Linux: ru_maxrss in KiB)
_TRAIN_WITH_RSS = (
    "import resource, sys\n"
    "from decoderlm.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('peak_rss_bytes', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    "sys.exit(rc)\n"
)


def train_with_peak_rss(argv: list[str]) -> tuple[str, int]:
    """Run `decoderlm train --no-progress ARGV` in a new process: (its stdout, its peak
    resident set size in bytes); exits with the script's name and train's stderr if it fails."""
    command = [sys.executable, "-c", _TRAIN_WITH_RSS, "train", "--no-progress", *argv]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        script = Path(sys.argv[0]).stem
        sys.exit(f"{script}: error: decoderlm train {' '.join(argv)}: {proc.stderr}")
    return proc.stdout, int(re.search(r"peak_rss_bytes (\d+)", proc.stdout)[1])
