"""The API's errors: every error is an `ApiError`, answered as OpenAI's
{"error": {"message", "type", "param", "code"}} (`protocol.ErrorResponse`) with an HTTP status:
400 (a bad request; param names the field), 401 (no API key or a wrong one, from `guard`),
404 (an unknown model or path), 413 (a body over the size limit, from `guard`), 503 (busy,
from `admission`) or 500. type is "invalid_request_error" for a 4xx, "server_error" else.

`validation_error` turns pydantic's errors (a body that does not fit its request model) into
one 400 naming the field; `refuse_extra_fields` refuses a field outside the request model (or
a value of it the server cannot honour).
"""

import json

from .protocol import ErrorInfo, ErrorResponse

__all__ = ["PROMPT_TYPES", "ApiError", "refuse_extra_fields", "validation_error"]

# what a completion's `prompt` may be, in words
PROMPT_TYPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


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
        return ApiError(400, f"prompt must be {PROMPT_TYPES}", "prompt")
    where = ".".join(loc)
    return ApiError(400, f"{where}: {msg}", param)


def refuse_extra_fields(request, allowed: dict[str, list]) -> None:
    """ApiError 400 naming the first field of a request model's `model_extra` (the fields
    outside the model) that asks for something: one not in `allowed`, or one whose value is
    not among its allowed values (compared with their JSON types: 0 is not False)."""
    for name, value in (request.model_extra or {}).items():
        if name not in allowed:
            fields = sorted(set(type(request).model_fields) | set(allowed))
            raise ApiError(400, f"unknown field {name!r}; this server supports {fields}", name)
        if not any(type(value) is type(ok) and value == ok for ok in allowed[name]):
            ok = " or ".join(json.dumps(v) for v in allowed[name])
            raise ApiError(
                400,
                f"{name}={json.dumps(value)} is not supported by this server; omit {name} or "
                f"send {ok}",
                name,
            )
