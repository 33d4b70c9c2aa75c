"""``/rerank`` and ``/score`` over HTTP: a cross-encoder server against transformers' scores,
an embedding server's cosine scores, bad input, and requests side by side."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from jaxpaged.server.serving import ServerConfig
from tests.server.conftest import LiveServer, engine_args, wait_engine_empty
from tests.test_embeddings import pooled
from tests.test_score import DOCUMENTS, QUERY, REFERENCES, SEQ_CLS, TOLERANCE, reference

NAME = "cross-encoder"


@pytest.fixture(scope="module")
def classify_server():
    """The random Llama cross-encoder, 16-token steps (pairs prefill in chunks)."""
    server = LiveServer(engine_args(model=SEQ_CLS, max_num_batched_tokens=16),
                        ServerConfig([NAME])).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cls_http(classify_server):
    with httpx.Client(base_url=classify_server.url, timeout=60) as c:
        yield c


def test_rerank_orders_by_the_reference_scores(cls_http, classify_server):
    refs = reference("llama_seq_cls", QUERY)
    expected = sorted(range(len(refs)), key=lambda j: -refs[j]["score"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = cls_http.post(path, json={"model": NAME, "query": QUERY, "documents": DOCUMENTS,
                                         "top_n": 2}).json()
        assert body["id"].startswith("rerank-") and body["model"] == NAME
        assert [r["index"] for r in body["results"]] == expected[:2]
        for r in body["results"]:
            assert abs(r["relevance_score"] - refs[r["index"]]["score"]) < TOLERANCE
            assert r["document"] == {"text": DOCUMENTS[r["index"]]}
        tokens = sum(len(r["input_ids"]) for r in refs)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    every = cls_http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                           "return_documents": False}).json()["results"]
    assert [r["index"] for r in every] == expected and every[0]["document"] is None
    wait_engine_empty(classify_server)


def test_score_one_to_many_and_one_to_one(cls_http):
    refs = reference("llama_seq_cls", QUERY)
    body = cls_http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in body["data"])
    np.testing.assert_allclose([d["score"] for d in body["data"]], [r["score"] for r in refs],
                               atol=TOLERANCE, rtol=0)
    refs = reference("llama_seq_cls")[3:6]
    body = cls_http.post("/v1/score", json={"text_1": [r["query"] for r in refs],
                                            "text_2": [r["document"] for r in refs],
                                            "use_activation": False}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], [r["logit"] for r in refs],
                               atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("path, body, param, words", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "at least one document"),
    ("/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents", "documents[1] is empty"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query", "query is empty"),
    ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n", "top_n must be"),
    ("/rerank", {"query": QUERY, "documents": ["cat " * 200]}, "documents",
     "more than this model's maximum context length of 128"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "one to one"),
    ("/score", {"text_1": [], "text_2": "c"}, "text_1", "text_1 must hold"),
    ("/score", {"text_1": "a", "text_2": 5}, "text_2", "text_2"),
])
def test_bad_input_is_a_400_that_says_why(cls_http, classify_server, path, body, param, words):
    r = cls_http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    wait_engine_empty(classify_server)


def test_servers_say_which_task_they_serve(cls_http, http):
    from jaxpaged.server.app import PROTECTED_PREFIXES

    # the API key guards the new routes as it guards /v1/*
    assert all(p.startswith(PROTECTED_PREFIXES) for p in ("/rerank", "/score", "/v2/rerank"))
    r = http.post("/v1/rerank", json={"query": "a", "documents": ["b"]})    # generating
    assert r.status_code == 400
    assert "runs for generation and cannot score or rerank" in r.json()["error"]["message"]
    assert http.post("/score", json={"text_1": "a", "text_2": "b"}).status_code == 400
    r = cls_http.post("/v1/embeddings", json={"input": "Once"})
    assert r.status_code == 404 and "runs a sequence classifier" in r.json()["error"]["message"]
    r = cls_http.post("/v1/completions", json={"prompt": "Once"})
    assert r.status_code == 404 and "it serves /rerank" in r.json()["error"]["message"]


def test_embedding_server_scores_by_cosine_similarity(pooling_server):
    with httpx.Client(base_url=pooling_server.url, timeout=60) as c:
        body = c.post("/rerank", json={"query": "Once upon a time",
                                       "documents": ["The cat saw a mouse", "Once upon a time"]
                                       }).json()
        score = c.post("/score", json={"text_1": "Once upon a time",
                                       "text_2": "The cat saw a mouse"}).json()
    cos = float(pooled(0, "LAST") @ pooled(2, "LAST"))      # reference prompts 0 and 2
    assert [r["index"] for r in body["results"]] == [1, 0]
    assert body["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
    assert body["results"][1]["relevance_score"] == pytest.approx(cos, abs=1e-5)
    assert score["data"][0]["score"] == pytest.approx(cos, abs=1e-5)


def test_rerank_and_score_side_by_side_lose_nothing(cls_http, classify_server):
    refs = REFERENCES["llama_seq_cls"]
    jobs = [("/rerank", {"query": r["query"], "documents": [r["document"], "The cat."]})
            for r in refs] + [("/score", {"text_1": r["query"], "text_2": r["document"]})
                              for r in refs]

    def send(job):
        return cls_http.post(job[0], json=job[1])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, jobs))
    assert [a.status_code for a in answers] == [200] * len(jobs)
    for (path, _), a, r in zip(jobs, answers, refs + refs):
        body = a.json()
        got = (next(x["relevance_score"] for x in body["results"] if x["index"] == 0)
               if path == "/rerank" else body["data"][0]["score"])
        assert abs(got - r["score"]) < TOLERANCE
    wait_engine_empty(classify_server)


def test_the_chat_template_is_the_score_template(cls_http, classify_server):
    from tests.test_score import TEMPLATE

    ref = reference("qwen3_reranker")[0]        # (the same tokenizer renders the same ids)
    with classify_server.configured(chat_template=TEMPLATE):
        body = cls_http.post("/score", json={"text_1": ref["query"],
                                             "text_2": ref["document"]}).json()
        assert body["usage"]["prompt_tokens"] == len(ref["input_ids"])
    with classify_server.configured(chat_template="{{ messages[0]['content'] | nofilter }}"):
        r = cls_http.post("/score", json={"text_1": "a", "text_2": "b"})
        assert r.status_code == 400 and "does not render" in r.json()["error"]["message"]


def test_openapi_documents_the_score_routes(cls_http, pooling_server, http):
    paths = cls_http.get("/openapi.json").json()["paths"]
    assert {"/rerank", "/v1/rerank", "/score", "/v1/score"} <= set(paths)
    assert "/v1/embeddings" not in paths and "/v1/completions" not in paths
    assert set(paths["/rerank"]["post"]["responses"]) >= {"200", "400", "429"}
    assert "/rerank" in httpx.get(pooling_server.url + "/openapi.json").json()["paths"]
    assert "/rerank" not in http.get("/openapi.json").json()["paths"]   # generating
