"""Issue 24 part 3: behaviours vLLM's clients rely on, each asserted with exact values
(``cached_tokens``, echoed logprob keys, the requested alias, /tokenize ids)."""

from __future__ import annotations

import uuid

from tests.server.conftest import MODEL, sse_events

#: The live server's page size (EngineArgs' default ``block_size``).
PAGE = 16


def full_pages(num_prompt_tokens: int) -> int:
    """Tokens a repeated prompt hits: its full pages, keeping one token to compute."""
    return (num_prompt_tokens - 1) // PAGE * PAGE


def test_cached_tokens_completions_and_chat(http):
    salt = uuid.uuid4().hex          # a cache of its own: earlier tests cannot have warmed it
    prompt = list(range(5, 45))      # 40 token ids: 2 full pages hit on a repeat
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "cache_salt": salt}
    first = http.post("/v1/completions", json=body).json()["usage"]
    second = http.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 2 * PAGE}
    stream = http.post("/v1/completions", json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    last = sse_events(stream)[-2]
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 2 * PAGE}

    chat = {"model": MODEL, "max_tokens": 2, "temperature": 0, "cache_salt": salt,
            "messages": [{"role": "user", "content": "Lily and Ben went to the park " * 4}]}
    miss = http.post("/v1/chat/completions", json=chat).json()["usage"]
    hit = http.post("/v1/chat/completions", json=chat).json()["usage"]
    assert miss["prompt_tokens_details"] == {"cached_tokens": 0}
    expected = full_pages(hit["prompt_tokens"])
    assert expected >= PAGE and hit["prompt_tokens_details"] == {"cached_tokens": expected}
    stream = http.post("/v1/chat/completions", json={
        **chat, "stream": True, "stream_options": {"include_usage": True}})
    assert sse_events(stream)[-2]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": expected}


def test_echoed_prompt_tokens_key_their_top_logprobs_by_their_text(http):
    prompt = "Once upon a time"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3,
            "temperature": 0}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert "".join(lp["tokens"][:n_prompt]) == prompt
    assert lp["tokens"][1] == "Once"           # the first word's share of the prompt text
    assert lp["top_logprobs"][0] is None
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                   lp["top_logprobs"][1:]):
        assert top[token] == logprob
    assert "".join(lp["tokens"]) == http.post("/v1/completions", json=body).json()[
        "choices"][0]["text"]


def test_an_alias_is_answered_with_its_own_name(http, client):
    for name in ("alias", MODEL):
        body = {"model": name, "prompt": "Once", "max_tokens": 3, "temperature": 0}
        assert http.post("/v1/completions", json=body).json()["model"] == name
        chunks = sse_events(http.post("/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}))[:-1]
        assert len(chunks) >= 2 and {c["model"] for c in chunks} == {name}
        chat = {"model": name, "messages": [{"role": "user", "content": "Lily"}],
                "max_tokens": 3, "temperature": 0}
        assert http.post("/v1/chat/completions", json=chat).json()["model"] == name
        chunks = sse_events(http.post("/v1/chat/completions", json={
            **chat, "stream": True, "stream_options": {"include_usage": True}}))[:-1]
        assert len(chunks) >= 3 and {c["model"] for c in chunks} == {name}
    anonymous = {"prompt": "Once", "max_tokens": 1}      # no model: the first served name
    assert http.post("/v1/completions", json=anonymous).json()["model"] == MODEL
    cards = http.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("alias", None)]
    assert client.models.retrieve("alias").parent is None


#: Reads every rendering argument: tools, a template variable, the generation prompt.
RENDER_TEMPLATE = ("{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}"
                   "\n{% endif %}{{ preamble | default('') }}{% for m in messages %}"
                   "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tokenize_messages_renders_what_chat_runs(http, live_server, monkeypatch):
    ran = []
    add_request = live_server.engine.add_request

    async def spy(request_id, prompt, *args, **kwargs):
        ran.append(prompt["prompt_token_ids"])
        return await add_request(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(live_server.engine, "add_request", spy)
    user = {"role": "user", "content": "Lily"}
    cases = [
        {"messages": [user]},
        {"messages": [user, {"role": "assistant", "content": "Once upon"}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"messages": [user], "add_generation_prompt": False},
        {"messages": [user], "chat_template": RENDER_TEMPLATE, "tools": [TOOL],
         "chat_template_kwargs": {"preamble": "Stories.\n"}},
        {"messages": [user], "add_special_tokens": True},
    ]
    texts = []
    with live_server.configured(trust_request_chat_template=True):
        for case in cases:
            ids = http.post("/tokenize", json=case).json()["tokens"]
            r = http.post("/v1/chat/completions", json={
                **case, "model": MODEL, "max_tokens": 1, "temperature": 0, "tool_choice": "none"})
            assert r.status_code == 200, r.text
            assert ran.pop() == ids and r.json()["usage"]["prompt_tokens"] == len(ids)
            texts.append(http.post("/detokenize", json={"tokens": ids}).json()["prompt"])
    assert texts[1].endswith("assistant: Once upon")           # left open, no newline
    assert texts[3].startswith("tools: get_weather\nStories.\nuser: Lily")
    assert len(set(texts)) == len(texts)                        # each argument took effect


def test_models_report_eos_ids_and_vocab_size(http, client):
    """The bundled model's config.json: ``eos_token_id`` 2, ``vocab_size`` 512."""
    for card in http.get("/v1/models").json()["data"]:
        assert (card["eos_token_ids"], card["vocab_size"], card["max_model_len"]) == (
            [2], 512, 128)
    card = client.models.retrieve(MODEL)
    assert card.eos_token_ids == [2] and card.vocab_size == 512
    assert http.post("/detokenize", json={"tokens": [card.vocab_size - 1]}).status_code == 200
    assert http.post("/detokenize", json={"tokens": [card.vocab_size]}).status_code == 400
