"""An OpenAI-style HTTP API for a model: FastAPI + uvicorn (the optional [serve] extra).

    POST /v1/completions   prompt (str or list), max_tokens, temperature, top_p, n, stop,
                           stream, seed  ->  OpenAI's "text_completion" shape, or Server-Sent
                           Events ("data: {chunk}" lines, then "data: [DONE]") when stream
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok"}

Each request samples with its own torch.Generator and KV cache, so concurrent requests
(generation runs in a thread pool) never share state. A bad field is a 422 (from the request
schema) or a 400 with a message (limits, unknown characters). OpenAI fields this server cannot
honour (logprobs, echo, best_of, suffix, presence_penalty, frequency_penalty, logit_bias) are
accepted only at their no-op values (null, false, 1, null, 0, 0, {}), any other value is a 400
naming the field; `user` is accepted and ignored (it only labels the caller); any other
unknown field is a 400 too, so a misspelt option is never silently dropped. A request whose client
disconnects stops generating at its next piece of text (usually the next token).
"""

import json  # no `from __future__ import annotations`: FastAPI reads the request type
import socket
import time
import uuid
from dataclasses import dataclass

import torch

from .generate import generate, stream_text

__all__ = ["create_app", "serve"]

# OpenAI completion fields we do not implement, with the values that ask for nothing from them
_NO_OP_FIELDS = {
    "logprobs": [None],
    "echo": [False],
    "best_of": [1],
    "suffix": [None],
    "presence_penalty": [0, 0.0],
    "frequency_penalty": [0, 0.0],
    "logit_bias": [None, {}],
}


def _unsupported_fields(extra: dict, supported: list[str]) -> str | None:
    """A message naming the first field of `extra` (fields outside the request schema) that
    this server cannot honour, or None when all of them ask for nothing."""
    for name, value in extra.items():
        if name not in _NO_OP_FIELDS:
            return f"unknown field {name!r}; this server supports {supported}"
        if not any(type(value) is type(ok) and value == ok for ok in _NO_OP_FIELDS[name]):
            allowed = " or ".join(json.dumps(ok) for ok in _NO_OP_FIELDS[name])
            return (
                f"{name}={json.dumps(value)} is not supported by this server; omit {name} "
                f"or send {allowed}"
            )
    return None


def _missing_extra(e: ImportError):
    return RuntimeError(
        f"`decoderlm serve` needs FastAPI and uvicorn: pip install 'decoderlm[serve]' ({e})"
    )


def _request_schema():
    """The pydantic model of a POST /v1/completions body."""
    from pydantic import BaseModel, ConfigDict, Field

    class CompletionRequest(BaseModel):
        # strict: no "yes" for true, no true for 1; extra fields are kept to be checked
        model_config = ConfigDict(strict=True, extra="allow")

        model: str | None = None
        prompt: str | list[str]
        max_tokens: int = Field(16, ge=0)
        temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
        top_p: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
        n: int = Field(1, ge=1, le=16)
        stop: str | list[str] | None = None
        stream: bool = False
        seed: int | None = Field(None, ge=0, lt=2**63)
        user: str | None = None  # accepted and ignored

    return CompletionRequest


@dataclass(frozen=True)
class _Served:
    """What one app serves, and its limits."""

    model: object
    tokenizer: object
    name: str
    max_tokens_limit: int
    max_prompt_tokens: int
    compile: bool


def _check(req, served: _Served) -> tuple[list[list[int]], list[str]]:
    """(each prompt's token ids, the stop texts) of a request; HTTPException 400 / 404 with a
    message naming what is wrong."""
    from fastapi import HTTPException

    unsupported = _unsupported_fields(req.model_extra or {}, sorted(type(req).model_fields))
    if unsupported:
        raise HTTPException(400, unsupported)
    if req.model not in (None, served.name):
        raise HTTPException(404, f"model {req.model!r} is not served here; GET /v1/models")
    if req.max_tokens > served.max_tokens_limit:
        raise HTTPException(
            400,
            f"max_tokens {req.max_tokens} exceeds this server's limit of {served.max_tokens_limit}",
        )
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not prompts or not all(prompts):
        raise HTTPException(400, "prompt must be a non-empty string or list of strings")
    if len(prompts) * req.n > 16:
        raise HTTPException(
            400, f"{len(prompts)} prompts x n={req.n} completions; at most 16 per request"
        )
    try:
        encoded = [served.tokenizer.encode(p, allowed_special="all") for p in prompts]
    except ValueError as e:
        raise HTTPException(400, f"prompt: {e}") from None
    longest = max(len(ids) for ids in encoded)
    if longest > served.max_prompt_tokens:
        raise HTTPException(
            400,
            f"a prompt has {longest} tokens; this server accepts at "
            f"most {served.max_prompt_tokens}",
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
        raise HTTPException(400, "at most 4 stop sequences")
    return encoded, stops


def _runs(req, served: _Served, encoded: list[list[int]], stops: list[str]):
    """(choice index, stream_text iterator) for every prompt x n."""
    for p, ids in enumerate(encoded):
        for i in range(req.n):
            seed = None if req.seed is None else req.seed + i
            yield (
                p * req.n + i,
                stream_text(
                    served.model,
                    served.tokenizer,
                    ids,
                    req.max_tokens,
                    req.temperature,
                    None,
                    req.top_p if req.top_p < 1.0 else None,
                    seed,
                    stops,
                    served.compile,
                ),
            )


def _events(head: dict, runs):
    """Server-Sent Events of a streamed completion: one chunk per piece of text, then
    [DONE]."""
    for index, pieces in runs:
        for delta, finish, *_ in pieces:
            chunk = {
                **head,
                "choices": [
                    {"text": delta, "index": index, "logprobs": None, "finish_reason": finish}
                ],
            }
            yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def _complete(head: dict, runs, prompt_tokens: int, request):
    """The whole completion, or a 499 response once the client has gone."""
    from fastapi import Response
    from fastapi.concurrency import run_in_threadpool

    # one token per trip to the thread pool, so a client that has gone is noticed (a
    # streamed response stops the same way: Starlette stops pulling its chunks)
    choices, completion_tokens = [], 0
    for index, pieces in runs:
        text, finish, made = "", None, 0
        while (piece := await run_in_threadpool(next, pieces, None)) is not None:
            if await request.is_disconnected():
                pieces.close()
                return Response(status_code=499)  # nobody reads it; nginx's code
            delta, finish, *rest = piece
            text += delta
            made = rest[0] if rest else made
        completion_tokens += made
        choices.append({"text": text, "index": index, "logprobs": None, "finish_reason": finish})
    return {
        **head,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def create_app(
    model,
    tokenizer,
    model_name: str,
    max_tokens_limit: int = 1024,
    max_prompt_tokens: int = 4096,
    compile: bool = False,
):
    """Build the FastAPI app serving `model` with `tokenizer` under the id `model_name`;
    compile=True decodes with `generate(..., compile=True)`.

    Raises:
        RuntimeError: FastAPI is not installed.
    """
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, StreamingResponse
    except ImportError as e:
        raise _missing_extra(e) from None
    CompletionRequest = _request_schema()
    served = _Served(model, tokenizer, model_name, max_tokens_limit, max_prompt_tokens, compile)
    app = FastAPI(title="decoderlm", version="0.1.0")
    model.eval()

    @app.exception_handler(RequestValidationError)
    def invalid_request(request: Request, exc: RequestValidationError):
        # the default echoes the bad input, which cannot be JSON when it is NaN or Infinity
        detail = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "decoderlm"}],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        encoded, stops = _check(req, served)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        runs = _runs(req, served, encoded, stops)
        if req.stream:
            return StreamingResponse(_events(head, runs), media_type="text/event-stream")
        return await _complete(head, runs, sum(len(ids) for ids in encoded), request)

    return app


def serve(
    model,
    tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_tokens_limit: int = 1024,
    max_prompt_tokens: int = 4096,
    compile: bool = False,
) -> None:
    """Run the API with uvicorn until interrupted; with compile=True, the decoding step is
    compiled before the server listens."""
    try:
        import uvicorn
    except ImportError as e:
        raise _missing_extra(e) from None
    try:  # fail with one clear line, before uvicorn starts, if the address is unusable
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.bind(infos[0][4])
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    app = create_app(model, tokenizer, model_name, max_tokens_limit, max_prompt_tokens, compile)
    if compile:
        print("compiling the decoding step (once; 10-30 s)...", flush=True)
        device = model.device
        generate(model, torch.zeros(1, 1, dtype=torch.long, device=device), 2, compile=True)
    print(f"serving {model_name} on http://{host}:{port} (POST /v1/completions)")
    uvicorn.run(app, host=host, port=port, log_level="info")
