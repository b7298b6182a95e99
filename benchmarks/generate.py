"""Greedy decoding speed: decoderlm with its KV cache (eager and compiled) and without it,
against transformers.

For each shape, a randomly initialised GPT-2 is saved once as a Hugging Face directory and
loaded by both libraries; batch 1, a 32-token prompt, 256 new tokens, greedy, float32 and
bfloat16. The contenders alternate (A B C D A B C D ...) after one warm-up run each (which
is when the model prepared with `prepare_for_decoding(model, compile=True)` compiles), and
each one's greedy tokens are compared with transformers'. This machine's read bandwidth
(summing a 1 GiB float32 tensor, best of 5) is measured between runs, because it drifts with
the load of other tenants; weight bytes (every parameter but the unused rows of the position
table) x tokens/s is reported as a fraction of the higher of the two probes around the run
that gave the best speed.

    python benchmarks/generate.py [--repeats 2] [--shapes small tiny] [--skip-no-cache]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

SHAPES = {
    "small": dict(n_layer=12, n_embd=768, n_head=12),  # GPT-2 small, 124M
    "tiny": dict(n_layer=4, n_embd=256, n_head=4),
}  # overhead-bound


def read_bandwidth() -> float:
    """Bytes per second of torch.sum over a 1 GiB float32 tensor (best of 5)."""
    x = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def main() -> None:
    import transformers

    from decoderlm.generation import cpu_decode
    from decoderlm.generation.generate import generate
    from decoderlm.generation.precision import prepare_for_decoding
    from decoderlm.io.hf_gpt2 import load_gpt2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--skip-no-cache", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    prompt = torch.randint(0, 50257, (1, 32))
    n = args.new_tokens
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = transformers.GPT2Config(vocab_size=50257, n_positions=1024, **SHAPES[shape])
            transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp)
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                hf = transformers.GPT2LMHeadModel.from_pretrained(tmp, dtype=dtype).eval()
                # the CPU's one-row kernels, kept plain in dtype (no packing: not prepared)
                ours = cpu_decode.install(load_gpt2(tmp).to(dtype))
                compiled = prepare_for_decoding(load_gpt2(tmp).to(dtype), compile=True)
                # bytes each new token reads: every parameter but the position table (one row)
                weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters()) - (
                    ours.pos_emb.weight[1:].numel() * ours.pos_emb.weight.element_size()
                )
                contenders = {
                    "decoderlm (KV cache)": lambda: generate(ours, prompt, n, do_sample=False),
                    "decoderlm (compiled)": lambda: generate(compiled, prompt, n, do_sample=False),
                    "transformers generate": lambda: hf.generate(
                        prompt,
                        attention_mask=torch.ones_like(prompt),
                        do_sample=False,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        pad_token_id=50256,
                    ),
                }
                if not args.skip_no_cache:
                    contenders["decoderlm (no cache)"] = lambda: generate(
                        ours, prompt, n, do_sample=False, use_cache=False
                    )
                times = {k: [] for k in contenders}
                probes = {k: [] for k in contenders}  # bandwidth just before and after each run
                outputs = {}
                with torch.no_grad():
                    for name, run in contenders.items():  # warm-up (and compilation)
                        run() if "no cache" not in name else None
                    before = read_bandwidth()
                    for r in range(args.repeats):
                        for name, run in contenders.items():
                            if "no cache" in name and r > 0:
                                continue  # slow; once is enough
                            t = time.perf_counter()
                            outputs[name] = run()
                            times[name].append(time.perf_counter() - t)
                            after = read_bandwidth()
                            probes[name].append(max(before, after))
                            before = after
                reference = outputs["transformers generate"]
                hf_speed = n / min(times["transformers generate"])
                for name, ts in times.items():
                    best = min(range(len(ts)), key=ts.__getitem__)
                    speed, bandwidth = n / ts[best], probes[name][best]
                    same = torch.equal(outputs[name], reference)
                    print(
                        f"{shape:>5} {dtype_name:>8}  {name:<22} {speed:8.1f} tokens/s  "
                        f"x{speed / hf_speed:5.2f} vs transformers  weights x tokens/s = "
                        f"{weight_bytes * speed / bandwidth:5.0%} of {bandwidth / 1e9:.1f} "
                        f"GB/s  tokens as transformers: {same}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
