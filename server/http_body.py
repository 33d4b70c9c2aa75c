"""What every route handler does before its own work: read and check the JSON body, and ask the
engine whether it takes requests. Handlers find the app's parts on ``request.app.state``
(``server/app.py``: ``engine``, ``config``, ...).
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from jaxpaged.server.errors import APIError, bad_request, from_validation_error
from jaxpaged.server.serving import CLIENT_GONE, engine_error

logger = logging.getLogger("server")


def ready(request: Request) -> None:
    """Raises the API error (503, 429, ...) of an engine that takes no new requests now
    (``AsyncEngine.check_ready``)."""
    try:
        request.app.state.engine.check_ready()
    except Exception as e:  # noqa: BLE001 - every engine state maps to an API error
        raise engine_error(e) from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", "invalid_request_error")


async def parse(request: Request, model: type[BaseModel]):
    """The request's JSON body validated as ``model``.

    Raises:
        APIError: 413 for a body over ``--max-request-body-bytes`` (declared or read), 415
            for a body that is not JSON by its ``Content-Type``, 400 for bad JSON, a non-object,
            a lone surrogate or a schema error (naming the field), :data:`CLIENT_GONE` when
            the client hangs up while sending.
    """
    limit = request.app.state.config.max_request_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)             # refused before reading it
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        # as FastAPI (vLLM's server) does: a browser's cross-site "simple" request
        # (text/plain, a form) never reaches the engine
        raise APIError(415, f"the request body must be JSON (Content-Type: "
                            f"application/json), got Content-Type {media_type!r}",
                       "invalid_request_error")
    body = bytearray()
    try:
        async for chunk in request.stream():   # a chunked body (or a lying length)
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:                   # hung up while sending: nobody to answer
        logger.info("client disconnected while sending its request body")
        raise APIError(CLIENT_GONE, "the client disconnected", "invalid_request_error",
                       None) from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:   # bad JSON or UTF-8, too deep, huge ints
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    check_unicode(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def check_unicode(data) -> None:
    """Raises APIError 400 for a string with a lone surrogate (valid JSON, but no text: it
    cannot be tokenized or echoed), naming where it is."""
    try:   # one C-speed pass for the common case; walk only to name the field
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                field = path.lstrip(".") or "body"
                raise bad_request(f"'{field}' holds invalid Unicode (a lone surrogate)",
                                  field.split(".")[0]) from None
        elif isinstance(value, dict):
            stack.extend((v, f"{path}.{k}") for k, v in value.items())
            stack.extend((k, f"{path}.{k!r}") for k in value if isinstance(k, str))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(value))
