"""Schemathesis against the server's OpenAPI document (``/openapi.json``): generated
requests, valid and invalid by the schema, to every operation of the live server; no answer
may be a 5xx or differ from what the document declares."""

from importlib.metadata import version

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               negative_data_rejection,
                                               response_schema_conformance,
                                               status_code_conformance)

from jaxpaged.server.openapi import openapi_document

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]

# The document is built from the request/response models alone, so it is known at import
# time (schemathesis' fixture-based loading needs a pytest internal that pytest 9 dropped);
# the test checks that the live server serves this very document.
# Schemathesis' coverage phase sends every boundary value of every field: only its invalid
# ones here (hundreds, each answered 400 at once); the valid requests, which run the model,
# come from the fuzzing phase, bounded by max_examples.
schema = schemathesis.openapi.from_dict(
    openapi_document(version("jaxpaged")),
    config=SchemathesisConfig.from_dict({"phases": {"coverage": {"generation": {
        "mode": "negative"}}}}))


#: The Responses route's schema is large (its input items): its boundary values alone take
#: about a minute here, so it is fuzzed nightly.
RESPONSES = "/v1/responses"
FUZZ_SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck))


@schema.exclude(path=RESPONSES).parametrize()
@FUZZ_SETTINGS
def test_openapi_fuzz(case, live_server, http):
    assert http.get("/openapi.json").json() == schema.raw_schema
    case.call_and_validate(base_url=live_server.url, checks=CHECKS, timeout=60)


@pytest.mark.slow
@schema.include(path=RESPONSES).parametrize()
@FUZZ_SETTINGS
def test_openapi_fuzz_responses(case, live_server):
    case.call_and_validate(base_url=live_server.url, checks=CHECKS, timeout=60)


def test_integral_numbers_are_integers(http):
    """Found by schemathesis: JSON Schema counts ``2.0`` as an integer (the document says
    "integer"), and so does the server now; strings, bools and fractions stay refused."""
    r = http.post("/v1/completions", json={"prompt": [1.0, 403.0], "max_tokens": 2.0, "n": 1.0,
                                           "temperature": 0, "seed": 3.0, "top_k": -1.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    for bad in ({"max_tokens": 2.5}, {"max_tokens": "2"}, {"max_tokens": True}, {"n": 1.5}):
        r = http.post("/v1/completions", json={"prompt": "x", **bad})
        assert r.status_code == 400 and "integer" in r.json()["error"]["message"], (bad, r.text)
    assert http.post("/v1/completions", json={"prompt": [1.5]}).status_code == 400
    assert http.post("/detokenize", json={"tokens": [1.0, 403.0]}).status_code == 200


def test_document_states_the_accepted_values():
    doc = schema.raw_schema["components"]["schemas"]
    props = doc["CompletionRequest"]["properties"]
    assert props["n"]["minimum"] == 1
    assert {"type": "number", "exclusiveMinimum": 0, "maximum": 1} in props["top_p"]["anyOf"]
    assert props["suffix"]["type"] == "null" and props["use_beam_search"]["enum"] == [False]
    assert {"type": "string", "minLength": 1} in props["prompt"]["anyOf"]
    completions = schema.raw_schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "500", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
