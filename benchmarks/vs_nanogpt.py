"""decoderlm against nanoGPT on nanoGPT's own CPU recipe, as whole processes, alternated.

A: benchmarks/nanogpt_recipe.sh on a nanoGPT clone (--nanogpt DIR; its Shakespeare-character
CPU recipe: 4 layers, 4 heads, 128 wide, context 64, batch 12, --steps iterations). B:
`decoderlm train` on the same characters (--data, prepared once by `decoderlm prepare
--tokenizer char`, the same 90/10 split) with the same shape, batch, context, schedule and
steps (benchmarks/train_speed.py's RECIPE), plus --train-flags (any option of ours, e.g.
--train-flags="--dtype bfloat16 --pos-encoding rope"). They alternate A B A B ... Both final
models are scored by the same code: nanoGPT's checkpoint is loaded into a DecoderLM (its
layout is GPT-2's with Linear layers) and both go through `decoderlm.evaluate.evaluate` over
every non-overlapping 64-token window of the validation split, in float32.

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT
    curl -L -o data/input.txt \
        https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt
    python benchmarks/vs_nanogpt.py --nanogpt ../nanoGPT --data data/input.txt [--steps 2000]
        [--repeats 2] [--train-flags="..."]
    python benchmarks/vs_nanogpt.py --nanogpt ../nanoGPT --data data/input.txt --main-job

--main-job makes B the main job as users run it instead: `decoderlm train` with no flags but
--out (the default preset on the shipped WikiText-2 crop), whose whole-split loss is on its
own validation split; the figure is the wall-time ratio.

--steps must be a multiple of 250: nanoGPT's recipe saves its checkpoint at its evaluations.

Prints each run and a Markdown table: wall seconds (nanoGPT: its training process as
nanogpt_recipe.sh times it; decoderlm: the whole `decoderlm train` process), the ratio, and
the whole-split validation loss of each (nats/char).
"""

from __future__ import annotations

import re
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from common import (
    NANOGPT_HINT,
    SHAKESPEARE_HINT,
    TRAIN_FLAGS,
    arguments,
    decoderlm_train,
    prepare_chars,
    require_file,
    run_main,
    timed,
)
from train_speed import RECIPE

RUN_RECIPE = Path(__file__).resolve().parent / "nanogpt_recipe.sh"
_NAMES = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc"}
_NAMES["mlp.c_proj"] = "mlp.proj"


def nanogpt_as_decoderlm(checkpoint: Path):
    """nanoGPT's ckpt.pt as a DecoderLM (same weights: wte/wpe/h.i/ln_f renamed)."""
    from decoderlm import DecoderLM, ModelConfig

    ck = torch.load(checkpoint, map_location="cpu", weights_only=False)  # our own run's file
    args = ck["model_args"]
    config = ModelConfig(
        vocab_size=args["vocab_size"],
        block_size=args["block_size"],
        n_layers=args["n_layer"],
        n_heads=args["n_head"],
        d_model=args["n_embd"],
        bias=args["bias"],
        dropout=0.0,
    )
    state = {}
    for key, value in ck["model"].items():
        key = key.removeprefix("_orig_mod.").removeprefix("transformer.")
        key = (
            key.replace("wte.", "tok_emb.").replace("wpe.", "pos_emb.").replace("h.", "blocks.", 1)
        )
        for old, new in _NAMES.items():
            key = key.replace(old, new)
        state[key] = value
    model = DecoderLM(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def score(model, val_ids: np.ndarray) -> float:
    """Whole-split validation loss (nats/token), float32, decoderlm's evaluate."""
    from decoderlm.evaluate import evaluate

    return evaluate(model.float(), torch.from_numpy(val_ids.astype(np.int64)), None, 64)


def run_nanogpt(work: Path, nanogpt: Path, text: Path, steps: int) -> dict:
    """nanogpt_recipe.sh in `work`: {"wall_s" (its training process), "script_s", "val"
    (decoderlm's whole-split score of nanoGPT's model), "own" (the script's own score)}."""
    env = {"WORK": str(work), "MAX_ITERS": str(steps), "NANOGPT": str(nanogpt)}
    wall, stdout = timed(["bash", RUN_RECIPE], {**env, "INPUT": str(text)})
    fields = dict(re.findall(r"^(\w+)=(\S+)", stdout, re.M))
    val = np.fromfile(work / "data" / "shakespeare_char" / "val.bin", dtype=np.uint16)
    model = nanogpt_as_decoderlm(work / "out-shakespeare-char" / "ckpt.pt")
    own = float(fields["val_loss_full_split"])
    return {
        "wall_s": float(fields["wall_s"]),
        "script_s": wall,
        "val": score(model, val),
        "own": own,
    }


def run_decoderlm(work: Path, tokens: Path, steps: int, flags: list, main_job: bool) -> dict:
    from decoderlm import DecoderLM

    if main_job:
        run = decoderlm_train(work, [])
        return {"wall_s": run["wall_s"], "val": run["val_loss"]}
    run = decoderlm_train(work, ["--data", tokens, *RECIPE, "--max-steps", steps, *flags])
    val = np.fromfile(tokens / "val.bin", dtype=np.uint16)
    return {"wall_s": run["wall_s"], "val": score(DecoderLM.from_pretrained(work), val)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--train-flags", **TRAIN_FLAGS)
    parser.add_argument("--main-job", action="store_true", help="B: `decoderlm train`, no flags")
    parser.add_argument("--nanogpt", type=Path, help="a clone of karpathy/nanoGPT")
    parser.add_argument("--data", type=Path, help="Tiny Shakespeare's input.txt")
    args = parser.parse_args()
    flags = args.train_flags
    if args.steps < 1 or args.steps % 250 or args.repeats < 1:
        raise SystemExit(
            "error: --steps must be a positive multiple of 250 (nanoGPT's recipe evaluates and "
            "saves its checkpoint every 250 iterations) and --repeats positive"
        )
    nanogpt = require_file(args.nanogpt, NANOGPT_HINT, directory=True, flag="--nanogpt")
    require_file(nanogpt / "train.py", NANOGPT_HINT)
    text = require_file(args.data, SHAKESPEARE_HINT)
    nano, ours = [], []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        tokens = prepare_chars(text, work / "tokens")
        for i in range(args.repeats):  # A B A B ...
            nano.append(run_nanogpt(work / f"nanogpt-{i}", nanogpt, text, args.steps))
            print(f"round {i + 1} nanoGPT: {nano[-1]}")
            run = run_decoderlm(work / f"decoderlm-{i}", tokens, args.steps, flags, args.main_job)
            ours.append(run)
            print(f"round {i + 1} decoderlm: {ours[-1]}")
    a = statistics.median(r["wall_s"] for r in nano)
    b = statistics.median(r["wall_s"] for r in ours)
    what = "the main job (`decoderlm train`)" if args.main_job else " ".join(flags) or "(none)"
    print(f"\nnanoGPT {args.steps} steps; decoderlm: {what}")
    print("| | wall s (median) | whole-split val loss (nats/char) |")
    print("| --- | --- | --- |")
    for name, wall, runs in (("nanoGPT", a, nano), ("decoderlm", b, ours)):
        losses = ", ".join(f"{r['val']:.4f}" for r in runs)
        print(f"| {name} | {wall:.1f} | {losses} |")
    print(f"\ndecoderlm is {a / b:.2f}x faster (median wall time ratio)")


if __name__ == "__main__":
    run_main(main)
