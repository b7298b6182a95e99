"""The HTTP API against a real uvicorn server on 127.0.0.1 and a real HTTP client."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from decoderlm import CharTokenizer
from decoderlm.generation.generate import generate
from decoderlm.generation.precision import prepare_for_decoding

from conftest import running, tiny_model

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

JSON = {"content-type": "application/json"}
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:'\n0123456789-"))


@pytest.fixture(scope="module")
def server():
    from decoderlm.serve.app import create_app
    from decoderlm.serve.limits import ServeLimits

    torch.manual_seed(0)
    tok = CharTokenizer(CHARS[:65])  # the tiny model's 65 ids: all but "vwxyz"
    model = tiny_model()
    limits = ServeLimits(max_tokens_limit=64, max_prompt_tokens=100)
    with running(create_app(model, tok, "tiny", limits)) as url:
        yield url, model, tok


def test_health_and_models(server):
    url, _, _ = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["object"] == "list"


def test_completion_matches_the_model(server):
    url, model, tok = server
    body = {"prompt": "hello", "max_tokens": 12, "temperature": 0, "seed": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    choice = out["choices"][0]
    ids = generate(model, torch.tensor([tok.encode("hello")]), 12, do_sample=False)
    assert choice["text"] == tok.decode(ids[0, 5:]) and choice["finish_reason"] == "length"
    usage = out["usage"]
    assert usage.pop("prompt_tokens_details").keys() == {"cached_tokens"}
    assert usage == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    two = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "seed": 3},
        timeout=30,
    ).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]


def test_streamed_completion_concatenates_to_the_plain_one(server):
    url, _, _ = server
    body = {"prompt": "the ", "max_tokens": 20, "seed": 5, "top_p": 0.9}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    chunks = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert len(events) > 2
    assert "".join(e["choices"][0]["text"] for e in events) == plain["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_do_not_mix(server):
    url, _, _ = server
    bodies = [
        {"prompt": p, "max_tokens": 25, "seed": s}
        for p, s in [("ab", 1), ("cd", 2), ("ef", 3), ("gh", 4)] * 2
    ]
    alone = [
        httpx.post(f"{url}/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
        for b in bodies[:4]
    ]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(
                lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=60).json(), bodies
            )
        )
    assert [t["choices"][0]["text"] for t in together] == alone * 2


def test_a_compiled_server_answers_concurrent_requests_as_the_eager_model():
    from decoderlm.serve.app import create_app

    torch._dynamo.reset()
    tok, model = CharTokenizer(CHARS[:65]), tiny_model(seed=2)
    prompts = ["ab", "cde", "fghi", "j"]
    expected = [
        tok.decode(generate(model, torch.tensor([tok.encode(p)]), 20, do_sample=False)[0, len(p) :])
        for p in prompts
    ]
    prepare_for_decoding(model, compile=True)  # the server decodes as prepared: compiled
    with running(create_app(model, tok, "tiny")) as url:

        def complete(prompt):
            body = {"prompt": prompt, "max_tokens": 20, "temperature": 0}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(4) as pool:  # the first requests compile, concurrently
            got = list(pool.map(complete, prompts))
    assert [g["choices"][0]["text"] for g in got] == expected


def test_stop_text_ends_the_completion(server):
    url, _, _ = server
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    stop = full["text"][4:6]
    cut = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, timeout=30).json()[
        "choices"
    ][0]
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"prompt": "hi", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
        ({"prompt": "hi", "n": True}, "n", "valid integer"),
        ({"prompt": ["a"] * 5, "n": 4}, "n", "at most 16 per request"),
        ({"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
        ({"max_tokens": 5}, "prompt", "prompt: Field required"),
        ({"prompt": "hi", "max_tokens": 65}, "max_tokens", "limit of 64"),
        ({"prompt": "a" * 101}, "prompt", "at most 100"),
        ({"prompt": "hi!", "max_tokens": 2}, "prompt", "'!' at position 2"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": [[1, 2], []]}, "prompt", "must not be empty"),
        ({"prompt": [1, 2, 65]}, "prompt", "token id 65 is outside"),
        ({"prompt": [[1], [-1]]}, "prompt", "token id -1 is outside"),
        ({"prompt": [1, "a"]}, "prompt", "a list of lists of token ids"),
        ({"prompt": [1.5]}, "prompt", "a list of lists of token ids"),
        ({"prompt": "hi", "logprobs": 6}, "logprobs", "limit of 5"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "needs echo"),
        ({"prompt": "hi", "stop": ["a"] * 17}, "stop", "at most 16"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "hi", "stream": True, "stream_options": 1}, "stream_options", "valid"),
        ({"prompt": "hi", "best_of": 3}, "best_of", "best_of=3 is not supported"),
        ({"prompt": "hi", "suffix": "end"}, "suffix", 'suffix="end" is not supported'),
        ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", "0.5 is not supported"),
        ({"prompt": "hi", "frequency_penalty": -1}, "frequency_penalty", "-1 is not supported"),
        ({"prompt": "hi", "logit_bias": {"5": 100}}, "logit_bias", "logit_bias="),
        ({"prompt": "hi", "echo": 0}, "echo", "valid boolean"),
        ({"prompt": "hi", "max_token": 5}, "max_token", "unknown field 'max_token'"),
    ],
)
def test_bad_requests_get_an_openai_error_naming_the_field(server, body, param, message):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_in_openai_shape(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "not served here" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.get(f"{url}/no/such/path")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize(
    "raw,headers,message",
    [
        ('{"prompt": "hi", "temperature": NaN}', JSON, "finite"),
        ('{"prompt": "hi", "top_p": Infinity}', JSON, "finite"),
        ('{"prompt": "hi", "temperature": 1e400}', JSON, "finite"),
        ('{"prompt": "hi", ', JSON, "not valid JSON"),
        ("prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, "JSON object"),
        ('["hi"]', JSON, "JSON object"),
    ],
)
def test_malformed_bodies_are_openai_errors_and_the_server_keeps_serving(
    server, raw, headers, message
):
    url, _, _ = server
    with httpx.Client() as client:  # and the connection stays usable afterwards
        r = client.post(f"{url}/v1/completions", content=raw, headers=headers, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"]
        assert client.get(f"{url}/health").status_code == 200


def test_a_body_without_content_type_is_refused_with_what_to_send(server):
    url, _, _ = server
    body = json.dumps({"prompt": "ab", "max_tokens": 3, "temperature": 0})
    r = httpx.post(f"{url}/v1/completions", content=body, timeout=30)
    assert r.status_code == 400
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_serve_refuses_a_port_in_use(tmp_path, capsys):
    from decoderlm.cli import main

    tiny_model().save_pretrained(tmp_path)
    CharTokenizer(CHARS[:65]).save_pretrained(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--run", str(tmp_path), "--port", str(port)]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_top_p_zero_is_greedy_as_in_the_python_api(server):
    url, _, _ = server
    body = {"prompt": "abc", "max_tokens": 15, "seed": 3}
    greedy = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=30)
    nucleus = httpx.post(f"{url}/v1/completions", json={**body, "top_p": 0}, timeout=30)
    assert greedy.json()["choices"][0]["text"] == nucleus.json()["choices"][0]["text"]


def test_no_op_values_of_unsupported_fields_and_user_are_accepted(server):
    url, _, _ = server
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    extras = {
        "logprobs": None,
        "echo": False,
        "best_of": 1,
        "top_k": -1,
        "suffix": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "user": "someone",
    }
    r = httpx.post(f"{url}/v1/completions", json={**body, **extras}, timeout=30)
    assert r.status_code == 200
    assert r.json()["choices"] == plain["choices"]


def test_null_fields_mean_their_defaults_as_in_openais_api(server):
    url, _, _ = server
    body = {"prompt": "abc", "seed": 3}
    nulls = dict.fromkeys(("max_tokens", "temperature", "top_p", "n", "stream", "echo"))
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    r = httpx.post(f"{url}/v1/completions", json={**body, **nulls}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain["choices"] and plain["usage"]["completion_tokens"] == 16
    missing = httpx.post(f"{url}/v1/completions", json={"prompt": None}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_leaves_the_batch(stream):
    from decoderlm.serve.app import create_app
    from decoderlm.serve.limits import ServeLimits

    model = tiny_model()
    steps = []

    def slow(module, args):  # about 20 ms per forward pass, and a count of them
        steps.append(1)
        time.sleep(0.02)

    model.tok_emb.register_forward_pre_hook(slow)
    app = create_app(model, CharTokenizer(CHARS[:65]), "tiny", ServeLimits(max_tokens_limit=5000))
    with running(app) as url:
        other = {"prompt": "de", "max_tokens": 60, "temperature": 0}  # shares the batch
        with ThreadPoolExecutor(1) as pool:
            staying = pool.submit(httpx.post, f"{url}/v1/completions", json=other, timeout=60)
            body = {"prompt": "abc", "max_tokens": 5000, "stream": stream}
            if stream:  # read a few chunks, then close the connection
                with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
                    for _, _ in zip(range(3), r.iter_lines(), strict=False):
                        pass
            else:
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and goes
                    httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
            assert staying.result().json()["usage"]["completion_tokens"] == 60
        time.sleep(0.6)
        made = len(steps)
        time.sleep(0.5)
        assert 0 < made == len(steps) < 300  # it stopped, long before 5,000 tokens
        assert app.state.scheduler.load == (0, 0)
        assert app.state.serving_completion.admission.in_progress == 0  # and its place in the queue


def test_models_list_and_card(server):
    url, _, _ = server
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["owned_by"] == "decoderlm" and isinstance(card["created"], int)
    assert httpx.get(f"{url}/v1/models/tiny").json() == card


def test_tokenizer_endpoints_have_vllms_shapes(server):
    url, model, tok = server
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hi there", "add_special_tokens": False})
    assert r.json() == {
        "count": 8,
        "max_model_len": model.config.max_positions,
        "tokens": tok.encode("hi there"),
        "token_strs": None,
    }
    back = httpx.post(f"{url}/detokenize", json={"tokens": tok.encode("hi there")})
    assert back.json() == {"prompt": "hi there"}
    info = httpx.get(f"{url}/tokenizer_info").json()
    # a char model without an end-of-text token reports its line break
    assert info["eos_token"] == "\n" and info["eos_token_id"] == tok.encode("\n")[0]
    assert info["model_max_length"] == model.config.max_positions
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 99]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = httpx.post(f"{url}/tokenize", json={"prompt": "hi!"})
    assert unknown.status_code == 400 and "'!'" in unknown.json()["error"]["message"]


def test_a_prompt_sent_again_reports_its_kept_prefix_as_cached_tokens(server):
    # a finished sequence's keys and values are kept (prefix caching): the same prompt sent
    # again is prefilled from them but for its last token, and usage says so, as OpenAI's
    # prompt_tokens_details.cached_tokens; a prompt's n choices count it once, as its
    # prompt_tokens; the streamed usage says the same
    url, _, _ = server
    prompt = "Reused heads: sent again."  # 25 tokens: the cache keeps what fits the context
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["usage"]
    again = httpx.post(f"{url}/v1/completions", json=body | {"n": 2}, timeout=30).json()
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens"] == len(prompt)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}
    assert again["choices"][0]["text"] == again["choices"][1]["text"]  # greedy, both choices
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=streamed, timeout=30) as r:
        last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
    usage = json.loads(last.removeprefix("data: "))["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}


def test_a_server_without_prefix_caching_prefills_every_prompt_whole(server):
    from decoderlm.serve.app import create_app
    from decoderlm.serve.limits import ServeLimits

    _, model, tok = server
    body = {"prompt": "Reused heads: sent again.", "max_tokens": 3, "temperature": 0}
    limits = ServeLimits(max_tokens_limit=64, enable_prefix_caching=False)
    with running(create_app(model, tok, "tiny", limits)) as url:
        for _ in range(2):
            out = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
            assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_echo_with_max_tokens_0_scores_a_prompt_longer_than_the_context(server):
    from decoderlm.evaluate import token_logprobs

    url, model, tok = server
    prompt = "the cat sat on the mat and the dog ran off to the park at noon"  # 62 > 32
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": 62,
        "completion_tokens": 0,
        "total_tokens": 62,
        "prompt_tokens_details": {"cached_tokens": 0},  # nothing generated: nothing kept
    }
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list(prompt) and logprobs["token_logprobs"][0] is None
    expected, _, _ = token_logprobs(model, tok.encode(prompt))
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-5)
    assert logprobs["text_offset"] == list(range(62))


def test_streamed_echo_and_logprobs_add_up_to_the_plain_ones(server):
    url, _, _ = server
    body = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 6, "echo": True, "logprobs": 1}
    body.update(temperature=0, stop=["zz"] * 16)  # 16 stop strings are fine
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"]
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    for choice in plain:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        merged = {k: sum((c["logprobs"][k] for c in mine), []) for k in choice["logprobs"]}
        want = choice["logprobs"]  # equal up to float rounding of differently batched steps
        for key in ("tokens", "text_offset"):
            assert merged[key] == want[key]
        assert merged["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)
        for got, top in zip(merged["top_logprobs"][1:], want["top_logprobs"][1:], strict=True):
            assert got == pytest.approx(top, abs=1e-5)
        assert len(merged["tokens"]) == len(choice["text"])


def test_eight_concurrent_greedy_requests_get_the_sequential_answers(server):
    url, model, tok = server
    prompts = ["ab", "cd e", "f", "ghij", "kl", "mnop q", "r", "st"]

    def complete(prompt):
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()

    alone = [complete(p)["choices"][0]["text"] for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = [c["choices"][0]["text"] for c in pool.map(complete, prompts)]
    assert together == alone
    expected = generate(model, torch.tensor([tok.encode(prompts[0])]), 40, do_sample=False)
    assert alone[0] == tok.decode(expected[0, 2:])


def test_serve_refuses_more_than_20_logprobs_before_loading(tmp_path, capsys):
    from decoderlm.cli import main

    assert main(["serve", "--run", str(tmp_path / "none"), "--max-logprobs", "21"]) == 2
    assert "--max-logprobs must be in [0, 20], got 21" in capsys.readouterr().err


def test_a_wrong_method_or_path_is_a_client_error_naming_what_the_path_takes(server):
    url, _, _ = server
    r = httpx.get(f"{url}/v1/completions")
    assert r.status_code == 405
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "GET /v1/completions" in error["message"] and "POST" in error["message"]
    r = httpx.get(f"{url}/no/such/path")
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "/no/such/path" in r.json()["error"]["message"]


def _serve_process(run_dir, port: int):
    """`decoderlm serve --run run_dir --port port` in a child process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "decoderlm", "serve", "--run", str(run_dir), "--port", str(port)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_listening(proc, url: str) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {proc.stdout.read().decode()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("serve did not listen within 60 s")


def test_serve_restarts_at_once_on_the_port_it_served_clients_on(tmp_path):
    # A server that closed its clients' connections leaves them in TIME_WAIT on its port;
    # a new server started at once on that port must still listen.
    import signal

    tiny_model().save_pretrained(tmp_path)
    CharTokenizer(CHARS[:65]).save_pretrained(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    first = _serve_process(tmp_path, port)
    try:
        _wait_listening(first, url)
        body = {"prompt": "ab", "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Connection": "close"})
        assert r.status_code == 200
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=30)
    second = _serve_process(tmp_path, port)
    try:
        _wait_listening(second, url)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        second.send_signal(signal.SIGINT)
        second.wait(timeout=30)
