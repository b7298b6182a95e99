"""The API's gate: ASGI middleware in front of every route that checks the API key and the
size of the request body before a route (or FastAPI's body parsing) sees the request.

- With API keys, every path but /health needs `Authorization: Bearer KEY` for one of them
  (the header the openai SDK, simonw's llm and lm-evaluation-harness send): a missing or
  wrong key is 401 with OpenAI's error body (code invalid_api_key for a wrong one) and
  `WWW-Authenticate: Bearer`. Keys are compared in constant time (`hmac.compare_digest`,
  every key each time) and never written to a log or an answer.
- A body longer than max_body_bytes is 413 (code request_too_large): at once from its
  Content-Length, or, for a chunked body, as soon as the bytes read pass the limit.
"""

import hmac

from starlette.responses import JSONResponse

from .errors import ApiError

__all__ = ["Guard"]

OPEN_PATHS = frozenset({"/health"})


class Guard:
    """ASGI middleware: the API key and the body size (see the module).

    Args:
        app: the ASGI app behind it.
        api_keys: the accepted keys (empty: no key needed).
        max_body_bytes: the largest request body, in bytes (>= 0).
    """

    def __init__(self, app, api_keys=(), max_body_bytes: int = 4 * 2**20):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_keys = [key.encode("utf-8") for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # names are lower-case bytes
        error = self._key_error(scope["path"], headers.get(b"authorization"))
        if error is None and b"content-length" in headers:
            error = self._size_error(int(headers[b"content-length"]))
        elif error is None:
            receive, error = await self._read_body(receive)
        if error is not None:
            answer = JSONResponse(error.body(), error.status, headers=error.headers)
            return await answer(scope, receive, send)
        return await self.app(scope, receive, send)

    def _key_error(self, path: str, authorization: bytes | None) -> ApiError | None:
        """None when the path is open, no key is needed, or the header holds a key."""
        if not self.api_keys or path in OPEN_PATHS:
            return None
        scheme, _, sent = (authorization or b"").partition(b" ")
        if authorization is None or scheme.lower() != b"bearer" or not sent.strip():
            return ApiError(
                401,
                "no API key: send it in an Authorization header, 'Authorization: Bearer KEY' "
                "(the openai SDK's api_key, or OPENAI_API_KEY)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        sent, match = sent.strip(), False
        for key in self.api_keys:  # every key, so the time does not tell which matched
            match |= hmac.compare_digest(sent, key)
        if match:
            return None
        return ApiError(
            401,
            "incorrect API key: the server's key is the one given to decoderlm serve "
            "--api-key (or DECODERLM_API_KEY)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _size_error(self, size: int) -> ApiError | None:
        if size <= self.max_body_bytes:
            return None
        return ApiError(
            413,
            f"the request body has more than {self.max_body_bytes} bytes, this server's limit "
            "(decoderlm serve --max-body-bytes); send fewer or shorter prompts",
            code="request_too_large",
        )

    async def _read_body(self, receive):
        """(a receive replaying the body read, an ApiError 413 or None) for a body without
        Content-Length (chunked), read up to the limit."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if (error := self._size_error(size)) is not None:
                return receive, error
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        messages.reverse()

        async def replay():
            return messages.pop() if messages else await receive()

        return replay, None
