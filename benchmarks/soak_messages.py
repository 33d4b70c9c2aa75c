"""The soak's ``/v1/messages`` requests (``benchmarks/soak.py``): a fraction of the text
workload sent as Anthropic Messages requests, their answers and event streams read and
checked.

A converted request keeps the workload's text (as one user message), output limit
(``max_tokens``), stream flag, hang-up and the sampling fields the Messages route reads
(Anthropic's ``temperature`` / ``top_p`` / ``top_k``, ``stop`` as ``stop_sequences``, and
chat's extras ``min_p``, ``seed``, ``repetition_penalty``, ``ignore_eos``); its offline
prompt is the chat rendering of that text as one user message (``/tokenize``), which the
server runs. Like a Responses answer it has no token ids, so it is compared with offline
``LLM.generate`` by text, finish (``end_turn`` and ``stop_sequence`` are ``stop``,
``max_tokens`` is ``length``) and ``usage.output_tokens``
(:func:`jaxpaged.benchmarks.soak_responses.compare`).

A stream is a problem unless it opens with ``message_start``, its blocks start, take deltas
and stop in index order, ``message_delta`` comes after the last block with the stop reason,
and ``message_stop`` ends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxpaged.sampling_params import SamplingParams

MESSAGES_PATH = "/v1/messages"
#: The workload's sampling fields a Messages request carries (``stop`` renamed).
KEPT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop",
               "ignore_eos")
#: ``stop_reason`` -> the offline ``finish_reason`` it stands for.
FINISHES = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}
#: The paths whose text requests may be converted.
CONVERTIBLE = ("/v1/completions", "/v1/chat/completions")


def as_messages(requests: list, fraction: float, seed: int,
                chat_prompt: Callable[[str], list[int]]) -> list:
    """``requests`` with a seeded ``fraction`` of the completions and chat requests with a
    text prompt sent to ``/v1/messages`` instead (same index, ``X-Request-Id`` and hang-up;
    ``n`` 1)."""
    rng = np.random.default_rng([seed, 43])
    out = []
    for req in requests:
        if req.path not in CONVERTIBLE:
            out.append(req)
            continue
        text = req.body["messages"][0]["content"] if req.chat else req.body["prompt"]
        if rng.random() >= fraction or not isinstance(text, str):
            out.append(req)
            continue
        fields = {k: req.body[k] for k in KEPT_FIELDS if k in req.body}
        body = {"model": req.body["model"], "messages": [{"role": "user", "content": text}],
                "max_tokens": req.params.max_tokens, "stream": req.body["stream"],
                **{("stop_sequences" if k == "stop" else k): v for k, v in fields.items()}}
        out.append(dataclasses.replace(
            req, path=MESSAGES_PATH, body=body, prompt=chat_prompt(text),
            params=SamplingParams(max_tokens=req.params.max_tokens, **fields)))
    return out


def _finish(res, stop_reason: str | None, usage: dict) -> bool:
    finish = FINISHES.get(stop_reason)
    if finish is None:
        res.error = f"stop_reason {stop_reason!r} is not one of {sorted(FINISHES)}"
        return False
    res.finishes[0].append(finish)
    res.completion_tokens = usage["output_tokens"]
    res.prompt_tokens = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    return True


def read_answer(res, message: dict) -> None:
    """Fill a soak result from a non-streaming Messages answer."""
    if message.get("type") != "message":
        res.error = f"not a message: {str(message)[:300]}"
        return
    res.texts[0] = "".join(b["text"] for b in message["content"] if b["type"] == "text")
    res.done = _finish(res, message.get("stop_reason"), message["usage"])


def read_event(res, event: dict, state: dict) -> None:
    """Fill a soak result from one stream event (``state`` holds the stream's open block,
    how many blocks started, the text so far and whether ``message_delta`` came)."""
    kind, seen = event.get("type"), state.setdefault("seen", 0)
    state["seen"] = seen + 1
    started = state.setdefault("started", 0)
    if kind == "error":
        res.error = f"in-band error: {event}"
    elif seen == 0 and kind != "message_start":
        res.error = f"the stream opens with {kind}"
    elif kind == "content_block_start":
        if event["index"] != started or state.get("open") is not None:
            res.error = f"block {event['index']} starts after {started} blocks, " \
                        f"open: {state.get('open')}"
        state["open"], state["started"] = event["index"], started + 1
        state["block"] = event["content_block"]["type"]
    elif kind in ("content_block_delta", "content_block_stop"):
        if event["index"] != state.get("open"):
            res.error = f"{kind} for block {event['index']}, open: {state.get('open')}"
        elif kind == "content_block_stop":
            state["open"] = None
        elif event["delta"]["type"] == "text_delta":
            state["text"] = state.get("text", "") + event["delta"]["text"]
    elif kind == "message_delta":
        if state.get("open") is not None:
            res.error = f"message_delta while block {state['open']} is open"
        elif _finish(res, event["delta"].get("stop_reason"), event["usage"]):
            state["delta"] = True
    elif kind == "message_stop":
        if not state.get("delta"):
            res.error = "message_stop without message_delta"
            return
        res.texts[0] = state.get("text", "")
        res.done = True
