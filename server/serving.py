"""What completions and chat share: model check, running requests with abort-on-disconnect and a deadline, engine failures as API errors,
logprob formatting, SSE framing.

The prompt length rules and the SamplingParams of a request are
:mod:`jaxpaged.server.request_params`'s.

Failures (``docs/reliability.md``): a request refused for ``--max-pending-requests`` gets 429
with ``Retry-After``; one that passes ``--request-timeout`` 504; one whose model step failed,
or that was running when the engine died, 500 with the reason (for a stream: an error event,
then ``[DONE]``); requests to a dead or loading engine 503.

Request ids: ``cmpl-<32 hex>`` / ``chatcmpl-<32 hex>``, or, as vLLM does, the client's
``X-Request-Id`` header after the same prefix (engine ids add ``-<prompt index>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.engine.async_engine import AsyncEngine
from jaxpaged.engine.exceptions import (EngineDeadError, EngineNotReadyError, RequestFailedError,
                                        RequestIdInUseError, RequestTimeoutError,
                                        TooManyPendingRequestsError)
from jaxpaged.engine.request_stream import RequestStream
from jaxpaged.outputs import Logprob, RequestOutput
from jaxpaged.sampling_params import SamplingParams, SamplingParamsError
from jaxpaged.server.config import ServerConfig
from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.protocol import SamplingFields, TopLogprob
from jaxpaged.server.request_params import RequestParameters, sampling_error
from jaxpaged.server.serving_models import ServingModels
from jaxpaged.tokenizer import longest_token_chars

logger = logging.getLogger("server")

#: Logprobs are clamped to this for JSON (which has no -inf), as vLLM does.
MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: The answer to a client that disconnected before its result (nobody reads it).
CLIENT_GONE = 499
#: Seconds a client refused for ``--max-pending-requests`` is told to wait (``Retry-After``):
#: about the time a waiting request needs to be scheduled under load.
RETRY_AFTER_S = 1
#: The one thread that tokenizes and renders chat templates for every route: off the event loop
#: (a long prompt never delays /health or other streams) and one at a time (a fast tokenizer
#: must not be used by two threads at once).
_TOKENIZER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
#: A prompt text longer than ``max_model_len`` x this x the tokenizer's longest piece cannot
#: fit the context whatever it tokenizes to (a safety factor for normalizers that compose
#: characters); it is refused before it is tokenized.
_CHARS_SAFETY_FACTOR = 4


async def off_loop(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the tokenizer thread; its exceptions are raised here."""
    return await asyncio.get_running_loop().run_in_executor(
        _TOKENIZER_THREAD, functools.partial(fn, *args, **kwargs))


#: What an ``X-Request-Id`` header may hold: 1-128 printable ASCII characters, no spaces.
_REQUEST_ID_HEADER = re.compile(r"[!-~]{1,128}")


@dataclass
class PreparedPrompt:
    """One prompt ready for the engine: its text (if given as text), ids, output limit."""

    text: str | None
    token_ids: list[int]
    max_tokens: int


class OpenAIServing(RequestParameters):
    """Base of the completion and chat handlers (their checks and SamplingParams:
    :class:`~jaxpaged.server.request_params.RequestParameters`).

    Args:
        engine: the running engine.
        config: HTTP-layer settings.
        tokenizer: the server's own tokenizer instance (the engine thread has its own), used
            in the event loop only.
    """

    def __init__(self, engine: AsyncEngine, config: ServerConfig, tokenizer,
                 models: ServingModels | None = None):
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        #: The names ``model`` may take (base names and LoRA adapters), shared by the routes.
        self.models = models or ServingModels(config.served_model_names)
        #: The most characters one token can stand for (its vocabulary's longest piece).
        self.max_token_chars = longest_token_chars(tokenizer)

    def check_text_length(self, text: str, param: str) -> None:
        """Refuse, without tokenizing it, a text too long to fit ``max_model_len`` tokens.

        Raises:
            APIError: 400 when ``text`` has more characters than ``max_model_len`` tokens of
                the longest piece could cover (times a safety factor).
        """
        max_model_len = self.engine.model_info.max_model_len
        limit = max_model_len * self.max_token_chars * _CHARS_SAFETY_FACTOR
        if len(text) > limit:
            raise bad_request(f"the prompt has {len(text)} characters: more than any "
                              f"{max_model_len} tokens (the maximum model length) of this "
                              f"tokenizer can hold", param)

    def model_name(self, requested: str | None) -> str:
        """The ``model`` a response reports: the name the request asked for (any alias of
        ``--served-model-name``), else the first served name (vLLM's ``_get_model_name``)."""
        return requested or self.config.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        """Raises APIError 404 (``model_not_found``) for a model that is not served (neither
        a base model name nor a LoRA adapter's)."""
        names = self.models.names
        if name and name not in names:
            raise model_not_found(name, names)

    @staticmethod
    def request_id(raw_request: Request, prefix: str, body_id: str | None = None) -> str:
        """``{prefix}-{X-Request-Id}`` when the client sent that header, else
        ``{prefix}-{body_id}`` (the body's ``request_id``), else ``{prefix}-{uuid4 hex}``
        (vLLM's ``_base_request_id``).

        Raises:
            APIError: 400 for an id that is empty, longer than 128 characters or holds
                anything but printable ASCII without spaces. (An id still in use is refused
                by the engine when the request is added: 400.)
        """
        header = raw_request.headers.get("x-request-id")
        given = body_id if header is None else header
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not _REQUEST_ID_HEADER.fullmatch(given):
            name = "the X-Request-Id header" if header is not None else "request_id"
            raise bad_request(f"{name} must be 1 to 128 printable ASCII characters without "
                              "spaces", None if header is not None else "request_id")
        return f"{prefix}-{given}"

    # ---- running requests ---------------------------------------------------------------------

    async def add_requests(self, request_id: str, prompts: list[PreparedPrompt],
                           params: list[SamplingParams], priority: int, cache_salt: str | None,
                           prompt_param: str, deadline: float | None,
                           lora_request=None) -> list[RequestStream]:
        """Submit one engine request per prompt (ids ``{request_id}-{i}``); all or none
        (``lora_request``: the adapter they run with, None: the base model).

        Raises:
            APIError: 400 if the engine refuses one (the others are aborted) or the request
                has more sequences than ``--max-pending-requests`` could ever admit, 429
                beyond ``--max-pending-requests``, 504 past ``deadline``, 503 while loading
                or once the engine has failed.
        """
        limit = self.engine.max_pending_requests
        num_seqs = sum(getattr(p, "n", 1) for p in params)   # (PoolingParams: 1)
        if limit is not None and num_seqs > limit:
            raise bad_request(f"this request has {num_seqs} sequences (n x prompts), more than "
                              f"the server ever admits at once (--max-pending-requests={limit})",
                              "n" if len(prompts) == 1 else prompt_param)
        streams = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                engine_prompt = {"prompt_token_ids": prompt.token_ids}
                if cache_salt is not None:
                    engine_prompt["cache_salt"] = cache_salt
                streams.append(await self.engine.add_request(f"{request_id}-{i}", engine_prompt,
                                                             p, priority, deadline,
                                                             lora_request))
                if self.config.enable_log_requests:
                    logger.info("request %s-%d: prompt %r (%d tokens), %s", request_id, i,
                                prompt.token_ids if prompt.text is None else prompt.text,
                                len(prompt.token_ids), p)
        except BaseException as e:
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(e, SamplingParamsError):
                raise sampling_error(e) from None
            if isinstance(e, RequestIdInUseError):
                raise bad_request(f"{e} (X-Request-Id must be unique among running "
                                  f"requests)") from None
            if isinstance(e, (ValueError, TypeError)):
                raise bad_request(str(e), prompt_param) from None
            if isinstance(e, Exception):
                raise self.request_error(e) from e
            raise
        return streams

    def request_error(self, e: Exception) -> APIError:
        """The API error for a request the engine could not finish: :func:`engine_error`,
        and 504 (naming ``--request-timeout``) for one that passed its deadline."""
        if isinstance(e, RequestTimeoutError):
            return APIError(504, f"the request did not finish within --request-timeout="
                                 f"{self.config.request_timeout:g} s and was aborted",
                            "timeout_error")
        return engine_error(e)

    async def respond(self, raw_request: Request, body: SamplingFields, request_id: str,
                      prompts: list[PreparedPrompt], params: list[SamplingParams],
                      prompt_param: str, stream_events, build_response) -> Response:
        """Run the prompts and answer: SSE from ``stream_events(streams)`` when the body asks
        to stream, else JSON of ``build_response(final_outputs)`` (nothing, if the client
        went away first).

        The request must finish within ``--request-timeout`` of now (the streams raise
        :class:`RequestTimeoutError` after that).

        Raises:
            APIError: as :meth:`add_requests`; 500 if the engine fails the request, 504 past
                the deadline.
        """
        timeout = self.config.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = await self.add_requests(request_id, prompts, params, body.priority,
                                          body.cache_salt, prompt_param, deadline,
                                          self.models.lora_request(body.model))
        if body.stream:
            return StreamingResponse(stream_events(streams), media_type="text/event-stream")
        async with self.abort_on_disconnect(raw_request, streams):
            try:
                finals = await final_outputs(streams)
            except Exception as e:
                raise self.request_error(e) from e
        if any(f is None for f in finals):
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(build_response(finals).model_dump())

    @contextlib.asynccontextmanager
    async def abort_on_disconnect(self, raw_request: Request, streams: list[RequestStream]):
        """Within the block, a client disconnect aborts ``streams`` at once (their pages are
        freed before the engine's next step); leaving the block aborts what is unfinished."""

        async def watch():
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass
            logger.info("client disconnected: aborting %s", [s.request_id for s in streams])
            for stream in streams:
                self.engine.abort(stream.request_id)

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            for stream in streams:
                self.engine.abort(stream.request_id)

    # ---- formatting ---------------------------------------------------------------------------

    def token_text(self, token_id: int, logprob: Logprob, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else (logprob.decoded_token or "")

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """UTF-8 bytes of a token: the raw byte for a byte-fallback token (``<0xE2>``)."""
        match = _BYTE_TOKEN.fullmatch(self.tokenizer.convert_ids_to_tokens(token_id) or "")
        return [int(match.group(1), 16)] if match else list(text.encode("utf-8"))

    def top_logprobs(self, entry: dict[int, Logprob], k: int, as_ids: bool) -> list[TopLogprob]:
        """The ``k`` most likely tokens of one position, most likely first."""
        ranked = sorted((lp.rank, t, lp) for t, lp in entry.items()
                        if lp.rank is not None and lp.rank <= k)
        out = []
        for _, t, lp in ranked[:k]:
            text = self.token_text(t, lp, as_ids)
            out.append(TopLogprob(token=text, logprob=clamp_logprob(lp.logprob),
                                  bytes=self.token_bytes(t, text)))
        return out


def model_not_found(name: str, served: list[str]) -> APIError:
    """404 (``NotFoundError``, param ``model``) for a ``model`` none of ``served`` is."""
    return APIError(404, f"The model `{name}` does not exist; this server serves {served}.",
                    "NotFoundError", "model")


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def sse(payload: BaseModel | str) -> str:
    """One server-sent event carrying JSON (or the literal ``[DONE]``)."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def engine_error(e: BaseException) -> APIError:
    """The API error for an engine that cannot run a request: 503 while it loads or stops
    and once it has died, 429 (with ``Retry-After``) when too many requests wait, 500 for a
    request the engine failed (the reason as the message) or any other failure."""
    if isinstance(e, (EngineNotReadyError, EngineDeadError)):
        return APIError(503, str(e), "service_unavailable")
    if isinstance(e, TooManyPendingRequestsError):
        return APIError(429, str(e), "rate_limit_error", None,
                        {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "internal_server_error")
    return APIError(500, f"internal error: {e!r}", "internal_server_error")


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they arrive, tagged by stream position. The hand-over
    queue holds one output, so a consumer that falls behind leaves the others folded in
    their streams (bounded memory) rather than queued here."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
            last = done
        except Exception as e:   # noqa: BLE001 - handed to the consumer
            last = e
        await queue.put((i, last))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput | None]:
    """The finished output of each stream (None for one that was aborted)."""

    async def last(stream):
        final = None
        async for out in stream:
            final = out
        return final if final is not None and final.finished else None

    return list(await asyncio.gather(*(last(s) for s in streams)))
