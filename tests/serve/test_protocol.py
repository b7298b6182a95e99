"""The API's published shapes: the OpenAPI schema names the request and response models of each
route, the bodies the server sends validate against those models, and the serve command and
its module load without the [serve] extra."""

import json
import subprocess
import sys

import pytest

from decoderlm import CharTokenizer
from decoderlm.errors import UserError
from decoderlm.options import ModelSource
from decoderlm.serve.app import serve

from conftest import running, tiny_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:'\n0123456789-"))


def _app():
    from decoderlm.serve.app import create_app

    return create_app(tiny_model(), CharTokenizer(CHARS[:65]), "tiny")


@pytest.fixture(scope="module")
def schema():
    app = _app()
    try:
        yield app.openapi()
    finally:
        app.state.serving_completion.close()


def _ref(content: dict) -> str:
    return content["schema"]["$ref"].rsplit("/", 1)[-1]


@pytest.mark.parametrize(
    "path,method,request_model,response_model",
    [
        ("/v1/completions", "post", "CompletionRequest", "CompletionResponse"),
        ("/tokenize", "post", "TokenizeRequest", "TokenizeResponse"),
        ("/detokenize", "post", "DetokenizeRequest", "DetokenizeResponse"),
        ("/tokenizer_info", "get", None, "TokenizerInfo"),
        ("/v1/models", "get", None, "ModelList"),
        ("/v1/models/{model_id}", "get", None, "ModelCard"),
        ("/health", "get", None, "HealthResponse"),
    ],
)
def test_the_openapi_schema_names_each_routes_models(
    schema, path, method, request_model, response_model
):
    operation = schema["paths"][path][method]
    if request_model:
        assert _ref(operation["requestBody"]["content"]["application/json"]) == request_model
    assert _ref(operation["responses"]["200"]["content"]["application/json"]) == response_model
    assert "422" not in operation["responses"]  # a body that does not fit is a 400
    errors = {s for s in operation["responses"] if s != "200"}
    assert "500" in errors and (request_model is None or {"400", "404"} <= errors)
    for status in errors:
        assert (
            _ref(operation["responses"][status]["content"]["application/json"]) == "ErrorResponse"
        )
    components = schema["components"]["schemas"]
    for name in filter(None, (request_model, response_model)):
        fields = components[name]["properties"]
        # every field of every model is documented
        assert all(f.get("description") for f in fields.values()), name


def test_the_streamed_chunk_and_the_nested_models_are_in_the_schema(schema):
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert _ref(completions["text/event-stream"]) == "CompletionStreamResponse"
    components = schema["components"]["schemas"]
    for name in ("CompletionStreamResponse", "CompletionChoice", "CompletionLogprobs", "Usage"):
        assert name in components, name
    choice = components["CompletionStreamResponse"]["properties"]["choices"]["items"]
    assert choice["$ref"] == "#/components/schemas/CompletionChoice"
    error = components["ErrorResponse"]["properties"]["error"]
    assert error["$ref"] == "#/components/schemas/ErrorInfo"
    assert "HTTPValidationError" not in components
    json.dumps(schema)  # the schema is JSON as it stands


@pytest.fixture(scope="module")
def server():
    app = _app()
    with running(app) as url:
        yield url


def test_the_bodies_sent_validate_against_their_response_models(server):
    from decoderlm.serve import protocol as p

    url = server
    body = {"prompt": [[1, 2], [3, 4]], "n": 2, "max_tokens": 4, "echo": True, "logprobs": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = p.CompletionResponse.model_validate(r.json())
    assert len(out.choices) == 4 and out.usage.completion_tokens == 16
    assert all(c.logprobs is not None and c.finish_reason == "length" for c in out.choices)
    chunks = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True, "stream_options": {}}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(p.CompletionStreamResponse.model_validate_json(line[len("data: ") :]))
    assert chunks and {c.choices[0].index for c in chunks} == {0, 1, 2, 3}
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "ab", "return_token_strs": True})
    assert p.TokenizeResponse.model_validate(tokens.json()).token_strs == ["a", "b"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": [1, 2]}).json()
    assert p.DetokenizeResponse.model_validate(text).prompt == CharTokenizer(CHARS[:65]).decode(
        [1, 2]
    )
    info = p.TokenizerInfo.model_validate(httpx.get(f"{url}/tokenizer_info").json())
    assert info.vocab_size == 65
    models = p.ModelList.model_validate(httpx.get(f"{url}/v1/models").json())
    assert models.data[0].id == "tiny"
    assert p.HealthResponse.model_validate(httpx.get(f"{url}/health").json()).status == "ok"
    for bad in (
        httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "n": 0}),
        httpx.get(f"{url}/v1/models/other"),
        httpx.get(f"{url}/no/such/path"),
    ):
        error = p.ErrorResponse.model_validate(bad.json()).error
        assert bad.status_code in (400, 404) and error.type == "invalid_request_error"


def test_the_serve_module_and_command_load_without_fastapi_or_pydantic():
    code = (
        "import sys, decoderlm.cli, decoderlm.serve.app\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'pydantic', 'starlette', 'uvicorn', 'torch')]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"source": {"run": ""}}, "--run must not be empty"),
        ({"source": {"hf": ""}}, "--hf must not be empty"),
        ({"served_model_name": ""}, "--served-model-name must not be empty"),
        ({"port": 0}, "--port must be in [1, 65536), got 0"),
        ({"port": 65536}, "--port must be in [1, 65536), got 65536"),
        ({"limits": {"max_batch_size": 0}}, "--max-batch-size must be an integer >= 1, got 0"),
        ({"limits": {"max_tokens_limit": 0}}, "--max-tokens-limit must be an integer >= 1, got 0"),
        (
            {"limits": {"max_prompt_tokens": -3}},
            "--max-prompt-tokens must be an integer >= 1, got -3",
        ),
        ({"limits": {"max_stop": -1}}, "--max-stop must be an integer >= 0, got -1"),
        ({"limits": {"max_logprobs": 21}}, "--max-logprobs must be in [0, 20], got 21"),
        ({"limits": {"max_queue": -1}}, "--max-queue must be an integer >= 0, got -1"),
        ({"limits": {"max_body_bytes": 0}}, "--max-body-bytes must be an integer >= 1, got 0"),
        ({"limits": {"request_timeout": -1.0}}, "--request-timeout must be >= 0 seconds, got -1.0"),
        ({"api_key": [""]}, "--api-key (or DECODERLM_API_KEY) must be a non-empty key"),
    ],
)
def test_the_serve_command_refuses_bad_flags_before_loading(tmp_path, flags, message):
    # the run directory does not exist: a flag error must come first
    flags = {"source": {"run": str(tmp_path / "none")}, **flags}
    with pytest.raises(UserError) as e:
        serve(**{**flags, "source": ModelSource(**flags["source"])})
    assert str(e.value).startswith(message)


def test_a_missing_serve_extra_is_one_line_saying_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['fastapi'] = None  # as if FastAPI were not installed\n"
        "from decoderlm.errors import UserError\n"
        "from decoderlm.serve.app import create_app\n"
        "try:\n"
        "    create_app(None, None, 'tiny')\n"
        "except UserError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'decoderlm[serve]'" in out.stdout and out.stdout.count("\n") == 1


def test_a_completion_request_converts_itself_to_sampling_params():
    from decoderlm.generation.params import SamplingParams
    from decoderlm.serve.protocol import CompletionRequest

    plain = CompletionRequest(prompt="a").to_sampling_params()
    assert plain == SamplingParams(16, 1.0, None, None, None)  # OpenAI's defaults: all off
    for off in (-1, 0, None):
        assert CompletionRequest(prompt="a", top_k=off).to_sampling_params().top_k is None
    req = CompletionRequest(
        prompt="a",
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.25,
        seed=10,
        stop="x",
        logprobs=2,
        ignore_eos=True,
    )
    assert req.to_sampling_params(eos_token_id=5, seed=11) == SamplingParams(
        max_new_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.25,
        seed=11,
        stop=("x",),
        eos_token_id=5,
        ignore_eos=True,
        logprobs=2,
    )
    assert req.to_sampling_params().seed == 10
    assert CompletionRequest(prompt="a", stop=["x", "y"]).to_sampling_params().stop == ("x", "y")
