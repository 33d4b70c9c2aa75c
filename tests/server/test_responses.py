"""Issue 24 part 1: ``POST /v1/responses`` through the official ``openai`` client, unmodified,
against the shared live server: text equal to chat's for the same conversation and sampling,
the incomplete status, stream events in OpenAI's order, a function-call round trip, the
structured formats, reasoning items, and the opt-in store."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.server.conftest import MODEL

USER = "Lily and Ben went to the park"
INSTRUCTIONS = "Tell a story."
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": USER}]
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}}


def chat(client, messages=MESSAGES, max_tokens=12, **fields):
    return client.chat.completions.create(model=MODEL, messages=messages,
                                          max_completion_tokens=max_tokens, **fields)


def respond(client, max_tokens=12, **fields):
    fields.setdefault("input", USER)
    fields.setdefault("instructions", INSTRUCTIONS)
    return client.responses.create(model=MODEL, max_output_tokens=max_tokens, **fields)


def prompt_ids(http, messages) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def bad(http, param: str, *words: str, **body):
    r = http.post("/v1/responses", json={"model": MODEL, "input": USER, **body})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and all(w in e["message"] for w in words), e


@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 1.0, "extra_body": {"seed": 7}}])
def test_text_equals_chat_for_the_same_messages(client, http, sampling):
    answer = chat(client, **sampling)
    r = respond(client, input=[{"role": "user", "content": [
        {"type": "input_text", "text": USER}]}], metadata={"k": "v"}, **sampling)
    status = "incomplete" if answer.choices[0].finish_reason == "length" else "completed"
    assert r.object == "response" and r.id.startswith("resp_") and r.status == status
    assert r.output_text == answer.choices[0].message.content and r.output_text
    message = r.output[0]
    assert [o.type for o in r.output] == ["message"] and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == status
    assert r.usage.input_tokens == answer.usage.prompt_tokens == len(prompt_ids(http, MESSAGES))
    assert r.usage.output_tokens == answer.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = chat(client, **sampling)        # the same prompt: the same prefix-cache hit
    assert r.usage.input_tokens_details.cached_tokens == \
        again.usage.prompt_tokens_details.cached_tokens > 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"k": "v"} and r.instructions == INSTRUCTIONS
    assert r.temperature == sampling["temperature"] and r.max_output_tokens == 12


def test_incomplete_at_max_output_tokens(client, http):
    r = respond(client, max_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    assert r.output_text == chat(client, max_tokens=3, temperature=0).choices[0].message.content
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": USER,
                                                    "max_output_tokens": 3, "stream": True,
                                                    "temperature": 0}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_stream_events_in_order_and_deltas_join_to_the_text(client):
    stop = {"stop": ["."]}                     # ends the story's first sentence: completed
    whole = respond(client, temperature=0, max_tokens=60, extra_body=stop)
    with client.responses.stream(model=MODEL, input=USER, instructions=INSTRUCTIONS,
                                 max_output_tokens=60, temperature=0,
                                 extra_body=stop) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas                   # how many follows timing: chunks coalesce
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] *
                     len(deltas), "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == final.output_text == whole.output_text
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events[2:-1])
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id and whole.status == "completed"


def test_function_call_round_trip(client, http):
    first = respond(client, temperature=0, max_tokens=30, tools=[WEATHER],
                    tool_choice={"type": "function", "name": "get_weather"})
    call = first.output[0]
    assert [o.type for o in first.output] == ["function_call"] and first.status == "completed"
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    with client.responses.stream(model=MODEL, input=USER, instructions=INSTRUCTIONS,
                                 max_output_tokens=30, temperature=0, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}
                                 ) as stream:
        events = list(stream)
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == call.arguments
    types = [e.type.removeprefix("response.") for e in events]
    assert types == ["created", "in_progress", "output_item.added", *[
        "function_call_arguments.delta"] * (len(types) - 6), "function_call_arguments.done",
        "output_item.done", "completed"]
    turn = [{"role": "user", "content": USER}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = respond(client, input=turn, temperature=0, tools=[WEATHER], tool_choice="none")
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [{
        "id": call.call_id, "type": "function",
        "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    answer = chat(client, messages=messages, temperature=0)
    assert second.output_text == answer.choices[0].message.content
    assert second.usage.input_tokens == len(prompt_ids(http, messages))


VERDICT = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
           "required": ["answer"], "additionalProperties": False}


@pytest.mark.parametrize("fmt, response_format", [
    ({"type": "json_schema", "name": "verdict", "strict": True, "schema": VERDICT},
     {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True,
                                             "schema": VERDICT}}),
    ({"type": "json_object"}, {"type": "json_object"})])
def test_text_formats_equal_chats_response_format(client, fmt, response_format):
    r = respond(client, temperature=0, max_tokens=40, text={"format": fmt})
    answer = chat(client, max_tokens=40, temperature=0, response_format=response_format)
    assert r.output_text == answer.choices[0].message.content
    assert r.output_text.startswith("{") and r.text.format.type == fmt["type"]


def test_json_schema_output_parses(client):
    schema = {"type": "string", "enum": ["yes", "no"]}
    r = respond(client, temperature=0, max_tokens=10, text={"format": {
        "type": "json_schema", "name": "verdict", "schema": schema}})
    assert r.status == "completed" and json.loads(r.output_text) in ("yes", "no")


def test_reasoning_items_and_tokens(client, live_server):
    with live_server.configured(reasoning_parser="deepseek_r1"):  # untagged: all reasoning
        answer = chat(client, temperature=0)
        r = respond(client, temperature=0, reasoning={"effort": "low"})
    item = r.output[0]
    assert [o.type for o in r.output] == ["reasoning"] and item.id.startswith("rs_")
    assert item.content[0].text == answer.choices[0].message.reasoning
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
    assert r.reasoning.effort == "low"


def test_store_previous_response_id_and_background(client, http, live_server):
    for field in ({"store": True}, {"previous_response_id": "resp_x"}, {"background": True}):
        bad(http, next(iter(field)), "--responses-store-size", **field)
    assert http.get("/v1/responses/resp_x").status_code == 400
    with live_server.configured(responses_store_size=2):
        first = respond(client, temperature=0)
        assert first.store and client.responses.retrieve(first.id).output_text == \
            first.output_text
        follow = respond(client, temperature=0, input="And then?",
                         previous_response_id=first.id, instructions=None)
        messages = [{"role": "user", "content": USER},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And then?"}]
        assert follow.usage.input_tokens == len(prompt_ids(http, messages))
        assert follow.output_text == chat(client, messages=messages,
                                          temperature=0).choices[0].message.content
        queued = respond(client, temperature=0, background=True)
        assert queued.status == "queued"
        deadline = time.monotonic() + 30
        while (got := client.responses.retrieve(queued.id)).status == "queued":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert got.status == first.status and got.output_text == first.output_text
        with pytest.raises(openai.NotFoundError):      # LRU: the oldest of three is gone
            client.responses.retrieve(first.id)
        client.responses.delete(queued.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(queued.id)
        assert not respond(client, temperature=0, store=False).store
        bad(http, "background", "stream=false", background=True, stream=True)
        bad(http, "background", "store", background=True, store=False)
        with pytest.raises(openai.NotFoundError):
            respond(client, previous_response_id="resp_unknown")


def test_fields_that_ask_for_nothing_are_accepted(http):
    """What clients (e.g. Codex) send by default: empty or null values of features this
    server does not have."""
    r = http.post("/v1/responses", json={"model": MODEL, "input": USER, "max_output_tokens": 2,
                                         "include": [], "top_logprobs": 0,
                                         "max_tool_calls": None, "conversation": None,
                                         "prompt": None})
    assert r.status_code == 200, r.text
    bad(http, "top_logprobs", top_logprobs=2)
    bad(http, "conversation", conversation="conv_1")


def test_unknown_and_unsupported_fields_are_400s_naming_them(http):
    bad(http, "include", "include", include=["message.output_text.logprobs"])
    bad(http, "tools", tools=[{"type": "web_search"}])
    bad(http, "input", "text only", input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}])
    bad(http, "max_output_tokens", ">= 1", max_output_tokens=0)
    bad(http, "tool_choice", "tools", tool_choice="required")
    bad(http, "input", "empty", input=[])
    bad(http, "truncation", truncation="auto")
    bad(http, "max_output_tokens", "500", "at most", max_output_tokens=500)
    bad(http, "tool_choice", "--enable-auto-tool-choice", tools=[WEATHER])   # "auto"


def test_store_flag_reaches_the_config_and_the_store_is_lru():
    from jaxpaged.cli import build_parser
    from jaxpaged.server.errors import APIError
    from jaxpaged.server.server_args import server_config
    from jaxpaged.server.protocol_responses import ResponseObject
    from jaxpaged.server.responses_store import ResponsesStore, StoredResponse

    parse = build_parser().parse_args
    assert server_config(parse(["serve", "--responses-store-size", "3"])).responses_store_size \
        == 3
    assert server_config(parse(["serve"])).responses_store_size == 0
    store = ResponsesStore(2)
    for name in "abc":
        if name == "c":
            store.get("a")                          # a used again: b is the oldest
        store.put(StoredResponse(ResponseObject(id=name, status="completed", model=MODEL), []))
    assert len(store) == 2 and store.get("a").response.id == "a"
    with pytest.raises(APIError, match="'b' not found"):
        store.get("b")
    # Running (background) responses are never dropped: the finished ones go first, and
    # the store overflows only while more than its capacity run.
    for name in ("q1", "q2", "q3"):
        store.put(StoredResponse(ResponseObject(id=name, status="queued", model=MODEL), []))
    assert len(store) == 3 and all(store.get(n) for n in ("q1", "q2", "q3"))
    store.put(StoredResponse(ResponseObject(id="q1", status="completed", model=MODEL), []))
    store.put(StoredResponse(ResponseObject(id="d", status="completed", model=MODEL), []))
    assert sorted(i for i in ("q1", "q2", "q3", "d") if i in store._entries) == ["q2", "q3"]


def test_cancel_a_background_response(client, http, live_server):
    from tests.server.conftest import wait_engine_empty

    with live_server.configured(responses_store_size=4), live_server.slow_steps(0.05):
        queued = respond(client, temperature=0, max_tokens=60, background=True)
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled"
        wait_engine_empty(live_server, timeout=30)    # aborted: every page free again
        assert client.responses.retrieve(queued.id).status == "cancelled"
        r = http.post(f"/v1/responses/{queued.id}/cancel")
        assert r.status_code == 400 and "cancelled" in r.json()["error"]["message"]
