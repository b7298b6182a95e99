"""The fine-tuning example (docs/finetune.md): from scratch, full fine-tune and LoRA.

Pretrains the default character model on the shipped WikiText-2 crop (`decoderlm train`, or
takes an existing run with --base), then trains on another text (--data, required: it
measures a change of domain, so the shipped corpus will not do; Tiny Shakespeare, a download,
in the figures) three ways, each `decoderlm train` in a fresh process with the same batches
per step:

    scratch  decoderlm train --data TEXT                           (the 'default' preset)
    full     decoderlm train --init-from BASE --data TEXT          (the 'finetune' preset)
    lora     decoderlm train --init-from BASE --data TEXT --lora-rank 8 --lora-targets ...

and prints Markdown tables: the validation loss (nats/char, the text's last 10%) against
steps; and per run the trainable and total parameters, the peak resident memory of the
training process (ru_maxrss, bytes -> MiB), the training time, the final validation loss over
the whole split, and the validation loss at equal wall time (the last evaluation within the
shortest run's training time, which includes its periodic evaluations).

    python benchmarks/finetune_example.py --data data/input.txt [--base RUN] [--steps 300]
    python benchmarks/finetune_example.py --data data/input.txt --tiny   # a seconds-long smoke run

The fine-tuned runs encode the text with the base's vocabulary (characters it lacks map to its
unknown token and are counted in the output); the from-scratch run builds its own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from common import SHAKESPEARE_HINT, require_file, train_with_peak_rss

TINY_SHAPE = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--block-size", "32"]
TINY_TRAIN = ["--batch-size", "4", "--eval-batches", "2", "--dtype", "float32"]


def train(argv: list[str]) -> tuple[str, int]:
    """Run `decoderlm train ARGV` in a new process: (stdout, peak RSS in bytes)."""
    return train_with_peak_rss(argv)


def summarize(name: str, out: Path, stdout: str, peak: int) -> dict:
    """One run's figures from its stdout and metrics.jsonl."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    final = re.search(r"final validation loss ([\d.]+)", stdout)
    params = re.search(r"model: ([\d,]+) parameters", stdout)
    trainable = re.search(r"trainable: ([\d,]+) of", stdout)
    total = int(params[1].replace(",", "")) if params else 0
    unknown = re.search(r"([\d,]+) of them outside the vocabulary", stdout)
    return {
        "name": name,
        "evals": {r["step"]: r["val_loss"] for r in evals},
        "elapsed": [(r["elapsed_s"], r["val_loss"]) for r in evals],
        "train_s": records[-1]["elapsed_s"],
        "final": float(final[1]) if final else float("nan"),
        "total": total,
        "trainable": int(trainable[1].replace(",", "")) if trainable else total,
        "peak_mib": peak / 2**20,
        "unknown": unknown[1] if unknown else "0",
    }


def tables(rows: list[dict]) -> str:
    """The two Markdown tables."""
    steps = sorted({s for r in rows for s in r["evals"]})
    lines = ["| run | " + " | ".join(f"step {s}" for s in steps) + " |"]
    lines.append("| --- |" + " ---: |" * len(steps))
    for r in rows:
        cells = [f"{r['evals'][s]:.4f}" if s in r["evals"] else "" for s in steps]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    budget = min(r["train_s"] for r in rows)
    lines += [
        "",
        f"| run | trainable params | total params | peak RSS (MiB) | training time (s) | "
        f"final val loss (whole split) | val loss at {budget:.1f} s | unknown chars |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        within = [loss for t, loss in r["elapsed"] if t <= budget + 1e-9]
        at_budget = f"{within[-1]:.4f}" if within else "(no evaluation yet)"
        lines.append(
            f"| {r['name']} | {r['trainable']:,} | {r['total']:,} | {r['peak_mib']:.0f} | "
            f"{r['train_s']:.1f} | {r['final']:.4f} | {at_budget} | {r['unknown']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", type=Path, help="an existing run to fine-tune (default: pretrain)"
    )
    parser.add_argument("--data", type=Path, help="the fine-tuning text, e.g. Tiny Shakespeare")
    parser.add_argument("--pretrain-steps", type=int, help="steps of the pretraining run")
    parser.add_argument("--steps", type=int, default=300, help="steps of each run")
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=40, help="40 x 32 windows: all")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-targets", default="qkv,proj,fc")
    parser.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA's peak lr")
    parser.add_argument("--full-lr", type=float, help="full fine-tune's peak lr (default: 3e-4)")
    parser.add_argument("--max-chars", type=int, help="use only the text's first N characters")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--tiny", action="store_true", help="tiny model and steps (smoke test)")
    args = parser.parse_args()
    require_file(args.data, SHAKESPEARE_HINT)
    if args.base is not None and not (args.base / "config.json").is_file():
        sys.exit(f"finetune_example: error: --base {args.base} is not a run directory")
    shape = TINY_SHAPE if args.tiny else []
    common = ["--max-steps", str(args.steps), "--eval-interval", str(args.eval_interval)]
    common += ["--eval-batches", str(args.eval_batches), "--data", str(args.data)]
    common += ["--max-chars", str(args.max_chars)] if args.max_chars else []
    common += TINY_TRAIN if args.tiny else []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        base = args.base
        if base is None:
            base = root / "base"
            steps = ["--max-steps", str(args.pretrain_steps)] if args.pretrain_steps else []
            extra = [*TINY_TRAIN, "--eval-interval", "5"] if args.tiny else []
            train(["--out", str(base), *shape, *steps, *extra])
            print(f"pretrained {base}", flush=True)
        lora = ["--lora-rank", str(args.lora_rank), "--lora-targets", args.lora_targets]
        full_lr = (
            ["--lr", str(args.full_lr), "--min-lr", str(args.full_lr / 10)] if args.full_lr else []
        )
        runs = {
            "from scratch": [*shape, *common],
            "full fine-tune": ["--init-from", str(base), *common, *full_lr],
            f"LoRA r={args.lora_rank}": [
                "--init-from",
                str(base),
                *common,
                *lora,
                "--lr",
                str(args.lora_lr),
                "--min-lr",
                str(args.lora_lr / 10),
            ],
        }
        rows = []
        for name, argv in runs.items():
            out = root / re.sub(r"\W+", "-", name)
            stdout, peak = train(["--out", str(out), *argv])
            rows.append(summarize(name, out, stdout, peak))
            print(f"{name}: final val {rows[-1]['final']:.4f}", flush=True)
        print(f"\nvalidation loss (nats/char) of {args.data} against steps\n")
        print(tables(rows))


if __name__ == "__main__":
    main()
