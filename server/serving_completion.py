"""``POST /v1/completions``: prompts (text, token ids, or lists of either) to completions.

Choices are indexed ``prompt_index * n + sequence_index`` (OpenAI's order). ``echo`` puts the
prompt before each choice's text (and its logprobs first, the first one null);
``max_tokens=0`` with ``echo`` scores the prompt only (lm-evaluation-harness; BUGCASES B10).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.server.errors import bad_request, error_body
from jaxpaged.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse)
from jaxpaged.server.serving import (OpenAIServing, PreparedPrompt, clamp_logprob, merge_streams,
                                     off_loop, sse)
from jaxpaged.server.usage import cached_tokens, usage
from jaxpaged.server.vllm_extras import (check_refused, continuous_usage, prompt_logprobs_json,
                                         truncate_prompt)

#: OpenAI's default ``max_tokens`` for legacy completions.
DEFAULT_MAX_TOKENS = 16


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint."""

    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        """Answer one completions request (JSON, or SSE when ``stream``).

        Raises:
            APIError: 400 for invalid parameters or prompts, 404 for an unknown model,
                503/500 when the engine cannot run it. Raised before any SSE is sent.
        """
        self.check_model(body.model)
        self.check_request(body)
        check_refused(body)
        if body.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request(f"best_of must equal n (best_of > n is not supported), got "
                              f"best_of={body.best_of}, n={body.n}", "best_of")
        prompts = await off_loop(self._prepare_prompts, body)
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = body.logprobs
        params = [self.sampling_params(body, p.max_tokens, body.logprobs, prompt_logprobs,
                                       body.stream, max_tokens_from_model=body.max_tokens is None)
                  for p in prompts]
        request_id = self.request_id(raw_request, "cmpl", body.request_id)
        return await self.respond(
            raw_request, body, request_id, prompts, params, "prompt",
            lambda streams: self._stream(request_id, body, prompts, streams, raw_request),
            lambda finals: self._response(request_id, body, prompts, finals))

    def _response(self, request_id: str, body: CompletionRequest, prompts: list[PreparedPrompt],
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for i, (prompt, final) in enumerate(zip(prompts, finals)):
            for out in final.outputs:
                choice, n_tokens, _ = self._choice(body, prompt, final, out, offset=None)
                choice.index = i * body.n + out.index
                choices.append(choice)
                completion_tokens += n_tokens
        cached = cached_tokens(self.engine.args.enable_prefix_caching,
                               (f.num_cached_tokens for f in finals))
        return CompletionResponse(id=request_id, model=self.model_name(body.model),
                                  choices=choices, usage=usage(prompts, completion_tokens, cached),
                                  weight_version=max(f.weight_version for f in finals))

    def _prepare_prompts(self, body: CompletionRequest) -> list[PreparedPrompt]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        prepared = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt must not be empty (an empty string)", "prompt")
                self.check_text_length(p, "prompt")
                text, ids = p, self.tokenizer.encode(p, add_special_tokens=body.add_special_tokens)
            else:
                if not p:
                    raise bad_request("prompt must not be empty (no token ids)", "prompt")
                text, ids = None, list(p)
            truncated = truncate_prompt(ids, body.truncate_prompt_tokens,
                                        self.engine.model_info.max_model_len)
            if len(truncated) < len(ids):     # echo the prompt that ran
                text, ids = None, truncated
            max_tokens = self.resolve_max_tokens(len(ids), body.max_tokens, DEFAULT_MAX_TOKENS,
                                                 "prompt", "max_tokens")
            prepared.append(PreparedPrompt(text, ids, max_tokens))
        return prepared

    def _prompt_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids)

    def _choice(self, body: CompletionRequest, prompt: PreparedPrompt, final: RequestOutput,
                out: CompletionOutput, offset: int | None) -> tuple[CompletionChoice, int, int]:
        """A choice for one (delta or final) output, how many tokens it adds to usage, and
        the text offset after it. ``offset`` is None for the index's first piece (where echo
        and prompt logprobs go), else the offset its logprobs continue from."""
        first = offset is None
        score_only = prompt.max_tokens == 0
        text = "" if score_only else out.text
        ids = [] if score_only else out.token_ids
        logprob_entries = [] if score_only or out.logprobs is None else out.logprobs
        if body.echo and first:
            text = self._prompt_text(prompt) + text
        logprobs, end = None, (offset or 0)
        if body.logprobs is not None:
            positions = list(zip(ids, logprob_entries))
            prompt_positions = []
            if body.echo and first:
                prompt_positions = list(zip(prompt.token_ids, final.prompt_logprobs or []))
            texts = self._prompt_token_texts(prompt.token_ids) if prompt_positions else None
            logprobs, end = self._logprobs(prompt_positions, body, end, texts)
            generated, end = self._logprobs(positions, body, end)
            for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                getattr(logprobs, name).extend(getattr(generated, name))
        finish = out.finish_reason
        if score_only and finish is not None:
            finish = "length"
        choice = CompletionChoice(index=out.index, text=text, logprobs=logprobs,
                                  finish_reason=finish,
                                  stop_reason=None if score_only else out.stop_reason)
        if first and body.prompt_logprobs is not None and final.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_json(final.prompt_logprobs)
        if body.return_token_ids:
            choice.token_ids = list(ids)
            if first:
                choice.prompt_token_ids = prompt.token_ids
        return choice, len(ids), end

    def _prompt_token_texts(self, ids: list[int]) -> list[str]:
        """Each prompt token's share of the decoded prompt, so that they join to it exactly
        (a token inside an unfinished UTF-8 sequence gets "" and the one completing it the
        character). Quadratic in the prompt length; used only to echo logprobs."""
        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        texts, done = [], 0
        for i in range(1, len(ids) + 1):
            part = self.tokenizer.decode(ids[:i], skip_special_tokens=True)
            end = len(part) if full.startswith(part) else done
            texts.append(full[done:end])
            done = end
        texts[-1] += full[done:]
        return texts

    def _logprobs(self, positions: list[tuple[int, dict[int, Logprob] | None]],
                  body: CompletionRequest, offset: int, texts: list[str] | None = None
                  ) -> tuple[CompletionLogprobs, int]:
        """Completions-shaped logprobs of ``positions``, text offsets counted from
        ``offset`` (``texts``: the tokens' texts, when not the engine's); returns them and
        the offset after the last token."""
        lp = CompletionLogprobs()
        as_ids = body.return_tokens_as_token_ids
        for i, (token_id, entry) in enumerate(positions):
            if as_ids:
                text = f"token_id:{token_id}"
            elif texts is not None:
                text = texts[i]
            else:
                text = entry[token_id].decoded_token or ""
            if entry is None:   # the first prompt token has no logprob
                lp.tokens.append(text)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                lp.tokens.append(text)
                lp.token_logprobs.append(clamp_logprob(entry[token_id].logprob))
                # the token's own entry is keyed by its text in ``tokens`` (an echoed prompt
                # token's share of the prompt may differ from its decoded piece) and wins a
                # clash with another token decoding to the same text
                top = {}
                for t, v in entry.items():
                    if t == token_id:
                        top[text] = lp.token_logprobs[-1]
                    elif v.rank is not None and v.rank <= body.logprobs:
                        top.setdefault(self.token_text(t, v, as_ids), clamp_logprob(v.logprob))
                lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp, offset

    async def _stream(self, request_id: str, body: CompletionRequest,
                      prompts: list[PreparedPrompt], streams, raw_request: Request
                      ) -> AsyncIterator[str]:
        model = self.model_name(body.model)
        offsets: dict[int, int] = {}     # per choice index: where its next text starts
        num_cached: dict[int, int] = {}  # per prompt: its prefix-cache hits
        completion_tokens, per_prompt = 0, [0] * len(prompts)
        async with self.abort_on_disconnect(raw_request, streams):
            try:
                async for i, out in merge_streams(streams):
                    num_cached[i] = out.num_cached_tokens
                    choices = []
                    for seq in out.outputs:
                        index = i * body.n + seq.index
                        choice, n_tokens, offsets[index] = self._choice(
                            body, prompts[i], out, seq, offsets.get(index))
                        choice.index = index
                        completion_tokens += n_tokens
                        per_prompt[i] += n_tokens
                        if choice.text or choice.finish_reason or choice.logprobs or \
                                choice.token_ids:
                            choices.append(choice)
                    if choices:
                        chunk = CompletionResponse(id=request_id, model=model, choices=choices,
                                                   weight_version=out.weight_version)
                        if continuous_usage(body):    # vLLM: this prompt's counts so far
                            chunk.usage = usage([prompts[i]], per_prompt[i])
                        yield sse(chunk)
            except Exception as e:   # noqa: BLE001 - the stream has started: report in-band
                yield sse(error_body(self.request_error(e)))
        opts = body.stream_options
        if opts is not None and opts.include_usage:
            cached = cached_tokens(self.engine.args.enable_prefix_caching, num_cached.values())
            yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                         usage=usage(prompts, completion_tokens, cached)))
        yield sse("[DONE]")

