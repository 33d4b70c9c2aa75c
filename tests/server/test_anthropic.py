"""Issue 43 part 2: Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``
through the official ``anthropic`` client, unmodified, against the shared live server: text,
stop reasons and usage equal chat's for the same conversation and the stream the client
assembles equals the JSON answer; ``tool_choice`` ``any`` / ``tool`` give input valid for the
schema and the call round-trips into the next turn; thinking blocks from the reasoning
parser; ``x-api-key``; errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import pytest
from anthropic.types import Message
from starlette.testclient import TestClient

from jaxpaged.benchmarks.soak_workload import FAULT_MARK, injecting_faults
from jaxpaged.server.anthropic_stream import ContentBuilder, signature, sse_event
from jaxpaged.server.chat_output import ChoiceDelta
from jaxpaged.server.launcher import make_server
from jaxpaged.server.serving import ServerConfig
from jaxpaged.server.tool_parsers import ToolCallDelta
from tests.server.conftest import MODEL, engine_args

try:                       # the client's HTTP library (httpx2 from anthropic 2.x on)
    import httpx2 as sdk_http
except ImportError:        # pragma: no cover - older clients
    import httpx as sdk_http

SYSTEM = "Tell a story."
USER = "Lily and Ben went to the park"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
#: Renders tools, earlier calls (name and input) and tool results.
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
GRID = {"type": "object", "additionalProperties": False, "required": ["mode", "size"],
        "properties": {"mode": {"enum": ["on", "off"]},
                       "size": {"type": "integer", "minimum": 1, "maximum": 99}}}
TOOLS = [{"name": "set_grid", "input_schema": GRID},
         {"name": "reset", "input_schema": {"type": "object", "properties": {},
                                            "additionalProperties": False}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters":
                                                t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def claude(live_server) -> anthropic.Anthropic:
    """The official client, unmodified except base_url / api_key."""
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0)


#: Sampling fields the server reads that recent clients no longer take as arguments.
BODY_FIELDS = ("temperature", "top_p", "top_k", "seed", "output_config")


def arguments(fields: dict) -> dict:
    """The client's arguments for a request: the sampling fields go in ``extra_body``."""
    fields.setdefault("messages", [{"role": "user", "content": USER}])
    extra = {k: fields.pop(k) for k in BODY_FIELDS if k in fields}
    return {**fields, "extra_body": extra} if extra else fields


def create(claude, max_tokens=12, **fields) -> Message:
    return claude.messages.create(model=MODEL, max_tokens=max_tokens, **arguments(fields))


def streamed(claude, max_tokens=12, **fields) -> tuple[Message, list[str], str]:
    """The message the client assembles from the stream, the event types, and the text of
    its ``text`` events."""
    with claude.messages.stream(model=MODEL, max_tokens=max_tokens, **arguments(fields)) as s:
        events = list(s)
        final = s.get_final_message()
    text = "".join(e.text for e in events if e.type == "text")
    return final, [e.type for e in events], text


def same(a: Message, b: Message) -> None:
    """Two answers to the same request: equal content, stop and usage (the prompt split
    between cache hits and the rest may differ)."""
    assert [c.model_dump(exclude_none=True) for c in a.content] == \
        [c.model_dump(exclude_none=True) for c in b.content] and a.content
    assert (a.stop_reason, a.stop_sequence) == (b.stop_reason, b.stop_sequence)
    assert a.usage.output_tokens == b.usage.output_tokens
    assert a.usage.output_tokens_details == b.usage.output_tokens_details
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == \
        b.usage.input_tokens + b.usage.cache_read_input_tokens


def chat(client, messages=CHAT, max_tokens=12, **fields):
    return client.chat.completions.create(model=MODEL, messages=messages,
                                          max_completion_tokens=max_tokens, **fields)


def test_text_usage_and_count_equal_chat_and_the_stream_equals_the_answer(claude, client):
    answer = chat(client, temperature=0)
    m = create(claude, system=SYSTEM, temperature=0, metadata={"user_id": "u-1"})
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == MODEL and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == answer.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        answer.choices[0].finish_reason] and m.stop_sequence is None
    prompt = answer.usage.prompt_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    assert m.usage.cache_read_input_tokens > 0 and m.usage.cache_creation_input_tokens == 0
    assert m.usage.output_tokens == answer.usage.completion_tokens
    assert claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[
        {"role": "user", "content": USER}]).input_tokens == prompt
    final, kinds, text = streamed(claude, system=[{"type": "text", "text": SYSTEM}],
                                  temperature=0)
    same(final, m)
    assert final.id.startswith("msg_") and text == m.content[0].text
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_stop_sequences_and_max_tokens(claude, client):
    text = chat(client, temperature=0).choices[0].message.content
    word = text.split()[2]
    m = create(claude, system=SYSTEM, temperature=0, stop_sequences=["zzz", word])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == chat(client, temperature=0, stop=["zzz", word]).choices[
        0].message.content == text[:text.index(word)]
    same(streamed(claude, system=SYSTEM, temperature=0, stop_sequences=["zzz", word])[0], m)
    short = create(claude, max_tokens=3, system=SYSTEM, temperature=0.7, top_p=0.9, top_k=20,
                   seed=5)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    same(streamed(claude, max_tokens=3, system=SYSTEM, temperature=0.7, top_p=0.9, top_k=20,
                  seed=5)[0], short)
    seeded = chat(client, max_tokens=3, temperature=0.7, top_p=0.9, extra_body={
        "seed": 5, "top_k": 20})
    assert short.content[0].text == seeded.choices[0].message.content


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "set_grid"}])
def test_forced_tool_use_is_valid_and_round_trips(claude, client, live_server, choice):
    # The bundled story model knows no tools: only the forced-call grammar makes the call
    # (mistral's call ids are 9 characters: the next turn fits the context).
    common = dict(tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0.8, seed=3)
    with live_server.configured(chat_template=TOOLS_TEMPLATE, tool_call_parser="mistral",
                                enable_auto_tool_choice=True):
        m = create(claude, **common)
        final = streamed(claude, **common)[0]
        assert m.stop_reason == final.stop_reason == "tool_use"
        [call] = [b for b in m.content if b.type == "tool_use"]
        schemas = {t["name"]: t["input_schema"] for t in TOOLS}
        assert call.name == "set_grid" if choice["type"] == "tool" else call.name in schemas
        jsonschema.validate(call.input, schemas[call.name])
        assert [(b.type, getattr(b, "name", None), getattr(b, "input", None))
                for b in final.content] == [(b.type, getattr(b, "name", None),
                                             getattr(b, "input", None)) for b in m.content]
        # the next turn: the call and its result, rendered as chat renders them
        turn = [{"role": "user", "content": USER},
                {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "done"}]}]
        chat_turn = [{"role": "user", "content": USER},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": call.id, "type": "function", "function": {
                             "name": call.name, "arguments": json.dumps(call.input)}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "done"}]
        count = claude.messages.count_tokens(model=MODEL, messages=turn, tools=TOOLS)
        rendered = (f"tools: set_grid,reset\nuser: {USER}\nassistant: "
                    f"[{call.name} {json.dumps(call.input)}]\ntool: done ({call.id})\n"
                    "assistant:")
        tok = live_server.engine.engine.tokenizer
        assert count.input_tokens == len(tok.encode(rendered, add_special_tokens=False))
        reply = create(claude, messages=turn, tools=TOOLS, max_tokens=6, temperature=0)
        answer = chat(client, chat_turn, max_tokens=6, tools=CHAT_TOOLS, temperature=0)
    assert count.input_tokens == answer.usage.prompt_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == count.input_tokens
    assert [b.text for b in reply.content] == [answer.choices[0].message.content]


def test_thinking_blocks_from_the_reasoning_parser(claude, client, live_server):
    with live_server.configured(reasoning_parser="deepseek_r1"):   # untagged: all reasoning
        answer = chat(client, temperature=0)
        m = create(claude, system=SYSTEM, temperature=0,
                   thinking={"type": "enabled", "budget_tokens": 1024})
        final, kinds, _ = streamed(claude, system=SYSTEM, temperature=0,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
        hidden = create(claude, system=SYSTEM, temperature=0, thinking={
            "type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    reasoning = answer.choices[0].message.model_extra["reasoning"]
    assert [b.type for b in m.content] == ["thinking"] and reasoning
    assert m.content[0].thinking == reasoning and m.content[0].signature == signature(reasoning)
    assert m.usage.output_tokens_details.thinking_tokens == m.usage.output_tokens == 12
    same(final, m)
    assert "thinking" in kinds and "signature" in kinds
    assert hidden.content[0].thinking == "" and hidden.content[0].signature == signature(
        reasoning)


def test_output_config_format_is_chats_json_schema(claude, client):
    schema = {"type": "object", "properties": {"name": {"enum": ["Lily", "Ben"]}},
              "required": ["name"], "additionalProperties": False}
    m = create(claude, max_tokens=20, temperature=0, output_config={
        "format": {"type": "json_schema", "schema": schema}})
    answer = chat(client, [{"role": "user", "content": USER}], max_tokens=20, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "output", "schema": schema}})
    assert m.content[0].text == answer.choices[0].message.content
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert m.stop_reason == "end_turn"


def test_builder_events_assemble_to_the_answer():
    """Thinking, text and two calls (the live model writes none of these markers): the
    events, accumulated by the client's own code, give the non-streaming content."""
    builder = ContentBuilder()
    deltas = [ChoiceDelta(reasoning="Let me "), ChoiceDelta(reasoning="see.", content="Hi"),
              ChoiceDelta(content=" there", calls=[ToolCallDelta(0, "t1", "f", '{"a"')]),
              ChoiceDelta(calls=[ToolCallDelta(0, None, None, ": [1, 2]}")]),
              ChoiceDelta(calls=[ToolCallDelta(1, "t2", "g", "")])]
    events = [event for d in deltas for event in builder.add(d)] + builder.finish()
    frames = [{"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL,
        "usage": {"input_tokens": 3, "output_tokens": 0}}}, *events,
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
         "usage": {"output_tokens": 9}}, {"type": "message_stop"}]
    body = "".join(map(sse_event, frames)).encode()
    transport = sdk_http.MockTransport(lambda request: sdk_http.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    sdk = anthropic.Anthropic(api_key="x", base_url="http://mock",
                              http_client=sdk_http.Client(transport=transport))
    with sdk.messages.stream(model=MODEL, max_tokens=9, messages=[]) as s:
        snapshot = s.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == \
        [b.model_dump() for b in builder.blocks] == [
        {"type": "thinking", "thinking": "Let me see.", "signature": signature("Let me see.")},
        {"type": "text", "text": "Hi there"},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": [1, 2]}},
        {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3] and builder.has_tool_use


def test_x_api_key_and_bearer_are_accepted():
    _, app = make_server(engine_args(), ServerConfig([MODEL], api_key="s3cret"))
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with TestClient(app) as http:
        for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": "s3cretx"},
                        {"Authorization": "Bearer wrong"}):
            r = http.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
        assert http.post("/v1/completions", json={}, headers={"x-api-key": "no"}).json()[
            "error"]["code"] == 401                    # OpenAI's shape off the Anthropic routes
        for headers in ({"x-api-key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
            r = http.post("/v1/messages/count_tokens", json=body, headers=headers)
            assert r.status_code == 503                # past the key: the engine is not loaded
            assert r.json()["error"]["type"] == "overloaded_error"

    async def sdk_status(api_key: str) -> int:     # the client's own x-api-key header
        sdk = anthropic.AsyncAnthropic(
            base_url="http://app", api_key=api_key, max_retries=0,
            http_client=sdk_http.AsyncClient(transport=sdk_http.ASGITransport(app=app)))
        with pytest.raises(anthropic.APIStatusError) as e:
            await sdk.messages.create(model=MODEL, max_tokens=4, messages=body["messages"])
        return e.value.status_code

    assert asyncio.run(sdk_status("wrong")) == 401
    assert asyncio.run(sdk_status("s3cret")) == 503


@pytest.mark.parametrize("body, status, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, ["max_tokens", "Field required"]),
    ({"max_tokens": 0}, 400, ["max_tokens must be an integer >= 1"]),
    ({"max_tokens": 4, "messages": []}, 400, ["messages must not be empty"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, 400, ["'image'"]),
    ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     ["run by Anthropic's servers"]),
    ({"max_tokens": 4, "tools": TOOLS[:1], "tool_choice": {"type": "tool"}}, 400,
     ["needs the tool's name"]),
    ({"max_tokens": 4, "tools": TOOLS[:1]}, 400, ["--enable-auto-tool-choice"]),
    ({"max_tokens": 4, "tools": TOOLS[:1], "tool_choice": {"type": "tool", "name": "nope"}},
     400, ["nope"]),
    ({"max_tokens": 4, "model": "nope"}, 404, ["nope"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400,
     ["belongs in an assistant message"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, 400,
     ["belongs in a user message"]),
    ({"max_tokens": 4, "output_config": {"format": {"type": "json_schema"}}}, 400,
     ["output_config.format.schema"]),
    ({"max_tokens": 400}, 400, ["maximum context length", "400 for the output"]),
    ({"max_tokens": 4, "temperature": "hot"}, 400, ["temperature"]),
])
def test_bad_input_is_answered_in_anthropics_error_shape(http, claude, body, status, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": USER}], **body}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert all(w in r.json()["error"]["message"] for w in words), r.json()
    if "max_tokens" in body and body["max_tokens"] == 4 and status == 400:
        with pytest.raises(anthropic.BadRequestError) as e:   # as the client reads it
            claude.messages.create(**arguments(dict(body)))
        assert e.value.body["error"]["type"] == kind


def test_other_failures_keep_the_shape_and_the_server_serves_on(http, claude):
    for path, data in (("/v1/messages", b"{nope"), ("/v1/messages/nope", b"{}")):
        r = http.post(path, content=data, headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 404) and r.json()["type"] == "error", r.text
    r = http.post("/v1/messages/count_tokens", json={"model": "nope", "messages": [
        {"role": "user", "content": USER}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.post("/v1/chat/completions", content=b"{nope").json()["error"]["code"] == 400
    assert create(claude, max_tokens=2).usage.output_tokens == 2


def test_a_failed_model_step_is_an_error_in_anthropics_shape(http, claude, live_server):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": USER}]}
    with injecting_faults(live_server.engine):
        r = http.post("/v1/messages", json=body, headers={"X-Request-Id": "a" + FAULT_MARK})
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error", r.text
        with http.stream("POST", "/v1/messages", json={**body, "stream": True},
                         headers={"X-Request-Id": "b" + FAULT_MARK}) as s:
            lines = [line for line in s.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["message_start", "error"]
    assert lines[-2] == "event: error" and events[-1]["error"]["type"] == "api_error"
    assert create(claude, max_tokens=2).usage.output_tokens == 2     # it serves on
