"""What keeps the HTTP API from being silently wrong or open to anyone: the end-of-text stop,
API keys, the limits on body size, queue and time, each against a real uvicorn server on
127.0.0.1 (the exact text offsets: test_logprobs.py)."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from decoderlm import CharTokenizer
from decoderlm.tokenizers import GPT2Tokenizer

from conftest import running, tiny_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

REPO = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"
KEYS = ("key-one", "key-two")


def _post(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60, **kwargs)


def _streamed(url: str, body: dict, **kwargs) -> list[dict]:
    """The chunks of a streamed completion, checked to end with [DONE]."""
    lines = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60, **kwargs
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _slow(model, seconds: float = 0.02):
    """The model with about `seconds` added to each forward pass."""
    model.tok_emb.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return model


@pytest.fixture(scope="module")
def eot_server():
    """A char model whose vocabulary has the end-of-text token (id 20)."""
    from decoderlm.serve.app import create_app

    tok = CharTokenizer("abcdefghij klmnopqr.", special_tokens=[EOT])
    model = tiny_model(seed=5, vocab_size=tok.vocab_size)
    with running(create_app(model, tok, "eot")) as url:
        yield url, tok


def _ends_at_eot(url: str) -> tuple[dict, str]:
    """(a seeded request whose sampled continuation holds the end-of-text token, that
    continuation generated with ignore_eos)."""
    for seed in range(50):
        body = {"prompt": "abc", "max_tokens": 40, "seed": seed, "temperature": 1.5}
        text = _post(url, {**body, "ignore_eos": True}).json()["choices"][0]["text"]
        if EOT in text[1:]:  # some text comes first
            return body, text
    raise AssertionError("no seed in 50 sampled the end-of-text token")


def test_a_completion_stops_at_the_end_of_text_token_unless_ignore_eos(eot_server):
    url, _ = eot_server
    body, past = _ends_at_eot(url)
    out = _post(url, body).json()
    choice = out["choices"][0]
    assert choice["text"] == past[: past.index(EOT)] and choice["finish_reason"] == "stop"
    # the end-of-text token counts as generated, as in vLLM, but is not in the text
    assert out["usage"]["completion_tokens"] == len(choice["text"]) + 1
    logprobs = _post(url, {**body, "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    chunks = _streamed(url, body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    ignored = _post(url, {**body, "ignore_eos": True}).json()["choices"][0]
    assert ignored["finish_reason"] == "length" and ignored["text"] == past


def test_a_stop_string_across_tokens_still_stops_before_the_end_of_text(eot_server):
    url, _ = eot_server
    body, past = _ends_at_eot(url)
    before = past[: past.index(EOT)]
    stop = before[-2:]  # two characters: two tokens
    cut = _post(url, {**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == before[: before.index(stop)] and cut["finish_reason"] == "stop"
    assert (
        "".join(c["choices"][0]["text"] for c in _streamed(url, {**body, "stop": [stop]}))
        == cut["text"]
    )


def test_without_the_end_of_text_token_a_choice_runs_to_length(eot_server):
    url, _ = eot_server
    for seed in range(50):
        body = {"prompt": "abc", "max_tokens": 5, "seed": seed, "ignore_eos": True}
        if EOT not in _post(url, body).json()["choices"][0]["text"]:
            break
    body.pop("ignore_eos")
    assert _post(url, body).json()["choices"][0]["finish_reason"] == "length"
    assert _streamed(url, body)[-1]["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_must_be_a_boolean(eot_server):
    url, _ = eot_server
    r = _post(url, {"prompt": "ab", "ignore_eos": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


def test_a_gpt2_model_stops_at_endoftext_in_plain_and_streamed_answers():
    from decoderlm.serve.app import create_app

    tok = GPT2Tokenizer()
    model = tiny_model(seed=4, vocab_size=tok.vocab_size)
    calls = []

    def late_eot(module, args, logits):  # from the 4th forward pass on, 50256 wins
        calls.append(1)
        if len(calls) >= 4:
            logits = logits.clone()
            logits[..., 50256] += 1e4
        return logits

    model.lm_head.register_forward_hook(late_eot)
    with running(create_app(model, tok, "bpe-eot")) as url:
        body = {"prompt": "Hello", "max_tokens": 10, "temperature": 0}
        out = _post(url, body).json()
        calls.clear()
        chunks = _streamed(url, body)
        calls.clear()
        ignored = _post(url, {**body, "ignore_eos": True}).json()["choices"][0]
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 4
    assert EOT not in choice["text"] and ignored["text"].startswith(choice["text"])
    assert ignored["text"].endswith(EOT * 7) and ignored["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def keyed_server():
    """A char model covering the lm-eval task files, served with two keys."""
    from decoderlm.serve.app import create_app

    tasks = REPO / "tests" / "lm_eval_tasks"
    text = (tasks / "choices.jsonl").read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text + "abcdefghijklmnopqrstuvwxyz .,\n")
    model = tiny_model(seed=6, vocab_size=tok.vocab_size)
    with running(create_app(model, tok, "keyed", api_keys=KEYS)) as url:
        yield url, model, tok


def test_every_path_but_health_needs_one_of_the_keys(keyed_server):
    url, _, _ = keyed_server
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/v1/models", "/tokenizer_info", "/openapi.json", "/no/such/path"):
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"] == {
            "message": r.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        assert "Authorization: Bearer" in r.json()["error"]["message"]
    body = {"prompt": "ab", "max_tokens": 2}
    wrong = _post(url, body, headers={"Authorization": "Bearer key-three"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert "key-three" not in wrong.text  # a key sent is never echoed
    for header in ("Basic key-one", "Bearer", "key-one"):
        assert _post(url, body, headers={"Authorization": header}).status_code == 401
    for key in KEYS:
        assert _post(url, body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert _post(url, body, headers={"Authorization": "bearer key-two"}).status_code == 200


def test_the_openai_sdk_sends_its_key(keyed_server):
    openai = pytest.importorskip("openai")
    url, _, _ = keyed_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="key-one", max_retries=0)
    out = client.completions.create(model="keyed", prompt="abc", max_tokens=3)
    assert out.usage.completion_tokens == 3
    stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        stranger.models.list()
    assert info.value.code == "invalid_api_key"


def test_llm_sends_the_key_named_by_api_key_name(keyed_server, tmp_path):
    pytest.importorskip("llm")
    import os
    import subprocess
    import sys

    url, _, _ = keyed_server
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: keyed\n  model_name: keyed\n  api_base: {url}/v1\n  completion: true\n"
        "  api_key_name: decoderlm\n"
    )

    def run(keys: dict) -> subprocess.CompletedProcess:
        (tmp_path / "keys.json").write_text(json.dumps(keys))
        env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}
        env.pop("OPENAI_API_KEY", None)
        cmd = [sys.executable, "-m", "llm", "-m", "keyed", "--no-log", "-o", "max_tokens", "4"]
        return subprocess.run([*cmd, "abc"], env=env, capture_output=True, text=True, timeout=120)

    done = run({"decoderlm": "key-two"})
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    refused = run({"decoderlm": "wrong"})
    assert refused.returncode != 0 and "incorrect API key" in refused.stderr


def test_lm_eval_sends_openai_api_key_and_its_tokenizer_sends_auth_token(keyed_server, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    url, _, _ = keyed_server
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(REPO)  # the task files name their data relative to the repository
    # completions carry OPENAI_API_KEY; the remote tokenizer's requests carry auth_token
    monkeypatch.setenv("OPENAI_API_KEY", "key-one")
    args = f"model=keyed,base_url={url}/v1/completions,max_length=34,auth_token=key-two"
    out = simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=["decoderlm_generate"],
        task_manager=TaskManager(
            include_path=str(REPO / "tests" / "lm_eval_tasks"), include_defaults=False
        ),
        log_samples=True,
    )
    samples = out["samples"]["decoderlm_generate"]
    docs = (REPO / "tests" / "lm_eval_tasks" / "choices.jsonl").read_text().splitlines()
    assert len(samples) == len(docs)  # every document was answered
    assert all(isinstance(s["resps"][0][0], str) for s in samples)


@pytest.fixture(scope="module")
def small_limits_server():
    """Batch 1, queue 1, bodies of at most 2,000 bytes, 20 ms per forward pass."""
    from decoderlm.serve.app import create_app
    from decoderlm.serve.limits import ServeLimits

    tok = CharTokenizer("abcdefghij klmnopqrstuvwxyz.,\n")
    model = _slow(tiny_model(seed=7, vocab_size=tok.vocab_size))
    limits = ServeLimits(max_batch_size=1, max_queue=1, max_body_bytes=2000, max_tokens_limit=5000)
    app = create_app(model, tok, "small", limits)
    with running(app) as url:
        yield url, app


def test_a_body_over_the_limit_is_413(small_limits_server):
    url, _ = small_limits_server
    big = {"prompt": "a" * 3000, "max_tokens": 1}
    r = _post(url, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-body-bytes" in r.json()["error"]["message"]

    def chunked(data: bytes):  # no Content-Length: Transfer-Encoding: chunked
        yield from (data[i : i + 500] for i in range(0, len(data), 500))

    headers = {"content-type": "application/json"}
    r = httpx.post(
        f"{url}/v1/completions", content=chunked(json.dumps(big).encode()), headers=headers
    )
    assert r.status_code == 413
    small = json.dumps({"prompt": "abc " * 100, "max_tokens": 2}).encode()
    r = httpx.post(f"{url}/v1/completions", content=chunked(small), headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 400


def test_beyond_the_batch_and_queue_a_request_gets_503_with_retry_after(small_limits_server):
    url, app = small_limits_server
    long = {"prompt": "ab", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_post, url, long)
        time.sleep(0.3)  # decoding
        second = pool.submit(_post, url, long)
        time.sleep(0.3)  # queued
        busy = _post(url, {"prompt": "cd", "max_tokens": 2})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "server_busy"
        assert busy.json()["error"]["type"] == "server_error"
        assert first.result().status_code == second.result().status_code == 200
    assert _post(url, {"prompt": "cd", "max_tokens": 2}).status_code == 200
    assert app.state.serving_completion.admission.in_progress == 0


def test_a_request_past_the_time_limit_ends_with_its_text_as_length():
    from decoderlm.serve.app import create_app
    from decoderlm.serve.limits import ServeLimits

    tok = CharTokenizer("abcdefghij klmnopqrstuvwxyz.,\n")
    model = _slow(tiny_model(seed=8, vocab_size=tok.vocab_size))
    limits = ServeLimits(max_tokens_limit=5000, request_timeout=1.0)
    app = create_app(model, tok, "timed", limits)
    with running(app) as url:
        body = {"prompt": "ab", "max_tokens": 5000, "temperature": 0}
        start = time.monotonic()
        out = _post(url, body).json()
        assert time.monotonic() - start < 3
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length" and choice["text"]
        assert 0 < out["usage"]["completion_tokens"] < 5000
        chunks = _streamed(url, body)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        time.sleep(0.3)
        assert app.state.scheduler.load == (0, 0)
        assert app.state.serving_completion.admission.in_progress == 0


@pytest.fixture
def served(tmp_path, monkeypatch):
    """Run `decoderlm serve` on a saved tiny model with uvicorn.run replaced: returns a function
    of the command's arguments giving the app it would serve."""
    import uvicorn

    from decoderlm.cli import main

    tiny_model().save_pretrained(tmp_path)
    CharTokenizer([chr(0x100 + i) for i in range(65)]).save_pretrained(tmp_path)
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))

    def serve(*args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        assert main(["serve", "--run", str(tmp_path), "--port", port, *args]) == 0
        return apps.pop()

    return serve


def _status(app, headers=None) -> int:
    from starlette.testclient import TestClient

    with TestClient(app) as client:
        return client.get("/v1/models", headers=headers or {}).status_code


def test_serve_takes_keys_from_its_flags_or_decoderlm_api_key(served, monkeypatch, capsys):
    monkeypatch.delenv("DECODERLM_API_KEY", raising=False)
    app = served("--api-key", "a1", "--api-key", "a2")
    assert _status(app) == 401 and _status(app, {"Authorization": "Bearer a2"}) == 200
    monkeypatch.setenv("DECODERLM_API_KEY", "from-env")
    app = served()
    assert _status(app, {"Authorization": "Bearer from-env"}) == 200 and _status(app) == 401
    assert "from-env" not in capsys.readouterr().out  # keys are never printed
    monkeypatch.delenv("DECODERLM_API_KEY")
    assert _status(served()) == 200  # no key: none needed


def test_serving_beyond_loopback_without_a_key_warns_in_one_line(served, monkeypatch, capsys):
    monkeypatch.delenv("DECODERLM_API_KEY", raising=False)
    served("--host", "0.0.0.0")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: serving on 0.0.0.0 with no API key" in err
    served("--host", "0.0.0.0", "--api-key", "k")
    served("--host", "127.0.0.1")
    assert capsys.readouterr().err == ""
