"""The HTTP API's app: `create_app` (FastAPI with the routes of `routes`, every error answered
as OpenAI's error body, an OpenAPI schema naming every request and response model),
`run_server` (uvicorn) and `serve`, the `decoderlm serve` command.

FastAPI and uvicorn are the optional [serve] extra: this module imports them (and the modules
that need them or pydantic) only when a server is built, so the command's signature and help
need neither (its limit flags are the fields of `limits.ServeLimits`). The API itself is
described in `routes` (the endpoints), `protocol` (the bodies), `serving_models` and
`serving_completion` (what is checked and computed) and `errors` (the error bodies).
"""

import concurrent.futures
import contextlib
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Annotated

from ..arguments import Fields
from ..errors import UserError
from ..options import Decoding, ModelSource
from .limits import ServeLimits

__all__ = ["create_app", "run_server", "serve"]


def _missing_extra(e: ImportError) -> UserError:
    return UserError(
        f"`decoderlm serve` needs FastAPI and uvicorn: pip install 'decoderlm[serve]' ({e})"
    )


def create_app(
    model,
    tokenizer,
    model_name: str,
    limits: ServeLimits | None = None,
    api_keys=(),
    chat_template=None,
):
    """Build the FastAPI app serving `model` with `tokenizer` under the id `model_name`.

    The app's `state.serving_models` is its `serving_models.ServingModels` (models, health,
    tokenizer endpoints), `state.serving_completion` its `serving_completion.ServingCompletion`
    and `state.scheduler` that one's `Scheduler` of limits.max_batch_size sequences, stopped
    when the app shuts down. Its `guard.Guard` checks the API key and the body size first.

    Args:
        model: the DecoderLM (put in eval mode).
        tokenizer: its tokenizer.
        model_name: the model id clients send.
        limits: the server's limits (None: `limits.ServeLimits`' defaults).
        api_keys: the keys a client may send as `Authorization: Bearer KEY` (empty: none
            needed); every path but /health needs one.
        chat_template: the `ChatTemplate` of /v1/chat/completions (`state.serving_chat`;
            None: the tokenizer's own, `chat_template_of(tokenizer)`, if it has one).

    Raises:
        UserError: FastAPI is not installed.
        ChatTemplateError: the tokenizer's template does not compile.
    """
    try:
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from starlette.exceptions import HTTPException

        from .errors import ApiError
        from .guard import Guard
        from .routes import router
        from .serving_chat import ServingChat
        from .serving_completion import ServingCompletion
        from .serving_models import ServingModels
    except ImportError as e:
        raise _missing_extra(e) from None
    from ..tokenizers.chat_template import chat_template_of

    chat_template = chat_template or chat_template_of(tokenizer)
    limits = limits or ServeLimits()
    models = ServingModels(model, tokenizer, model_name)
    completion = ServingCompletion(models, limits)
    app = FastAPI(title="decoderlm", version="0.1.0", lifespan=_lifespan)
    app.add_middleware(Guard, api_keys=tuple(api_keys), max_body_bytes=limits.max_body_bytes)
    app.state.serving_models, app.state.serving_completion = models, completion
    app.state.serving_chat = ServingChat(completion, chat_template)
    app.state.scheduler = completion.scheduler
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.include_router(router)
    _complete_schema(app)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app):
    yield
    app.state.serving_completion.close()


def _complete_schema(app) -> None:
    """Make the app's OpenAPI schema (built here once; FastAPI keeps it as app.openapi_schema)
    say what the app answers: the streamed chunks' models among the components (the
    text/event-stream answers of /v1/completions and /v1/chat/completions refer to them), and
    no 422 answers (a body that does not fit its model is a 400 with OpenAI's error body)."""
    from .protocol import ChatCompletionStreamResponse, CompletionStreamResponse
    from .routes import CHAT_STREAM_CHUNK, STREAM_CHUNK

    schema = app.openapi()
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    for name, model in [
        (STREAM_CHUNK, CompletionStreamResponse),
        (CHAT_STREAM_CHUNK, ChatCompletionStreamResponse),
    ]:
        chunk = model.model_json_schema(
            mode="serialization", ref_template="#/components/schemas/{model}"
        )
        for sub_name, sub in chunk.pop("$defs", {}).items():
            components.setdefault(sub_name, sub)
        components[name] = chunk


def _answer(error):
    """The JSON response of an ApiError: OpenAI's error body, with the error's status."""
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=error.status, content=error.body(), headers=error.headers)


def _api_error(request, exc):
    return _answer(exc)


def _invalid_request(request, exc):
    """A body that does not fit its request model: a 400 naming the field."""
    from .errors import validation_error

    return _answer(validation_error(exc.errors()))


def _http_error(request, exc):
    """Starlette's own errors (an unknown path: 404, a wrong method: 405)."""
    from .errors import ApiError

    message = f"{exc.detail}: {request.method} {request.url.path}"
    allow = (exc.headers or {}).get("Allow")
    if exc.status_code == 405 and allow:
        message += f"; this path takes {allow}"
    return _answer(ApiError(exc.status_code, message))


def _server_error(request, exc):
    """Any other exception: a 500 naming it."""
    from .errors import ApiError

    return _answer(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def _check_address(host: str, port: int) -> None:
    """OSError (one line) unless host:port can be listened on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            # as uvicorn binds: a port whose old connections sit in TIME_WAIT is free, one
            # that something listens on is not
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _is_loopback(host: str) -> bool:
    """Whether every address host resolves to is a loopback one (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def run_server(
    model,
    tokenizer,
    name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServeLimits | None = None,
    api_keys=(),
    chat_template=None,
) -> None:
    """Serve the API of `create_app(model, tokenizer, name, limits, api_keys, chat_template)`
    with uvicorn on
    host:port until interrupted; a model prepared with compile=True (`prepare_for_decoding`)
    has its decoding step compiled before the server listens. Without api_keys on a host that
    is not loopback, one warning line goes to stderr.

    Raises:
        UserError: FastAPI or uvicorn is not installed.
        OSError: the address cannot be listened on (one line), checked before the model's
            app is built.
    """
    try:
        import uvicorn
    except ImportError as e:
        raise _missing_extra(e) from None
    _check_address(host, port)  # one clear line, before uvicorn starts
    if not api_keys and not _is_loopback(host):
        print(
            f"warning: serving on {host} with no API key: anyone who can reach it can use the "
            "model (give --api-key KEY or set DECODERLM_API_KEY)",
            file=sys.stderr,
        )
    app = create_app(model, tokenizer, name, limits, api_keys, chat_template)
    from ..generation.precision import decoding_setup

    setup = decoding_setup(model)
    if setup is not None and setup.compile:
        print("compiling the decoding steps of one row and of several (minutes)...", flush=True)
        app.state.serving_completion.warm_up()
    chat = ", /v1/chat/completions" if app.state.serving_chat.template is not None else ""
    print(f"serving {name} on http://{host}:{port} (POST /v1/completions{chat})")
    uvicorn.run(app, host=host, port=port, log_level="info")


def _check_flags(served_model_name, port: int) -> None:
    """UserError for an empty name or a port outside [1, 65536)."""
    if served_model_name == "":
        raise UserError("--served-model-name must not be empty")
    if not 1 <= port < 65536:
        raise UserError(f"--port must be in [1, 65536), got {port}")


def _api_keys(flags: list[str] | None) -> tuple[str, ...]:
    """The --api-key values, else DECODERLM_API_KEY's (one key), else none; UserError for an
    empty or blank key."""
    env = os.environ.get("DECODERLM_API_KEY")
    keys = flags or ([] if env is None else [env])
    for key in keys:
        if not key.strip() or key != key.strip():
            raise UserError(
                "--api-key (or DECODERLM_API_KEY) must be a non-empty key without spaces around it"
            )
    return tuple(keys)


def serve(
    source: Annotated[ModelSource, Fields(ModelSource)] = ModelSource(),
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    limits: Annotated[dict | None, Fields(ServeLimits, "limits")] = None,
    api_key: list[str] | None = None,
    chat_template: str | None = None,
    decoding: Annotated[Decoding, Fields(Decoding)] = Decoding(),
) -> int:
    """An OpenAI-style HTTP API for a model.

    Serve POST /v1/completions (with echo and logprobs), POST /v1/chat/completions (for a
    model with a chat template), GET /v1/models, the tokenizer
    endpoints POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's shapes, which
    lm-evaluation-harness reads) and GET /health; concurrent requests are decoded in one batch
    (needs the [serve] extra: FastAPI and uvicorn). A prompt's <|endoftext|> is the
    end-of-text token where the vocabulary has one, as in `decoderlm sample`.

    Args:
        source: the model (`ModelSource`: --run, --hf or --gguf; --device, --no-verify, --threads).
        host: the address to listen on.
        port: the TCP port to listen on, in [1, 65536).
        served_model_name: the model id clients send (default: the directory's name).
        limits: ServeLimits fields to change (`limits` in a settings file): what one request
            may ask for, the batch, the queue, the time a request may take and the size of its
            body.
        api_key: a key clients must send as "Authorization: Bearer KEY" on every path but
            /health; repeat for several (default: the DECODERLM_API_KEY environment
            variable; neither: no key needed).
        chat_template: a Jinja chat template file for /v1/chat/completions (default: the
            model's own, from its tokenizer_config.json, chat_template.jinja or GGUF file).
        decoding: how the model decodes (`Decoding`: --dtype, --quantize, --compile; a
            compiled step is compiled once, at start).

    Returns:
        0 once the server has stopped.

    Raises:
        UserError: a bad flag (checked before the model is loaded), the [serve] extra is
            not installed, or the model cannot be loaded (see
            `generation.loading.load_for_decoding`).
        OSError: host:port cannot be listened on.
    """
    _check_flags(served_model_name, port)
    server_limits = ServeLimits(**(limits or {}))
    api_keys = _api_keys(api_key)
    try:  # the [serve] extra, before the model is loaded
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise _missing_extra(e) from None
    from ..generation.loading import load_for_decoding
    from ..tokenizers.chat_template import chat_template_of

    # loaded on a thread that then exits: the scheduler's thread then does all of the
    # server's torch work (generation/scheduler.py says why)
    with concurrent.futures.ThreadPoolExecutor(1) as loader:
        model, tokenizer = loader.submit(load_for_decoding, source, decoding).result()
    template = chat_template_of(tokenizer, chat_template)
    name = served_model_name or Path(source.path).resolve().name
    run_server(model, tokenizer, name, host, port, server_limits, api_keys, template)
    return 0
