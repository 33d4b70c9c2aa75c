"""Tool calling and reasoning output through the HTTP server, on model output forced with
the FORCE hook (tests/helpers/force.py): exact ``tool_calls`` / ``reasoning`` / ``content``,
streamed pieces joining to the non-streaming message, the finish-reason rules, vLLM's 400s,
and the official ``openai`` client reading it all unmodified."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from jaxpaged.server.serving import ServerConfig
from tests.helpers.force import force_tokens
from tests.server.conftest import MODEL, LiveServer, engine_args, sse_events
from tests.server.test_tool_parsers import CASES, PARIS, TOOLS

EOS = 2
#: Renders tools, earlier calls (arguments as the dicts the server decodes them to), tool
#: results, and a think block pre-filled (``prefill_think``) or closed
#: (``enable_thinking: false``) after the generation prompt.
TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }} "
    "{{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif prefill_think %}<think>\n{% endif %}{% endif %}")
USER = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    config = ServerConfig([MODEL], TEMPLATE, enable_auto_tool_choice=True,
                          tool_call_parser="hermes")
    live = LiveServer(engine_args(async_scheduling=False, max_model_len=512), config).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def output_ids(tok, text: str) -> list[int]:
    """Token ids that the engine detokenizes to exactly ``text`` after a prompt (no
    sentencepiece word-start space on the first one)."""
    ids = tok.encode("\n" + text, add_special_tokens=False)[2:]
    assert tok.decode([5] + ids)[len(tok.decode([5])):] == text
    return ids


def force(monkeypatch, server, outputs: dict[str, str]) -> dict[str, int]:
    """Requests sent with ``X-Request-Id: <key>`` (and ``<key>-s``, for the stream) emit
    ``outputs[key]`` then EOS; returns each key's token count (EOS included)."""
    tok = server.engine.engine.tokenizer
    scripts, counts = {}, {}
    for key, text in outputs.items():
        ids = output_ids(tok, text) + [EOS]
        scripts[f"chatcmpl-{key}-0"] = scripts[f"chatcmpl-{key}-s-0"] = ids
        counts[key] = len(ids)
    force_tokens(monkeypatch, server.engine.engine, scripts)
    return counts


def ask(client, key: str, max_tokens: int, stream: bool = False, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=fields.pop("messages", USER), max_tokens=max_tokens,
        stream=stream, extra_headers={"X-Request-Id": key + ("-s" if stream else "")},
        **fields)


def joined(client, key, max_tokens, **fields):
    """The stream of a request, joined: (content, reasoning, calls, finish_reason), calls as
    {index: [id, type, name, arguments]}."""
    content = reasoning = ""
    calls, finish = {}, None
    for chunk in ask(client, key, max_tokens, stream=True, **fields):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            for c in delta.tool_calls or []:
                if c.id is not None:
                    assert c.index not in calls and c.type == "function"
                    calls[c.index] = [c.id, c.type, c.function.name, ""]
                calls[c.index][3] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("parser, text, content, calls",
                         [(n, *case) for n, cases in CASES.items() for case in cases])
def test_auto_tool_calls_streaming_and_not(server, client, monkeypatch, parser, text, content,
                                           calls):
    n = force(monkeypatch, server, {"call": text})["call"]
    with server.configured(tool_call_parser=parser):
        r = ask(client, "call", n, tools=TOOLS)
        s_content, _, s_calls, s_finish = joined(client, "call", n, tools=TOOLS)
    message = r.choices[0].message
    assert message.content == (content or None)
    got = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert got == calls
    assert all(c.type == "function" for c in message.tool_calls)
    assert r.choices[0].finish_reason == ("tool_calls" if calls else "stop")
    assert s_content == content and s_finish == r.choices[0].finish_reason
    assert [(name, args) for _, _, name, args in s_calls.values()] == calls
    assert all(json.loads(args) is not None for _, args in got)


def test_reasoning_then_tool_call_and_a_call_inside_reasoning_is_not_parsed(
        server, client, monkeypatch):
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'
    text = f"<think>maybe {call}</think>{call}"
    n = force(monkeypatch, server, {"rt": text})["rt"]
    with server.configured(reasoning_parser="qwen3"):
        r = ask(client, "rt", n, tools=TOOLS)
        s = joined(client, "rt", n, tools=TOOLS)
    m = r.choices[0].message
    assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"] == f"maybe {call}"
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == \
        [("get_weather", PARIS)]
    assert m.content is None and r.choices[0].finish_reason == "tool_calls"
    assert s[:2] == ("", f"maybe {call}") and s[3] == "tool_calls"
    assert [v[2:] for v in s[2].values()] == [["get_weather", PARIS]]


def test_finish_reason_and_tool_choice_rules(server, client, monkeypatch):
    required = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    hermes = f'<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}</tool_call> more text'
    n = force(monkeypatch, server, {"req": required, "named": PARIS, "none": hermes,
                                    "cut": hermes})
    r = ask(client, "req", n["req"], tools=TOOLS, tool_choice="required")
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] \
        == [("get_weather", '{"city": "Paris"}')]
    assert r.choices[0].finish_reason == "tool_calls"
    s = joined(client, "req", n["req"], tools=TOOLS, tool_choice="required")
    assert [v[2:] for v in s[2].values()] == [["get_weather", '{"city": "Paris"}']]
    assert s[3] == "tool_calls"
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = ask(client, "named", n["named"], tools=TOOLS, tool_choice=named)
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] \
        == [("get_weather", PARIS)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    s = joined(client, "named", n["named"], tools=TOOLS, tool_choice=named)
    assert [v[2:] for v in s[2].values()] == [["get_weather", PARIS]] and s[3] == "stop"
    # tool_choice "none": the tools are rendered, the output is not parsed
    r = ask(client, "none", n["none"], tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == hermes and r.choices[0].message.tool_calls == []
    assert r.choices[0].finish_reason == "stop"
    # auto with a call found, then cut by max_tokens: still "tool_calls" (vLLM's rule)
    tok = server.engine.engine.tokenizer
    kept = output_ids(tok, hermes)[:n["cut"] - 3]
    cut_text = tok.decode([5] + kept)[len(tok.decode([5])):]
    assert cut_text.startswith(hermes[:hermes.index(" more")]) and cut_text != hermes
    r = ask(client, "cut", n["cut"] - 3, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == cut_text[hermes.index(" more"):]


def reasoning_of(server, client, key, n, stream=False, **fields):
    """(reasoning, content, finish_reason): the message's, or the raw SSE stream's joined
    (the tags arrive split over several byte tokens: the joined pieces equal to the exact
    expected texts show that no part of a tag leaked into either)."""
    if not stream:
        r = ask(client, key, n, **fields)
        m = r.choices[0].message
        assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"]
        return m.model_extra["reasoning"], m.content, r.choices[0].finish_reason
    body = {"model": MODEL, "messages": USER, "max_tokens": n, "stream": True}
    body.update(fields.pop("extra_body", {}))
    body.update(fields)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Request-Id": key + "-s"}) as response:
        events = sse_events(response)
    reasoning = content = ""
    finish = None
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            assert delta["reasoning"] == delta["reasoning_content"]
            reasoning += delta["reasoning"] or ""
            content += delta["content"] or ""
            finish = choice["finish_reason"] or finish
    return reasoning or None, content or None, finish


@pytest.mark.parametrize("case", ["both_tags", "prefilled", "thinking_off",
                                  "thinking_off_by_default", "cut_by_max_tokens",
                                  "stop_string_in_reasoning"])
def test_reasoning_cases_streaming_equal_to_not(server, client, monkeypatch, case):
    outputs = {
        "both_tags": "<think>\nplan the answer\n</think>\n\nIt is sunny.",
        "prefilled": "plan the answer\n</think>\n\nIt is sunny.",
        "thinking_off": "It is <think>sunny</think>.",
        "thinking_off_by_default": "It is <think>sunny</think>.",
        "cut_by_max_tokens": "<think>\nstill planning the answer",
        "stop_string_in_reasoning": "<think>\nfirst STOP second</think>It is sunny.",
    }
    n = force(monkeypatch, server, {case: outputs[case]})[case]
    fields, config = {}, {"reasoning_parser": "qwen3"}
    expected = {
        "both_tags": ("\nplan the answer\n", "\n\nIt is sunny.", "stop"),
        "prefilled": ("plan the answer\n", "\n\nIt is sunny.", "stop"),
        "thinking_off": (None, "It is <think>sunny</think>.", "stop"),
        "thinking_off_by_default": (None, "It is <think>sunny</think>.", "stop"),
        "stop_string_in_reasoning": ("\nfirst ", None, "stop"),
    }.get(case)
    if case == "prefilled":
        fields["extra_body"] = {"chat_template_kwargs": {"prefill_think": True}}
    if case == "thinking_off":
        fields["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    if case == "thinking_off_by_default":
        config["default_chat_template_kwargs"] = {"enable_thinking": False}
    if case == "cut_by_max_tokens":
        tok = server.engine.engine.tokenizer
        n -= 4
        cut = tok.decode([5] + output_ids(tok, outputs[case])[:n])[len(tok.decode([5])):]
        assert cut.startswith("<think>\nstill") and len(cut) < len(outputs[case])
        expected = (cut[len("<think>"):], None, "length")
    if case == "stop_string_in_reasoning":
        fields["stop"] = ["STOP"]
    with server.configured(**config):
        whole = reasoning_of(server, client, case, n, **dict(fields))
        streamed = reasoning_of(server, client, case, n, stream=True, **dict(fields))
    assert whole == expected
    assert streamed == whole


def test_without_a_reasoning_parser_the_think_block_is_content(server, client, monkeypatch):
    text = "<think>\nplan\n</think>\n\nIt is sunny."
    n = force(monkeypatch, server, {"plain": text})["plain"]
    m = ask(client, "plain", n).choices[0].message
    assert (m.content, m.model_extra["reasoning"], m.tool_calls) == (text, None, [])


@pytest.mark.parametrize("fields, needle", [
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Tool 'nope' has not been passed in `tools`."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "function"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments must be a JSON object")])
def test_tool_request_errors(server, fields, needle):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("fields", [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}])
def test_auto_on_a_server_without_the_flags_names_them(server, fields):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}
    with server.configured(enable_auto_tool_choice=False, tool_call_parser=None):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": '"auto" tool choice requires --enable-auto-tool-choice and '
                       '--tool-call-parser to be set', "type": "invalid_request_error",
            "param": "tool_choice", "code": 400}
        body["tool_choice"] = "none"
        assert httpx.post(server.url + "/v1/chat/completions", json=body,
                          timeout=30).status_code == 200


def test_a_tool_result_conversation_renders_and_answers(server, client, monkeypatch):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"}]
    n = force(monkeypatch, server, {"turn2": "It is sunny."})["turn2"]
    r = ask(client, "turn2", n, tools=TOOLS, messages=messages)
    assert r.choices[0].message.content == "It is sunny."
    tok = server.engine.engine.tokenizer
    prompt = ("tools: get_weather,get_time\nuser: weather in Paris?\nassistant: "
              "[get_weather Paris]\ntool: sunny, 21 C (call-1)\nassistant:")
    assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


GRID_TOOLS = [{"type": "function", "function": {"name": "set_grid", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["mode", "size"],
    "properties": {"mode": {"enum": ["on", "off"]},
                   "size": {"type": "integer", "minimum": 1, "maximum": 99}}}}},
    {"type": "function", "function": {"name": "reset", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {}}}}]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_choices_are_enforced_on_a_model_that_knows_no_tools(
        server, client, choice):
    # The bundled story model has never seen a tool call: only the grammar (structured
    # outputs over the forced call's schema) makes its output a valid call.
    import jsonschema

    tool_choice = ("required" if choice == "required" else
                   {"type": "function", "function": {"name": "set_grid"}})
    params = {t["function"]["name"]: t["function"]["parameters"] for t in GRID_TOOLS}
    common = dict(model=MODEL, messages=USER, tools=GRID_TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=120, temperature=0.8, seed=3)
    reply = client.chat.completions.create(**common)
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and reply.choices[0].finish_reason == ("tool_calls" if choice == "required"
                                                        else "stop")
    for call in calls:
        assert call.function.name in params if choice == "required" else \
            call.function.name == "set_grid"
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    streamed = {}
    for chunk in client.chat.completions.create(**common, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, {"name": None, "arguments": ""})
            entry["name"] = delta.function.name or entry["name"]
            entry["arguments"] += delta.function.arguments or ""
    assert [(e["name"], json.loads(e["arguments"])) for e in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("prefill", [True, False])
def test_structured_outputs_start_after_the_reasoning(server, client, monkeypatch, caplog,
                                                      prefill):
    # A think block then the JSON: the grammar admits every token of it only because the
    # server puts the schema behind the reasoning (after_reasoning; qwen3 offers the block
    # only where thinking is enabled); without a reasoning parser the same tokens break the
    # grammar at the first one.
    text = ("" if prefill else "<think>") + 'plan it</think>\n{"city":"Paris"}'
    n = force(monkeypatch, server, {"think-json": text})["think-json"]
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    fields = {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "w", "schema": schema}},
              "extra_body": {"chat_template_kwargs": {"prefill_think": prefill,
                                                      "enable_thinking": True}}}
    refused = "structured output: the grammar refused"
    with server.configured(reasoning_parser="qwen3"), caplog.at_level("WARNING"):
        m = ask(client, "think-json", n, **fields).choices[0].message
    assert (m.model_extra["reasoning"], m.content) == ("plan it", '\n{"city":"Paris"}')
    assert not [r for r in caplog.records if refused in r.getMessage()]
    caplog.clear()
    with caplog.at_level("WARNING"):
        ask(client, "think-json", n, **fields)
    assert [r for r in caplog.records if refused in r.getMessage()]


def test_responses_api_reasoning_text_and_an_auto_call(server, client, monkeypatch):
    """``/v1/responses`` on the same parsers: a reasoning item, a message and a
    ``function_call`` item, streamed in OpenAI's event order and equal to the non-streaming
    output."""
    text = (f'<think>plan</think>Sure.<tool_call>\n{{"name": "get_weather", "arguments": '
            f'{PARIS}}}\n</tool_call>')
    ids = output_ids(server.engine.engine.tokenizer, text) + [EOS]
    force_tokens(monkeypatch, server.engine.engine, {"resp-rc-0": ids, "resp-rc-s-0": ids})
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    with server.configured(reasoning_parser="qwen3"):
        r = client.responses.create(model=MODEL, input=USER, tools=tools, max_output_tokens=
                                    len(ids), extra_headers={"X-Request-Id": "rc"})
        with client.responses.stream(model=MODEL, input=USER, tools=tools,
                                     max_output_tokens=len(ids),
                                     extra_headers={"X-Request-Id": "rc-s"}) as stream:
            events = list(stream)
            final = stream.get_final_response()
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "plan" and r.output_text == "Sure."
    call = r.output[2]
    assert (call.name, call.arguments, r.status) == ("get_weather", PARIS, "completed")
    assert call.call_id.startswith("chatcmpl-tool-")
    assert r.usage.output_tokens == len(ids)
    tok = server.engine.engine.tokenizer       # the tokens up to the one that ends </think>
    block = next(k for k in range(1, len(ids)) if "</think>" in tok.decode(ids[:k]))
    assert r.usage.output_tokens_details.reasoning_tokens == block
    assert (final.usage.output_tokens, final.usage.output_tokens_details) == \
        (r.usage.output_tokens, r.usage.output_tokens_details)     # (the cache hits differ)

    def shape(items):
        return [{k: v for k, v in i.model_dump(exclude_none=True).items()
                 if k not in ("id", "call_id")}
                for i in items]

    assert shape(final.output) == shape(r.output)
    types = [e.type.removeprefix("response.") for e in events]
    item = ["output_item.added", "content_part.added"]
    done = ["content_part.done", "output_item.done"]
    expected = ["created", "in_progress", *item]
    expected += [t for t in types if t == "reasoning_text.delta"] + ["reasoning_text.done", *done]
    expected += item + [t for t in types if t == "output_text.delta"] + ["output_text.done", *done]
    expected += ["output_item.added", "function_call_arguments.delta",
                 "function_call_arguments.done", "output_item.done", "completed"]
    assert types == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))
