"""The OpenAPI 3.1 document of the API, built from the pydantic schemas.

Every status an operation can answer is declared (schemathesis checks the server against
this document: ``tests/server/test_fuzz_openapi.py``): errors in OpenAI's shape, and for the
generation routes the SSE stream (``text/event-stream``) a ``stream: true`` request gets.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from jaxpaged.sampling_params import MAX_LOGPROBS

from jaxpaged.server.protocol import (CompletionRequest, CompletionResponse, DetokenizeRequest,
                                      DetokenizeResponse, ErrorResponse, ModelList,
                                      TokenizeResponse, VersionResponse)
from jaxpaged.server.protocol_chat import (ChatCompletionChunk, ChatCompletionRequest,
                                           ChatCompletionResponse, TokenizeRequest)
from jaxpaged.server.protocol_responses import ResponseObject, ResponsesRequest
from jaxpaged.server.serving_embedding import EmbeddingRequest, EmbeddingResponse
from jaxpaged.server.serving_score import (RERANK_PATHS, SCORE_PATHS, RerankRequest,
                                          RerankResponse, ScoreRequest, ScoreResponse)

#: (method, path, summary, request schema or None, response schema or None)
OPERATIONS = [
    ("post", "/v1/completions", "Create a completion (SSE of CompletionResponse chunks when "
     "stream is true)", CompletionRequest, CompletionResponse),
    ("post", "/v1/chat/completions", "Create a chat completion (SSE of ChatCompletionChunk "
     "when stream is true)", ChatCompletionRequest, ChatCompletionResponse),
    ("post", "/v1/responses", "Create a response (OpenAI's Responses API; SSE of typed events "
     "when stream is true)", ResponsesRequest, ResponseObject),
    ("get", "/v1/models", "List the served models", None, ModelList),
    ("get", "/health", "Liveness: 200 once the model is loaded and warmed up, and while a "
     "shutdown drains; 503 while loading and once the engine has died", None, None),
    ("get", "/ready", "Readiness: 200 while new requests are taken; 503 while loading, while "
     "a shutdown drains (--shutdown-timeout) and once the engine has died", None, None),
    ("get", "/version", "The server's version", None, VersionResponse),
    ("get", "/metrics", "Prometheus metrics (text exposition format)", None, None),
    ("post", "/tokenize", "Tokenize a prompt or chat messages", TokenizeRequest,
     TokenizeResponse),
    ("post", "/detokenize", "Decode token ids", DetokenizeRequest, DetokenizeResponse),
]

#: The generation routes, first in :data:`OPERATIONS`.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
#: What a pooling server (``--runner pooling``) serves instead of the generation routes.
EMBEDDINGS_OPERATION = ("post", "/v1/embeddings", "Create embeddings (float or base64)",
                        EmbeddingRequest, EmbeddingResponse)
#: A pooling server's score and rerank routes (``server/serving_score.py``).
SCORE_OPERATIONS = [
    *[("post", p, "Score text pairs (a classifier's score, or embeddings' cosine similarity)",
       ScoreRequest, ScoreResponse) for p in SCORE_PATHS],
    *[("post", p, "Rerank documents by relevance to a query", RerankRequest, RerankResponse)
      for p in RERANK_PATHS]]

#: Error statuses of the operations that take a request body, and what they mean.
REQUEST_ERRORS = {
    "400": "Invalid request (OpenAI's error shape)",
    "401": "Missing or wrong API key (servers started with --api-key)",
    "404": "The model is not served",
    "413": "The request body is too large",
    "415": "The request body is not declared as JSON (Content-Type)",
    "500": "The engine has failed",
    "503": "The model is still loading, or the server is shutting down",
}
#: What the generation routes answer besides :data:`REQUEST_ERRORS`.
GENERATION_ERRORS = {
    "429": "Too many requests waiting (servers started with --max-pending-requests); "
           "Retry-After says when to retry",
    "500": "The model step running the request failed, or the engine has failed",
    "504": "The request did not finish within --request-timeout",
}
#: vLLM's optional request id header of the generation routes.
REQUEST_ID_HEADER = {"name": "X-Request-Id", "in": "header", "required": False,
                     "description": "the request's id after its cmpl- / chatcmpl- prefix "
                                    "(default: a random one); unique among running requests",
                     "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"}}
#: The SSE stream of the completion routes (``stream: true``). Before OpenAPI 3.2 a stream's
#: ``schema`` describes one event: ``data`` is a chunk's JSON (CompletionResponse /
#: ChatCompletionChunk, or an ErrorResponse if the engine fails mid-stream), then ``[DONE]``.
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "description": "a chunk's JSON, or [DONE] last"},
        "event": {"type": "string"}}}}}

_REF = "#/components/schemas/{model}"

#: Ranges the server accepts for request fields. The models take any number (the sampling
#: parameters check the range and answer 400 naming it); the document states the ranges so
#: that clients, and generated tests, see them.
FIELD_RANGES = {
    "n": {"minimum": 1}, "best_of": {"minimum": 1}, "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1}, "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "seed": {"minimum": -2**63, "maximum": 2**64 - 1},
    "max_tokens": {"minimum": 0}, "max_completion_tokens": {"minimum": 0},
    "min_tokens": {"minimum": 0}, "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "stop": {"minLength": 1}, "cache_salt": {"minLength": 1},
    "truncate_prompt_tokens": {"minimum": -1, "not": {"const": 0}},
    "thinking_token_budget": {"minimum": -1},
}
#: Constraints on the items of list (and map) fields.
ITEM_RANGES = {"stop": {"minLength": 1}, "bad_words": {"minLength": 1},
               "stop_token_ids": {"minimum": 0}, "allowed_token_ids": {"minimum": 0}}
#: Fields of features this server does not have: only these values are accepted (any other
#: gets a 400 naming the field).
UNSUPPORTED = {
    "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
    "tool_choice": {"enum": [None, "none"]}, "use_beam_search": {"enum": [False]},
    **{name: {"type": "null"} for name in (
        "functions", "function_call", "suffix")},
}


def openapi_document(app_version: str, pooling: bool = False, classify: bool = False) -> dict:
    """The OpenAPI document (``GET /openapi.json``) of a generating server, or of a pooling
    one (``pooling``: ``/v1/embeddings``, unless it runs a classifier (``classify``), and the
    score and rerank routes instead of the generation routes)."""
    operations = ([*([] if classify else [EMBEDDINGS_OPERATION]), *SCORE_OPERATIONS,
                   *OPERATIONS[len(GENERATION_PATHS):]] if pooling else OPERATIONS)
    models = {m for op in operations for m in op[3:] if m is not None}
    models |= {ErrorResponse} if pooling else {ChatCompletionChunk, ErrorResponse}
    keyed = [(m, "validation" if m in {op[3] for op in operations} else "serialization")
             for m in sorted(models, key=lambda m: m.__name__)]
    _, schema = models_json_schema(keyed, ref_template=_REF)
    for request in () if pooling else (CompletionRequest, ChatCompletionRequest):
        _state_request_rules(schema["$defs"][request.__name__]["properties"])
    def error(description: str) -> dict:
        return {"description": description, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model="ErrorResponse")}}}}

    paths: dict = {}
    for method, path, summary, request, response in operations:
        op: dict = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if response is not None:
            op["responses"]["200"]["content"] = {"application/json": {
                "schema": {"$ref": _REF.format(model=response.__name__)}}}
        if request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=request.__name__)}}}}
            op["responses"].update({code: error(text) for code, text in REQUEST_ERRORS.items()})
        if path.endswith(("/completions", "/responses")):
            op["responses"]["200"]["content"].update(EVENT_STREAM)
            op["responses"].update({code: error(text) for code, text in GENERATION_ERRORS.items()})
            op["parameters"] = [REQUEST_ID_HEADER]
        if path == "/v1/embeddings" or path in SCORE_PATHS + RERANK_PATHS:
            op["responses"].update({code: error(text) for code, text in GENERATION_ERRORS.items()})
            op["parameters"] = [REQUEST_ID_HEADER]
        if path in ("/health", "/ready"):
            op["responses"].update({"500": error("The engine has failed"), "503": error(
                "The model is still loading" + (", or the server is draining"
                                                if path == "/ready" else ""))})
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "jaxpaged OpenAI-compatible API", "version": app_version},
            "paths": paths, "components": {"schemas": schema.get("$defs", {})}}


def _state_request_rules(properties: dict) -> None:
    """Add :data:`FIELD_RANGES`, :data:`ITEM_RANGES` and :data:`UNSUPPORTED` to a completion
    request's properties (a nullable field's range goes on its non-null branch), and that
    prompts and messages are not empty."""
    for name, prop in properties.items():
        if name in UNSUPPORTED:
            keep = {k: prop[k] for k in ("title", "default") if k in prop}
            prop.clear()
            prop.update(keep, **UNSUPPORTED[name], description="not supported by this server")
            continue
        for branch in prop.get("anyOf", [prop]):
            kind = branch.get("type")
            if name in FIELD_RANGES and kind in ("integer", "number", "string"):
                branch.update({k: v for k, v in FIELD_RANGES[name].items()
                               if (k == "minLength") == (kind == "string")})
            if name in ITEM_RANGES and kind == "array":
                branch["items"].update(ITEM_RANGES[name])
            if name == "logit_bias" and kind == "object":
                branch["additionalProperties"].update(minimum=-100, maximum=100)
                branch["propertyNames"] = {"pattern": "^[0-9]+$"}
            if name in ("prompt", "messages"):      # no empty prompt, at any depth
                _non_empty(branch)


def _non_empty(schema: dict) -> None:
    """Strings and arrays in ``schema`` (recursively) get at least one character / item;
    integers (token ids) are >= 0."""
    kind = schema.get("type")
    if kind == "string":
        schema["minLength"] = 1
    elif kind == "integer":
        schema["minimum"] = 0
    elif kind == "array":
        schema["minItems"] = 1
        if "type" in schema["items"]:
            _non_empty(schema["items"])
