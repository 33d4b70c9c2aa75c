"""Structured outputs over HTTP: response_format, vLLM's structured_outputs and guided_*
fields on both endpoints, streaming and not, through the official client too, and the 400s."""

import json
import math
import re

import jsonschema
import pytest

from tests.server.conftest import MODEL, sse_events
from tests.server.test_http_bugcases import assert_error, chat, completion
from tests.test_structured_outputs import CHOICES, REGEX, SCHEMA

MESSAGES = [{"role": "user", "content": "Tell me about a child."}]
JSON_FIELDS = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}


def streamed_texts(events, key) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (key(c) or "")
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_for_every_sequence(http, stream):
    body = dict(messages=MESSAGES, n=4, temperature=1.0, seed=5, max_tokens=64, **JSON_FIELDS)
    if not stream:
        r = chat(http, **body)
        assert r.status_code == 200, r.text
        texts = {c["index"]: c["message"]["content"] for c in r.json()["choices"]}
        assert {c["finish_reason"] for c in r.json()["choices"]} == {"stop"}
    else:
        with http.stream("POST", "/v1/chat/completions",
                         json={"model": MODEL, "stream": True, **body}) as r:
            texts = streamed_texts(sse_events(r), lambda c: c["delta"].get("content"))
    assert sorted(texts) == [0, 1, 2, 3]
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_guided_choice_and_regex(http, stream):
    for fields, ok in (({"guided_choice": CHOICES}, lambda t: t in CHOICES),
                       ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                       ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES)):
        body = dict(prompt="Once upon a time", n=2, temperature=1.0, seed=1, max_tokens=16,
                    **fields)
        if stream:
            with http.stream("POST", "/v1/completions",
                             json={"model": MODEL, "stream": True, **body}) as r:
                texts = streamed_texts(sse_events(r), lambda c: c["text"]).values()
        else:
            r = completion(http, **body)
            assert r.status_code == 200, r.text
            texts = [c["text"] for c in r.json()["choices"]]
        assert len(texts) == 2 and all(ok(t) for t in texts), (fields, texts)


def test_openai_client_response_format_and_extra_body(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "child", "schema": SCHEMA, "strict": True}})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":      # (JSON whitespace may run long)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert text.lstrip().startswith("{")
    out = client.completions.create(model=MODEL, prompt="Lily", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["red", "blue"]})
    assert out.choices[0].text in ("red", "blue")


def test_logprobs_of_masked_alternatives_are_valid_json(http):
    r = chat(http, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
             top_logprobs=5, guided_choice=["cat", "dog"])
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    values = [t["logprob"] for e in content for t in e["top_logprobs"]]
    assert len(values) == 5 * len(content) and all(math.isfinite(v) for v in values)
    assert min(values) < -1e3           # a forbidden alternative, clamped from -inf


@pytest.mark.parametrize("fields, param, needle", [
    ({"guided_regex": "[0-9"}, "guided_regex", "unclosed character class"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format", "Invalid type: foo"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs", "bogus"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice",
     "not several"),
    ({"response_format": {"type": "xml"}}, "response_format", "")])
def test_invalid_structured_outputs_are_400_naming_the_field(http, live_server, fields, param,
                                                             needle):
    for send in (completion, chat):
        body = {"prompt": "Once"} if send is completion else {"messages": MESSAGES}
        r = send(http, max_tokens=4, **body, **fields)
        assert_error(r, 400, param, needle)
    assert not live_server.engine.engine.has_unfinished_requests()
