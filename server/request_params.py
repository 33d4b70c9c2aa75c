"""A request's checks, output limit and SamplingParams (what completions and chat share).

Length rules (vLLM's, with exact messages; BUGCASES B09, B11): a prompt longer than
``max_model_len`` is refused naming both lengths; ``prompt + max_tokens`` beyond
``max_model_len`` is refused naming the prompt, requested and allowed counts; a prompt of
exactly ``max_model_len`` tokens can only be scored (``max_tokens=0``). ``max_tokens`` null or
absent means the model's ``generation_config.json`` default, else the endpoint's (16 for
completions, the room left for chat), capped by the room left. Null sampling fields take the
model's defaults too: the engine's input processor applies them
(``SamplingParams.model_default_fields``).
"""

from __future__ import annotations

from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.protocol import SamplingFields
from jaxpaged.server.structured import structured_outputs_params


#: The request's sampling fields that a null leaves to the model's defaults.
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class RequestParameters:
    """The request-to-engine translation of :class:`~jaxpaged.server.serving.OpenAIServing`
    (which sets ``self.engine``, the running ``AsyncEngine``)."""

    def check_request(self, body: SamplingFields) -> None:
        """Checks both endpoints share beyond the schema.

        Raises:
            APIError 400: a feature this server lacks, ``logit_bias`` outside [-100, 100]
                (OpenAI's range), ``priority`` without ``--scheduling-policy priority``, or
                an empty ``cache_salt``, or ``stream_options`` without ``stream``.
        """
        name = body.unsupported()
        if name is not None:
            raise bad_request(f"{name} is not supported by this server", name)
        bad = {k: v for k, v in (body.logit_bias or {}).items() if not -100 <= v <= 100}
        if bad:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bad}",
                              "logit_bias")
        if body.priority != 0 and self.engine.args.scheduling_policy != "priority":
            raise bad_request("priority needs a server started with --scheduling-policy "
                              "priority", "priority")
        if body.cache_salt == "":
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options needs stream=true", "stream_options")

    # ---- limits and parameters --------------------------------------------------------------

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None,
                           default: int | None, prompt_param: str,
                           max_tokens_param: str) -> int:
        """The output limit of one prompt (0 = score the prompt only).

        Raises:
            APIError 400: the prompt or prompt + requested tokens do not fit the context.
        """
        limit = self.engine.model_info.max_model_len
        room = limit - num_prompt_tokens
        if room < 0:
            raise bad_request(f"This model's maximum context length is {limit} tokens, but the "
                              f"prompt has {num_prompt_tokens} tokens; shorten the prompt.",
                              prompt_param)
        if requested is not None and requested < 0:
            raise bad_request(f"{max_tokens_param} must be an integer >= 0, got {requested}",
                              max_tokens_param)
        if requested == 0:
            return 0
        if room == 0:
            raise bad_request(f"The prompt has {num_prompt_tokens} tokens, which leaves no room "
                              f"to generate: this model's maximum context length is {limit} "
                              f"tokens, so a prompt must be shorter than that to generate "
                              f"(or use {max_tokens_param}=0 to score it).", prompt_param)
        if requested is None:
            return min(default or room, room)
        if requested > room:
            raise bad_request(f"This model's maximum context length is {limit} tokens, but "
                              f"{num_prompt_tokens + requested} were requested ({num_prompt_tokens} "
                              f"in the prompt, {requested} for the output): at most {room} "
                              f"tokens can be generated for this prompt.", max_tokens_param)
        return requested

    def sampling_params(self, body: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, stream: bool,
                        param_names: dict[str, str] | None = None,
                        max_tokens_from_model: bool = False) -> SamplingParams:
        """SamplingParams of a request. The sampling fields it leaves null, and ``max_tokens``
        when ``max_tokens_from_model`` (the request gave no limit; ``max_tokens`` is then the
        endpoint's own default), are left to the model: the engine's input processor gives
        them the model's ``generation_config.json`` defaults where it has them
        (``SamplingParams.model_default_fields``); vLLM's defaults otherwise.
        ``max_tokens=0`` runs one token that the handler drops.

        Raises:
            APIError 400: naming the parameter and its allowed range.
        """
        unset = {name for name in _MODEL_DEFAULTS if getattr(body, name) is None}

        def pick(name, fallback):
            value = getattr(body, name)
            return value if value is not None else fallback

        try:
            logit_bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings), got "
                              f"{list(body.logit_bias)[:8]}", "logit_bias") from None
        try:
            return SamplingParams(
                n=body.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, max_tokens=max(max_tokens, 1),
                min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens,
                logit_bias=logit_bias or None, allowed_token_ids=body.allowed_token_ids,
                bad_words=body.bad_words, structured_outputs=structured_outputs_params(body),
                thinking_token_budget=body.thinking_token_budget,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                model_default_fields=frozenset(
                    unset | ({"max_tokens"} if max_tokens_from_model else set())))
        except SamplingParamsError as e:
            raise sampling_error(e, param_names) from None


def sampling_error(e: SamplingParamsError, param_names: dict[str, str] | None = None
                   ) -> APIError:
    """400 for a SamplingParams field, named as the request names it (``param_names`` maps
    SamplingParams names to request names, e.g. ``logprobs`` -> ``top_logprobs`` for chat)."""
    param = (param_names or {}).get(e.param, e.param)
    return bad_request(param + e.detail[len(e.param):], param)
