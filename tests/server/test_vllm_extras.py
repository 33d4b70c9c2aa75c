"""Issue 24 part 5: vLLM's output-changing extras are honoured (exact values against the
plain request they stand for), the rest refused with a 400 naming the field; fields that
change nothing pass."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL, sse_events

IDS = list(range(5, 45))          # a 40-token prompt
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6}
USER = [{"role": "user", "content": "Lily and Ben went to the park"}]


def completion(http, **body):
    r = http.post("/v1/completions", json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http, **body):
    r = http.post("/v1/chat/completions", json={**GREEDY, "messages": USER, **body})
    assert r.status_code == 200, r.text
    return r.json()


def error(r, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["code"] == 400 and all(w in e["message"] for w in words), e


def chat_prompt_ids(http, **body) -> list[int]:
    return http.post("/tokenize", json={"messages": USER, **body}).json()["tokens"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(http):
    cut = completion(http, prompt=IDS, truncate_prompt_tokens=10, echo=True)
    plain = completion(http, prompt=IDS[-10:], echo=True)
    assert cut["usage"]["prompt_tokens"] == 10 and cut["choices"][0]["text"] == \
        plain["choices"][0]["text"]                   # the echo is the prompt that ran
    assert completion(http, prompt=IDS, truncate_prompt_tokens=-1)["usage"][
        "prompt_tokens"] == 40                        # -1: up to max_model_len (128)
    ids = chat_prompt_ids(http)
    cut = chat(http, truncate_prompt_tokens=5)
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["message"]["content"] == completion(
        http, prompt=ids[-5:])["choices"][0]["text"]
    error(http.post("/v1/completions", json={**GREEDY, "prompt": IDS,
                                             "truncate_prompt_tokens": 129}),
          "truncate_prompt_tokens", "129", "128")
    error(http.post("/v1/chat/completions", json={**GREEDY, "messages": USER,
                                                  "truncate_prompt_tokens": 0}),
          "truncate_prompt_tokens", "-1")


def test_return_token_ids(http):
    out = completion(http, prompt="Once upon a time", return_token_ids=True)
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == http.post(
        "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == 6
    assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()[
        "prompt"].strip() == choice["text"].strip()
    events = sse_events(http.post("/v1/completions", json={
        **GREEDY, "prompt": "Once upon a time", "return_token_ids": True, "stream": True}))
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert sum((c["token_ids"] for c in chunks), []) == choice["token_ids"]

    out = chat(http, return_token_ids=True)
    assert out["prompt_token_ids"] == chat_prompt_ids(http)
    token_ids = out["choices"][0]["token_ids"]
    assert len(token_ids) == out["usage"]["completion_tokens"]
    assert token_ids == completion(http, prompt=out["prompt_token_ids"],
                                   return_token_ids=True)["choices"][0]["token_ids"]
    events = sse_events(http.post("/v1/chat/completions", json={
        **GREEDY, "messages": USER, "return_token_ids": True, "stream": True}))
    assert events[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert sum((e["choices"][0]["token_ids"] or [] for e in events[:-1]), []) == token_ids


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_in_every_chunk(http, route):
    body = {**GREEDY, "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": IDS} if route.endswith("/completions") and "chat" not in route
                else {"messages": USER})
    events = sse_events(http.post(route, json=body))[:-1]
    final = events[-1]["usage"]
    assert events[-1]["choices"] == [] and final["completion_tokens"] == 8
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert all(e["usage"]["prompt_tokens"] == final["prompt_tokens"] for e in events)
    assert counts == sorted(counts) and counts[-1] == 8
    body["stream_options"] = {"include_usage": True}      # without it: only the last
    plain = sse_events(http.post(route, json=body))[:-1]   # (chunking follows timing:
    assert plain[-1]["usage"]["completion_tokens"] == 8    # 8 tokens may come as 1 chunk)
    assert plain[-1]["choices"] == [] and len(plain) >= 2
    assert all(e["usage"] is None for e in plain[:-1])


def test_chat_echo_puts_the_continued_message_first(http):
    messages = USER + [{"role": "assistant", "content": "Once upon"}]
    body = dict(messages=messages, add_generation_prompt=False, continue_final_message=True)
    plain = chat(http, **body)["choices"][0]["message"]["content"]
    echoed = chat(http, echo=True, **body)["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain and plain
    events = sse_events(http.post("/v1/chat/completions", json={
        **GREEDY, "echo": True, "stream": True, **body}))[:-1]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == echoed
    assert chat(http, echo=True)["choices"][0]["message"]["content"] == \
        chat(http)["choices"][0]["message"]["content"]    # last message the user's: no echo


def test_chat_prompt_logprobs(http):
    out = chat(http, prompt_logprobs=2)
    ids = chat_prompt_ids(http)
    ref = completion(http, prompt=ids, prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    assert out["prompt_logprobs"] == ref and len(ref) == len(ids) and ref[0] is None
    assert all(str(t) in entry for t, entry in zip(ids[1:], ref[1:]))
    error(http.post("/v1/chat/completions", json={**GREEDY, "messages": USER, "stream": True,
                                                  "prompt_logprobs": 1}),
          "prompt_logprobs", "stream")


@pytest.mark.parametrize("field, value, param", [
    ("modalities", ["text", "audio"], "modalities"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
    ("web_search_options", {}, "web_search_options"),
    ("messages", [{"role": "user", "content": [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "messages"),
    ("messages", [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}], "messages"),
])
def test_refused_chat_fields_name_themselves(http, field, value, param):
    r = http.post("/v1/chat/completions", json={**GREEDY, "messages": USER, field: value})
    error(r, param, "text only" if field in ("modalities", "audio", "messages") else field)
    if field == "messages":
        assert value[0]["content"][-1]["type"] in r.json()["error"]["message"]


def test_refused_completion_fields_and_silent_ones(http):
    error(http.post("/v1/completions", json={**GREEDY, "prompt": "x", "prompt_embeds": "AAA"}),
          "prompt_embeds")
    base = chat(http)["choices"][0]["message"]["content"]
    silent = chat(http, user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
                  modalities=["text"])
    assert silent["choices"][0]["message"]["content"] == base


@pytest.mark.parametrize("path, why", [("/v1/embeddings", "embeddings")])
def test_unserved_openai_routes_say_why(http, path, why):
    r = http.post(path, json={"model": MODEL, "input": "Once"})
    assert r.status_code == 404
    e = r.json()["error"]
    assert why in e["message"] and "/v1/chat/completions" in e["message"] and e["code"] == 404


def test_include_reasoning_false_leaves_the_reasoning_out(http, live_server):
    with live_server.configured(reasoning_parser="deepseek_r1"):   # untagged output: reasoning
        full = chat(http)["choices"][0]["message"]
        quiet = chat(http, include_reasoning=False)["choices"][0]["message"]
        events = sse_events(http.post("/v1/chat/completions", json={
            **GREEDY, "messages": USER, "stream": True, "include_reasoning": False}))[:-1]
    assert full["reasoning"] and full["content"] is None
    assert quiet["reasoning"] is None and quiet["reasoning_content"] is None
    assert quiet["content"] is None
    assert all(e["choices"][0]["delta"].get("reasoning") is None for e in events)


def test_documents_reach_the_template(http, live_server):
    template = ("{% for d in documents %}doc: {{ d.text }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    body = {"messages": USER, "chat_template": template,
            "documents": [{"title": "a", "text": "Lily has a dog."}]}
    with live_server.configured(trust_request_chat_template=True):
        ids = http.post("/tokenize", json=body).json()["tokens"]
        out = chat(http, return_token_ids=True, **body)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].startswith(
        "doc: Lily has a dog.\nuser: Lily")
    assert out["prompt_token_ids"] == ids


@pytest.mark.parametrize("field", ["logits_processors", "vllm_xargs"])
def test_logits_processor_fields_are_refused(http, field):
    error(http.post("/v1/completions", json={**GREEDY, "prompt": "x", field: ["a.b"]}),
          field, "logits processors")


def test_request_id_field_names_the_request(http):
    assert completion(http, prompt="x", request_id="job-7")["id"] == "cmpl-job-7"
    assert chat(http, request_id="job-8")["id"] == "chatcmpl-job-8"
    r = http.post("/v1/completions", json={**GREEDY, "prompt": "x", "request_id": "job-9"},
                  headers={"X-Request-Id": "hdr-9"})
    assert r.json()["id"] == "cmpl-hdr-9"             # the header wins, as in vLLM
    error(http.post("/v1/completions", json={**GREEDY, "prompt": "x", "request_id": "a b"}),
          "request_id", "request_id", "128")
