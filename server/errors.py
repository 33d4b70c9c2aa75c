"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is raised as an :class:`APIError` and rendered by
:func:`error_response`; the app maps framework errors (malformed JSON, pydantic validation,
unknown routes, oversized bodies) onto the same shape, so the official SDKs can read
``e.message``. The Anthropic routes (``/v1/messages``) answer the same errors in Anthropic's
shape instead (:func:`anthropic_error_response`).
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from jaxpaged.server.protocol import ErrorInfo, ErrorResponse
from jaxpaged.server.protocol_anthropic import AnthropicErrorInfo, AnthropicErrorResponse


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error body.

    Args:
        status: HTTP status code.
        message: what went wrong, in words the client can act on.
        type: OpenAI's error type (``invalid_request_error``, ...).
        param: the request parameter at fault, if any.
        headers: extra response headers (``Retry-After`` of a 429).

    The body's ``code`` is always the HTTP status (an integer), as vLLM's ``ErrorInfo``
    has it; ``type`` tells failures apart.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = status
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    """400 ``invalid_request_error``."""
    return APIError(400, message, "invalid_request_error", param)


def error_body(e: APIError) -> ErrorResponse:
    """OpenAI's error body for ``e``."""
    return ErrorResponse(error=ErrorInfo(message=e.message, type=e.type, param=e.param,
                                         code=e.code))


def error_response(e: APIError) -> JSONResponse:
    """The JSON response for ``e``."""
    return JSONResponse(error_body(e).model_dump(), status_code=e.status, headers=e.headers)


#: Anthropic's error ``type`` for an HTTP status (its API reference's table; a 503 is its
#: ``overloaded_error``); other 4xx are ``invalid_request_error``, other 5xx ``api_error``.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(e: APIError) -> AnthropicErrorResponse:
    """Anthropic's error body for ``e`` (``/v1/messages``): ``{"type": "error", "error":
    {"type", "message"}}``, the type from the status (:data:`ANTHROPIC_ERROR_TYPES`)."""
    kind = ANTHROPIC_ERROR_TYPES.get(
        e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=e.message))


def anthropic_error_response(e: APIError) -> JSONResponse:
    """The JSON response for ``e`` in Anthropic's shape."""
    return JSONResponse(anthropic_error_body(e).model_dump(), status_code=e.status,
                        headers=e.headers)


#: Names pydantic puts in an error's location for the branch of a union it tried.
_UNION_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance"}


def _field_path(loc: tuple) -> tuple:
    """``loc`` without pydantic's union-branch and validator tags (``str``,
    ``function-before[...]``, ``list[...]``): the path as the client wrote it."""
    return tuple(p for p in loc if not (isinstance(p, str) and (
        p in _UNION_BRANCHES or "[" in p or "(" in p)))


def from_validation_error(e: ValidationError) -> APIError:
    """400 naming the first invalid field: ``param`` is the top-level request field, the
    message gives the full path (``messages.0.role``) and pydantic's reason (each union
    branch's reason, joined by "or", when the field may take several types)."""
    errors = e.errors()
    loc = _field_path(errors[0]["loc"])
    reasons = list(dict.fromkeys(err["msg"] for err in errors
                                 if _field_path(err["loc"]) == loc))
    path = ".".join(str(p) for p in loc)
    return bad_request(f"invalid value for '{path}': {' or '.join(reasons)}",
                       str(loc[0]) if loc else None)
