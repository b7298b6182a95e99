"""An OpenAI-style HTTP API for a model: FastAPI + uvicorn (the optional [serve] extra).

    POST /v1/completions     OpenAI's legacy completions (fields below) -> "text_completion",
                             or Server-Sent Events ("data: {chunk}" lines, "data: [DONE]")
    GET  /v1/models          the one model served; GET /v1/models/{id}
    POST /tokenize           {"prompt": text} -> {"tokens", "count", "max_model_len"}  (vLLM's)
    POST /detokenize         {"tokens": [ids]} -> {"prompt": text}                    (vLLM's)
    GET  /tokenizer_info     eos_token (+ eos_token_id), bos/pad/unk tokens, model_max_length
    GET  /health             {"status": "ok"}

Completion fields: prompt (a string, a list of strings, a list of token ids or a list of lists
of ids), max_tokens, temperature, top_p, top_k (vLLM's extension; -1 or null: off), n, stop (up
to `max_stop` strings), stream, stream_options.include_usage (a last chunk with no choices and
the usage), seed (choice i of a prompt uses seed + i), logprobs (0..max_logprobs), echo, user
(ignored). OpenAI fields with no effect here are accepted at the values that ask for nothing
(best_of 1, suffix null, presence_penalty / frequency_penalty 0, logit_bias {} or null) and
refused otherwise; any other unknown field is refused, so a misspelt option is never silently
dropped.

logprobs (legacy completions, as OpenAI and vLLM): {"tokens", "token_logprobs", "top_logprobs",
"text_offset"} for the tokens of the choice's text. A log-probability is the log-softmax (nats)
of the model's raw logits (before temperature, top-k and top-p) over the tokenizer's ids;
top_logprobs[i] holds the `logprobs` most likely tokens and the chosen one ({token text:
log-probability}; tokens whose texts are equal share one key). With echo the prompt's tokens
come first (their logprobs entries null for the first token, which has no context), and
max_tokens 0 scores the prompt only. A prompt longer than the context (block_size) is scored
as `decoderlm eval` scores a text: non-overlapping windows of block_size, the tail scored in a
last window ending at the last token (`decoderlm.evaluate.token_logprobs`). text_offset[i] is
where token i starts in the choice's text, counting each token's text decoded alone.

End of text (GET /tokenizer_info's eos_token, which lm-evaluation-harness uses as the prefix
of every document it scores and appends to its stop strings): the tokenizer's end-of-text
token (GPT-2: "<|endoftext|>" = 50256); a char or byte model trained without one reports
"\\n", its line break, so documents are scored as if they started on a new line (pass
lm-eval's `eos_string=...` to stop generations at another text).

Generation is batched across requests by a `decoderlm.generation.scheduler.Scheduler` (continuous
batching, at most max_batch_size sequences per forward pass, the rest queued). Every error is
OpenAI's {"error": {"message", "type", "param", "code"}} with status 400 (bad request; param
names the field), 404 (unknown model or path) or 500. A request whose client disconnects
leaves the batch at the next step.
"""

import asyncio  # no `from __future__ import annotations`: FastAPI reads the request types
import json
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import NonNegativeInt, NotEmptyStr, PositiveInt, UserError
from ..evaluate import token_logprobs
from ..finetune.sources import load_model_and_tokenizer
from ..generation.generate import TextStream, _decode_step
from ..generation.scheduler import Scheduler, Sequence

__all__ = ["ServeLimits", "create_app", "run_server", "serve", "end_of_text"]

# OpenAI completion fields we do not implement, with the values that ask for nothing from them
_NO_OP_FIELDS = {
    "best_of": [None, 1],
    "suffix": [None],
    "presence_penalty": [0, 0.0],
    "frequency_penalty": [0, 0.0],
    "logit_bias": [None, {}],
}


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for, and the batch size.

    Attributes:
        max_tokens: the largest max_tokens.
        max_prompt_tokens: the longest prompt, in tokens.
        max_logprobs: the largest logprobs (OpenAI allows 5; at most 20).
        max_stop: the most stop strings.
        max_choices: the most prompts x n per request.
        max_batch_size: the most sequences decoded together (more wait).
    """

    max_tokens: int = 1024
    max_prompt_tokens: int = 4096
    max_logprobs: int = 5
    max_stop: int = 16
    max_choices: int = 16
    max_batch_size: int = 8

    def __post_init__(self):
        if not 0 <= self.max_logprobs <= 20:
            raise UserError(f"--max-logprobs must be in [0, 20], got {self.max_logprobs}")


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error"}.get(
            self.status, "server_error"
        )
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def _missing_extra(e: ImportError):
    return RuntimeError(
        f"`decoderlm serve` needs FastAPI and uvicorn: pip install 'decoderlm[serve]' ({e})"
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of text, special tokens' strings (e.g. "<|endoftext|>") taken as their ids,
    as Hugging Face tokenizers and vLLM do. Raises ValueError for unknown characters."""
    if getattr(tokenizer, "special_tokens", None):
        return tokenizer.encode(text, allowed_special="all")
    return tokenizer.encode(text)


def end_of_text(tokenizer) -> tuple[str | None, int | None]:
    """(text, id) of the token served as end of text: the tokenizer's `eot_token` (and its
    special-token string), else a line break "\\n" when it is one token of the vocabulary,
    else (None, None)."""
    eot = getattr(tokenizer, "eot_token", None)
    if eot is not None:
        names = {i: s for s, i in getattr(tokenizer, "special_tokens", {}).items()}
        return names.get(eot) or tokenizer.decode([eot]), int(eot)
    try:
        ids = encode(tokenizer, "\n")
    except ValueError:
        return None, None
    return ("\n", ids[0]) if len(ids) == 1 else (None, None)


def _schemas():
    """The pydantic models of the request bodies."""
    from pydantic import BaseModel, ConfigDict, Field, field_validator

    class Strict(BaseModel):
        # strict: no "yes" for true, no true for 1; extra fields are kept to be checked
        model_config = ConfigDict(strict=True, extra="allow")

        @field_validator("*", mode="before")
        @classmethod
        def _null_is_the_default(cls, value, info):
            """null means the default, as OpenAI's API reference has it for every field
            ("integer or null, defaults to 16", ...); a required field stays required."""
            field = cls.model_fields[info.field_name]
            return field.default if value is None and not field.is_required() else value

    class StreamOptions(BaseModel):  # other options (include_obfuscation, ...) change nothing
        model_config = ConfigDict(strict=True, extra="ignore")
        include_usage: bool = False

    class CompletionRequest(Strict):
        model: str | None = None
        prompt: str | list[str] | list[int] | list[list[int]]
        max_tokens: int = Field(16, ge=0)
        temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
        top_p: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
        top_k: int | None = Field(None, ge=-1)
        n: int = Field(1, ge=1)
        stop: str | list[str] | None = None
        stream: bool = False
        stream_options: StreamOptions | None = None
        seed: int | None = Field(None, ge=0, lt=2**63)
        logprobs: int | None = Field(None, ge=0)
        echo: bool = False
        user: str | None = None  # accepted and ignored

    class TokenizeRequest(Strict):
        model: str | None = None
        prompt: str
        add_special_tokens: bool = True  # no BOS token is ever added here
        return_token_strs: bool = False

    class DetokenizeRequest(Strict):
        model: str | None = None
        tokens: list[int]

    return CompletionRequest, TokenizeRequest, DetokenizeRequest


@dataclass(frozen=True)
class _Served:
    """What one app serves."""

    model: object
    tokenizer: object
    name: str
    limits: ServeLimits
    scheduler: Scheduler
    created: int
    # one prompt scored at a time: a long prompt's logits are large (block_size x vocab_size
    # floats), and the CPU cores are shared with decoding anyway
    scoring: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def _refuse_extra(req, allowed: dict) -> None:
    """ApiError 400 naming the first field outside the schema that asks for something."""
    for name, value in (req.model_extra or {}).items():
        if name not in allowed:
            fields = sorted(set(type(req).model_fields) | set(allowed))
            raise ApiError(400, f"unknown field {name!r}; this server supports {fields}", name)
        if not any(type(value) is type(ok) and value == ok for ok in allowed[name]):
            ok = " or ".join(json.dumps(v) for v in allowed[name])
            raise ApiError(
                400,
                f"{name}={json.dumps(value)} is not supported by this server; omit {name} or "
                f"send {ok}",
                name,
            )


def _check_model(name: str | None, served: _Served) -> None:
    if name not in (None, served.name):
        raise ApiError(
            404,
            f"model {name!r} is not served here; this server serves {served.name!r} "
            f"(GET /v1/models)",
            "model",
            "model_not_found",
        )


def _check_ids(ids: list[int], served: _Served, param: str) -> list[int]:
    bad = [i for i in ids if not 0 <= i < served.vocab_size]
    if bad:
        raise ApiError(
            400,
            f"{param}: token id {bad[0]} is outside this model's vocabulary [0, "
            f"{served.vocab_size})",
            param,
        )
    return ids


def _prompts(req, served: _Served) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) of each prompt of a request."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    if not p or not all(p):
        raise ApiError(400, "prompt must not be empty (nor hold an empty prompt)", "prompt")
    out = []
    for item in p:
        if isinstance(item, str):
            try:
                out.append((encode(served.tokenizer, item), item))
            except ValueError as e:
                raise ApiError(400, f"prompt: {e}", "prompt") from None
        else:
            out.append((_check_ids(item, served, "prompt"), None))
    return out


def _check_completion(req, served: _Served):
    """(prompts as `_prompts` gives them, stop texts) of a valid request; ApiError else."""
    _refuse_extra(req, _NO_OP_FIELDS)
    _check_model(req.model, served)
    lim = served.limits
    if req.max_tokens > lim.max_tokens:
        raise ApiError(
            400,
            f"max_tokens {req.max_tokens} exceeds this server's limit of {lim.max_tokens}",
            "max_tokens",
        )
    if req.logprobs is not None and req.logprobs > lim.max_logprobs:
        raise ApiError(
            400,
            f"logprobs {req.logprobs} exceeds this server's limit of {lim.max_logprobs}",
            "logprobs",
        )
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens 0 asks for nothing; it needs echo: true", "max_tokens")
    prompts = _prompts(req, served)
    if len(prompts) * req.n > lim.max_choices:
        raise ApiError(
            400,
            f"{len(prompts)} prompts x n={req.n} completions; at most "
            f"{lim.max_choices} per request",
            "n",
        )
    longest = max(len(ids) for ids, _ in prompts)
    if longest > lim.max_prompt_tokens:
        raise ApiError(
            400,
            f"a prompt has {longest} tokens; this server accepts at most {lim.max_prompt_tokens}",
            "prompt",
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > lim.max_stop:
        raise ApiError(
            400, f"{len(stops)} stop sequences; this server accepts at most {lim.max_stop}", "stop"
        )
    return prompts, stops


class _Logprobs:
    """The legacy logprobs object of one choice, built as tokens arrive."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer, self.offset = tokenizer, offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, token_id: int, logprob: float | None, top) -> None:
        """One token; top: (id, logprob) pairs, or None (no entry: the first prompt token)."""
        text = self.tokenizer.decode([token_id])
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        if top is None:
            self.top_logprobs.append(None)
        else:
            entry = {self.tokenizer.decode([i]): v for i, v in top}
            entry.setdefault(text, logprob)
            self.top_logprobs.append(entry)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def take(self) -> dict:
        """The entries added since the last take, as OpenAI's object."""
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def _score_prompt(served: _Served, ids: list[int], k: int, out: _Logprobs) -> None:
    """Add the prompt's tokens to `out`, each scored given those before it."""
    lp, top_v, top_i = token_logprobs(served.model, ids, k, served.vocab_size)
    out.add(ids[0], None, None)
    for j, token in enumerate(ids[1:]):
        out.add(token, float(lp[j]), zip(top_i[j].tolist(), top_v[j].tolist(), strict=True))


async def _choice(req, served: _Served, ids: list[int], text: str | None, seed, stops, request):
    """Yield a choice's pieces (text, logprobs object or None, finish_reason, n generated
    tokens) as they become final; echo's prompt text comes first."""
    from fastapi.concurrency import run_in_threadpool

    logs = None if req.logprobs is None else _Logprobs(served.tokenizer)
    if req.echo:
        text = served.tokenizer.decode(ids) if text is None else text
        if logs is not None:
            async with served.scoring:
                await run_in_threadpool(_score_prompt, served, ids, req.logprobs, logs)
            logs.offset = len(text)
        yield text, logs and logs.take(), "length" if req.max_tokens == 0 else None, 0
    if req.max_tokens == 0:
        return
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    top_k = req.top_k if req.top_k not in (None, -1, 0) else None
    seq = Sequence(
        ids,
        req.max_tokens,
        lambda item: loop.call_soon_threadsafe(queue.put_nowait, item),
        req.temperature,
        top_k,
        req.top_p if req.top_p < 1.0 else None,
        seed,
        req.logprobs,
    )
    served.scheduler.submit(seq)
    stream, made = TextStream(served.tokenizer, stops), 0
    try:
        async for items in _arrivals(queue, request):
            delta, finish = "", None
            for item in items:
                if isinstance(item, Exception):
                    raise ApiError(500, f"generation failed: {item}") from item
                if item is None:
                    delta, finish = delta + stream.rest(), "length"
                    break
                made += 1
                delta += stream.push(item.id)
                if logs is not None:
                    logs.add(item.id, item.logprob, item.top)
                if stream.stopped:
                    finish = "stop"
                    break
            if delta or finish:
                yield delta, logs and logs.take(), finish, made
            if finish:
                return
    finally:
        seq.cancel()


async def _arrivals(queue: asyncio.Queue, request):
    """Lists of the items that have arrived in `queue` (all of them at each wake-up, so a
    busy server sends fewer, larger pieces); ends when the client has gone (checked when
    `request` is given: a stream is stopped by Starlette instead)."""
    while True:
        try:
            async with asyncio.timeout(0.5):
                items = [await queue.get()]
        except TimeoutError:  # queued, or a slow step
            items = []
        while not queue.empty():
            items.append(queue.get_nowait())
        if request is not None and await request.is_disconnected():
            return
        if items:
            yield items


def _choices(req, served: _Served, prompts, stops, request):
    """(index, piece generator) of every prompt x n, index = prompt * n + i."""
    for p, (ids, text) in enumerate(prompts):
        for i in range(req.n):
            seed = None if req.seed is None else req.seed + i
            yield p * req.n + i, _choice(req, served, ids, text, seed, stops, request)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _complete(head: dict, req, choices, prompt_tokens: int, request):
    """The whole completion (every choice generating at once), or None once the client has
    gone."""

    async def collect(index, pieces):
        text, logs, finish, made = "", None, None, 0
        async for piece in pieces:
            text += piece[0]
            if piece[1] is not None:
                logs = piece[1] if logs is None else {k: logs[k] + piece[1][k] for k in logs}
            finish, made = piece[2], piece[3]
        if req.logprobs is not None and logs is None:
            logs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return {"text": text, "index": index, "logprobs": logs, "finish_reason": finish}, made

    tasks = [asyncio.ensure_future(collect(i, pieces)) for i, pieces in choices]
    try:
        results = await asyncio.gather(*tasks)
    finally:  # one choice failed: the others stop generating too
        for task in tasks:
            task.cancel()
    if await request.is_disconnected():
        return None
    return {
        **head,
        "choices": [c for c, _ in results],
        "usage": _usage(prompt_tokens, sum(made for _, made in results)),
    }


async def _events(head: dict, req, choices, prompt_tokens: int):
    """Server-Sent Events of a streamed completion: one chunk per piece of text, a usage
    chunk when asked for, then [DONE]. The choices generate at once and stream in order."""
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    queues = []
    for index, pieces in choices:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(pieces=pieces, queue=queue):
            try:
                async for piece in pieces:
                    await queue.put(piece)
            except ApiError as e:
                await queue.put(e)
            await queue.put(None)

        queues.append((index, queue, asyncio.ensure_future(pump())))
    completion_tokens = 0
    try:
        for index, queue, _ in queues:
            made = 0
            while (piece := await queue.get()) is not None:
                if isinstance(piece, ApiError):
                    yield f"data: {json.dumps(piece.body())}\n\n"
                    continue
                delta, logs, finish, made = piece
                choice = {"text": delta, "index": index, "logprobs": logs, "finish_reason": finish}
                yield f"data: {json.dumps({**head, 'choices': [choice], **extra})}\n\n"
            completion_tokens += made
        if include_usage:
            usage = _usage(prompt_tokens, completion_tokens)
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for _, _, task in queues:
            task.cancel()


def _error_handlers(app) -> None:
    """Every error as OpenAI's {"error": {...}}."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def answer(e: ApiError):
        return JSONResponse(status_code=e.status, content=e.body())

    @app.exception_handler(ApiError)
    def api_error(request, exc: ApiError):
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    def invalid_request(request, exc: RequestValidationError):
        return answer(_validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    def http_error(request, exc: HTTPException):
        return answer(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    def server_error(request, exc: Exception):
        return answer(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


_PROMPT_TYPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _validation_error(errors) -> ApiError:
    """One clear ApiError 400 from pydantic's errors: the field, and what is wrong with it."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    kind, msg = first.get("type", ""), first.get("msg", "invalid request")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {msg}")
    if not loc:
        return ApiError(
            400, "the body must be a JSON object (send it with Content-Type: application/json)"
        )
    param = loc[0]
    if param == "prompt" and kind != "missing":
        return ApiError(400, f"prompt must be {_PROMPT_TYPES}", "prompt")
    where = ".".join(loc)
    return ApiError(400, f"{where}: {msg}", param)


def create_app(
    model, tokenizer, model_name: str, limits: ServeLimits = ServeLimits(), compile: bool = False
):
    """Build the FastAPI app serving `model` with `tokenizer` under the id `model_name`, with
    a `Scheduler` of limits.max_batch_size (stopped when the app shuts down); compile=True
    decodes with the torch.compile'd step of `generate`.

    Raises:
        RuntimeError: FastAPI is not installed.
    """
    try:
        from fastapi import FastAPI
    except ImportError as e:
        raise _missing_extra(e) from None
    model.eval()
    step = None
    if compile:
        compiled = _decode_step(True)
        step = lambda m, idx, cache, pos: compiled(m, idx, cache, pos, None)  # noqa: E731
    scheduler = Scheduler(model, tokenizer.vocab_size, limits.max_batch_size, step)
    served = _Served(model, tokenizer, model_name, limits, scheduler, int(time.time()))

    async def lifespan(app):
        yield
        scheduler.close()

    app = FastAPI(title="decoderlm", version="0.1.0", lifespan=lifespan)
    app.state.scheduler = scheduler
    _error_handlers(app)
    _routes(app, served)
    return app


def _model_card(served: _Served) -> dict:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "decoderlm",
        "max_model_len": served.model.config.max_positions,
    }


def _routes(app, served: _Served) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    CompletionRequest, TokenizeRequest, DetokenizeRequest = _schemas()
    tokenizer, max_len = served.tokenizer, served.model.config.max_positions

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{model_id:path}")
    def model_card(model_id: str):
        _check_model(model_id, served)
        return _model_card(served)

    @app.get("/tokenizer_info")
    def tokenizer_info():
        eos, eos_id = end_of_text(tokenizer)
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "eos_token": eos,
            "eos_token_id": eos_id,
            "bos_token": None,
            "pad_token": None,
            "unk_token": getattr(tokenizer, "unk_token", None),
            "model_max_length": max_len,
            "chat_template": None,
        }

    @app.post("/tokenize")
    def tokenize(req: TokenizeRequest):
        _refuse_extra(req, {})
        _check_model(req.model, served)
        try:
            ids = encode(tokenizer, req.prompt)
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}", "prompt") from None
        strs = [tokenizer.decode([i]) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    def detokenize(req: DetokenizeRequest):
        _refuse_extra(req, {})
        _check_model(req.model, served)
        return {"prompt": tokenizer.decode(_check_ids(req.tokens, served, "tokens"))}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompts, stops = _check_completion(req, served)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served.name,
        }
        choices = list(_choices(req, served, prompts, stops, None if req.stream else request))
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if req.stream:
            events = _events(head, req, choices, prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream")
        body = await _complete(head, req, choices, prompt_tokens, request)
        return JSONResponse(body) if body is not None else JSONResponse({}, status_code=499)


def run_server(
    model,
    tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServeLimits = ServeLimits(),
    compile: bool = False,
) -> None:
    """Run the API with uvicorn until interrupted; with compile=True, the decoding step is
    compiled before the server listens.

    Raises:
        OSError: the address cannot be listened on (one line).
    """
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
    app = create_app(model, tokenizer, model_name, limits, compile)
    if compile:
        print("compiling the decoding step (once; 10-30 s)...", flush=True)
        _warm_up(app.state.scheduler)
    print(f"serving {model_name} on http://{host}:{port} (POST /v1/completions)")
    uvicorn.run(app, host=host, port=port, log_level="info")


def serve(
    run: NotEmptyStr | None = None,
    hf: NotEmptyStr | None = None,
    device: str = "cpu",
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: NotEmptyStr | None = None,
    max_tokens_limit: PositiveInt = 1024,
    max_prompt_tokens: PositiveInt = 4096,
    max_logprobs: NonNegativeInt = 5,
    max_stop: NonNegativeInt = 16,
    max_batch_size: PositiveInt = 8,
    compile: bool = False,
) -> int:
    """An OpenAI-style HTTP API for a model.

    Serve POST /v1/completions (with echo and logprobs), GET /v1/models, the tokenizer
    endpoints POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's shapes, which
    lm-evaluation-harness reads) and GET /health; concurrent requests are decoded in one batch
    (needs the [serve] extra: FastAPI and uvicorn). A prompt's <|endoftext|> is the
    end-of-text token where the vocabulary has one, as in `decoderlm sample`.

    Args:
        run: a run directory (give --run or --hf).
        hf: a Hugging Face GPT-2 checkpoint directory (config.json + model.safetensors);
            GPT-2 BPE tokenizer.
        device: cpu, cuda, ...
        host: the address to listen on.
        port: the TCP port to listen on, in [1, 65536).
        served_model_name: the model id clients send (default: the directory's name).
        max_tokens_limit: the largest max_tokens a request may ask for.
        max_prompt_tokens: the longest prompt accepted, in tokens.
        max_logprobs: the largest logprobs a request may ask for, at most 20.
        max_stop: the most stop strings in a request.
        max_batch_size: the most sequences decoded together; more requests wait.
        compile: decode with torch.compile: faster per token after a one-time compile
            at start (needs a C++ compiler on the CPU).

    Returns:
        0, the exit status, once the server stops.

    Raises:
        UserError / MissingFileError: a bad port or limit (before the model is loaded), not
            one of run and hf, missing or damaged files.
        OSError: the address cannot be listened on.
    """
    if not 1 <= port < 65536:
        raise UserError(f"--port must be in [1, 65536), got {port}")
    limits = ServeLimits(
        max_tokens=max_tokens_limit,
        max_prompt_tokens=max_prompt_tokens,
        max_logprobs=max_logprobs,
        max_stop=max_stop,
        max_batch_size=max_batch_size,
    )
    model, tokenizer = load_model_and_tokenizer(run, hf, device)
    name = served_model_name or Path(run or hf).resolve().name
    run_server(model, tokenizer, name, host, port, limits, compile)
    return 0


def _warm_up(scheduler: Scheduler) -> None:
    """Decode a few tokens of two sequences at once, so the compiled steps exist."""
    import threading

    done = threading.Semaphore(0)

    def emit(item) -> None:
        if item is None or isinstance(item, Exception):
            done.release()

    for prompt in ([0], [0, 0]):
        scheduler.submit(Sequence(prompt, 3, emit, 0.0))
    done.acquire()
    done.acquire()
