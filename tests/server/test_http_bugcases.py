"""BUGCASES B09-B12, B14, B17, B19, B27, B29, B30 as HTTP-level tests on the live server."""

import json
import math

import pytest

from jaxpaged import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN as L
from tests.server.conftest import MODEL, sse_events

VOCAB = 512


def completion(http, **body):
    return http.post("/v1/completions", json={"model": MODEL, **body})


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"model": MODEL, **body})


def assert_error(response, status, param=None, *needles):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def assert_serving(http, live_server):
    """A normal request succeeds and the engine holds nothing afterwards."""
    r = completion(http, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert r.status_code == 200, r.text
    live_server.wait_idle()
    assert live_server.kv.num_free_pages == live_server.kv.num_usable_pages


def ids_prompt(n):
    return [1] + [300 + i % 100 for i in range(n - 1)]


# ---- B09 -------------------------------------------------------------------------------


def test_max_tokens_null_or_omitted_takes_the_default(http):
    base = dict(prompt="test", temperature=0, ignore_eos=True)
    null = completion(http, max_tokens=None, **base)
    omitted = completion(http, **base)
    assert null.status_code == omitted.status_code == 200
    assert null.json()["usage"]["completion_tokens"] == 16      # OpenAI's default
    assert null.json()["choices"][0]["text"] == omitted.json()["choices"][0]["text"]
    messages = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        r = chat(http, messages=messages, temperature=0, ignore_eos=True, **{field: None})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]                                 # the room left in context
        assert usage["prompt_tokens"] + usage["completion_tokens"] == L


# ---- B10 -------------------------------------------------------------------------------


def test_echo_with_max_tokens_zero_scores_the_prompt(http, live_server, stories_llm):
    prompt = "Your answer: Yes"
    r = completion(http, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    ids = stories_llm.get_tokenizer().encode(prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    ref = stories_llm.generate(prompt, SamplingParams(prompt_logprobs=1, max_tokens=1),
                               use_tqdm=False)[0].prompt_logprobs
    for value, token, entry in zip(lp["token_logprobs"][1:], ids[1:], ref[1:]):
        assert math.isfinite(value) and abs(value - entry[token].logprob) < 1e-4
    assert r.json()["usage"]["completion_tokens"] == 0
    assert_serving(http, live_server)


# ---- B11 -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_prompts_beyond_the_context_are_400s_naming_the_lengths(http, live_server, stream):
    # (a) longer than the context: both numbers, before any SSE
    r = completion(http, prompt=ids_prompt(L + 10), max_tokens=1, stream=stream)
    assert_error(r, 400, "prompt", str(L), str(L + 10))
    assert_serving(http, live_server)
    # (b) prompt fits, prompt + max_tokens does not: prompt, requested and allowed counts
    r = completion(http, prompt=ids_prompt(L - 5), max_tokens=20, stream=stream)
    assert_error(r, 400, "max_tokens", str(L), str(L - 5), "20", "at most 5")
    assert_serving(http, live_server)
    # (c) exactly L tokens: no room to generate, never "longer than"
    r = completion(http, prompt=ids_prompt(L), max_tokens=1, stream=stream)
    error = assert_error(r, 400, "prompt", "no room to generate")
    assert "longer than" not in error["message"]
    assert_serving(http, live_server)
    # (d) exactly L tokens, scoring only: served
    r = completion(http, prompt=ids_prompt(L), max_tokens=0, echo=True, logprobs=1,
                   stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        tokens = [t for e in events[:-1] for c in e["choices"] for t in c["logprobs"]["tokens"]]
    else:
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == L
    assert_serving(http, live_server)
    # chat: counted after the template
    long_chat = [{"role": "user", "content": "Lily had a big red ball. " * 40}]
    r = chat(http, messages=long_chat, max_tokens=1, stream=stream)
    assert_error(r, 400, "messages", str(L))
    r = chat(http, messages=[{"role": "user", "content": "hi"}], max_tokens=L, stream=stream)
    assert_error(r, 400, "max_tokens", str(L))
    assert_serving(http, live_server)


# ---- B12 -------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, needle", [
    ("", "empty"), ([""], "empty"), ([], "empty"), ([[]], "empty"),
    ([-1], "outside the vocabulary"), ([[-1]], "outside the vocabulary"),
    ([VOCAB], "outside the vocabulary")])
def test_empty_and_invalid_prompts_are_400s(http, live_server, prompt, needle):
    assert_error(completion(http, prompt=prompt, max_tokens=2), 400, "prompt", needle)
    assert_serving(http, live_server)


def test_empty_chat_messages_are_a_400_and_empty_content_is_served(http, live_server):
    assert_error(chat(http, messages=[]), 400, "messages", "empty")
    assert_serving(http, live_server)
    # Documented: an empty content is served (the template still renders a prompt).
    r = chat(http, messages=[{"role": "user", "content": ""}], max_tokens=2)
    assert r.status_code == 200, r.text
    assert_serving(http, live_server)


# ---- B14 -------------------------------------------------------------------------------


def test_n_choices_are_the_same_streamed_and_not(http, live_server):
    body = dict(prompt="Once upon a time", n=4, temperature=1.0, seed=7, max_tokens=32)
    expected = None
    for _ in range(20):
        choices = completion(http, **body).json()["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
        texts = {c["index"]: c["text"] for c in choices}
        expected = expected or texts
        assert texts == expected
    assert len(set(expected.values())) > 1          # four different samples
    for _ in range(20):
        events = sse_events(completion(http, stream=True, **body))
        texts, finishes = {}, {}
        for e in events[:-1]:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"] is not None:
                    finishes[c["index"]] = finishes.get(c["index"], 0) + 1
        assert texts == expected and finishes == {0: 1, 1: 1, 2: 1, 3: 1}
    greedy = completion(http, **{**body, "temperature": 0}).json()["choices"]
    assert len({c["text"] for c in greedy}) == 1 and len(greedy) == 4
    assert_error(completion(http, **{**body, "best_of": 2}), 400, "best_of")
    assert_serving(http, live_server)


# ---- B17 -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_follow_openais_schema(http, live_server, stream):
    messages = [{"role": "user", "content": "Tell me a story"}]

    def content(**kw):
        r = chat(http, messages=messages, max_tokens=8, temperature=0, stream=stream, **kw)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["logprobs"]["content"], r.json()["usage"]
        events = sse_events(r)
        entries = [x for e in events[:-1] for c in e["choices"]
                   for x in ((c.get("logprobs") or {}).get("content") or [])]
        return entries, None

    entries, usage = content(logprobs=True)
    assert entries and all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in entries)
    if usage:
        assert len(entries) == usage["completion_tokens"]
    for e in entries:
        assert bytes(e["bytes"]).decode("utf-8", errors="replace") == e["token"]
    entries, _ = content(logprobs=True, top_logprobs=3)
    for e in entries:
        top = e["top_logprobs"]
        assert len(top) == 3 and set(top[0]) == {"token", "logprob", "bytes"}
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        match = [t for t in top if t["token"] == e["token"]]
        if match:
            assert match[0]["logprob"] == e["logprob"]
    assert len(entries) == 8
    r = chat(http, messages=messages, top_logprobs=3, stream=stream)
    assert_error(r, 400, "top_logprobs", "logprobs")
    r = chat(http, messages=messages, logprobs=True, top_logprobs=21, stream=stream)
    assert_error(r, 400, "top_logprobs", "20")
    assert_serving(http, live_server)


def test_logprob_bytes_of_a_byte_fallback_token(http):
    byte_e2 = 3 + 0xE2   # "<0xE2>" in the Llama-2 byte-fallback block (ids 3..258)
    r = chat(http, messages=[{"role": "user", "content": "x"}], max_tokens=1, logprobs=True,
             allowed_token_ids=[byte_e2])
    entry = r.json()["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == [0xE2]
    assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]


# ---- B19 -------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("options", [None, {}, {"include_usage": True}, {"include_usage": False}])
def test_sse_streams_are_framed_as_openai_frames_them(http, endpoint, options):
    body = dict(n=2, max_tokens=5, temperature=0, ignore_eos=True)
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        path, kind = "/v1/chat/completions", "chat.completion.chunk"
    else:
        body["prompt"] = "Once upon a time"
        path, kind = "/v1/completions", "text_completion"
    full = http.post(path, json={"model": MODEL, **body}).json()
    streamed = {"model": MODEL, **body, "stream": True}
    if options is not None:
        streamed["stream_options"] = options
    r = http.post(path, json=streamed)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == kind and c["model"] == MODEL and isinstance(c["created"], int)
               for c in chunks)
    finished, seen = {}, set()
    for c in chunks:
        for choice in c["choices"]:
            i = choice["index"]
            assert "finish_reason" in choice
            assert i not in finished, "a chunk after this index's final chunk"
            if endpoint == "chat" and i not in seen:
                assert choice["delta"]["role"] == "assistant"
            seen.add(i)
            if choice["finish_reason"] is not None:
                assert choice["finish_reason"] in ("stop", "length")
                finished[i] = choice["finish_reason"]
    assert finished == {0: "length", 1: "length"}
    with_usage = [c for c in chunks if c.get("usage")]
    if options and options.get("include_usage"):
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    else:
        assert with_usage == []


# ---- B27 -------------------------------------------------------------------------------


def test_chat_template_errors_are_400s_that_say_why(http, live_server):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with live_server.configured(chat_template=None):        # the bundled tokenizer has no template
        for stream in (False, True):
            r = chat(http, messages=messages, stream=stream)
            assert_error(r, 400, None, "no chat template", "--chat-template")
        assert completion(http, prompt="Once", max_tokens=2).status_code == 200
    raising = ("{% if messages[0]['role'] == messages[1]['role'] %}"
               "{{ raise_exception('roles must alternate') }}{% endif %}")
    with live_server.configured(chat_template=raising):
        for stream in (False, True):
            error = assert_error(chat(http, messages=messages, stream=stream), 400)
            assert error["message"] == "roles must alternate"
    error = assert_error(chat(http, messages=[{"role": "foo", "content": "x"}]), 400,
                         "messages", "messages.0.role")
    assert "foo" in error["message"] or "user" in error["message"]
    assert_serving(http, live_server)


# ---- B29 -------------------------------------------------------------------------------


def test_errors_and_model_lists_have_openais_shape(http):
    error = assert_error(completion(http, prompt="x", **{"model": "does-not-exist"}), 404,
                         "model", "does-not-exist")
    assert error["code"] == 404
    assert_error(completion(http, prompt=ids_prompt(L + 1)), 400, "prompt")
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                  headers={"content-type": "application/json"})
    assert_error(r, 400, None, "not valid JSON")
    assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    assert_error(http.get("/v1/nope"), 404)
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    for card in models["data"]:
        assert card["object"] == "model" and isinstance(card["created"], int)
        assert isinstance(card["owned_by"], str)
    assert [c["id"] for c in models["data"]] == [MODEL, "alias"]


# ---- B30 -------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, needle", [
    ("temperature", -1, ">= 0"), ("temperature", "NaN", "number"), ("top_p", 0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"), ("top_k", 0.5, "integer"), ("top_k", -2, ">= -1"),
    ("n", 0, ">= 1"), ("max_tokens", -5, ">= 0"), ("logprobs", -1, "[0, 20]"),
    ("presence_penalty", 3, "[-2, 2]"), ("repetition_penalty", 0, "> 0"),
    ("min_p", 1.5, "[0, 1]"), ("seed", "abc", "integer"),
    ("stop", ["x"] * 100 + [""], "non-empty"), ("logit_bias", {"abc": 1}, "token ids"),
    ("logit_bias", {"100000": 1}, "outside the vocabulary"), ("n", 17, "max_num_seqs"),
    ("prompt", 123, "prompt"), ("max_tokens", "5", "integer"), ("stream", "yes", "boolean"),
    ("logprobs", True, "integer"), ("stop", "", "non-empty"), ("logit_bias", {"3": 1000}, "100"),
    ("stop_token_ids", [99999], "outside the vocabulary"), ("cache_salt", "", "non-empty"),
    ("priority", 5, "scheduling-policy"), ("response_format", {"type": "json_schema"}, "schema"),
    ("tools", [{"type": "function"}], "not supported"), ("use_beam_search", True, "not"),
    ("stream_options", {"include_usage": True}, "stream=true")])
def test_out_of_range_parameters_are_400s_naming_the_field(http, live_server, field, value, needle):
    r = completion(http, **{"prompt": "Once", "max_tokens": 2, field: value})
    assert_error(r, 400, field, needle)
    assert not live_server.engine.engine.has_unfinished_requests()
    assert live_server.kv.num_free_pages == live_server.kv.num_usable_pages
    assert completion(http, prompt="Once", max_tokens=2).status_code == 200


@pytest.mark.parametrize("body, needle", [
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "Unicode"),
    (b'{"prompt": ["ok", "\\ud800"]}', "Unicode"),
    (b'{"model": "\\ud800", "prompt": "x"}', "Unicode"),
    (b'{"prompt": "x", "temperature": NaN}', "finite"),
    (b'{"prompt": "x", "max_tokens": 1' + b'0' * 5000 + b'}', "JSON"),
    (b'{"x": ' + b'[' * 30000 + b']' * 30000 + b'}', "JSON")])
def test_malformed_bodies_get_400(http, live_server, body, needle):
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, None, needle)
    assert_serving(http, live_server)


@pytest.mark.parametrize("field, value", [
    ("temperature", 0), ("top_p", 1), ("top_k", -1), ("top_k", 0), ("top_k", 1), ("n", 1),
    ("stop", ["x"] * 100)])
def test_parameters_at_their_boundaries_are_served(http, field, value):
    assert completion(http, prompt="Once", max_tokens=2, **{field: value}).status_code == 200


def test_unknown_fields_are_ignored_and_logit_bias_applies(http):
    r = completion(http, prompt="Once", max_tokens=3, temperature=0, user="me", foo=1,
                   logit_bias={"400": 100}, logprobs=0, return_tokens_as_token_ids=True)
    assert r.status_code == 200
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:400"] * 3
    text = http.post("/detokenize", json={"tokens": [400] * 3}).json()["prompt"]
    assert r.json()["choices"][0]["text"].strip() == text.strip()


def test_completion_logprob_tokens_spell_the_text(http):
    body = dict(prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=1)
    choice = completion(http, **body).json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == \
        lp["tokens"]
    events = sse_events(completion(http, stream=True, **body))
    offsets = [o for e in events[:-1] for c in e["choices"] for o in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
    for prompt in ("Once upon a time", "A café 日本"):    # echo: prompt tokens spell it too
        choice = completion(http, **{**body, "prompt": prompt, "echo": True}).json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt) and "".join(lp["tokens"]) == choice["text"]
        assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] \
            == lp["tokens"]


def test_prompt_logprobs_and_per_request_chat_template(http, live_server):
    r = completion(http, prompt="Once upon a time", max_tokens=1, prompt_logprobs=2).json()
    entries = r["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == r["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 3 and all(v["logprob"] <= 0 for v in e.values())
               for e in entries[1:])
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    ids = http.post("/tokenize", json={"prompt": "<<hi>>", "add_special_tokens": False}).json()
    body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                chat_template=template)
    assert_error(chat(http, **body), 400, "chat_template", "--trust-request-chat-template")
    with live_server.configured(trust_request_chat_template=True):
        r = chat(http, **body)
    assert r.json()["usage"]["prompt_tokens"] == ids["count"]


def test_model_retrieve(client, http):
    assert client.models.retrieve("alias").id == "alias"
    assert_error(http.get("/v1/models/nope"), 404, "model")


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == L and r["tokens"][0] == 1
    assert http.post("/detokenize", json={"tokens": r["tokens"][1:]}).json()["prompt"] == \
        "Once upon a time"
    chat_ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat_ids.json()["count"] > 0
    assert_error(http.post("/detokenize", json={"tokens": [VOCAB]}), 400, "tokens")


def test_version_and_openapi(http):
    assert http.get("/version").json()["version"]
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])
    assert "CompletionRequest" in doc["components"]["schemas"]
    json.dumps(doc)
