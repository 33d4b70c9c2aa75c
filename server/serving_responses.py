"""``POST /v1/responses`` (OpenAI's Responses API), run as a translated chat request.

The request becomes a :class:`ChatCompletionRequest` (:mod:`~jaxpaged.server.responses_input`)
and goes through chat's checks, template rendering, tools, structured outputs and reasoning
(:meth:`OpenAIServingChat.prepare`); the engine's output is split by the same output parser
and built into ``output`` items (:mod:`~jaxpaged.server.responses_stream`). So, for the same
conversation and sampling, the message text equals chat's content.

``status``: ``completed``, or ``incomplete`` with ``incomplete_details.reason:
"max_output_tokens"`` when the output stopped at its limit. ``usage``: ``input_tokens``
(the rendered prompt), ``input_tokens_details.cached_tokens`` (its prefix-cache hits),
``output_tokens``, ``output_tokens_details.reasoning_tokens`` (the output tokens of the
``--reasoning-parser``'s reasoning block, its tags included: :func:`count_reasoning_tokens`). ``store``, ``previous_response_id`` and
``background`` need ``--responses-store-size`` (:mod:`~jaxpaged.server.responses_store`);
``background`` answers at once with status ``queued``, the result is read with
``GET /v1/responses/{id}`` (``POST /v1/responses/{id}/cancel`` aborts it). Contract: OpenAI's API reference and vLLM's
``serving_responses.py``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.core.generation_config import apply_generation_defaults
from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.protocol_responses import (IncompleteDetails, InputTokensDetails,
                                                OutputTokensDetails, ResponseError,
                                                ResponseObject, ResponsesRequest, ResponseUsage)
from jaxpaged.server.responses_input import chat_request, input_items, output_as_input, renamed
from jaxpaged.server.responses_store import ResponsesStore, StoredResponse
from jaxpaged.server.responses_stream import EventCounter, OutputBuilder
from jaxpaged.server.serving import CLIENT_GONE, off_loop
from jaxpaged.server.serving_chat import ChatRun, OpenAIServingChat


class OpenAIServingResponses:
    """The Responses endpoint, on top of the chat handler ``chat``; its store holds
    ``config.responses_store_size`` responses."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat
        self.store = ResponsesStore()
        #: Running background requests: response id -> (task, engine request id).
        self._background: dict[str, tuple[asyncio.Task, str]] = {}

    def _store(self) -> ResponsesStore:
        self.store.capacity = self.chat.config.responses_store_size
        return self.store

    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        """Answer one Responses request (JSON, or typed SSE events when ``stream``).

        Raises:
            APIError: 400 naming the field (``store`` / ``previous_response_id`` /
                ``background`` without the store; chat's 400s renamed), 404 for an unknown
                ``previous_response_id``, as chat's 429 / 503 / 500 before any event.
        """
        store = self._store()
        for field in ("store", "previous_response_id", "background"):
            if getattr(body, field):
                store.require(field)
        keep = store.capacity > 0 and body.store is not False
        if body.background and (not keep or body.stream):
            raise bad_request("background needs store (not false) and stream=false",
                              "background")
        history = [] if body.previous_response_id is None else \
            store.get(body.previous_response_id, "previous_response_id").conversation
        conversation = history + input_items(body)
        try:
            run = await self.chat.prepare(chat_request(body, conversation), raw_request, "resp")
        except APIError as e:
            raise renamed(e) from None
        response = self._response_object(body, run, keep)
        timeout = self.chat.config.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            streams = await self.chat.add_requests(run.request_id, [run.prompt], [run.params],
                                                   body.priority, body.cache_salt, "messages",
                                                   deadline,
                                                   self.chat.models.lora_request(body.model))
        except APIError as e:
            raise renamed(e) from None
        done = (lambda: store.put(StoredResponse(response, conversation + output_as_input(
            response.output)))) if keep else (lambda: None)
        if body.background:
            response.status = "queued"
            store.put(StoredResponse(response, conversation))
            task = asyncio.create_task(self._in_background(run, streams[0], response, done))
            self._background[response.id] = task, streams[0].request_id
            task.add_done_callback(lambda _: self._background.pop(response.id, None))
            return JSONResponse(response.model_dump())
        if body.stream:
            return StreamingResponse(self._stream(run, streams, raw_request, response, done),
                                     media_type="text/event-stream")
        async with self.chat.abort_on_disconnect(raw_request, streams):
            try:
                await self._drain(run, streams[0], response, done)
            except Exception as e:
                raise self.chat.request_error(e) from e
        if response.usage is None:      # aborted: the client went away
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(response.model_dump())

    def retrieve(self, response_id: str) -> Response:
        """``GET /v1/responses/{id}``. Raises APIError 400 without the store, 404 for an
        unknown id."""
        store = self._store()
        store.require("response_id")
        return JSONResponse(store.get(response_id).response.model_dump())

    def cancel(self, response_id: str) -> Response:
        """``POST /v1/responses/{id}/cancel``: a running ``background`` response is aborted
        (its pages freed) and left ``cancelled``; returns the response.

        Raises:
            APIError: as :meth:`retrieve`; 400 for a response that is not running in the
                background.
        """
        store = self._store()
        store.require("response_id")
        entry = store.get(response_id)
        if response_id not in self._background or entry.response.status != "queued":
            raise bad_request(f"response {response_id} is not a running background response "
                              f"(its status is {entry.response.status})", "response_id")
        _, request_id = self._background.pop(response_id)
        entry.response.status = "cancelled"
        self.chat.engine.abort(request_id)
        return JSONResponse(entry.response.model_dump())

    def delete(self, response_id: str) -> Response:
        """``DELETE /v1/responses/{id}``. Raises as :meth:`retrieve`."""
        store = self._store()
        store.require("response_id")
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    # ---- running ------------------------------------------------------------------------------

    def _response_object(self, body: ResponsesRequest, run: ChatRun, keep: bool
                         ) -> ResponseObject:
        """The response as it starts (``in_progress``, no output), the request's settings
        echoed."""
        fmt = body.text.format if body.text is not None else None
        choice = body.tool_choice
        # the values the engine samples with: the model's defaults where the request left them
        sampled = apply_generation_defaults(run.params,
                                            self.chat.engine.model_info.generation_defaults)
        return ResponseObject(
            id=run.request_id.replace("resp-", "resp_", 1), status="in_progress",
            model=self.chat.model_name(body.model), instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            reasoning=None if body.reasoning is None else body.reasoning.model_dump(),
            store=keep, background=bool(body.background),
            temperature=sampled.temperature, top_p=sampled.top_p,
            text={"format": {"type": "text"} if fmt is None else
                  fmt.model_dump(by_alias=True, exclude_none=True)},
            tool_choice=choice.model_dump() if hasattr(choice, "model_dump") else
            choice or "auto",
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            user=body.user)

    async def _run(self, run: ChatRun, stream, response: ResponseObject
                   ) -> AsyncIterator[dict]:
        """Drive one engine request: yields the output events as they come; ``response``
        is finished in place (output, status, usage) once the engine finishes it."""
        parsed, builder = ParsedOutput(run), OutputBuilder()
        async for out in stream:
            for event in builder.add(parsed.feed(out)):
                yield event
        if not parsed.finished:                          # aborted: nothing is finished
            return
        status = "incomplete" if parsed.seq.finish_reason == "length" else "completed"
        for event in builder.finish(status):
            yield event
        response.output, response.status = builder.items, status
        if status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        reasoning_tokens = await parsed.reasoning_tokens(self.chat.tokenizer)
        token_ids, cached = parsed.token_ids, parsed.num_cached
        num_input = len(run.prompt.token_ids)
        response.usage = ResponseUsage(
            input_tokens=num_input, input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=len(token_ids),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=num_input + len(token_ids))

    async def _drain(self, run: ChatRun, stream, response: ResponseObject, done) -> None:
        """Run the request to its end without sending events; ``done()`` once finished."""
        async for _ in self._run(run, stream, response):
            pass
        if response.usage is not None:
            done()

    async def _in_background(self, run: ChatRun, stream, response: ResponseObject,
                             done) -> None:
        """A ``background`` request: run to the end (a client that goes away does not abort
        it); a failure leaves the stored response ``failed`` with the reason."""
        try:
            await self._drain(run, stream, response, done)
        except Exception as e:   # noqa: BLE001 - recorded on the response, read by GET
            response.status = "failed"
            response.error = ResponseError(code="server_error",
                                           message=self.chat.request_error(e).message)

    async def _stream(self, run: ChatRun, streams, raw_request: Request,
                      response: ResponseObject, done) -> AsyncIterator[str]:
        """The typed SSE events: ``response.created``, ``response.in_progress``, the output
        events, then ``response.completed`` (``response.incomplete`` at the limit); a
        failure mid-way is an ``error`` event, then ``response.failed``."""
        counter = EventCounter()
        yield counter.lifecycle("created", response)
        yield counter.lifecycle("in_progress", response)
        async with self.chat.abort_on_disconnect(raw_request, streams):
            try:
                async for event in self._run(run, streams[0], response):
                    yield counter.sse(event)
            except Exception as e:   # noqa: BLE001 - the stream has started: report in-band
                error = self.chat.request_error(e)
                yield counter.sse({"type": "error", "code": str(error.code),
                                   "message": error.message, "param": error.param})
                response.status = "failed"
                response.error = ResponseError(code="server_error", message=error.message)
                yield counter.lifecycle("failed", response)
                return
        if response.usage is None:       # aborted (the client went away)
            return
        done()
        yield counter.lifecycle("completed" if response.status == "completed" else
                                "incomplete", response)


class ParsedOutput:
    """One engine request's outputs read through its :class:`ChatRun`'s parser (what the
    Responses and Anthropic Messages routes build their events from): :meth:`feed` each
    ``RequestOutput`` as it comes; the tokens, the prefix-cache hits and whether any
    reasoning came are kept for the usage."""

    def __init__(self, run: ChatRun):
        self.run, self.parser = run, run.parser()
        self.token_ids: list[int] = []
        self.num_cached, self.reasoned, self.seq = 0, False, None

    def feed(self, out):
        """The parsed delta of ``out`` (its only choice), the parser's tail when it ends."""
        self.num_cached, self.seq = out.num_cached_tokens, out.outputs[0]
        delta = self.parser.feed(self.seq.text)
        if self.seq.finish_reason is not None:
            delta.extend(self.parser.finish())
        self.token_ids += self.seq.token_ids
        self.reasoned = self.reasoned or bool(delta.reasoning)
        return delta

    @property
    def finished(self) -> bool:
        """Whether the engine finished the request (False: aborted, or nothing came)."""
        return self.seq is not None and self.seq.finish_reason is not None

    async def reasoning_tokens(self, tokenizer) -> int:
        """How many output tokens the reasoning took (:func:`count_reasoning_tokens`, off
        the event loop; 0 without reasoning)."""
        if not self.reasoned:
            return 0
        decode = functools.partial(tokenizer.decode,
                                   skip_special_tokens=self.run.params.skip_special_tokens)
        return await off_loop(count_reasoning_tokens, decode, self.token_ids,
                              self.parser.reasoning.end)


def count_reasoning_tokens(decode, token_ids: list[int], end: str) -> int:
    """The output tokens of an output's reasoning block: up to the one that completes the
    reasoning's end tag (``end``, e.g. ``</think>``), or all of them when the output stopped
    inside the reasoning. Found by bisection on the decoded prefixes (whether a prefix holds
    ``end`` is monotonic in its length), so it is the same however the engine's steps
    grouped the tokens; ``decode(ids) -> str`` decodes as the output was.

    Only called for an output that had reasoning text (otherwise the count is 0).
    """
    if end not in decode(token_ids):
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if end in decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
