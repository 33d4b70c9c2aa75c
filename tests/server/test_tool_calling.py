"""Tool calling and reasoning output through the HTTP server, on model output forced with
the FORCE hook (tests/helpers/force.py): exact ``tool_calls`` / ``reasoning`` / ``content``,
streamed pieces joining to the non-streaming message, the finish-reason rules, vLLM's 400s,
and the official ``openai`` client reading it all unmodified."""

from __future__ import annotations

import json

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
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
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
