"""The HTTP API with the clients people use: the openai SDK, simonw's llm and
lm-evaluation-harness's `local-completions`, each against a real server on 127.0.0.1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoderlm import CharTokenizer
from decoderlm.evaluate import LN2, evaluate
from decoderlm.generation.generate import generate
from decoderlm.tokenizers import GPT2Tokenizer

from conftest import running, tiny_model

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "lm_eval_tasks"


def _texts(name: str) -> list[str]:
    return [json.loads(line)["text"] for line in (TASKS / name).read_text().splitlines()]


def _choices() -> list[dict]:
    return [json.loads(line) for line in (TASKS / "choices.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def char_server():
    """A char model whose vocabulary covers the task files, served as "tiny-char"."""
    from decoderlm.serve.app import create_app

    text = "".join(_texts("char_docs.jsonl")) + json.dumps(_choices())
    tok = CharTokenizer.from_text(text)
    model = tiny_model(seed=3, vocab_size=tok.vocab_size)
    with running(create_app(model, tok, "tiny-char")) as url:
        yield url, model, tok


@pytest.fixture(scope="module")
def bpe_server():
    """A GPT-2-vocabulary model (tiny otherwise), served as "tiny-bpe"."""
    from decoderlm.serve.app import create_app

    tok = GPT2Tokenizer()
    model = tiny_model(seed=4, vocab_size=tok.vocab_size)
    with running(create_app(model, tok, "tiny-bpe")) as url:
        yield url, model, tok


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_openai_sdk_completion_and_token_id_prompts(char_server):
    url, model, tok = char_server
    client = _client(url)
    out = client.completions.create(model="tiny-char", prompt="First", max_tokens=8, temperature=0)
    expected = generate(model, torch.tensor([tok.encode("First")]), 8, do_sample=False)
    assert out.choices[0].text == tok.decode(expected[0, 5:])
    assert out.usage.completion_tokens == 8
    by_ids = client.completions.create(
        model="tiny-char",
        prompt=[tok.encode("First"), tok.encode("Se")],
        max_tokens=8,
        temperature=0,
    )
    assert by_ids.choices[0].text == out.choices[0].text and len(by_ids.choices) == 2
    assert [m.id for m in client.models.list().data] == ["tiny-char"]
    card = client.models.retrieve("tiny-char")
    assert card.owned_by == "decoderlm" and card.created > 0


def test_openai_sdk_stream_with_usage_concatenates_to_the_plain_completion(char_server):
    url, _, _ = char_server
    client = _client(url)
    body = dict(model="tiny-char", prompt="All:", max_tokens=12, seed=7)
    plain = client.completions.create(**body)
    chunks = list(
        client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 4
    # the prompt's keys and values kept from the plain request: all but its last token
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3


def test_openai_sdk_echo_logprobs_are_the_models_log_softmax(char_server):
    url, model, tok = char_server
    prompt = "Speak, speak."
    out = _client(url).completions.create(
        model="tiny-char", prompt=prompt, max_tokens=1, echo=True, logprobs=3, temperature=0
    )
    lp = out.choices[0].logprobs
    ids = tok.encode(prompt)
    assert out.choices[0].text.startswith(prompt)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    expected = torch.log_softmax(model(torch.tensor([ids]))[0][0].double(), -1)
    want = expected[torch.arange(len(ids) - 1), ids[1:]]
    got = torch.tensor(lp.token_logprobs[1 : len(ids)], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-5)
    for j in range(1, len(ids)):  # the 3 largest entries are the true top 3
        top = sorted(lp.top_logprobs[j].items(), key=lambda kv: -kv[1])[:3]
        true = expected[j - 1].topk(3)
        assert [k for k, _ in top] == [tok.decode([i]) for i in true.indices.tolist()]
        assert [v for _, v in top] == pytest.approx(true.values.tolist(), abs=1e-5)
    assert lp.text_offset[: len(ids)] == list(range(len(ids)))


def test_openai_sdk_shows_the_error_message_and_param(char_server):
    url, _, _ = char_server
    with pytest.raises(openai.BadRequestError) as info:
        _client(url).completions.create(model="tiny-char", prompt=[[1, 10**6]], max_tokens=2)
    assert info.value.param == "prompt"
    assert "token id 1000000 is outside" in str(info.value)
    with pytest.raises(openai.NotFoundError) as info:
        _client(url).completions.create(model="gpt-4", prompt="hi")
    assert info.value.code == "model_not_found"


def _llm(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: tiny-char\n  model_name: tiny-char\n  api_base: {url}/v1\n"
        f"  completion: true\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "none"}
    cmd = [sys.executable, "-m", "llm", "-m", "tiny-char", "--no-log", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_llm_streams_by_default_and_takes_logprobs(char_server, tmp_path):
    pytest.importorskip("llm")
    url, model, tok = char_server
    streamed = _llm(url, tmp_path, "-o", "temperature", "0", "-o", "max_tokens", "10", "First")
    assert streamed.returncode == 0, streamed.stderr
    expected = generate(model, torch.tensor([tok.encode("First")]), 10, do_sample=False)
    assert streamed.stdout.rstrip("\n") == tok.decode(expected[0, 5:]).rstrip("\n")
    with_logprobs = _llm(
        url, tmp_path, "-o", "logprobs", "2", "-o", "max_tokens", "5", "--no-stream", "All"
    )
    assert with_logprobs.returncode == 0, with_logprobs.stderr


@pytest.fixture(scope="module")
def lm_eval_api():
    """lm_eval.simple_evaluate and a TaskManager of tests/lm_eval_tasks, offline."""
    pytest.importorskip("lm_eval")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate, TaskManager(include_path=str(TASKS), include_defaults=False)


def _run_lm_eval(lm_eval_api, url: str, name: str, block_size: int, task: str, monkeypatch):
    simple_evaluate, tasks = lm_eval_api
    monkeypatch.chdir(REPO)  # the task files name their data relative to the repository
    # lm-eval scores rolling windows of max_length - 2 tokens: block_size, as `evaluate`
    args = f"model={name},base_url={url}/v1/completions,max_length={block_size + 2}"
    out = simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=[task],
        task_manager=tasks,
        log_samples=True,
    )
    return out["results"][task], out["samples"][task]


def _bits_per_byte(model, eot: int, texts: list[str], tok) -> float:
    """Our own figure: `evaluate` over [eot] + ids of each text, whose length - 1 is a
    multiple of block_size, so its non-overlapping windows score every token."""
    nats, n_bytes = 0.0, 0
    for text in texts:
        ids = torch.tensor([eot, *tok.encode(text)])
        assert (len(ids) - 1) % model.config.block_size == 0
        nats += evaluate(model, ids) * (len(ids) - 1)
        n_bytes += len(text.encode("utf-8"))
    return nats / n_bytes / LN2


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_lm_eval_bits_per_byte_equals_ours(kind, lm_eval_api, request, monkeypatch):
    url, model, tok = request.getfixturevalue(f"{kind}_server")
    result, _ = _run_lm_eval(
        lm_eval_api,
        url,
        f"tiny-{kind}",
        model.config.block_size,
        f"decoderlm_{kind}_ppl",
        monkeypatch,
    )
    eot = tok.encode("\n")[0] if kind == "char" else 50256
    ours = _bits_per_byte(model, eot, _texts(f"{kind}_docs.jsonl"), tok)
    assert result["bits_per_byte,none"] == pytest.approx(ours, abs=1e-3)


def test_lm_eval_multiple_choice_accuracy_equals_ours(char_server, lm_eval_api, monkeypatch):
    url, model, tok = char_server
    result, samples = _run_lm_eval(
        lm_eval_api, url, "tiny-char", model.config.block_size, "decoderlm_choices", monkeypatch
    )
    correct = 0
    for doc in _choices():  # lm-eval's convention: the continuation is " " + choice
        context = tok.encode(doc["question"])
        scores = []
        for choice in doc["choices"]:
            cont = tok.encode(" " + choice)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([context + cont]))[0][0].double(), -1)
            n = len(context)
            scores.append(sum(float(lp[n - 1 + j, c]) for j, c in enumerate(cont)))
        sample = next(s for s in samples if s["doc"]["question"] == doc["question"])
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        assert theirs == pytest.approx(scores, abs=1e-4)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    assert result["acc,none"] == pytest.approx(correct / len(_choices()))


def test_gpt2_tokenizer_info_reports_endoftext(bpe_server):
    import httpx

    url, _, _ = bpe_server
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["eos_token_id"] == 50256
    r = httpx.post(f"{url}/tokenize", json={"prompt": "<|endoftext|>", "add_special_tokens": False})
    assert r.json()["tokens"] == [50256]  # lm-eval takes encode(eos_token)[0] as the eos id


def test_lm_eval_generation_with_five_stop_strings(char_server, lm_eval_api, monkeypatch):
    url, model, tok = char_server
    _, samples = _run_lm_eval(
        lm_eval_api, url, "tiny-char", model.config.block_size, "decoderlm_generate", monkeypatch
    )
    stops, cuts = [".", "ttt", "A:", "!", "\n"], []  # the task's, then the server's end of text
    for doc in _choices():
        ids = tok.encode(doc["question"])
        text = tok.decode(generate(model, torch.tensor([ids]), 12, do_sample=False)[0, len(ids) :])
        cut = min([text.find(s) for s in stops if s in text], default=len(text))
        sample = next(s for s in samples if s["doc"]["question"] == doc["question"])
        assert sample["resps"][0][0] == text[:cut]
        cuts.append(cut)
    assert min(cuts) < 12 == max(cuts)  # a stop string cut one answer, another ran to the end
