"""Where greedy decoding spends its time: torch.profiler over 128 new tokens of a model shape
with random weights (--shape tiny: GPT-2's vocabulary of 50,257 and 4 layers x 256; small:
GPT-2 small's 12 x 768; thin: SmolLM2-135M's 30 Llama layers at width 64 and a vocabulary of
256, whose products are too small to matter: a token's fixed cost, the calls and checks
around the kernels) or of a GGUF file's model (--gguf), batch 1, 32-token prompt, at the precision
`decoderlm sample --dtype/--quantize` decodes with
(`decoderlm.generation.precision.prepare_for_decoding`).

    python benchmarks/decode_profile.py [--dtype bfloat16] [--quantize int8|w8a8] [--shape small]
    python benchmarks/decode_profile.py --gguf "$SMOLLM2" --dtype float32   # a GGUF file's model
    python benchmarks/decode_profile.py --gguf "$SMOLLM2" --compile --kernels
    python benchmarks/decode_profile.py --shape thin --compile   # a token's fixed cost
    python benchmarks/decode_profile.py --gguf "$SMOLLM2" --compile --split
    python benchmarks/decode_profile.py --gguf "$SMOLLM2" --compile --prompt

--compile profiles the compiled one-token step, whose graph is one row unless --kernels
makes each of its C++ kernels a row of its own (inductor's `cpp.enable_kernel_profile`;
a GEMM template's kernel is named by its shape, as graph_0_gemm_m1n1536k576_kernel).

Prints tokens/s (timed over 256 tokens, after a warm-up; the profile is of another 128) and
the operators that took the most time. --split, instead of the profile: where a decoded
token's time goes without the profiler's own cost, over 3 generations of 128 tokens (each
token after the first): the one-token step (the call of `decode_step`'s function; compiled,
that is TorchDynamo's entry and guards and the graph), choosing the token (`sample_next`) and
the rest of `stream_generate`'s loop, in ms a token, the median of the 3. In
float32 the block products and the unembedding are aten::bmm / aten::addmm / aten::mm rows; in
bfloat16 mkldnn::_linear_pointwise (oneDNN's packed products); with int8
aten::_weight_int8pack_mm; with w8a8 onednn::qlinear_pointwise.

--prompt, instead: the 32-token prompt's pass alone (`steps.prefill` into a new cache of
the capacity `generate` gives it for 256 new tokens, without autograd, as `generate` runs
it: eagerly, or with --compile the compiled prompt pass, compiled at the first warm-up,
whose products are the layers' eager ones on the packed copies `prepare_for_decoding(...,
compile=True)` makes; the one-token step is not compiled), its tokens/s
(the median of 15 passes after 3 warm-ups), the same for the time `generate` takes to its
first token (the pass, sampling, and the work around them: tokens/s of the prompt's tokens),
then the profile of 5 more passes.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import arguments, load_gguf, median_seconds, refuse, require_file
from decoderlm import DecoderLM, ModelConfig
from decoderlm.generation import generate as loop
from decoderlm.generation.params import SamplingParams
from decoderlm.generation.precision import prepare_for_decoding

GPT2 = dict(vocab_size=50257, activation="gelu_tanh")
SHAPES = {
    "tiny": dict(n_layers=4, n_heads=4, d_model=256, **GPT2),
    "small": dict(n_layers=12, n_heads=12, d_model=768, **GPT2),
    # SmolLM2-135M's 30 Llama layers at width 64 and 256 tokens: a token's fixed cost
    "thin": dict(
        n_layers=30,
        n_heads=4,
        n_kv_heads=2,
        d_model=64,
        vocab_size=256,
        pos_encoding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
    ),
}


def split(model, prompt: torch.Tensor, rounds: int = 3, new: int = 128) -> None:
    """Print the ms a decoded token spends in the one-token step, in sample_next and in the
    rest of stream_generate's loop (module docstring), timed by wrapping the two functions
    the loop looks up in `decoderlm.generation.generate` (restored afterwards)."""
    spent = {"step": 0.0, "choose": 0.0}

    def timed(key, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[key] += time.perf_counter() - start
            return out

        return call

    step_of, choose = loop.decode_step, loop.sample_next
    loop.decode_step = lambda compile: timed("step", step_of(compile))
    loop.sample_next = timed("choose", choose)
    rows = []
    try:
        for _ in range(rounds):
            times = []
            for _ in loop.stream_generate(model, prompt, SamplingParams(new, temperature=0.0)):
                times.append(time.perf_counter())
                if len(times) == 1:  # from the first token on: the prompt's pass left out
                    spent.update(step=0.0, choose=0.0)
            whole = (times[-1] - times[0]) / (new - 1)
            step, chosen = spent["step"] / (new - 1), spent["choose"] / (new - 1)
            rows.append((whole, step, chosen, whole - step - chosen))
    finally:
        loop.decode_step, loop.sample_next = step_of, choose
    names = ("a token", "the one-token step", "choosing the token", "the rest of the loop")
    for name, values in zip(names, zip(*rows, strict=True), strict=True):
        print(f"{name}: {sorted(values)[len(values) // 2] * 1e3:.3f} ms")


def prompt_pass(model, prompt: torch.Tensor, rows: int, compiled: bool = False) -> None:
    """Print the prompt's pass's tokens/s and its operators (module docstring, --prompt);
    compiled: the cache sized as for a compiled step (`steps.fixed_capacity`)."""
    from decoderlm.generation.steps import fixed_capacity, prefill

    capacity = fixed_capacity(model, prompt.size(1) + 256) if compiled else None

    def once():
        with torch.no_grad():
            prefill(model, prompt, capacity=capacity)

    def first_token():  # generate's own work around the pass included
        for _ in loop.stream_generate(model, prompt, SamplingParams(1, temperature=0.0)):
            pass

    T = prompt.size(1)
    pass_s, first_s = (median_seconds(fn, rounds=15, warmups=3) for fn in (once, first_token))
    print(f"prompt of {T} tokens: {T / pass_s:.1f} tokens/s")
    print(f"the first token of generate: {T / first_s:.1f} tokens/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            once()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = arguments(__doc__)
    add = parser.add_argument
    add("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="default: bfloat16")
    add(
        "--quantize",
        choices=["int8", "w8a8"],
        help="int8: int8 weights; w8a8: int8 weights and activations (default: none)",
    )
    add("--shape", choices=list(SHAPES), help="model shape, random weights (default: tiny)")
    add("--gguf", help="profile this GGUF file's model (dequantized) instead of --shape")
    add("--compile", action="store_true", help="profile the compiled one-token step")
    add("--kernels", action="store_true", help="with --compile: one row per compiled kernel")
    add("--rows", type=int, default=12, help="rows of the profiler's table (default: 12)")
    add("--split", action="store_true", help="time a token's parts instead of profiling")
    add("--prompt", action="store_true", help="time and profile the prompt's pass instead")
    args = parser.parse_args()
    refusal = None
    if args.gguf and args.shape:
        refusal = "give --gguf or --shape, not both"
    elif args.kernels and not args.compile:
        refusal = "--kernels needs --compile"
    elif args.kernels and args.split:
        refusal = "give --kernels or --split, not both (--split runs without the profiler)"
    elif args.prompt and (args.kernels or args.split):
        refusal = "--prompt times the prompt's eager pass: give it without --kernels or --split"
    elif args.rows < 1:
        refusal = "--rows must be >= 1"
    if refusal:
        refuse(refusal)
    if args.gguf:
        require_file(args.gguf, "a GGUF model file, say SmolLM2-135M-Instruct's", flag="--gguf")
    if args.kernels:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    torch.manual_seed(0)
    if args.gguf:
        model = load_gguf(args.gguf)
    else:
        config = ModelConfig(block_size=1024, **SHAPES[args.shape or "tiny"])
        model = DecoderLM(config).eval()
    model = prepare_for_decoding(model, args.dtype, args.quantize, args.compile)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32))
    if args.prompt:
        prompt_pass(model, prompt, args.rows, args.compile)
        return
    for _ in range(2):
        loop.generate(model, prompt, 64, do_sample=False)
    start = time.perf_counter()
    loop.generate(model, prompt, 256, do_sample=False)
    name = args.dtype + (f", {args.quantize}" if args.quantize else "")
    print(f"{name}: {256 / (time.perf_counter() - start):.1f} tokens/s")
    if args.split:
        split(model, prompt)
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loop.generate(model, prompt, 128, do_sample=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
