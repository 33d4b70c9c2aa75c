"""The thinking budget over HTTP (issue 43, section 4): ``thinking_token_budget`` on chat and
``/v1/responses``, ``thinking.budget_tokens`` on ``/v1/messages``, and ``--reasoning-budget``
as the server's default, on the bundled model behind a template that opens a think block
(the model never writes ``</think>``: it thinks for ever unless the budget ends it)."""

from __future__ import annotations

import anthropic
import pytest

from jaxpaged.cli import build_parser
from jaxpaged.server.server_args import server_config
from tests.server.conftest import MODEL, PLAIN_TEMPLATE

#: The plain template with the think block opened after the generation prompt.
THINK_TEMPLATE = PLAIN_TEMPLATE.replace("assistant:", "assistant:<think>\n")
USER = [{"role": "user", "content": "Lily and Ben went to the park"}]
#: ``</think>``: 7 tokens of the bundled model's vocabulary.
END_LEN = 7


@pytest.fixture
def thinking(live_server):
    """The live server rendering THINK_TEMPLATE with the qwen3 reasoning parser."""
    with live_server.configured(chat_template=THINK_TEMPLATE, reasoning_parser="qwen3"):
        yield live_server


def end_ids(server) -> list[int]:
    ids = server.engine.engine.tokenizer.encode("\n</think>", add_special_tokens=False)[2:]
    assert len(ids) == END_LEN
    return ids


def ask(client, max_tokens: int, **body):
    """(reasoning, content, output token ids) of a greedy chat request."""
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, **body})
    m, choice = r.choices[0].message, r.choices[0]
    return m.model_extra["reasoning"], m.content, choice.model_extra["token_ids"]


def test_chat_gets_exactly_n_reasoning_tokens_then_the_answer(thinking, client):
    end = end_ids(thinking)
    _, free_content, free_ids = ask(client, 24)
    assert free_content is None and len(free_ids) == 24      # thinks for ever
    thought, _, _ = ask(client, 6)
    answers = {}
    for n, expected in ((6, thought), (0, None)):
        reasoning, content, ids = ask(client, n + END_LEN + 5, thinking_token_budget=n)
        assert ids[:n] == free_ids[:n] and ids[n:n + END_LEN] == end
        assert (reasoning, len(ids)) == (expected, n + END_LEN + 5)
        tok = thinking.engine.engine.tokenizer
        assert content == tok.decode([5] + ids[n + END_LEN:])[len(tok.decode([5])):]
        assert content and "</think>" not in content
        answers[n] = content
    # streamed: the same pieces
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6 + END_LEN + 5, temperature=0, stream=True,
        extra_body={"thinking_token_budget": 6})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answers[6]


def test_the_server_default_applies_unless_the_request_sets_one(thinking, client):
    end = end_ids(thinking)
    with thinking.configured(reasoning_budget=3):
        _, content, ids = ask(client, 20)
        assert ids[3:3 + END_LEN] == end and content
        _, _, ids = ask(client, 20, thinking_token_budget=8)
        assert ids[8:8 + END_LEN] == end
        reasoning, content, ids = ask(client, 20, thinking_token_budget=-1)   # no limit
        assert content is None and len(reasoning) > 0 and len(ids) == 20
    _, content, _ = ask(client, 20)                 # the flag's default -1: no limit
    assert content is None


def test_responses_and_messages_take_the_budget(thinking, client):
    thought, _, _ = ask(client, 4)
    _, content, _ = ask(client, 4 + END_LEN + 5, thinking_token_budget=4)
    r = client.responses.create(model=MODEL, input=USER[0]["content"], temperature=0,
                                max_output_tokens=4 + END_LEN + 5,
                                extra_body={"thinking_token_budget": 4})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == (thought, content)
    assert r.usage.output_tokens_details.reasoning_tokens == 4 + END_LEN
    claude = anthropic.Anthropic(base_url=thinking.url, api_key="unused", max_retries=0)
    m = claude.messages.create(model=MODEL, max_tokens=4 + END_LEN + 5, messages=USER,
                               thinking={"type": "enabled", "budget_tokens": 4},
                               extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in m.content] == [("thinking", thought), ("text", content)]
    assert m.usage.output_tokens_details.thinking_tokens == 4 + END_LEN


def test_a_bad_budget_is_a_400_naming_the_field(http):
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, "thinking_token_budget": -2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == \
        ("thinking_token_budget", 400, "invalid_request_error")
    assert "thinking_token_budget must be an integer >= 0" in error["message"]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": USER,
                                        "thinking": {"type": "enabled", "budget_tokens": -5}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens must be an integer >= 0" in r.json()["error"]["message"]


def test_the_reasoning_budget_flag(capsys):
    parse = build_parser().parse_args
    assert server_config(parse(["serve", "--reasoning-budget", "0"])).reasoning_budget == 0
    assert server_config(parse(["serve"])).reasoning_budget == -1
    with pytest.raises(SystemExit):
        parse(["serve", "--reasoning-budget", "-2"])
    assert "must be an integer >= 0, or -1 for no limit, got -2" in capsys.readouterr().err
