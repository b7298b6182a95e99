"""The serving logic of the HTTP API: a request model in, checks, the scheduler's (or the
scoring's) work, a response model out. No HTTP routing here (`routes` calls it).

A `Serving` serves one model and tokenizer under one id, within `ServeLimits`. Generation is
batched across requests by a `decoderlm.generation.scheduler.Scheduler` (continuous batching,
at most max_batch_size sequences per forward pass, the rest queued); a request whose client
disconnects leaves the batch at the next step. At most max_batch_size + max_queue choices are
in progress at once: a request beyond that is refused with 503 and Retry-After (unless
nothing is in progress, so a large request can always run alone). A request still going
request_timeout seconds after it arrived ends each unfinished choice with the text so far and
finish_reason "length", as max_tokens does. Every error is an `ApiError`: OpenAI's
{"error": {"message", "type", "param", "code"}} with status 400 (bad request; param names
the field), 404 (unknown model or path), 503 (busy) or 500 (401 and 413 come from `guard`).

A choice ends at the tokenizer's end-of-text token (`eot_token`, GPT-2's "<|endoftext|>"),
finish_reason "stop", unless the request sets ignore_eos; the token counts in usage but is
not in the text or the logprobs. A char or byte model without one stops only at stop texts.

logprobs (legacy completions, as OpenAI and vLLM): {"tokens", "token_logprobs", "top_logprobs",
"text_offset"} for the tokens of the choice's text (`protocol.CompletionLogprobs`). With echo
the prompt's tokens come first, and max_tokens 0 scores the prompt only. A prompt longer than
the context (block_size) is scored as `decoderlm eval` scores a text: non-overlapping windows of
block_size, the tail scored in a last window ending at the last token
(`decoderlm.evaluate.token_logprobs`). text_offset[i] is where token i starts in the choice's
text, in characters (Python str indices, as OpenAI's API counts them); a token that starts
inside a multi-byte UTF-8 character (a GPT-2 BPE piece holding part of one) gets the offset
of that character, as tiktoken's `decode_with_offsets` defines it. `tokens[i]` is the token
decoded alone (U+FFFD for an incomplete character, as vLLM sends).

End of text (GET /tokenizer_info's eos_token, which lm-evaluation-harness uses as the prefix
of every document it scores and appends to its stop strings): the tokenizer's end-of-text
token (GPT-2: "<|endoftext|>" = 50256); a char or byte model trained without one reports
"\\n", its line break, so documents are scored as if they started on a new line (pass
lm-eval's `eos_string=...` to stop generations at another text).
"""

import asyncio
import json
import math
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ..errors import UserError
from ..evaluate import token_logprobs
from ..generation.generate import TextStream
from ..generation.params import SamplingParams
from ..generation.scheduler import Scheduler, Sequence
from .protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    Usage,
)

__all__ = [
    "NO_OP_FIELDS",
    "ApiError",
    "CheckedCompletion",
    "Piece",
    "ServeLimits",
    "Serving",
    "encode",
    "end_of_text",
    "validation_error",
]

# OpenAI completion fields not implemented here, with the values that ask for nothing from them
NO_OP_FIELDS = {
    "best_of": [None, 1],
    "suffix": [None],
    "presence_penalty": [0, 0.0],
    "frequency_penalty": [0, 0.0],
    "logit_bias": [None, {}],
}

_PROMPT_TYPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"

# an async function telling whether the client has gone
Disconnected = Callable[[], Awaitable[bool]]


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
        max_queue: the most choices waiting beyond the batch (more: 503).
        request_timeout: seconds a request may take from its arrival (None: no limit).
        max_body_bytes: the largest request body, in bytes (more: 413; see `guard`).

    Raises:
        UserError: max_logprobs outside [0, 20].
    """

    max_tokens: int = 1024
    max_prompt_tokens: int = 4096
    max_logprobs: int = 5
    max_stop: int = 16
    max_choices: int = 16
    max_batch_size: int = 8
    max_queue: int = 64
    request_timeout: float | None = 600.0
    max_body_bytes: int = 4 * 2**20

    def __post_init__(self):
        if not 0 <= self.max_logprobs <= 20:
            raise UserError(f"--max-logprobs must be in [0, 20], got {self.max_logprobs}")


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {...}} (`protocol.ErrorResponse`) with an HTTP
    status.

    Args:
        status: the HTTP status (400, 404, 500, ...).
        message: one line naming the problem and what to do.
        param: the request field at fault, if one is.
        code: a machine-readable code ("model_not_found"), if any.
        headers: HTTP headers of the answer (Retry-After, WWW-Authenticate), if any.
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, code=None, headers=None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def response(self) -> ErrorResponse:
        """The error body."""
        kind = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorResponse(error=info)

    def body(self) -> dict:
        """The error body as JSON-ready data."""
        return self.response().model_dump()


def validation_error(errors: list[dict]) -> ApiError:
    """One clear ApiError 400 from pydantic's errors (a request body that does not fit its
    model): the field, and what is wrong with it."""
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


def _refuse_extra(req, allowed: dict) -> None:
    """ApiError 400 naming the first field outside the model that asks for something."""
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


def _check_limits(req: CompletionRequest, limits: ServeLimits) -> None:
    """ApiError 400 for a completion request's settings beyond the limits or that contradict
    one another (the prompts are checked by `Serving.check_completion`)."""
    if req.max_tokens > limits.max_tokens:
        raise ApiError(
            400,
            f"max_tokens {req.max_tokens} exceeds this server's limit of {limits.max_tokens}",
            "max_tokens",
        )
    if req.logprobs is not None and req.logprobs > limits.max_logprobs:
        raise ApiError(
            400,
            f"logprobs {req.logprobs} exceeds this server's limit of {limits.max_logprobs}",
            "logprobs",
        )
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens 0 asks for nothing; it needs echo: true", "max_tokens")


def _token_bytes(tokenizer, token_id: int) -> bytes:
    """The UTF-8 bytes token_id stands for (a GPT-2 BPE piece or a byte may hold part of a
    character; other tokens are whole characters)."""
    encoding = getattr(tokenizer, "encoding", None)  # tiktoken's, for GPT-2 BPE
    if encoding is not None:
        return encoding.decode_single_token_bytes(token_id)
    if tokenizer.kind == "byte" and token_id < 256:
        return bytes([token_id])
    return tokenizer.decode([token_id]).encode("utf-8")


def _is_continuation(byte: int) -> bool:
    """Whether a UTF-8 byte continues a character (0b10xxxxxx) rather than starting one."""
    return 0x80 <= byte < 0xC0


class _LogprobsBuilder:
    """The legacy logprobs object of one choice, built as tokens arrive; `offset` is the
    number of characters begun so far (the next token's text_offset, see the module)."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer, self.offset = tokenizer, offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, token_id: int, logprob: float | None, top) -> None:
        """One token; top: (id, logprob) pairs, or None (no entry: the first prompt token)."""
        text = self.tokenizer.decode([token_id])
        raw = _token_bytes(self.tokenizer, token_id)
        inside = bool(raw) and _is_continuation(raw[0])  # in a character begun before
        self.text_offset.append(max(self.offset - inside, 0))
        self.offset += sum(1 for b in raw if not _is_continuation(b))
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        if top is None:
            self.top_logprobs.append(None)
        else:
            entry = {self.tokenizer.decode([i]): v for i, v in top}
            entry.setdefault(text, logprob)
            self.top_logprobs.append(entry)

    def take(self) -> CompletionLogprobs:
        """The entries added since the last take."""
        out = CompletionLogprobs(
            tokens=self.tokens,
            token_logprobs=self.token_logprobs,
            top_logprobs=self.top_logprobs,
            text_offset=self.text_offset,
        )
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


@dataclass(frozen=True)
class Piece:
    """A part of a choice that has become final.

    Attributes:
        text: the new text.
        logprobs: the new text's tokens' logprobs (None unless asked for).
        finish_reason: "stop", "length", or None while the choice goes on.
        made: the tokens generated for the choice so far.
    """

    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    made: int


class _Slots:
    """The choices in progress (generating, scored or waiting), against a capacity."""

    def __init__(self, capacity: int):
        self.capacity, self.taken = capacity, 0

    def take(self, count: int) -> Callable[[], None]:
        """Take `count` slots; returns the function giving them back (once, however often it
        is called). ApiError 503 (Retry-After: 1) when they do not fit and some are taken."""
        if self.taken and self.taken + count > self.capacity:
            raise ApiError(
                503,
                f"the server is busy: {self.taken} choices are in progress or queued (at most "
                f"{self.capacity}: --max-batch-size + --max-queue); retry in a second",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        self.taken += count
        given = []

        def give_back() -> None:
            if not given:
                given.append(True)
                self.taken -= count

        return give_back


@dataclass(frozen=True)
class CheckedCompletion:
    """A completion request that passed the checks, with its prompts and stop texts.

    Attributes:
        request: the request.
        prompts: (token ids, text or None for a prompt given as ids) of each prompt.
        stops: the stop texts.
        id: the completion's id ("cmpl-...").
        created: when it was answered (Unix time, seconds).
        deadline: when its unfinished choices end (time.monotonic(); inf: never).
        release: gives back its slots of the server's queue (also called once it is freed).
    """

    request: CompletionRequest
    prompts: list[tuple[list[int], str | None]]
    stops: list[str]
    id: str
    created: int
    deadline: float = math.inf
    release: Callable[[], None] = lambda: None

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every prompt."""
        return sum(len(ids) for ids, _ in self.prompts)


def _joined(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    """One logprobs object of the parts' entries, in order (empty lists for no parts)."""
    fields = CompletionLogprobs.model_fields
    return CompletionLogprobs(
        **{k: [x for part in parts for x in getattr(part, k)] for k in fields}
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


async def _arrivals(queue: asyncio.Queue, disconnected: Disconnected | None, deadline: float):
    """Lists of the items that have arrived in `queue` (all of them at each wake-up, so a
    busy server sends fewer, larger pieces); ends when the client has gone (checked when
    `disconnected` is given: a stream is stopped by the server instead) or at `deadline`
    (time.monotonic())."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            async with asyncio.timeout(min(0.5, left)):
                items = [await queue.get()]
        except TimeoutError:  # queued, or a slow step
            items = []
        while not queue.empty():
            items.append(queue.get_nowait())
        if disconnected is not None and await disconnected():
            return
        if items:
            yield items


class Serving:
    """The API's work for one model: each method takes a request model (or nothing) and
    returns a response model, raising `ApiError` for a request it cannot answer.

    Args:
        model: the DecoderLM (put in eval mode).
        tokenizer: its tokenizer (tokenizer.vocab_size ids are sampled and scored).
        name: the model id clients send.
        limits: what a request may ask for, and the batch size.
        compile: decode with the torch.compile'd step (`generation.generate.decode_step`).

    Attributes:
        scheduler: the `Scheduler` decoding every request's sequences (stopped by `close`).
    """

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        limits: ServeLimits = ServeLimits(),
        compile: bool = False,
    ):
        model.eval()
        self.model, self.tokenizer, self.name, self.limits = model, tokenizer, name, limits
        self.created = int(time.time())
        self.scheduler = Scheduler(model, tokenizer.vocab_size, limits.max_batch_size)
        self._slots = _Slots(limits.max_batch_size + limits.max_queue)
        # one prompt scored at a time: a long prompt's logits are large (block_size x
        # vocab_size floats), and the CPU cores are shared with decoding anyway
        self._scoring = asyncio.Semaphore(1)

    @property
    def max_model_len(self) -> int:
        """The model's context length, in tokens."""
        return self.model.config.max_positions

    def close(self) -> None:
        """Stop the scheduler."""
        self.scheduler.close()

    def warm_up(self) -> None:
        """Decode a few tokens of two sequences at once, so the compiled steps exist."""
        done = threading.Semaphore(0)

        def emit(item) -> None:
            if item is None or isinstance(item, Exception):
                done.release()

        for prompt in ([0], [0, 0]):
            self.scheduler.submit(Sequence(prompt, SamplingParams(3, temperature=0.0), emit))
        done.acquire()
        done.acquire()

    def health(self) -> HealthResponse:
        """GET /health."""
        return HealthResponse()

    def check_model(self, name: str | None) -> None:
        """ApiError 404 unless `name` is None or the served model's id."""
        if name not in (None, self.name):
            raise ApiError(
                404,
                f"model {name!r} is not served here; this server serves {self.name!r} "
                f"(GET /v1/models)",
                "model",
                "model_not_found",
            )

    def model_card(self, model_id: str | None = None) -> ModelCard:
        """GET /v1/models/{model_id}; ApiError 404 for another id."""
        self.check_model(model_id)
        return ModelCard(id=self.name, created=self.created, max_model_len=self.max_model_len)

    def models(self) -> ModelList:
        """GET /v1/models."""
        return ModelList(data=[self.model_card()])

    def tokenizer_info(self) -> TokenizerInfo:
        """GET /tokenizer_info."""
        tok = self.tokenizer
        eos, eos_id = end_of_text(tok)
        return TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            kind=tok.kind,
            vocab_size=tok.vocab_size,
            eos_token=eos,
            eos_token_id=eos_id,
            bos_token=None,
            pad_token=None,
            unk_token=getattr(tok, "unk_token", None),
            model_max_length=self.max_model_len,
            chat_template=None,
        )

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """POST /tokenize; ApiError 400 for a text the vocabulary cannot encode."""
        _refuse_extra(req, {})
        self.check_model(req.model)
        try:
            ids = encode(self.tokenizer, req.prompt)
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}", "prompt") from None
        strs = [self.tokenizer.decode([i]) for i in ids] if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize; ApiError 400 for an id outside the vocabulary."""
        _refuse_extra(req, {})
        self.check_model(req.model)
        return DetokenizeResponse(prompt=self.tokenizer.decode(self._check_ids(req.tokens)))

    def _check_ids(self, ids: list[int], param: str = "tokens") -> list[int]:
        vocab_size = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ApiError(
                400,
                f"{param}: token id {bad[0]} is outside this model's vocabulary [0, {vocab_size})",
                param,
            )
        return ids

    def _prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """(token ids, text or None) of each prompt of a request's `prompt` field."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or not all(prompt):
            raise ApiError(400, "prompt must not be empty (nor hold an empty prompt)", "prompt")
        out = []
        for item in prompt:
            if isinstance(item, str):
                try:
                    out.append((encode(self.tokenizer, item), item))
                except ValueError as e:
                    raise ApiError(400, f"prompt: {e}", "prompt") from None
            else:
                out.append((self._check_ids(item, "prompt"), None))
        return out

    def check_completion(self, req: CompletionRequest) -> CheckedCompletion:
        """The request with its prompts tokenized and its stop texts; ApiError 400 (404 for
        another model) for one that cannot be answered."""
        _refuse_extra(req, NO_OP_FIELDS)
        self.check_model(req.model)
        lim = self.limits
        _check_limits(req, lim)
        prompts = self._prompts(req.prompt)
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
                f"a prompt has {longest} tokens; this server accepts at most "
                f"{lim.max_prompt_tokens}",
                "prompt",
            )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > lim.max_stop:
            raise ApiError(
                400,
                f"{len(stops)} stop sequences; this server accepts at most {lim.max_stop}",
                "stop",
            )
        timeout = lim.request_timeout
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        release = self._slots.take(len(prompts) * req.n)
        job = CheckedCompletion(
            req, prompts, stops, f"cmpl-{uuid.uuid4().hex}", int(time.time()), deadline, release
        )
        weakref.finalize(job, release)  # a response never sent still gives its slots back
        return job

    def _score_prompt(self, ids: list[int], k: int, out: _LogprobsBuilder) -> None:
        """Add the prompt's tokens to `out`, each scored given those before it."""
        lp, top_v, top_i = token_logprobs(self.model, ids, k, self.tokenizer.vocab_size)
        out.add(ids[0], None, None)
        for j, token in enumerate(ids[1:]):
            out.add(token, float(lp[j]), zip(top_i[j].tolist(), top_v[j].tolist(), strict=True))

    async def _echo(self, req: CompletionRequest, ids, text, logs) -> Piece:
        """The prompt's piece of an echoed choice (scored into `logs` when asked)."""
        text = self.tokenizer.decode(ids) if text is None else text
        if logs is not None:
            async with self._scoring:
                await asyncio.to_thread(self._score_prompt, ids, req.logprobs, logs)
            logs.offset = len(text)
        finish = "length" if req.max_tokens == 0 else None
        return Piece(text, logs and logs.take(), finish, 0)

    def _submit(
        self, req: CompletionRequest, ids: list[int], seed
    ) -> tuple[Sequence, asyncio.Queue]:
        """Queue a sequence for the scheduler; its tokens arrive in the queue returned."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        seq = Sequence(
            ids,
            req.to_sampling_params(self.tokenizer.eot_token, seed),
            lambda item: loop.call_soon_threadsafe(queue.put_nowait, item),
        )
        self.scheduler.submit(seq)
        return seq, queue

    async def _choice(
        self, job: CheckedCompletion, ids, text, seed, disconnected: Disconnected | None
    ) -> AsyncIterator[Piece]:
        """Yield a choice's pieces as they become final; echo's prompt text comes first."""
        req = job.request
        logs = None if req.logprobs is None else _LogprobsBuilder(self.tokenizer)
        if req.echo:
            yield await self._echo(req, ids, text, logs)
        if req.max_tokens == 0:
            return
        seq, queue = self._submit(req, ids, seed)
        stream, made = TextStream(self.tokenizer, job.stops), 0
        try:
            async for items in _arrivals(queue, disconnected, job.deadline):
                delta, finish = "", None
                for item in items:
                    if isinstance(item, Exception):
                        raise ApiError(500, f"generation failed: {item}") from item
                    if item is None:
                        delta, finish = delta + stream.rest(), "length"
                        break
                    made += 1
                    if item.id == seq.stop_id:  # end of text: not part of the text
                        delta, finish = delta + stream.rest(), "stop"
                        break
                    delta += stream.push(item.id)
                    if logs is not None:
                        logs.add(item.id, item.logprob, item.top)
                    if stream.stopped:
                        finish = "stop"
                        break
                if delta or finish:
                    yield Piece(delta, logs and logs.take(), finish, made)
                if finish:
                    return
            if time.monotonic() >= job.deadline:  # the time limit: what there is, as length
                yield Piece(stream.rest(), logs and logs.take(), "length", made)
        finally:
            seq.cancel()

    def _choices(self, job: CheckedCompletion, disconnected: Disconnected | None):
        """(index, piece generator) of every prompt x n, index = prompt * n + i."""
        n, seed = job.request.n, job.request.seed
        for p, (ids, text) in enumerate(job.prompts):
            for i in range(n):
                choice_seed = None if seed is None else seed + i
                yield p * n + i, self._choice(job, ids, text, choice_seed, disconnected)

    async def complete(
        self, job: CheckedCompletion, disconnected: Disconnected
    ) -> CompletionResponse | None:
        """The whole completion (every choice generating at once), or None once the client
        has gone (`disconnected()` is true)."""
        want_logprobs = job.request.logprobs is not None

        async def collect(index, pieces) -> tuple[CompletionChoice, int]:
            text, logs, finish, made = "", [], None, 0
            async for piece in pieces:
                text += piece.text
                if piece.logprobs is not None:
                    logs.append(piece.logprobs)
                finish, made = piece.finish_reason, piece.made
            logprobs = _joined(logs) if want_logprobs else None
            choice = CompletionChoice(
                text=text, index=index, logprobs=logprobs, finish_reason=finish
            )
            return choice, made

        tasks = [asyncio.ensure_future(collect(i, p)) for i, p in self._choices(job, disconnected)]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # one choice failed: the others stop generating too
            for task in tasks:
                task.cancel()
            job.release()
        if await disconnected():
            return None
        return CompletionResponse(
            id=job.id,
            created=job.created,
            model=self.name,
            choices=[c for c, _ in results],
            usage=_usage(job.prompt_tokens, sum(made for _, made in results)),
        )

    async def stream(self, job: CheckedCompletion) -> AsyncIterator[str]:
        """Server-Sent Events of a streamed completion: one chunk per piece of text (an error
        body in place of a failed choice's rest), a usage chunk when asked for, then [DONE].
        The choices generate at once and stream in index order."""
        options = job.request.stream_options
        include_usage = options is not None and options.include_usage

        def event(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            chunk = CompletionStreamResponse(
                id=job.id, created=job.created, model=self.name, choices=choices, usage=usage
            )
            data = chunk.model_dump(exclude=None if include_usage else {"usage"})
            return f"data: {json.dumps(data)}\n\n"

        queues = [(index, _pumped(pieces)) for index, pieces in self._choices(job, None)]
        completion_tokens = 0
        try:
            for index, (queue, _) in queues:
                made = 0
                while (piece := await queue.get()) is not None:
                    if isinstance(piece, ApiError):
                        yield f"data: {json.dumps(piece.body())}\n\n"
                        continue
                    made = piece.made
                    choice = CompletionChoice(
                        text=piece.text,
                        index=index,
                        logprobs=piece.logprobs,
                        finish_reason=piece.finish_reason,
                    )
                    yield event([choice])
                completion_tokens += made
            if include_usage:
                yield event([], _usage(job.prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            for _, (_, task) in queues:
                task.cancel()
            job.release()


def _pumped(pieces: AsyncIterator[Piece]) -> tuple[asyncio.Queue, asyncio.Task]:
    """A queue that a task fills with the pieces (an ApiError in place of the rest of a
    failed choice), then None."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump():
        try:
            async for piece in pieces:
                await queue.put(piece)
        except ApiError as e:
            await queue.put(e)
        await queue.put(None)

    return queue, asyncio.ensure_future(pump())
