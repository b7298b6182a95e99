"""POST /v1/chat/completions against a real server: the tiny HF chat model's greedy replies
equal transformers' generate on the rendered prompt, streamed deltas join to the plain reply,
bad requests get OpenAI-shaped 400s; the openai SDK, llm and lm-evaluation-harness's
`local-chat-completions` as clients."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_chat
import torch

from decoderlm.io.hf import load_hf

from conftest import running

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")

chat_dir = tiny_chat.chat_dir  # the fixture

HELLO = [{"role": "user", "content": "Hello, how are you?"}]
SYSTEM = [
    {"role": "system", "content": "Answer briefly."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "The capital "},
            {"type": "text", "text": "of France?"},
        ],
    },
]


@pytest.fixture(scope="module")
def server(chat_dir):
    from decoderlm.serve.app import create_app
    from decoderlm.serve.limits import ServeLimits

    directory, hf_model = chat_dir
    model, tok = load_hf(directory)
    limits = ServeLimits(max_tokens_limit=64, max_prompt_tokens=120, max_logprobs=5)
    with running(create_app(model, tok, "tiny-chat", limits)) as url:
        yield url, hf_model, transformers.AutoTokenizer.from_pretrained(directory)


def _expected(hf_model, hf_tok, messages, max_new_tokens: int) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of transformers' greedy reply."""
    text = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(p["text"] for p in m["content"]),
        }
        for m in messages
    ]
    return tiny_chat.hf_greedy_reply(hf_model, hf_tok, text, max_new_tokens)


def _post(url, body):
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("messages", [HELLO, SYSTEM])
def test_greedy_reply_is_transformers_generate_on_the_rendered_prompt(server, messages):
    url, hf_model, hf_tok = server
    r = _post(url, {"messages": messages, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    text, finish, tokens = _expected(hf_model, hf_tok, messages, 40)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == finish
    rendered = hf_tok.apply_chat_template(
        [{"role": m["role"], "content": "x"} for m in messages], add_generation_prompt=True
    )
    assert out["usage"]["completion_tokens"] == tokens and out["usage"]["prompt_tokens"] > 0
    assert len(rendered) > 0


def test_a_reply_ends_at_an_end_of_turn_id_left_out_of_the_text(chat_dir):
    from decoderlm.serve.app import create_app
    from decoderlm.tokenizers.chat_template import chat_template_of

    directory, hf_model = chat_dir
    model, tok = load_hf(directory)
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    ids = hf_tok.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False)
    greedy = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
    )[0, len(ids) :].tolist()
    end = next(j for j in range(1, 12) if greedy[j] not in greedy[:j])  # its first new token
    template = chat_template_of(tok)
    template.end_ids = (greedy[end],)  # as if the template's end-of-turn token were that one
    with running(create_app(model, tok, "m", chat_template=template)) as url:
        out = _post(url, {"messages": HELLO, "max_tokens": 12, "temperature": 0}).json()
    assert out["choices"][0]["message"]["content"] == hf_tok.decode(greedy[:end])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == end + 1


def test_streamed_deltas_join_to_the_plain_reply_in_vllms_chunk_order(server):
    url, _, _ = server
    body = {"messages": SYSTEM, "max_tokens": 30, "seed": 5, "n": 2}
    plain = _post(url, body).json()
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    for index in range(2):
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        text = "".join(ch["delta"].get("content") or "" for ch in mine)
        assert text == plain["choices"][index]["message"]["content"]
        assert mine[-1]["finish_reason"] == plain["choices"][index]["finish_reason"]
        assert [ch["finish_reason"] for ch in mine[:-1]] == [None] * (len(mine) - 1)
    assert chunks[-1]["choices"] == []
    usage, cached = chunks[-1]["usage"], plain["usage"]["prompt_tokens"] - 1
    assert usage | {"prompt_tokens_details": None} == plain["usage"] | {
        "prompt_tokens_details": None
    }
    # the same conversation again: its prompt is prefilled from the plain request's keys and
    # values but for its last token
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}


def test_logprobs_are_the_models_log_softmax(server):
    url, hf_model, hf_tok = server
    out = _post(
        url,
        {"messages": HELLO, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ).json()
    content = out["choices"][0]["logprobs"]["content"]
    ids = hf_tok.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False)
    reply = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None
    )[0, len(ids) :].tolist()
    assert [e["token"] for e in content] == [hf_tok.decode([i]) for i in reply]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + reply])).logits[0].double().log_softmax(-1)
    for j, entry in enumerate(content):
        assert entry["logprob"] == pytest.approx(
            float(logits[len(ids) - 1 + j, reply[j]]), abs=1e-4
        )
        top = logits[len(ids) - 1 + j].topk(2)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            top.values.tolist(), abs=1e-4
        )
        assert entry["bytes"] == list(entry["token"].encode())


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "role"),
        (
            {"messages": HELLO, "response_format": {"type": "json_object"}},
            "response_format",
            "not supported",
        ),
        (
            {"messages": HELLO, "max_completion_tokens": 1000},
            "max_completion_tokens",
            "limit of 64",
        ),
        ({"messages": HELLO, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"messages": HELLO, "logprobs": True, "top_logprobs": 9}, "top_logprobs", "limit of 5"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools", "not supported"),
        ({"messages": HELLO, "temperature": "hot"}, "temperature", "number"),
        ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages", "at most 120"),
    ],
)
def test_bad_chat_requests_get_openai_shaped_400s(server, body, param, message):
    url, _, _ = server
    r = _post(url, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]


def test_a_template_error_and_a_model_without_a_template_are_400s(chat_dir):
    from decoderlm.serve.app import create_app
    from decoderlm.tokenizers.chat_template import ChatTemplate

    directory, _ = chat_dir
    model, tok = load_hf(directory)
    raising = ChatTemplate("{{ raise_exception('only user turns, please') }}", tok)
    with running(create_app(model, tok, "m", chat_template=raising)) as url:
        error = _post(url, {"messages": HELLO}).json()["error"]
        assert error["param"] == "messages" and "only user turns, please" in error["message"]
    tok.chat_template = None
    with running(create_app(model, tok, "m")) as url:
        r = _post(url, {"messages": HELLO})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_openai_sdk_chat_plain_and_streamed(server):
    openai = pytest.importorskip("openai")
    url, hf_model, hf_tok = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model="tiny-chat", messages=HELLO, max_tokens=20, temperature=0
    )
    assert out.choices[0].message.content == _expected(hf_model, hf_tok, HELLO, 20)[0]
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=HELLO,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-chat", messages=HELLO, response_format={"type": "json_object"}
        )
    assert info.value.param == "response_format"


def test_llm_chats_with_the_server(server, tmp_path):
    pytest.importorskip("llm")
    url, hf_model, hf_tok = server
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: tiny-chat\n  model_name: tiny-chat\n  api_base: {url}/v1\n"
    )
    # LLM_LOAD_PLUGINS empty: llm's own OpenAI models only (no plugin installed here runs)
    env = {
        **os.environ,
        "LLM_USER_PATH": str(tmp_path),
        "OPENAI_API_KEY": "none",
        "LLM_LOAD_PLUGINS": "",
    }
    for stream in ([], ["--no-stream"]):
        cmd = [
            sys.executable,
            "-m",
            "llm",
            "-m",
            "tiny-chat",
            "--no-log",
            *stream,
            "-o",
            "temperature",
            "0",
            "-o",
            "max_tokens",
            "20",
            HELLO[0]["content"],
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.rstrip("\n") == _expected(hf_model, hf_tok, HELLO, 20)[0].rstrip("\n")


def test_lm_eval_local_chat_completions_answers_are_our_greedy_replies(server, monkeypatch):
    """lm-eval's local-chat-completions runs tests/lm_eval_tasks/chat_generate.yaml (six
    questions, each one user message; greedy, 10 tokens, stop strings "W" and "M") against
    /v1/chat/completions: each logged answer is transformers' greedy reply to that message cut
    before the first stop string, and exact_match is the fraction of those equal to the file's
    answers. Among the replies some are cut by a stop string, one ends at an end token, one runs
    to 10 tokens, and two are empty, one of which the file answers "": the fraction is 1/6."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    repo = Path(__file__).resolve().parents[2]
    tasks = repo / "tests" / "lm_eval_tasks"
    monkeypatch.chdir(repo)  # the task file names its data relative to the repository
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("OPENAI_API_KEY", "none")
    url, hf_model, hf_tok = server
    task = "decoderlm_chat_generate"
    out = simple_evaluate(
        model="local-chat-completions",
        model_args=f"model=tiny-chat,base_url={url}/v1/chat/completions,"
        "tokenizer_backend=None,num_concurrent=1,max_retries=1",
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        apply_chat_template=True,
        log_samples=True,
    )
    docs = [json.loads(line) for line in (tasks / "chat_questions.jsonl").read_text().splitlines()]
    samples = {s["doc"]["question"]: s for s in out["samples"][task]}
    assert sorted(samples) == sorted(d["question"] for d in docs)
    expected, finishes = [], set()
    for doc in docs:
        messages = [{"role": "user", "content": doc["question"]}]
        prompt, gen_kwargs = samples[doc["question"]]["arguments"][0]
        assert json.loads(prompt[0]) == messages and gen_kwargs["until"] == ["W", "M"]
        text, finish, _ = tiny_chat.hf_greedy_reply(hf_model, hf_tok, messages, 10)
        cut = min([text.find(s) for s in ("W", "M") if s in text], default=len(text))
        finishes.add("cut" if cut < len(text) else finish)
        expected.append(text[:cut])
        assert samples[doc["question"]]["filtered_resps"] == [text[:cut]], doc["question"]
    assert finishes == {"cut", "stop", "length"} and "" in expected and any(expected)
    hits = [e == d["answer"] for e, d in zip(expected, docs, strict=True)]
    assert sum(hits) == 1
    assert out["results"][task]["exact_match,none"] == pytest.approx(sum(hits) / len(docs))
