"""Each --tool-call-parser (and the tool_choice parsers) on exact model output texts: a call,
several calls, a call after prose, a half marker at the end, malformed JSON (left as content);
fed whole, a character at a time and in uneven pieces, with identical results."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from jaxpaged.server.config import ServerConfig
from jaxpaged.server.protocol_chat import ChatCompletionRequest
from jaxpaged.server.tool_calls import forced_call_schema, tool_choice_of
from jaxpaged.server.tool_parsers import TOOL_PARSERS
from jaxpaged.server.tool_parsers.forced import NamedToolParser, RequiredToolParser

PARIS = '{"city": "Paris", "unit": "celsius"}'


def parse(make, text: str):
    """(content, [(name, arguments)], ids) of ``text``, asserting that streamed pieces (one
    character at a time, and random pieces) give the same content and joined arguments."""
    whole = make().parse(text)
    calls, ids = {}, {}
    for c in whole.calls:
        if c.id is not None:
            ids[c.index], calls[c.index] = c.id, [c.name, ""]
        calls[c.index][1] += c.arguments
    expected = (whole.content, [tuple(v) for v in calls.values()])
    rng = random.Random(len(text))
    for cuts in (list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), 5))):
        parser, pieces = make(), [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        streamed = {}
        for d in deltas:
            for c in d.calls:
                if c.id is not None:
                    assert c.index not in streamed and c.arguments == ""
                    streamed[c.index] = [c.name, ""]
                else:
                    assert c.name is None
                streamed[c.index][1] += c.arguments
        assert ("".join(d.content for d in deltas), [tuple(v) for v in streamed.values()]) \
            == expected
    return expected + (list(ids.values()),)


CASES = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
         "", [("get_weather", PARIS)]),
        ('<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n</tool_call>\n'
         '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
         "", [("a", '{"x": [1, 2]}'), ("b", "{}")]),
        (f'Let me look that up.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}'
         '\n</tool_call>', "Let me look that up.\n", [("get_weather", PARIS)]),
        ("The answer is 4. <tool_", "The answer is 4. <tool_", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {PARIS}}}', "", [("get_weather", PARIS)]),
        ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
         "", [("a", '{"x": 1}'), ("b", "{}")]),
        # Llama 3 calls are the whole output: a call after prose is content (as vLLM's)
        (f'Sure. {{"name": "get_weather", "parameters": {PARIS}}}',
         f'Sure. {{"name": "get_weather", "parameters": {PARIS}}}', []),
        ("<|python_ta", "<|python_ta", []),
        ('{"name": "get_weather", "parameters": {"city": "Paris"', 
         '{"name": "get_weather", "parameters": {"city": "Paris"', []),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]', "",
         [("get_weather", PARIS)]),
        ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
         "", [("a", '{"x": 1}'), ("b", "{}")]),
        (f'Checking. [TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]',
         "Checking. ", [("get_weather", PARIS)]),
        ("Done [TOOL_CA", "Done [TOOL_CA", []),
        # the v11 format: name[ARGS]{...} after each marker
        (f'[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]b[ARGS]{{}}', "",
         [("get_weather", PARIS), ("b", "{}")]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
         '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius")]', "", [("get_weather", PARIS)]),
        ('[get_weather(city="Paris"), get_time(zone="CET", exact=True, offsets=[1, None])]',
         "", [("get_weather", '{"city": "Paris"}'),
              ("get_time", '{"zone": "CET", "exact": true, "offsets": [1, null]}')]),
        ('Sure: [get_weather(city="Paris")]', 'Sure: [get_weather(city="Paris")]', []),
        ('[get_weather(city="Par', '[get_weather(city="Par', []),
        ('[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ],
}


@pytest.mark.parametrize("name, text, content, calls",
                         [(n, *case) for n, cases in CASES.items() for case in cases])
def test_parser_gives_the_exact_calls(name, text, content, calls):
    got_content, got_calls, ids = parse(TOOL_PARSERS[name], text)
    assert (got_content, got_calls) == (content, calls)
    pattern = r"[A-Za-z0-9]{9}" if name == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
    assert len(ids) == len(calls) and all(re.fullmatch(pattern, i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_text_that_may_begin_a_marker_is_held_back_until_decided():
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed("Hi <tool").content == "Hi "
    assert parser.feed("box> there").content == "<toolbox> there"
    assert parser.feed("<").content == ""
    assert parser.finish().content == "<"


def test_prose_after_calls_is_kept_and_blank_text_between_them_dropped():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>\nDone.')
    assert parse(TOOL_PARSERS["hermes"], text)[:2] == ("\nDone.", [("a", "{}"), ("b", "{}")])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert parse(lambda: TOOL_PARSERS["mistral"](max_calls=1), text)[:2] == ("", [("a", "{}")])


def test_required_parser_reads_the_enforced_array():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert parse(RequiredToolParser, text)[:2] == ("", [("a", '{"x": 1}'), ("b", "{}")])
    assert parse(RequiredToolParser, "no calls")[:2] == ("no calls", [])
    assert parse(RequiredToolParser, '[{"name": "a"}]')[:2] == ('[{"name": "a"}]', [])


@pytest.mark.parametrize("cut", ['[{"name":"get_', '[\n  {"', '[{"name": "a", "parameters": {}}, ',
                                 '[{"name": "a", "parameters": {}},{"name":"b","parameters":'
                                 '{"city":"Rome","country":"IT'])
def test_required_array_cut_by_max_tokens_shows_no_grammar_as_content(cut):
    """An array cut short keeps its complete calls; the element it was writing is dropped,
    not returned as content (the grammar admits nothing else, so only max_tokens cuts it)."""
    calls = [("a", "{}")] if '"a"' in cut else []
    assert parse(RequiredToolParser, cut)[:2] == ("", calls)


def test_named_parser_takes_the_output_as_the_arguments():
    assert parse(lambda: NamedToolParser("get_weather"), PARIS)[:2] == \
        ("", [("get_weather", PARIS)])


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"$ref": "#/$defs/unit"}},
        "required": ["city"], "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
        "additionalProperties": False}}}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields})


def test_required_schema_accepts_exactly_the_valid_call_arrays():
    schema = forced_call_schema(request(), "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
             [{"name": "get_time", "parameters": {"zone": "CET"}},
              {"name": "get_weather", "parameters": {"city": "Oslo"}}]]
    invalid = [[], {"name": "get_time", "parameters": {"zone": "CET"}},
               [{"name": "get_date", "parameters": {}}],
               [{"name": "get_weather"}],
               [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
               [{"name": "get_time", "parameters": {"zone": "CET", "city": "Paris"}}],
               [{"name": "get_time", "parameters": {"city": "Paris"}}]]
    for value in valid:
        jsonschema.validate(value, schema)
    for value in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    # what the enforced output parses to
    assert parse(RequiredToolParser, json.dumps(valid[1]))[:2] == (
        "", [("get_time", '{"zone": "CET"}'), ("get_weather", '{"city": "Oslo"}')])


def test_required_schema_without_parallel_calls_allows_one_item():
    schema = forced_call_schema(request(parallel_tool_calls=False), "required")
    one = [{"name": "get_time", "parameters": {"zone": "CET"}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)


def test_named_schema_is_the_function_parameters():
    body = request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    schema = forced_call_schema(body, tool_choice_of(body, ServerConfig(["m"])))
    assert schema == TOOLS[1]["function"]["parameters"]
    jsonschema.validate({"zone": "UTC"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"zone": "UTC", "x": 1}, schema)
    assert forced_call_schema(request(tool_choice="auto"), "auto") is None
