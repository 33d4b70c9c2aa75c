"""Constrained output (``response_format``, forced tool calls) under ``--reasoning-parser``
and the forced calls' id format (issue 43, section 1): the grammar holds from the first token
where no think block is asked for, a thought cut by ``max_tokens`` is never an answer or a
call, a named call is announced when its arguments begin, and forced calls take the
``--tool-call-parser``'s ids."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.server.test_tool_calling import (GRID_TOOLS, ask, client, force,  # noqa: F401
                                            joined, server)

#: A closed object: the bundled model fills it and stops within 40 tokens.
PERSON = {"type": "object", "properties": {"age": {"type": "integer"},
                                           "name": {"type": "string", "maxLength": 8}},
          "required": ["age", "name"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
SET_GRID = {"type": "function", "function": {"name": "set_grid"}}
REFUSED = "structured output: the grammar refused"


def reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning")


@pytest.mark.parametrize("parser", ["qwen3", None])
def test_qwen3_without_thinking_constrains_from_the_first_token(server, client, parser):
    # The bundled model never writes </think>: with a think block on offer (as before) its
    # text went to reasoning and the JSON / the call's arguments never came.
    with server.configured(reasoning_parser=parser):
        r = ask(client, "q3-json", 40, temperature=0, response_format=PERSON_FORMAT)
        call = ask(client, "q3-named", 40, temperature=0, tools=GRID_TOOLS,
                   tool_choice=SET_GRID)
    m = r.choices[0].message
    assert (reasoning(m), r.choices[0].finish_reason) == (None, "stop")
    jsonschema.validate(json.loads(m.content), PERSON)
    assert re.fullmatch(r'\{"age":-?\d+,"name":"[^"]*"\}', m.content), m.content
    (c,) = call.choices[0].message.tool_calls
    assert (c.function.name, call.choices[0].finish_reason) == ("set_grid", "stop")
    jsonschema.validate(json.loads(c.function.arguments),
                        GRID_TOOLS[0]["function"]["parameters"])


def test_qwen3_offers_a_think_block_only_where_thinking_is_enabled(server, client,
                                                                   monkeypatch, caplog):
    n = force(monkeypatch, server, {"q3-think": '<think>hm</think>{"age":3,"name":"Al"}'}
              )["q3-think"]
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    with server.configured(reasoning_parser="qwen3"), caplog.at_level("WARNING"):
        m = ask(client, "q3-think", n, response_format=PERSON_FORMAT,
                extra_body=thinking).choices[0].message
        assert not [r for r in caplog.records if REFUSED in r.getMessage()]
        assert (reasoning(m), m.content) == ("hm", '{"age":3,"name":"Al"}')
        ask(client, "q3-think", n, response_format=PERSON_FORMAT)
        assert [r for r in caplog.records if REFUSED in r.getMessage()]


@pytest.mark.parametrize("parser, fields", [
    # deepseek_r1 reasons until </think>, which the bundled model never writes
    ("deepseek_r1", {}),
    # qwen3 asked to think: greedy decoding opens the block and is cut inside "<think>"
    ("qwen3", {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}})])
def test_a_thought_cut_by_max_tokens_is_no_answer_and_no_call(server, client, parser,
                                                              fields):
    common = dict(temperature=0, tools=GRID_TOOLS, tool_choice=SET_GRID, **fields)
    with server.configured(reasoning_parser=parser):
        r = ask(client, "cut-named", 4, **common)
        content, thought, calls, finish = joined(client, "cut-named", 4, **common)
        j = ask(client, "cut-json", 4, temperature=0, response_format={"type": "json_object"},
                **fields)
    m = r.choices[0].message
    assert (m.content, m.tool_calls, r.choices[0].finish_reason) == (None, [], "length")
    assert (content, calls, finish) == ("", {}, "length")
    assert thought == (reasoning(m) or "")
    assert (parser == "deepseek_r1") == bool(thought)   # qwen3's cut "<thin" is the tag
    assert (j.choices[0].message.content, j.choices[0].finish_reason) == (None, "length")


def test_a_named_call_is_announced_when_its_arguments_begin(server, client, monkeypatch):
    args = '{"mode":"on","size":7}'
    n = force(monkeypatch, server, {"r1-named": "plan it</think>" + args})["r1-named"]
    chunks = []
    with server.configured(reasoning_parser="deepseek_r1"):
        r = ask(client, "r1-named", n, tools=GRID_TOOLS, tool_choice=SET_GRID)
        for chunk in ask(client, "r1-named", n, stream=True, tools=GRID_TOOLS,
                         tool_choice=SET_GRID):
            chunks += [c.delta for c in chunk.choices]
    (call,) = r.choices[0].message.tool_calls
    assert (reasoning(r.choices[0].message), call.function.name, call.function.arguments) == \
        ("plan it", "set_grid", args)
    kinds = ["reasoning" if reasoning(d) else "call" if d.tool_calls else None
             for d in chunks]
    kinds = [k for k in kinds if k]
    first_call = kinds.index("call")
    assert "reasoning" not in kinds[first_call:] and first_call > 0
    header = next(d.tool_calls[0] for d in chunks if d.tool_calls)
    assert (header.function.name, header.function.arguments) == ("set_grid", "")
    assert "".join(tc.function.arguments or "" for d in chunks for tc in d.tool_calls or []) \
        == args


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_take_the_tool_call_parsers_ids(server, client, monkeypatch, choice):
    args = '{"mode":"off","size":12}'
    text = f'[{{"name":"set_grid","parameters":{args}}}]' if choice == "required" else args
    n = force(monkeypatch, server, {"ids": text})["ids"]
    tool_choice = "required" if choice == "required" else SET_GRID
    common = dict(tools=GRID_TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    if choice == "required":        # the array's items are re-serialized (json.dumps)
        args = json.dumps(json.loads(args))
    ids = {}
    for parser in ("mistral", "hermes"):
        with server.configured(tool_call_parser=parser):
            r = ask(client, "ids", n, **common)
            _, _, calls, _ = joined(client, "ids", n, **common)
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("set_grid", args)
        assert [c[2:] for c in calls.values()] == [["set_grid", args]]
        ids[parser] = [call.id, calls[0][0]]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids["mistral"]), ids
    assert all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i) for i in ids["hermes"]), ids
