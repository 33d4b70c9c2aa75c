"""``POST /v1/chat/completions``: conversations rendered with the chat template, answered.

The prompt is the template's rendering (``--chat-template`` or the tokenizer's), counted in
tokens after rendering for the length rules. Logprobs use the chat shape
(``logprobs.content[]`` of ``{token, logprob, bytes, top_logprobs}``; BUGCASES B17); streams
open each choice with a ``role`` delta (B19). Tools and reasoning (``docs/tool_calling.md``):
the request side in :mod:`~jaxpaged.server.tool_calls`, the output split in
:mod:`~jaxpaged.server.chat_output`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from jaxpaged.chat_utils import ChatTemplateError, encode_chat, render_chat
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from jaxpaged.structured_output.grammar import after_reasoning
from jaxpaged.server.chat_output import ChoiceOutputParser, assistant_message, delta_messages
from jaxpaged.server.errors import bad_request, error_body
from jaxpaged.server.protocol_chat import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                           ChatCompletionRequest, ChatCompletionResponse,
                                           ChatLogprobs, ChatMessage, DeltaMessage, TokenLogprob,
                                           TokenizeRequest)
from jaxpaged.server.reasoning import REASONING_PARSERS
from jaxpaged.server.reasoning.think import thinking_enabled
from jaxpaged.server.serving import OpenAIServing, PreparedPrompt, clamp_logprob, off_loop, sse
from jaxpaged.server.usage import cached_tokens, usage
from jaxpaged.server.vllm_extras import (check_refused, continuous_usage, echo_text,
                                         prompt_logprobs_json, truncate_prompt)
from jaxpaged.server.tool_calls import (conversation_message, forced_call_schema,
                                        template_tools, tool_choice_of, tool_parser_for,
                                        with_forced_call)

#: Prompt tokens decoded for the reasoning parser's initial state (a pre-filled ``<think>``).
PROMPT_TAIL_TOKENS = 32


@dataclasses.dataclass
class ChatRun:
    """A checked chat request, ready for the engine.

    Attributes:
        request_id: ``{prefix}-<id>`` (engine request ``{request_id}-0``).
        prompt: the rendered prompt's ids and output limit.
        params: its sampling parameters.
        parser: makes a fresh :class:`ChoiceOutputParser` for one choice (no arguments).
    """

    request_id: str
    prompt: PreparedPrompt
    params: SamplingParams
    parser: Callable[[], ChoiceOutputParser]


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint (and chat rendering for ``/tokenize``)."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: dict | None = None,
               add_special_tokens: bool = False, chat_template: str | None = None,
               tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the chat template (``tools`` given to
        it as the ``tools`` variable).

        Raises:
            APIError 400: no messages, no template, the template's own error (its message
                unchanged), or an empty rendering.
        """
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        own = {name for name, p in inspect.signature(
            self.tokenizer.apply_chat_template).parameters.items()
            if p.kind != p.VAR_KEYWORD and name not in ("tools", "documents")}
        clash = sorted(own.intersection(template_kwargs or ()))
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {clash}: they are arguments "
                              "of the template rendering itself", "chat_template_kwargs")
        conversation = [conversation_message(m, i) for i, m in enumerate(messages)]
        if tools is not None:
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        try:
            text = render_chat(self.tokenizer, conversation,
                               chat_template or self.config.chat_template,
                               add_generation_prompt, continue_final_message, template_kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        except ValueError as e:
            raise bad_request(str(e), None) from None
        self.check_text_length(text, "messages")
        ids = (self.tokenizer.encode(text, add_special_tokens=True) if add_special_tokens
               else encode_chat(self.tokenizer, text))
        if not ids:
            raise bad_request("the chat template rendered these messages as an empty prompt",
                              "messages")
        return ids

    async def render_request(self, body: ChatCompletionRequest | TokenizeRequest,
                             add_special_tokens: bool) -> list[int]:
        """Prompt ids of a chat request's conversation, or a ``/tokenize`` request's: the
        same rendering arguments (``add_generation_prompt``, ``continue_final_message``,
        ``chat_template``, ``chat_template_kwargs`` over ``--default-chat-template-kwargs``,
        ``tools``, ``documents``), so ``/tokenize`` answers the ids chat runs.

        Raises:
            APIError 400: a ``chat_template`` without ``--trust-request-chat-template``;
                as :meth:`render`.
        """
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise bad_request("a chat_template in the request is refused: this server renders "
                              "only its own template (start it with "
                              "--trust-request-chat-template to accept them)", "chat_template")
        template_kwargs = {**(self.config.default_chat_template_kwargs or {}),
                           **(body.chat_template_kwargs or {})}
        if body.documents is not None:
            template_kwargs["documents"] = body.documents
        return await off_loop(self.render, body.messages, body.add_generation_prompt,
                              body.continue_final_message, template_kwargs, add_special_tokens,
                              body.chat_template, template_tools(body))

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        """Answer one chat request (JSON, or SSE when ``stream``).

        Raises:
            APIError: 400 (also for a ``chat_template`` without
                ``--trust-request-chat-template``) / 404 / 429 / 503 / 500, before any SSE is
                sent.
        """
        run = await self.prepare(body, raw_request)
        request_id, prompt, parser = run.request_id, run.prompt, run.parser
        return await self.respond(
            raw_request, body, request_id, [prompt], [run.params], "messages",
            lambda streams: self._stream(request_id, body, prompt, streams, raw_request,
                                         parser),
            lambda finals: self._response(request_id, body, prompt, finals[0], parser))

    async def prepare(self, body: ChatCompletionRequest, raw_request: Request,
                      prefix: str = "chatcmpl") -> ChatRun:
        """Check a chat request and turn it into what the engine runs: the rendered prompt,
        the sampling parameters (tools' forced-call grammar and the reasoning-aware
        structured output included) and the output parser. ``/v1/responses`` runs its
        translated requests through here too (``prefix`` ``resp``).

        Raises:
            APIError: 400 / 404 naming the chat request's field.
        """
        self.check_model(body.model)
        self.check_request(body)
        check_refused(body)
        if body.prompt_logprobs is not None and body.stream:
            raise bad_request("prompt_logprobs are not available when stream=true",
                              "prompt_logprobs")
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                                  f"{body.top_logprobs}", "top_logprobs")
        tool_choice = tool_choice_of(body, self.config)
        ids = truncate_prompt(await self.render_request(body, body.add_special_tokens),
                              body.truncate_prompt_tokens, self.engine.model_info.max_model_len)
        if body.max_completion_tokens is not None:
            limit_param, requested = "max_completion_tokens", body.max_completion_tokens
        else:
            limit_param, requested = "max_tokens", body.max_tokens
        max_tokens = self.resolve_max_tokens(len(ids), requested, None, "messages", limit_param)
        prompt = PreparedPrompt(None, ids, max_tokens)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling_params(body, max_tokens, k, body.prompt_logprobs, body.stream,
                                      {"logprobs": "top_logprobs", "max_tokens": limit_param},
                                      max_tokens_from_model=requested is None)
        if body.thinking_token_budget is None and self.config.reasoning_budget != -1:
            params = dataclasses.replace(      # --reasoning-budget: the server's default
                params, thinking_token_budget=self.config.reasoning_budget)
        tail = None
        if self.config.reasoning_parser:     # the reasoning parser's initial state reads it
            tail = await off_loop(self.tokenizer.decode, ids[-PROMPT_TAIL_TOKENS:],
                                  skip_special_tokens=False)
        schema = forced_call_schema(body, tool_choice)
        if schema is not None:      # "required" / a named function: the format is enforced
            params = with_forced_call(params, schema)
        parser = functools.partial(self._parser, body, tool_choice, tail,
                                   params.structured_outputs is not None)
        tools = parser().tools
        if tools is not None and tools.keeps_special_tokens:   # call markers may be special
            params = dataclasses.replace(params, skip_special_tokens=False)
        reasoning = parser().reasoning
        if reasoning is not None and params.structured_outputs is not None:
            opening = reasoning.grammar_opening()     # the grammar starts after the reasoning
            if opening is not None:
                try:
                    params = dataclasses.replace(params, structured_outputs=after_reasoning(
                        params.structured_outputs, reasoning.start, reasoning.end, opening))
                except SamplingParamsError as e:     # the wrapped grammar did not compile
                    raise bad_request(e.detail, "response_format") from None
        request_id = self.request_id(raw_request, prefix, body.request_id)
        return ChatRun(request_id, prompt, params, parser)

    def _parser(self, body: ChatCompletionRequest, tool_choice, prompt_tail: str | None,
                constrained: bool = False) -> ChoiceOutputParser:
        """A fresh output parser for one choice (``--reasoning-parser`` started in the state
        the end of the prompt, ``prompt_tail``, implies, knowing whether the request enables
        thinking and whether its output follows a grammar, ``constrained``)."""
        reasoning = None
        if self.config.reasoning_parser:
            thinking = thinking_enabled({**(self.config.default_chat_template_kwargs or {}),
                                         **(body.chat_template_kwargs or {})})
            reasoning = REASONING_PARSERS[self.config.reasoning_parser](
                prompt_tail, thinking=thinking, constrained=constrained)
        return ChoiceOutputParser(reasoning, tool_parser_for(body, tool_choice, self.config),
                                  tool_choice)

    def _response(self, request_id: str, body: ChatCompletionRequest, prompt: PreparedPrompt,
                  final: RequestOutput, parser) -> ChatCompletionResponse:
        choices, completion_tokens = [], 0
        for out in final.outputs:
            text, ids_out, logprobs = self._content(body, prompt, out)
            p = parser()
            parsed = p.parse(text)
            if not body.include_reasoning:
                parsed.reasoning = ""
            message = assistant_message(parsed, p.reasoning is not None or p.tools is not None)
            if body.echo and echo_text(body.messages):
                message.content = echo_text(body.messages) + (message.content or "")
            choices.append(ChatChoice(index=out.index, message=message, logprobs=logprobs,
                                      finish_reason=p.finish_reason(self._finish(prompt, out)),
                                      stop_reason=out.stop_reason,
                                      token_ids=list(ids_out) if body.return_token_ids else None))
            completion_tokens += len(ids_out)
        cached = cached_tokens(self.engine.args.enable_prefix_caching, [final.num_cached_tokens])
        response = ChatCompletionResponse(id=request_id, model=self.model_name(body.model),
                                          choices=choices,
                                          usage=usage([prompt], completion_tokens, cached),
                                          weight_version=final.weight_version)
        if body.prompt_logprobs is not None and final.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_json(final.prompt_logprobs)
        if body.return_token_ids:
            response.prompt_token_ids = prompt.token_ids
        return response

    @staticmethod
    def _finish(prompt: PreparedPrompt, out: CompletionOutput) -> str | None:
        if prompt.max_tokens == 0 and out.finish_reason is not None:
            return "length"
        return out.finish_reason

    def _content(self, body: ChatCompletionRequest, prompt: PreparedPrompt,
                 out: CompletionOutput) -> tuple[str, list[int], ChatLogprobs | None]:
        """Text, token ids and chat-shaped logprobs of one (delta or final) output."""
        if prompt.max_tokens == 0:
            return "", [], ChatLogprobs(content=[]) if body.logprobs else None
        if not body.logprobs:
            return out.text, out.token_ids, None
        k, as_ids, content = body.top_logprobs or 0, body.return_tokens_as_token_ids, []
        for token_id, entry in zip(out.token_ids, out.logprobs or []):
            sampled = entry[token_id]
            text = self.token_text(token_id, sampled, as_ids)
            content.append(TokenLogprob(token=text, logprob=clamp_logprob(sampled.logprob),
                                        bytes=self.token_bytes(token_id, text),
                                        top_logprobs=self.top_logprobs(entry, k, as_ids)))
        return out.text, out.token_ids, ChatLogprobs(content=content)

    @staticmethod
    def _chunk(request_id: str, model: str, choice: ChatChunkChoice, **fields) -> str:
        """One SSE chunk of one choice (``fields``: the chunk's ``usage``,
        ``prompt_token_ids``, ``weight_version``)."""
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice], **fields))

    async def _stream(self, request_id: str, body: ChatCompletionRequest, prompt: PreparedPrompt,
                      streams, raw_request: Request, parser) -> AsyncIterator[str]:
        parsers, model = [parser() for _ in range(body.n)], self.model_name(body.model)
        counts = [0] * body.n                # each choice's tokens so far

        def extra(index: int) -> dict:       # vLLM's continuous usage: this choice's counts
            return {"usage": usage([prompt], counts[index])} if continuous_usage(body) else {}

        echo = echo_text(body.messages) if body.echo else ""
        for index in range(body.n):
            ids = {"prompt_token_ids": prompt.token_ids} if body.return_token_ids else {}
            yield self._chunk(request_id, model, ChatChunkChoice(
                index=index, delta=DeltaMessage(role="assistant", content="")),
                **extra(index), **ids)
            if echo:
                yield self._chunk(request_id, model, ChatChunkChoice(
                    index=index, delta=DeltaMessage(content=echo)), **extra(index))
        completion_tokens, num_cached = 0, 0
        async with self.abort_on_disconnect(raw_request, streams):
            try:
                async for out in streams[0]:
                    num_cached = out.num_cached_tokens
                    for seq in out.outputs:
                        text, ids_out, logprobs = self._content(body, prompt, seq)
                        completion_tokens += len(ids_out)
                        counts[seq.index] += len(ids_out)
                        p, finish = parsers[seq.index], self._finish(prompt, seq)
                        delta = p.feed(text)
                        if finish:
                            delta.extend(p.finish())
                            finish = p.finish_reason(finish)
                        if not body.include_reasoning:
                            delta.reasoning = ""
                        deltas = delta_messages(delta)
                        token_ids = list(ids_out) if body.return_token_ids else None
                        if not deltas and (finish or token_ids or
                                           (logprobs is not None and logprobs.content)):
                            deltas = [DeltaMessage(content="")]
                        for i, message in enumerate(deltas):
                            last = finish if i == len(deltas) - 1 else None
                            yield self._chunk(request_id, model, ChatChunkChoice(
                                index=seq.index, delta=message,
                                logprobs=logprobs if i == 0 else None, finish_reason=last,
                                stop_reason=seq.stop_reason if last else None,
                                token_ids=token_ids if i == 0 else None),
                                weight_version=out.weight_version, **extra(seq.index))
            except Exception as e:   # noqa: BLE001 - the stream has started: report in-band
                yield sse(error_body(self.request_error(e)))
        opts = body.stream_options
        if opts is not None and opts.include_usage:
            cached = cached_tokens(self.engine.args.enable_prefix_caching, [num_cached])
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                          usage=usage([prompt], completion_tokens, cached)))
        yield sse("[DONE]")
