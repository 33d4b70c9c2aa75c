"""The soak's ``/v1/responses`` requests (``benchmarks/soak.py``): a fraction of the text
workload sent as Responses requests, their answers and typed event streams read and checked.

A converted request keeps the workload's text (as ``input``), output limit
(``max_output_tokens``), stream flag, hang-up and the sampling fields the Responses request
has (OpenAI's ``temperature`` / ``top_p``, vLLM's ``top_k``, ``min_p``, ``seed``,
``repetition_penalty``, ``stop``, ``ignore_eos``); its offline prompt is the chat rendering
of that text as one user message (``/tokenize``), which the server runs. A Responses answer
has no token ids, so it is compared with offline ``LLM.generate`` by text, finish
(``completed`` is ``stop``, ``incomplete`` is ``length``) and ``usage.output_tokens``.

A stream is a problem unless its ``sequence_number`` runs 0, 1, 2, ..., it opens with
``response.created`` then ``response.in_progress``, ends with ``response.completed`` or
``response.incomplete``, and its ``response.output_text.delta`` events join to the final
response's text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxpaged.sampling_params import SamplingParams

RESPONSES_PATH = "/v1/responses"
#: The workload's sampling fields a Responses request carries.
KEPT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop",
               "ignore_eos")
#: The last event of a finished stream, and the ``finish_reason`` its status stands for.
FINISHES = {"response.completed": "stop", "response.incomplete": "length"}


def as_responses(requests: list, fraction: float, seed: int,
                 chat_prompt: Callable[[str], list[int]]) -> list:
    """``requests`` with a seeded ``fraction`` of those with a text prompt sent to
    ``/v1/responses`` instead (same index, ``X-Request-Id`` and hang-up; ``n`` 1)."""
    rng = np.random.default_rng([seed, 24])
    out = []
    for req in requests:
        text = req.body["messages"][0]["content"] if req.chat else req.body["prompt"]
        if rng.random() >= fraction or not isinstance(text, str):
            out.append(req)
            continue
        fields = {k: req.body[k] for k in KEPT_FIELDS if k in req.body}
        body = {"model": req.body["model"], "input": text, "stream": req.body["stream"],
                "max_output_tokens": req.params.max_tokens, **fields}
        out.append(dataclasses.replace(
            req, path=RESPONSES_PATH, body=body, prompt=chat_prompt(text),
            params=SamplingParams(max_tokens=req.params.max_tokens, **fields)))
    return out


def output_text(response: dict) -> str:
    """The text of a response's message items (the client's ``output_text``)."""
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def read_answer(res, response: dict) -> None:
    """Fill a soak result from a non-streaming Responses answer."""
    finish = {"completed": "stop", "incomplete": "length"}.get(response["status"])
    if response.get("object") != "response" or finish is None:
        res.error = f"not a finished response: {str(response)[:300]}"
        return
    res.texts[0] = output_text(response)
    res.finishes[0].append(finish)
    res.completion_tokens = response["usage"]["output_tokens"]
    res.prompt_tokens = response["usage"]["input_tokens"]
    res.done = True


def read_event(res, event: dict, state: dict) -> None:
    """Fill a soak result from one stream event (``state`` holds the stream's count and
    text so far)."""
    number, kind = event.get("sequence_number"), event.get("type")
    expected = state.setdefault("next", 0)
    state["next"] = expected + 1
    if kind in ("error", "response.failed"):
        res.error = f"in-band error: {event}"
    elif number != expected:
        res.error = f"event {kind} has sequence_number {number}, expected {expected}"
    elif expected < 2 and kind != ("response.created", "response.in_progress")[expected]:
        res.error = f"event {expected} is {kind}"
    elif kind == "response.output_text.delta":
        state["text"] = state.get("text", "") + event["delta"]
    elif kind in FINISHES:
        response = event["response"]
        if output_text(response) != state.get("text", ""):
            res.error = (f"the deltas join to {state.get('text', '')!r}, the final text is "
                         f"{output_text(response)!r}")
            return
        res.texts[0] = state.get("text", "")
        res.finishes[0].append(FINISHES[kind])
        res.completion_tokens = response["usage"]["output_tokens"]
        res.prompt_tokens = response["usage"]["input_tokens"]
        res.done = True


def check_answer(req, res) -> list[str]:
    """Problems with the shape of a completed Responses answer."""
    finishes = res.finishes.get(0, [])
    problems = [] if len(finishes) == 1 else [f"finishes {finishes}, expected one"]
    if not 1 <= (res.completion_tokens or 0) <= req.params.max_tokens:
        problems.append(f"{res.completion_tokens} output tokens, max_output_tokens is "
                        f"{req.params.max_tokens}")
    return problems


def compare(res, offline) -> list[str]:
    """Differences between a completed Responses answer and the offline output."""
    o, problems = offline.outputs[0], []
    if res.texts.get(0, "") != o.text:
        problems.append(f"text {res.texts.get(0, '')!r} != offline {o.text!r}")
    if res.finishes.get(0, [None])[-1] != o.finish_reason:
        problems.append(f"finish {res.finishes.get(0)} != offline {o.finish_reason}")
    if res.completion_tokens != len(o.token_ids):
        problems.append(f"usage {res.completion_tokens} output tokens != offline "
                        f"{len(o.token_ids)}")
    return problems
