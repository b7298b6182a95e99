"""What bfloat16, int8 and w8a8 decoding cost in quality: whole-split validation loss and
greedy text against float32, for a trained char run and for GPT-2-shape weights.

For each model, `decoderlm.generation.precision.prepare_for_decoding` makes a bfloat16, a
weight-only int8 (per-row scales) and a w8a8 copy (the same weights, 8-bit activations); each
precision is scored over the whole validation split (`decoderlm.evaluate.evaluate`:
non-overlapping block_size windows, deterministic) and greedily continues --prompts prompts
(--prompt-tokens ids taken evenly from the validation split, --new-tokens new ones); the share
of prompts whose greedy continuation is identical to float32's is printed, with the loss and
its change relative to float32 (the goal: int8 within 1%).

The char run is --run DIR, or (default) one trained here by `decoderlm train` with the default
preset on the shipped corpus (--train-steps, 500 by default: about 90 s on a quiet 2-core
machine). The GPT-2-shape model is --hf DIR (a Hugging Face GPT-2 directory, e.g. real GPT-2
weights saved with `save_pretrained`), or (default) transformers' GPT2LMHeadModel of GPT-2
small's shape with random initial weights (no download), scored on the shipped corpus's last
10% in GPT-2 BPE tokens; --gpt2-block-size crops its context (1024 by default) to bound the
time. --quick: 100 training steps, 8 prompts, a 256-token context for the GPT-2 shape.

    python benchmarks/decode_precision.py [--run DIR] [--hf DIR] [--quick] [--train-steps N]
        [--prompts 20] [--prompt-tokens 32] [--new-tokens 48] [--gpt2-block-size 1024]
        [--models char gpt2]
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import ROOT, arguments, decoderlm_train, require_file, run_main

PRECISIONS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantize": "int8"},
    "w8a8": {"quantize": "w8a8"},
}


def char_model(args, tmp: Path):
    """(model, val ids, name) of --run, or of a run trained here."""
    from decoderlm.data.corpus import load_corpus
    from decoderlm.io.load import load_model, load_tokenizer

    if args.run:
        run = require_file(args.run, "pass a `decoderlm train` run directory", True, "--run")
    else:
        run = tmp / "char-run"
        steps = 100 if args.quick else args.train_steps
        print(f"training the default preset for {steps} steps ...", flush=True)
        decoderlm_train(run, ["--max-steps", str(steps), "--sample-chars", "0"])
    spec = json.loads((run / "config.json").read_text(encoding="utf-8")).get("data_spec")
    if spec is None:
        sys.exit(f"decode_precision.py: error: {run}/config.json records no data_spec")
    _, _, val, _, _ = load_corpus(spec, load_tokenizer(run))
    return load_model(run), torch.as_tensor(val, dtype=torch.long), f"char run {run.name}"


def gpt2_model(args, tmp: Path):
    """(model, val ids, name) of --hf, or of a random GPT-2-small-shape model."""
    from decoderlm.data.corpus import data_spec, load_corpus
    from decoderlm.io.hf_gpt2 import load_gpt2
    from decoderlm.tokenizers import GPT2Tokenizer

    if args.hf:
        directory, name = (
            require_file(args.hf, "pass a Hugging Face GPT-2 directory", True, "--hf"),
            "GPT-2 (--hf)",
        )
    else:
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
        directory, name = tmp / "gpt2-random", "GPT-2 small shape, random init"
        transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    model = load_gpt2(directory)
    block = 256 if args.quick else args.gpt2_block_size
    if block < model.config.block_size:
        model.crop_block_size(block)
    _, _, val, _, _ = load_corpus(data_spec(None, None, None, 0.1), GPT2Tokenizer())
    return model, torch.as_tensor(val, dtype=torch.long), f"{name}, context {block}"


def prompts_of(val: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """[n, length] windows of val ids, spread evenly over the split."""
    starts = torch.linspace(0, len(val) - length - 1, n).long()
    return torch.stack([val[s : s + length] for s in starts])


def score(model, val: torch.Tensor, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Whole-split loss and greedy continuations [n, new_tokens] of one prepared model."""
    from decoderlm.evaluate import evaluate
    from decoderlm.generation.generate import generate

    start = time.perf_counter()
    loss = evaluate(model, val, batch_size=8)
    scored = time.perf_counter() - start
    out = [generate(model, p[None], new_tokens, do_sample=False)[0, -new_tokens:] for p in prompts]
    return {"loss": loss, "greedy": torch.stack(out), "eval_s": scored}


def compare(model, val, args, name: str) -> None:
    from decoderlm.generation.precision import prepare_for_decoding

    n_prompts = 8 if args.quick else args.prompts
    prompts = prompts_of(val, n_prompts, args.prompt_tokens)
    windows = (len(val) - 1) // model.config.block_size
    print(
        f"\n{name}: {len(val):,} validation tokens, {windows} windows of {model.config.block_size}"
    )
    print(
        f"{'precision':>9}  {'loss (nats/token)':>17}  {'vs float32':>10}  {'greedy identical':>16}"
    )
    base = None
    for precision, options in PRECISIONS.items():
        r = score(
            prepare_for_decoding(copy.deepcopy(model), **options), val, prompts, args.new_tokens
        )
        base = base or r
        same = (r["greedy"] == base["greedy"]).all(dim=1).float().mean().item()
        change = (r["loss"] - base["loss"]) / base["loss"]
        print(
            f"{precision:>9}  {r['loss']:17.4f}  {change:+10.3%}  "
            f"{same:11.0%} of {n_prompts:<3}  (scored in {r['eval_s']:.1f} s)",
            flush=True,
        )


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--run", help="a trained char run (default: train one here)")
    parser.add_argument("--hf", help="a Hugging Face GPT-2 directory (default: random init)")
    parser.add_argument("--models", nargs="+", default=["char", "gpt2"], choices=["char", "gpt2"])
    parser.add_argument("--train-steps", type=int, default=500)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--gpt2-block-size", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="a short run (see below)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repository {ROOT}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            load = char_model if kind == "char" else gpt2_model
            model, val, name = load(args, Path(tmp))
            compare(model, val, args, name)


if __name__ == "__main__":
    run_main(main)
