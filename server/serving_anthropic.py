"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API),
run as translated chat requests.

The request becomes a :class:`ChatCompletionRequest` (:mod:`~jaxpaged.server.anthropic_input`)
and goes through chat's checks, template rendering, tools and their forced-call grammars,
reasoning and sampling (:meth:`OpenAIServingChat.prepare`); the engine's output is split by
the same output parser and built into content blocks
(:mod:`~jaxpaged.server.anthropic_stream`). So, for the same conversation and sampling, the
text equals chat's content, and ``count_tokens`` equals chat's ``prompt_tokens``.

``stop_reason``: ``max_tokens`` when the output stopped at its limit, ``tool_use`` when the
message holds a call, ``stop_sequence`` (with ``stop_sequence``) when one of
``stop_sequences`` ended it, else ``end_turn``. ``usage``: see
:class:`~jaxpaged.server.protocol_anthropic.MessagesUsage`; ``output_tokens_details.
thinking_tokens`` counts the reasoning block's tokens, its tags included, when there was one.
Errors are answered in Anthropic's shape (the app renders them; a failure after the stream
began is an ``error`` event). Contract: Anthropic's API reference and vLLM's
``vllm/entrypoints/anthropic/serving.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.server.anthropic_input import chat_request, count_request, renamed
from jaxpaged.server.anthropic_stream import ContentBuilder, sse_event
from jaxpaged.server.errors import APIError, anthropic_error_body
from jaxpaged.server.protocol_anthropic import (CountTokensRequest, CountTokensResponse,
                                                MessagesRequest, MessagesResponse,
                                                MessagesUsage, OutputTokensDetails)
from jaxpaged.server.serving import CLIENT_GONE
from jaxpaged.server.serving_chat import ChatRun, OpenAIServingChat
from jaxpaged.server.serving_responses import ParsedOutput


@dataclasses.dataclass
class _Outcome:
    """What the engine's side of one message ends with (None until it finished)."""

    message: MessagesResponse
    finished: bool = False


class AnthropicServingMessages:
    """The Messages endpoints, on top of the chat handler ``chat``."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def count_tokens(self, body: CountTokensRequest, raw_request: Request) -> Response:
        """``count_tokens``: the tokens of the prompt ``/v1/messages`` would run for the same
        conversation, tools and thinking.

        Raises:
            APIError: 400 / 404 as the Messages request's.
        """
        self.chat.check_model(body.model)
        try:
            ids = await self.chat.render_request(count_request(body), False)
        except APIError as e:
            raise renamed(e) from None
        return JSONResponse(CountTokensResponse(input_tokens=len(ids)).model_dump())

    async def create(self, body: MessagesRequest, raw_request: Request) -> Response:
        """Answer one Messages request (JSON, or Anthropic's SSE events when ``stream``).

        Raises:
            APIError: 400 naming the field (chat's 400s renamed), 404 for an unknown model,
                as chat's 429 / 503 / 500 before any event.
        """
        try:
            run = await self.chat.prepare(chat_request(body), raw_request, "msg")
        except APIError as e:
            raise renamed(e) from None
        timeout = self.chat.config.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            streams = await self.chat.add_requests(run.request_id, [run.prompt], [run.params],
                                                   0, None, "messages", deadline,
                                                   self.chat.models.lora_request(body.model))
        except APIError as e:
            raise renamed(e) from None
        outcome = _Outcome(MessagesResponse(
            id=run.request_id.replace("msg-", "msg_", 1), model=self.chat.model_name(body.model),
            usage=MessagesUsage(input_tokens=len(run.prompt.token_ids), output_tokens=0)))
        omit = body.thinking is not None and body.thinking.display == "omitted"
        if body.stream:
            return StreamingResponse(self._stream(run, streams, raw_request, outcome, omit),
                                     media_type="text/event-stream")
        async with self.chat.abort_on_disconnect(raw_request, streams):
            try:
                async for _ in self._run(run, streams[0], outcome, omit):
                    pass
            except Exception as e:
                raise self.chat.request_error(e) from e
        if not outcome.finished:          # aborted: the client went away
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(outcome.message.model_dump())

    async def _run(self, run: ChatRun, stream, outcome: _Outcome, omit_thinking: bool
                   ) -> AsyncIterator[dict]:
        """Drive one engine request: yields ``message_start`` at its first output, the
        content events as they come and ``message_delta`` once the engine finishes it;
        ``outcome`` is finished in place (content, stop reason, usage)."""
        parsed, builder = ParsedOutput(run), ContentBuilder(omit_thinking)
        message = outcome.message
        async for out in stream:
            if parsed.seq is None:
                self._usage(run, message, out.num_cached_tokens, 0)
                yield {"type": "message_start", "message": message.model_dump()}
                yield {"type": "ping"}
            for event in builder.add(parsed.feed(out)):
                yield event
        if not parsed.finished:                          # aborted: nothing is finished
            return
        for event in builder.finish():
            yield event
        message.content = builder.blocks
        message.stop_reason, message.stop_sequence = stop_reason(
            parsed.seq.finish_reason, parsed.seq.stop_reason, builder.has_tool_use)
        thinking = (await parsed.reasoning_tokens(self.chat.tokenizer)) if parsed.reasoned \
            else None
        self._usage(run, message, parsed.num_cached, len(parsed.token_ids), thinking)
        outcome.finished = True
        yield {"type": "message_delta",
               "delta": {"stop_reason": message.stop_reason,
                         "stop_sequence": message.stop_sequence},
               "usage": message.usage.model_dump(exclude_none=True)}

    def _usage(self, run: ChatRun, message: MessagesResponse, num_cached: int,
               output_tokens: int, thinking_tokens: int | None = None) -> None:
        cached = num_cached if self.chat.engine.args.enable_prefix_caching else 0
        message.usage = MessagesUsage(
            input_tokens=len(run.prompt.token_ids) - cached, cache_read_input_tokens=cached,
            output_tokens=output_tokens,
            output_tokens_details=None if thinking_tokens is None else
            OutputTokensDetails(thinking_tokens=thinking_tokens))

    async def _stream(self, run: ChatRun, streams, raw_request: Request,
                      outcome: _Outcome, omit_thinking: bool) -> AsyncIterator[str]:
        """The SSE events, then ``message_stop``; a failure mid-way is an ``error`` event
        (after ``message_start``, which a failure before any output sends first)."""
        started = False
        async with self.chat.abort_on_disconnect(raw_request, streams):
            try:
                async for event in self._run(run, streams[0], outcome, omit_thinking):
                    started = True
                    yield sse_event(event)
            except Exception as e:   # noqa: BLE001 - the stream has started: report in-band
                if not started:
                    yield sse_event({"type": "message_start",
                                     "message": outcome.message.model_dump()})
                yield sse_event(anthropic_error_body(self.chat.request_error(e)))
                return
        if outcome.finished:
            yield sse_event({"type": "message_stop"})


def stop_reason(finish: str, engine_stop: int | str | None, called: bool
                ) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished message, from the engine's finish
    reason and stop reason (the stop string that ended it, if one did) and whether the
    message holds a call."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None
