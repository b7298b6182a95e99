"""Two checkouts of decoderlm against each other: training and decoding tokens/s, as whole
processes, alternated (A B A B ...), with the ratio B / A of each pair.

    python benchmarks/versions.py OLD_SRC NEW_SRC [--repeats 3]

OLD_SRC and NEW_SRC are the `src` directories of the two checkouts (e.g. a `git worktree` of
an earlier commit); each process imports decoderlm from its own through PYTHONPATH.

train-bf16, train-fp32: `python -m decoderlm train` with the default preset for 300 steps
    (bfloat16 autocast as the preset says, then float32), no evaluation before the end and no
    checkpoints; the figure is the tokens/s the command prints (training steps only).
--in-process: both versions imported into one process (the old one under another package
    name), the same weights, timed in alternation 20 times: one training step (forward,
    backward, AdamW) of the default preset's shape in bfloat16 autocast (with the attention
    kernel the trainer picks) and in float32, and greedy decoding of 64 tokens
    of the 4 x 256 model; the ratio new/old of the medians. Steadier than whole processes on a
    noisy machine, and what the hook points cost is inside it.

decode-4x256, decode-gpt2: greedy decoding with the KV cache of a randomly initialised model
    (4 layers x 256 wide, 8 heads, vocabulary 50,257, block_size 1,024; and GPT-2 small's
    shape), float32, 256 new tokens after a 32-token prompt, after one warm-up call; the
    figure is new tokens / s of the timed call.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from common import require_file

DECODE = """
import time, torch
from decoderlm import DecoderLM, ModelConfig
try:
    from decoderlm.generation.generate import generate
except ImportError:  # a checkout from before the subsystem folders
    from decoderlm.generate import generate
torch.manual_seed(0)
model = DecoderLM(ModelConfig(vocab_size=50257, block_size=1024, n_layers={n_layers},
                              n_heads={n_heads}, d_model={d_model})).eval()
try:  # the commands' decoding (since it exists; older generate() calls installed its kernels)
    from decoderlm.generation.precision import prepare_for_decoding
    model = prepare_for_decoding(model)
except ImportError:
    pass
prompt = torch.randint(0, 50257, (1, 32))
generate(model, prompt, 32, do_sample=False)
start = time.perf_counter()
generate(model, prompt, 256, do_sample=False)
print(f"{{256 / (time.perf_counter() - start):.1f}} tokens/s")
"""

TRAIN = [
    "-m",
    "decoderlm",
    "train",
    "--max-steps",
    "300",
    "--eval-interval",
    "100000",
    "--checkpoint-interval",
    "0",
    "--sample-chars",
    "0",
    "--no-progress",
    "--overwrite",
]

CASES = {
    "train-bf16": TRAIN,
    "train-fp32": TRAIN + ["--dtype", "float32"],
    "decode-4x256": ["-c", DECODE.format(n_layers=4, n_heads=8, d_model=256)],
    "decode-gpt2": ["-c", DECODE.format(n_layers=12, n_heads=12, d_model=768)],
}


def run(src: str, args: list[str], out_dir: str) -> float:
    """tokens/s printed by one process importing decoderlm from `src`."""
    env = {**os.environ, "PYTHONPATH": src}
    extra = ["--out", out_dir] if "train" in args else []
    done = subprocess.run(
        [sys.executable, *args, *extra], env=env, capture_output=True, text=True, check=True
    )
    found = re.findall(r"([\d,.]+) tokens/s", done.stdout)
    if not found:
        raise RuntimeError(f"no tokens/s in the output of {args[:3]}:\n{done.stdout[-2000:]}")
    return float(found[-1].replace(",", ""))


def _import_as(src: str, name: str):
    """The decoderlm package found in `src`, imported under `name`."""
    import importlib.util

    init = os.path.join(src, "decoderlm", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[os.path.dirname(init)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _generate_of(package: str):
    """`generate` of a decoderlm package, wherever its checkout keeps it."""
    import importlib

    try:
        return importlib.import_module(package + ".generation.generate").generate
    except ModuleNotFoundError:  # a checkout from before the subsystem folders
        return importlib.import_module(package + ".generate").generate


def in_process(old_src: str, new_src: str, rounds: int = 20) -> None:
    """Alternate the two versions in one process; print the median times and their ratio."""
    import time

    import torch

    torch.manual_seed(0)
    versions = {
        "old": _import_as(old_src, "decoderlm_old"),
        "new": _import_as(new_src, "decoderlm"),
    }
    shapes = {
        "train step bf16 (3 x 128, T 96, batch 32)": dict(
            vocab_size=139, block_size=96, n_layers=3, n_heads=4, d_model=128
        ),
        "train step (3 x 128, T 96, batch 32)": dict(
            vocab_size=139, block_size=96, n_layers=3, n_heads=4, d_model=128
        ),
        "decode 64 tokens (4 x 256)": dict(
            vocab_size=50257, block_size=1024, n_layers=4, n_heads=8, d_model=256
        ),
    }
    for label, shape in shapes.items():
        models = {tag: pkg.DecoderLM(pkg.ModelConfig(**shape)) for tag, pkg in versions.items()}
        models["new"].load_state_dict(models["old"].state_dict())  # the same weights
        jobs = {}
        for tag, model in models.items():
            if label.startswith("train"):
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                x = torch.randint(0, 139, (32, 97))

                bf16 = "bf16" in label
                if bf16 and hasattr(model.blocks[0].attn, "impl"):  # as the trainer chooses
                    for block in model.blocks:
                        block.attn.impl = "explicit"

                def step(model=model, opt=opt, x=x, bf16=bf16):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        loss = model(x[:, :-1], x[:, 1:])[1]
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                jobs[tag] = step
            else:
                model.eval()
                gen = _generate_of(versions[tag].__name__)
                prompt = torch.randint(0, 50257, (1, 32))
                jobs[tag] = lambda gen=gen, model=model, p=prompt: gen(
                    model, p, 64, do_sample=False
                )
        times = {tag: [] for tag in jobs}
        for _ in range(rounds + 2):
            for tag, job in jobs.items():
                start = time.perf_counter()
                job()
                times[tag].append(time.perf_counter() - start)
        old, new = (statistics.median(times[t][2:]) for t in ("old", "new"))
        print(
            f"{label}: old {old * 1e3:.2f} ms, new {new * 1e3:.2f} ms (medians of {rounds}), "
            f"new/old time {new / old:.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_src")
    parser.add_argument("new_src")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--in-process", action="store_true")
    args = parser.parse_args()
    for src in (args.old_src, args.new_src):
        require_file(src, "pass the src directories of two checkouts", directory=True)
    if args.in_process:
        return in_process(args.old_src, args.new_src)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            old, new, ratios = [], [], []
            for _ in range(args.repeats):
                old.append(run(args.old_src, CASES[case], f"{tmp}/run"))
                new.append(run(args.new_src, CASES[case], f"{tmp}/run"))
                ratios.append(new[-1] / old[-1])
            print(
                f"{case:13s} old {statistics.median(old):9,.1f}  new "
                f"{statistics.median(new):9,.1f} tokens/s (medians)  new/old per pair "
                f"{', '.join(f'{r:.3f}' for r in ratios)}  median {statistics.median(ratios):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
