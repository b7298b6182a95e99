"""The HTTP routes of the API: each takes its request model, calls the app's
`serving_models.ServingModels` (`app.state.serving_models`) or
`serving_completion.ServingCompletion` (`app.state.serving_completion`) and returns its
response model (`protocol`). Needs FastAPI.

    POST /v1/completions     OpenAI's legacy completions -> CompletionResponse, or (stream:
                             true) Server-Sent Events: "data: {CompletionStreamResponse}"
                             lines, then "data: [DONE]"
    POST /v1/chat/completions OpenAI's chat completions -> ChatCompletionResponse, or
                             streamed: "data: {ChatCompletionStreamResponse}" lines, then
                             "data: [DONE]" (`serving_chat`; app.state.serving_chat)
    GET  /v1/models          the one model served; GET /v1/models/{id}
    POST /tokenize           {"prompt": text} -> {"count", "max_model_len", "tokens", ...}
    POST /detokenize         {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info     eos_token (+ eos_token_id), bos/pad/unk tokens, model_max_length
    GET  /health             {"status": "ok"}

With API keys (`guard`), every route but /health answers 401 to a request without one; a body
over the size limit is 413; a completion beyond the queue is 503 with Retry-After.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' parameter types
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_models import ServingModels

__all__ = ["router", "STREAM_CHUNK", "CHAT_STREAM_CHUNK"]

router = APIRouter()

# the routes' error answers, for the OpenAPI schema: any route can fail (500) or, with API
# keys, refuse a request without one (401; /health never does), and those that take a request
# can refuse it (400), a body too large (413), or not serve the model it names (404)
_FAILED = {500: {"model": ErrorResponse, "description": "the server failed"}}
_KEYED = {401: {"model": ErrorResponse, "description": "no API key or a wrong one"}, **_FAILED}
_ERRORS = {
    400: {"model": ErrorResponse, "description": "a bad request (param names the field)"},
    404: {"model": ErrorResponse, "description": "another model than the one served"},
    413: {"model": ErrorResponse, "description": "the body is over the size limit"},
    **_KEYED,
}
_BUSY = {503: {"model": ErrorResponse, "description": "the queue is full (see Retry-After)"}}
# the schema component of a streamed completion's chunks (added to the schema by the app)
STREAM_CHUNK = "CompletionStreamResponse"
CHAT_STREAM_CHUNK = "ChatCompletionStreamResponse"


def _streamed(chunk: str) -> dict:
    return {
        "description": "the answer; with stream: true, Server-Sent Events of chunks",
        "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk}"}}},
    }


def _models(request: Request) -> ServingModels:
    return request.app.state.serving_models


def _completion(request: Request) -> ServingCompletion:
    return request.app.state.serving_completion


@router.get("/health", response_model=HealthResponse, responses=_FAILED)
def health(request: Request):
    """Whether the server answers."""
    return _models(request).health()


@router.get("/v1/models", response_model=ModelList, responses=_KEYED)
def models(request: Request):
    """The model served (a list of one)."""
    return _models(request).models()


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
def model_card(model_id: str, request: Request):
    """The model served, if model_id is its id."""
    return _models(request).model_card(model_id)


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses=_KEYED)
def tokenizer_info(request: Request):
    """The tokenizer's end-of-text and special tokens, and the context length."""
    return _models(request).tokenizer_info()


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
def tokenize(req: TokenizeRequest, request: Request):
    """The token ids of a text."""
    return _models(request).tokenize(req)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
def detokenize(req: DetokenizeRequest, request: Request):
    """The text of token ids."""
    return _models(request).detokenize(req)


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={200: _streamed(STREAM_CHUNK), **_ERRORS, **_BUSY},
)
async def completions(req: CompletionRequest, request: Request):
    """Complete prompts (OpenAI's legacy completions), whole or streamed."""
    completion = _completion(request)
    job = completion.check_completion(req)
    if req.stream:
        return StreamingResponse(completion.stream(job), media_type="text/event-stream")
    out = await completion.complete(job, request.is_disconnected)
    return out if out is not None else JSONResponse({}, status_code=499)  # the client has gone


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={200: _streamed(CHAT_STREAM_CHUNK), **_ERRORS, **_BUSY},
)
async def chat_completions(req: ChatCompletionRequest, request: Request):
    """Reply to a conversation (OpenAI's chat completions), whole or streamed."""
    chat: ServingChat = request.app.state.serving_chat
    job = chat.check_chat(req)
    if req.stream:
        return StreamingResponse(chat.stream(job), media_type="text/event-stream")
    out = await chat.complete(job, request.is_disconnected)
    return out if out is not None else JSONResponse({}, status_code=499)  # the client has gone
