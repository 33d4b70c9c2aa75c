"""``POST /v1/embeddings`` on a pooling server, with the official client and raw HTTP."""

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL, wait_engine_empty
from tests.test_embeddings import NUM_PROMPTS, TOLERANCE, pooled, prompts

TEXTS = ["Once upon a time", "The cat saw a mouse"]     # reference prompts 0 and 2


@pytest.fixture(scope="module")
def embed_client(pooling_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def pooling_http(pooling_server):
    with httpx.Client(base_url=pooling_server.url, timeout=60) as c:
        yield c


def test_openai_client_embeddings_equal_the_reference(embed_client, pooling_server):
    # The client asks for base64 unless told otherwise, and decodes it.
    res = embed_client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in res.data] == [0, 1] and res.model == MODEL
    for d, i in zip(res.data, (0, 2)):
        np.testing.assert_allclose(d.embedding, pooled(i, "LAST"), atol=TOLERANCE, rtol=0)
    n = len(prompts()[0]) + len(prompts()[2])
    assert res.usage.prompt_tokens == res.usage.total_tokens == n
    as_float = embed_client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.embedding for d in as_float.data] == [d.embedding for d in res.data]
    wait_engine_empty(pooling_server)


def test_token_id_inputs_base64_and_single_input(pooling_http):
    ids = prompts()
    body = pooling_http.post("/v1/embeddings", json={"input": ids}).json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["id"].startswith("embd-")
    assert [d["object"] for d in body["data"]] == ["embedding"] * NUM_PROMPTS
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)),
                             "total_tokens": sum(map(len, ids))}
    for i, d in enumerate(body["data"]):    # the long ones ran in 16-token chunks
        np.testing.assert_allclose(d["embedding"], pooled(i, "LAST"), atol=TOLERANCE, rtol=0)
    b64 = pooling_http.post("/v1/embeddings", json={"input": ids,
                                                    "encoding_format": "base64"}).json()
    # Separate requests may be batched or prefix-cached differently, which moves the float32
    # sums in their 7th digit (seen 2 runs in 6): equal to float32 rounding, not bit for bit.
    for d, f in zip(b64["data"], body["data"]):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
        np.testing.assert_allclose(decoded, f["embedding"], atol=1e-6, rtol=0)
    single = pooling_http.post("/v1/embeddings", json={"input": ids[1]}).json()
    np.testing.assert_allclose(single["data"][0]["embedding"], body["data"][1]["embedding"],
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "Once", "dimensions": 32}, "dimensions", "does not support Matryoshka"),
    ({"input": ""}, "input", "input[0] is empty"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": [[]]}, "input", "input[0] is empty"),
    ({"input": ["Once", ""]}, "input", "input[1] is empty"),
    ({"input": [5] * (MAX_MODEL_LEN + 1)}, "input",
     f"129 tokens, more than this model's maximum context length of {MAX_MODEL_LEN}"),
    ({"input": [600]}, "input", "outside the vocabulary"),
    ({"input": "Once", "encoding_format": "bytes"}, "encoding_format", "encoding_format"),
])
def test_bad_requests_are_400s_that_say_why(pooling_http, pooling_server, body, param, words):
    r = pooling_http.post("/v1/embeddings", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    wait_engine_empty(pooling_server)


def test_each_server_says_which_task_it_serves(pooling_http, http):
    r = pooling_http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
    assert r.status_code == 404
    assert "runs its model for embeddings (--runner pooling)" in r.json()["error"]["message"]
    assert "it serves /v1/embeddings" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={"input": "Once"})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "serves no embeddings (start it with --runner pooling" in message
    assert pooling_http.post("/v1/embeddings", json={"input": "x", "model": "gpt"}
                             ).status_code == 404


def test_openapi_documents_the_served_task(pooling_http, http):
    pooling_paths = pooling_http.get("/openapi.json").json()["paths"]
    assert "/v1/embeddings" in pooling_paths and "/v1/completions" not in pooling_paths
    assert set(pooling_paths["/v1/embeddings"]["post"]["responses"]) >= {"200", "400", "429"}
    generating_paths = http.get("/openapi.json").json()["paths"]
    assert "/v1/completions" in generating_paths and "/v1/embeddings" not in generating_paths


def test_serve_flags_make_a_pooling_engine():
    from jaxpaged.cli import build_parser
    from jaxpaged.arg_utils import EngineArgs
    from jaxpaged.pooling_params import PoolerConfig

    args = build_parser().parse_args(["serve", "--runner", "pooling", "--pooler-config",
                                      '{"pooling_type": "MEAN", "normalize": false}'])
    assert EngineArgs.from_cli_args(args).pooler == PoolerConfig(pooling_type="MEAN",
                                                                 normalize=False)
    args = build_parser().parse_args(["serve", "--convert", "embed"])
    assert EngineArgs.from_cli_args(args).pooler == PoolerConfig()
    assert EngineArgs.from_cli_args(build_parser().parse_args(["serve"])).pooler is None
