"""The OpenAPI 3.1 document of the API, built from the pydantic schemas."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from server.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                             CompletionRequest, CompletionResponse, DetokenizeRequest,
                             DetokenizeResponse, ErrorResponse, ModelList, TokenizeRequest,
                             TokenizeResponse, VersionResponse)

#: (method, path, summary, request schema or None, response schema or None)
OPERATIONS = [
    ("post", "/v1/completions", "Create a completion (SSE of CompletionResponse chunks when "
     "stream is true)", CompletionRequest, CompletionResponse),
    ("post", "/v1/chat/completions", "Create a chat completion (SSE of ChatCompletionChunk "
     "when stream is true)", ChatCompletionRequest, ChatCompletionResponse),
    ("get", "/v1/models", "List the served models", None, ModelList),
    ("get", "/health", "200 once the model is loaded and warmed up; 503 while loading and "
     "once the engine has died", None, None),
    ("get", "/version", "The server's version", None, VersionResponse),
    ("get", "/metrics", "Prometheus metrics (text exposition format)", None, None),
    ("post", "/tokenize", "Tokenize a prompt or chat messages", TokenizeRequest,
     TokenizeResponse),
    ("post", "/detokenize", "Decode token ids", DetokenizeRequest, DetokenizeResponse),
]

_REF = "#/components/schemas/{model}"


def openapi_document(app_version: str) -> dict:
    """The OpenAPI document (``GET /openapi.json``)."""
    models = {m for op in OPERATIONS for m in op[3:] if m is not None}
    models |= {ChatCompletionChunk, ErrorResponse}
    keyed = [(m, "validation" if m in {op[3] for op in OPERATIONS} else "serialization")
             for m in sorted(models, key=lambda m: m.__name__)]
    _, schema = models_json_schema(keyed, ref_template=_REF)
    error = {"description": "Error (OpenAI shape)", "content": {"application/json": {
        "schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
    paths: dict = {}
    for method, path, summary, request, response in OPERATIONS:
        op: dict = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if response is not None:
            op["responses"]["200"]["content"] = {"application/json": {
                "schema": {"$ref": _REF.format(model=response.__name__)}}}
        if request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=request.__name__)}}}}
            op["responses"]["400"] = error
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "jaxpaged OpenAI-compatible API", "version": app_version},
            "paths": paths, "components": {"schemas": schema.get("$defs", {})}}
