"""Aggregate decoding speed of `decoderlm serve` under 1, 2, 4, 8 concurrent streams.

For each model shape, a randomly initialised model is saved as a run directory and served by
`decoderlm serve` in its own process (continuous batching, --max-batch-size); then for each
concurrency c, c client threads each stream one completion at the same time (a 16-token id
prompt, max_tokens new tokens, greedy, so every stream runs to max_tokens). max_tokens is
capped so that prompt and continuation fit the model's context, as OpenAI-style servers
require; --past-context lifts the cap (each step then re-reads the last block_size tokens of
every full sequence: the exact sliding window of learned positions). Reported per c:
aggregate tokens/s (all streams' tokens / wall time of the round), its ratio to c = 1, and
the median and worst time to first token (request sent -> first text chunk), each the median
over --repeats rounds (the concurrencies alternate between rounds). A warm-up round runs first.

    python benchmarks/serve_concurrency.py [--shapes seed gpt2-small] [--concurrency 1 2 4 8]
        [--max-tokens 128] [--past-context] [--repeats 3] [--max-batch-size 8] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

PROMPT_TOKENS = 16
SHAPES = {  # the seed model's shape (preset "default") and GPT-2 small's
    "seed": dict(vocab_size=139, block_size=96, n_layers=3, n_heads=4, d_model=128),
    "gpt2-small": dict(vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768),
}


def save_run(shape: str, directory: str) -> None:
    """A random model of `shape` and a tokenizer of its vocab_size, as a run directory."""
    import torch

    from decoderlm import CharTokenizer, DecoderLM, ModelConfig
    from decoderlm.tokenizers import GPT2Tokenizer

    torch.manual_seed(0)
    config = ModelConfig(**SHAPES[shape])
    DecoderLM(config).save_pretrained(directory)
    V = config.vocab_size
    tok = GPT2Tokenizer() if V == 50257 else CharTokenizer([chr(0x100 + i) for i in range(V)])
    tok.save_pretrained(directory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_one(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first text chunk, seconds in all, completion tokens) of one stream, on
    a shared httpx.Client (a new client per request costs more CPU than a small model's
    tokens)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, tokens = time.perf_counter(), None, 0
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or float("nan"), time.perf_counter() - start, tokens


def run_round(url: str, c: int, max_tokens: int, vocab_size: int) -> dict:
    import httpx

    prompts = [[(7 * i + j) % vocab_size for j in range(PROMPT_TOKENS)] for i in range(c)]
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(c) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda p: stream_one(client, url, p, max_tokens), prompts))
        wall = time.perf_counter() - start
    ttft = [r[0] for r in results]
    return {
        "tokens_per_s": sum(r[2] for r in results) / wall,
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
    }


def wait_ready(url: str, server: subprocess.Popen) -> None:
    import httpx

    deadline = time.time() + 300
    while time.time() < deadline:
        if server.poll() is not None:
            sys.exit(f"serve_concurrency: the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    sys.exit("serve_concurrency: the server did not start within 300 s")


def bench_shape(shape: str, args) -> None:
    with tempfile.TemporaryDirectory() as run:
        save_run(shape, run)
        port = free_port()
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
        cmd = [sys.executable, "-m", "decoderlm", "serve", "--run", run, "--port", str(port)]
        cmd += ["--max-batch-size", str(args.max_batch_size)]
        server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, server)
            V = SHAPES[shape]["vocab_size"]
            max_tokens = args.max_tokens
            if not args.past_context:
                max_tokens = min(max_tokens, SHAPES[shape]["block_size"] - PROMPT_TOKENS)
            print(f"{shape:>10}  {max_tokens} new tokens per stream", flush=True)
            run_round(url, 2, 8, V)  # warm-up
            rounds = {c: [] for c in args.concurrency}
            for _ in range(args.repeats):  # the concurrencies alternate: 1 2 4 8 1 2 4 8 ...
                for c in args.concurrency:
                    rounds[c].append(run_round(url, c, max_tokens, V))
            base = None
            for c, results in rounds.items():
                r = {k: statistics.median(x[k] for x in results) for k in results[0]}
                base = base or r["tokens_per_s"]
                each = "/".join(f"{x['tokens_per_s']:.0f}" for x in results)
                print(
                    f"{shape:>10}  c={c:<2}  {r['tokens_per_s']:8.1f} tokens/s  "
                    f"x{r['tokens_per_s'] / base:4.2f}  time to first token: median "
                    f"{r['ttft_median_s'] * 1000:7.1f} ms, worst {r['ttft_max_s'] * 1000:7.1f} ms"
                    f"  (rounds: {each})",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--past-context", action="store_true", help="no cap at the context")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per concurrency (median)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the server")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.repeats < 1:
        sys.exit("serve_concurrency: --concurrency, --max-tokens and --repeats must be >= 1")
    for shape in args.shapes:
        bench_shape(shape, args)


if __name__ == "__main__":
    main()
