"""A load test of `decoderlm serve`: concurrent streaming clients, some misbehaving, on 127.0.0.1.

A tiny randomly initialised char model is saved as a run directory and served by `decoderlm
serve` in its own process, with an API key, --max-batch-size 8 and a short --max-queue (so
some requests meet the 503 of a full queue) and a small --max-body-bytes. First every good
request of a fixed set (a prompt, a seed, sampling at temperature 0.8, streamed) is run alone,
one after another: its answer is the reference. Then --clients threads send requests for
--duration seconds, each drawn at random (--seed): 80% good ones from the set, 10% good ones
whose client closes the connection after a few chunks, 5% bad requests (a bad field, an id
outside the vocabulary, a body over the size limit: a 4xx each), 5% without the key (401). A
503 is retried after its Retry-After. The server's resident memory (VmRSS) is read every
second.

Checks, each printed with its figures (exit status 1 if one fails): every good request was
answered in full ([DONE], finish_reason) with the text of the same request run alone; every
bad or keyless request got the 4xx meant for it; no 5xx but 503; the resident memory after
the warm-up (the first quarter of the run) grew by less than --rss-slack MiB; a request after
the load is answered (the disconnected clients' slots were freed).

    python benchmarks/serve_load.py [--duration 120] [--clients 32] [--max-tokens 48]
        [--threads 1] [--seed 0]
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from common import arguments

KEY = "load-test-key"
VOCAB = [chr(0x100 + i) for i in range(64)]
SHAPE = dict(vocab_size=64, block_size=128, n_layers=2, n_heads=4, d_model=64)
MAX_BODY = 16384
PROMPTS = 16  # the good requests' set: prompt i, seed i


def save_run(directory: str) -> None:
    import torch

    from decoderlm import CharTokenizer, DecoderLM, ModelConfig

    torch.manual_seed(0)
    DecoderLM(ModelConfig(**SHAPE)).save_pretrained(directory)
    CharTokenizer(VOCAB).save_pretrained(directory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def good_body(i: int, max_tokens: int) -> dict:
    prompt = [(5 * i + 3 * j) % len(VOCAB) for j in range(4 + i % 5)]
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": i}


BAD = [  # (body or raw bytes, status expected)
    ({"prompt": [1, 2], "temperature": -1}, 400),
    ({"prompt": [1, 2], "max_token": 5}, 400),
    ({"prompt": [1, 999]}, 400),
    (b'{"prompt": "' + b"x" * (2 * MAX_BODY) + b'"}', 413),
]


@dataclass
class Tally:
    """What the clients saw (shared by the threads, under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    kinds: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    retried_503: int = 0
    mismatches: list = field(default_factory=list)

    def add(self, kind: str, status: int, problem: str | None = None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.statuses[status] += 1
            if problem:
                self.mismatches.append(f"{kind}: {problem}")


def stream(client, url: str, body: dict, headers: dict, stop_after: int | None = None):
    """(status, text, finish_reason, done, Retry-After seconds) of a streamed completion; with
    stop_after, the connection is closed after that many chunks. Another status than 200
    (a 503) returns at once."""
    text, finish, done, chunks = "", None, False, 0
    with client.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers
    ) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, "", None, False, float(r.headers.get("retry-after", 1))
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break
    return 200, text, finish, done, 0.0


def one_request(client, url, rng, tally, reference, max_tokens) -> None:
    """Draw a request kind, send it (retrying 503s after Retry-After), and tally it."""
    auth = {"Authorization": f"Bearer {KEY}"}
    roll = rng.random()
    if roll < 0.05:  # a bad request
        body, want = rng.choice(BAD)
        send = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = client.post(f"{url}/v1/completions", headers=auth, **send)
        tally.add("bad", r.status_code, None if r.status_code == want else f"got {r.status_code}")
        return
    if roll < 0.10:  # no key
        r = client.post(f"{url}/v1/completions", json=good_body(0, 4))
        tally.add("no key", r.status_code, None if r.status_code == 401 else f"{r.status_code}")
        return
    i = rng.randrange(PROMPTS)
    leaves = roll < 0.20
    while True:
        stop_after = rng.randint(1, 3) if leaves else None
        status, text, finish, done, retry_after = stream(
            client, url, good_body(i, max_tokens), auth, stop_after
        )
        if status != 503:
            break
        with tally.lock:
            tally.retried_503 += 1
        time.sleep(retry_after)
    if leaves:
        tally.add("disconnecting", status, None if status == 200 else f"status {status}")
        return
    problem = None
    if status != 200 or not done:
        problem = f"request {i}: status {status}, [DONE] {'seen' if done else 'missing'}"
    elif (text, finish) != reference[i]:
        problem = f"request {i}: {text!r} {finish} != alone {reference[i]!r}"
    tally.add("good", status, problem)


def client_loop(url, seed, until, tally, reference, max_tokens) -> None:
    import httpx

    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < until:
            try:
                one_request(client, url, rng, tally, reference, max_tokens)
            except httpx.HTTPError as e:  # a failed connection is a failure of the server
                tally.add("error", 0, f"{type(e).__name__}: {e}")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_ready(url: str, server: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"serve_load: error: the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    sys.exit("serve_load: error: the server did not start within 120 s")


def load(url: str, pid: int, args) -> list[tuple[str, bool, str]]:
    """Run the reference pass and the load; returns (check, passed, figures) rows."""
    import httpx

    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=120) as client:
        reference = {}
        for i in range(PROMPTS):
            status, text, finish, done, _ = stream(client, url, good_body(i, args.max_tokens), auth)
            assert status == 200 and done, f"the reference request {i} failed: {status}"
            reference[i] = (text, finish)
    tally, rss = Tally(), []
    start = time.monotonic()
    until = start + args.duration
    threads = [
        threading.Thread(
            target=client_loop,
            args=(url, args.seed * 1000 + c, until, tally, reference, args.max_tokens),
        )
        for c in range(args.clients)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and time.monotonic() < until + 180:
        rss.append((time.monotonic() - start, rss_mib(pid)))
        time.sleep(1)
    stuck = sum(t.is_alive() for t in threads)
    with httpx.Client(timeout=30) as client:
        after = client.post(
            f"{url}/v1/completions", json=good_body(0, args.max_tokens), headers=auth
        )
    warm = [m for t, m in rss if t >= args.duration / 4] or [m for _, m in rss]
    warm_start, warm_end, warm_max = warm[0], warm[-1], max(warm)
    fives = {s: n for s, n in tally.statuses.items() if s >= 500 and s != 503}
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(tally.kinds.items()))
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))
    return [
        (
            "requests",
            True,
            f"{sum(tally.kinds.values())} in {args.duration:.0f} s ({kinds}); "
            f"statuses {statuses}; 503s retried: {tally.retried_503}",
        ),
        (
            "every answer as expected",
            not tally.mismatches,
            f"{len(tally.mismatches)} wrong"
            + "".join(f"\n      {m}" for m in tally.mismatches[:5]),
        ),
        ("no 5xx but 503", not fives, f"{fives or 'none'}"),
        ("every client finished", stuck == 0, f"{stuck} still running"),
        (
            "resident memory flat after warm-up",
            warm_max - warm_start < args.rss_slack,
            f"{warm_start:.1f} MiB at {args.duration / 4:.0f} s, {warm_end:.1f} MiB at the end, "
            f"max {warm_max:.1f} MiB (first reading {rss[0][1]:.1f} MiB; "
            f"slack {args.rss_slack} MiB)",
        ),
        ("answered after the load", after.status_code == 200, f"status {after.status_code}"),
    ]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per good request")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--seed", type=int, default=0, help="seeds the clients' draws")
    parser.add_argument("--rss-slack", type=float, default=32.0, help="MiB of growth allowed")
    args = parser.parse_args()
    if args.duration <= 0 or args.clients < 1 or not 1 <= args.max_tokens <= 100:
        parser.error("--duration must be > 0, --clients >= 1, --max-tokens in [1, 100]")
    with tempfile.TemporaryDirectory() as run:
        save_run(run)
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        env.pop("DECODERLM_API_KEY", None)
        cmd = [sys.executable, "-m", "decoderlm", "serve", "--run", run, "--port", str(port)]
        cmd += ["--api-key", KEY, "--max-batch-size", "8", "--max-queue", "8"]
        cmd += ["--max-body-bytes", str(MAX_BODY), "--request-timeout", "120"]
        server = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, server)
            rows = load(url, server.pid, args)
        finally:
            server.terminate()
            server.wait(timeout=30)
    for check, passed, figures in rows:
        print(f"{'ok  ' if passed else 'FAIL'}  {check}: {figures}", flush=True)
    sys.exit(0 if all(passed for _, passed, _ in rows) else 1)


if __name__ == "__main__":
    main()
