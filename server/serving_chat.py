"""``POST /v1/chat/completions``: conversations rendered with the chat template, answered.

The prompt is the template's rendering (``--chat-template`` or the tokenizer's), counted in
tokens after rendering for the length rules. Logprobs use the chat shape
(``logprobs.content[]`` of ``{token, logprob, bytes, top_logprobs}``; BUGCASES B17); streams
open each choice with a ``role`` delta (B19).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from jaxpaged.chat_utils import ChatTemplateError, encode_chat, render_chat
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.server.errors import bad_request, error_body
from jaxpaged.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                      ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                      DeltaMessage, TokenLogprob)
from jaxpaged.server.serving import (OpenAIServing, PreparedPrompt, clamp_logprob, off_loop, sse,
                                     usage)


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint (and chat rendering for ``/tokenize``)."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: dict | None = None,
               add_special_tokens: bool = False, chat_template: str | None = None) -> list[int]:
        """Token ids of a conversation rendered with the chat template.

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
        conversation = []
        for m in messages:
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(part.text for part in m.content)
            message = {"role": m.role, "content": content or ""}
            if m.name is not None:
                message["name"] = m.name
            conversation.append(message)
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

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        """Answer one chat request (JSON, or SSE when ``stream``).

        Raises:
            APIError: 400 (also for a ``chat_template`` without
                ``--trust-request-chat-template``) / 404 / 429 / 503 / 500, before any SSE is
                sent.
        """
        self.check_model(body.model)
        self.check_request(body)
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise bad_request("a chat_template in the request is refused: this server renders "
                              "only its own template (start it with "
                              "--trust-request-chat-template to accept them)", "chat_template")
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                                  f"{body.top_logprobs}", "top_logprobs")
        ids = await off_loop(self.render, body.messages, body.add_generation_prompt,
                             body.continue_final_message, body.chat_template_kwargs,
                             body.add_special_tokens, body.chat_template)
        if body.max_completion_tokens is not None:
            limit_param, requested = "max_completion_tokens", body.max_completion_tokens
        else:
            limit_param, requested = "max_tokens", body.max_tokens
        max_tokens = self.resolve_max_tokens(
            len(ids), requested, self.engine.engine.generation_defaults.get("max_tokens"),
            "messages", limit_param)
        prompt = PreparedPrompt(None, ids, max_tokens)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling_params(body, max_tokens, k, None, body.stream,
                                      {"logprobs": "top_logprobs", "max_tokens": limit_param})
        request_id = self.request_id(raw_request, "chatcmpl")
        return await self.respond(
            raw_request, body, request_id, [prompt], [params], "messages",
            lambda streams: self._stream(request_id, body, prompt, streams, raw_request),
            lambda finals: self._response(request_id, body, prompt, finals[0]))

    def _response(self, request_id: str, body: ChatCompletionRequest, prompt: PreparedPrompt,
                  final: RequestOutput) -> ChatCompletionResponse:
        choices, completion_tokens = [], 0
        for out in final.outputs:
            text, ids_out, logprobs = self._content(body, prompt, out)
            choices.append(ChatChoice(index=out.index, message=AssistantMessage(content=text),
                                      logprobs=logprobs, finish_reason=self._finish(prompt, out),
                                      stop_reason=out.stop_reason))
            completion_tokens += len(ids_out)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=usage([prompt], completion_tokens))

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

    def _chunk(self, request_id: str, choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[choice]))

    async def _stream(self, request_id: str, body: ChatCompletionRequest, prompt: PreparedPrompt,
                      streams, raw_request: Request) -> AsyncIterator[str]:
        for index in range(body.n):
            yield self._chunk(request_id, ChatChunkChoice(
                index=index, delta=DeltaMessage(role="assistant", content="")))
        completion_tokens = 0
        async with self.abort_on_disconnect(raw_request, streams):
            try:
                async for out in streams[0]:
                    for seq in out.outputs:
                        text, ids_out, logprobs = self._content(body, prompt, seq)
                        completion_tokens += len(ids_out)
                        finish = self._finish(prompt, seq)
                        if text or finish or (logprobs is not None and logprobs.content):
                            yield self._chunk(request_id, ChatChunkChoice(
                                index=seq.index, delta=DeltaMessage(content=text),
                                logprobs=logprobs, finish_reason=finish,
                                stop_reason=seq.stop_reason if finish else None))
            except Exception as e:   # noqa: BLE001 - the stream has started: report in-band
                yield sse(error_body(self.request_error(e)))
        opts = body.stream_options
        if opts is not None and opts.include_usage:
            yield sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                          usage=usage([prompt], completion_tokens)))
        yield sse("[DONE]")
