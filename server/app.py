"""The Starlette application: routes, API-key check, body limit, error mapping, lifespan.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (and,
with ``--responses-store-size``, ``GET`` / ``DELETE /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``) on a generating engine, or ``POST /v1/embeddings`` on a pooling
engine (``--runner pooling``: one task per server, as vLLM registers only its model's task's
routes; the other task's routes answer a 404 that says why, ``UNSERVED_ROUTES`` /
``UNSERVED_BY_POOLING``); ``POST /score`` and ``POST /rerank`` (also under ``/v1/``, and
``/v2/rerank``; ``server/serving_score.py``) on a pooling engine, a sequence classifier's or an
embedding model's (a generating engine answers them with a 400 that says why),
``GET /v1/models``, ``GET /health`` (liveness: 200 only once the
model is loaded and warmed up, and while a graceful shutdown drains; 503 while loading and
from the moment the engine has died; it never waits on the engine), ``GET /ready``
(readiness: as ``/health``, but 503 from the moment a shutdown begins, so a load balancer
stops sending new requests), ``GET /version``, ``GET /metrics``
(Prometheus text), ``POST /tokenize``, ``POST /detokenize``, ``GET /openapi.json``; and
Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` on a generating
engine (``server/serving_anthropic.py``).
Every error, the framework's included, is answered in OpenAI's shape (``server/errors.py``),
on the Anthropic routes in Anthropic's. The API key (``--api-key``) may come as
``Authorization: Bearer <key>`` or as Anthropic's ``x-api-key: <key>``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from importlib.metadata import version

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxpaged.engine.async_engine import AsyncEngine
from jaxpaged.server.errors import (APIError, anthropic_error_response, bad_request,
                                   error_response, from_validation_error)
from jaxpaged.server.openapi import openapi_document
from jaxpaged.server.protocol import (CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                      ModelCard, ModelList, TokenizeResponse, VersionResponse)
from jaxpaged.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from jaxpaged.server.protocol_chat import ChatCompletionRequest, TokenizeRequest
from jaxpaged.server.serving import CLIENT_GONE, ServerConfig, engine_error, off_loop
from jaxpaged.server.serving_anthropic import AnthropicServingMessages
from jaxpaged.server.serving_chat import OpenAIServingChat
from jaxpaged.server.protocol_responses import ResponsesRequest
from jaxpaged.server.serving_completion import OpenAIServingCompletion
from jaxpaged.server.serving_responses import OpenAIServingResponses
from jaxpaged.server.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from jaxpaged.server.serving_rl import RL_PATHS, rl_routes
from jaxpaged.server.serving_score import OpenAIServingScore, score_routes
from jaxpaged.server.serving_models import (LoadLoRAAdapterRequest, ServingModels,
                                            UnloadLoRAAdapterRequest)

logger = logging.getLogger("server")

#: Paths that need the API key (when one is set); health, metrics and version stay open.
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/score", "/rerank",
                      *RL_PATHS)
#: Paths answered in Anthropic's error shape (``server/serving_anthropic.py``).
ANTHROPIC_PREFIX = "/v1/messages"
#: OpenAI routes this server does not serve, and why (their 404 says so, not "Not Found").
UNSERVED_ROUTES = {
    "/v1/embeddings": "this server runs a generative model and serves no embeddings (start "
                      "it with --runner pooling, or --convert embed, to serve them)",
    "/v1/audio/": "this model accepts text only",
    "/v1/images/": "this model accepts text only",
}
#: The same for a server that runs its model for embeddings (``--runner pooling``).
UNSERVED_BY_POOLING = {
    **{route: "this server runs its model for embeddings (--runner pooling) and does not "
              "generate (start it with --runner generate to generate)"
       for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                     "/v1/messages")},
    "/v1/audio/": "this model accepts text only",
    "/v1/images/": "this model accepts text only",
}
#: The same for a server that runs a sequence classifier (``--convert classify``).
UNSERVED_BY_CLASSIFIER = {
    **UNSERVED_BY_POOLING,
    "/v1/embeddings": "this server runs a sequence classifier (rerank and score) and serves "
                      "no embeddings (start it with --convert embed to serve them)",
}
for _route in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
    UNSERVED_BY_CLASSIFIER[_route] = ("this server runs its model as a sequence classifier "
                                      "(--runner pooling) and does not generate (start it "
                                      "with --runner generate to generate)")
SCORE_ROUTES = "/rerank, /v1/rerank, /score and /v1/score"


def build_app(engine: AsyncEngine, config: ServerConfig, tokenizer,
              registry: CollectorRegistry | None = None, manage_engine: bool = True) -> Starlette:
    """The ASGI app serving ``engine``.

    Args:
        engine: the engine (started by the app's lifespan when ``manage_engine``).
        config: HTTP-layer settings.
        tokenizer: a tokenizer instance for the event loop (not the engine's).
        registry: the Prometheus registry ``/metrics`` exposes.
        manage_engine: start the engine at start-up and stop it at shutdown.
    """
    names = ServingModels(config.served_model_names, engine, config.lora_modules)
    completion = OpenAIServingCompletion(engine, config, tokenizer, names)
    chat = OpenAIServingChat(engine, config, tokenizer, names)
    responses = OpenAIServingResponses(chat)
    anthropic = AnthropicServingMessages(chat)
    embedding = OpenAIServingEmbedding(engine, config, tokenizer, names)
    scoring = OpenAIServingScore(engine, config, tokenizer, names)
    pooling = engine.args.pooler is not None
    classify = pooling and engine.args.pooler.task == "classify"
    unserved = (UNSERVED_BY_CLASSIFIER if classify else UNSERVED_BY_POOLING if pooling
                else UNSERVED_ROUTES)
    served = (SCORE_ROUTES if classify else f"/v1/embeddings, {SCORE_ROUTES}" if pooling else
              "/v1/completions, /v1/chat/completions, /v1/responses and /v1/messages")

    def too_large() -> APIError:
        return APIError(413, f"the request body exceeds {config.max_request_body_bytes} bytes",
                        "invalid_request_error")

    async def parse(request: Request, model: type[BaseModel]):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > config.max_request_body_bytes:
            raise too_large()               # refused before reading it
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type and media_type != "application/json" and not media_type.endswith("+json"):
            # as FastAPI (vLLM's server) does: a browser's cross-site "simple" request
            # (text/plain, a form) never reaches the engine
            raise APIError(415, f"the request body must be JSON (Content-Type: "
                                f"application/json), got Content-Type {media_type!r}",
                           "invalid_request_error")
        body = bytearray()
        try:
            async for chunk in request.stream():   # a chunked body (or a lying length)
                body += chunk
                if len(body) > config.max_request_body_bytes:
                    raise too_large()
        except ClientDisconnect:                   # hung up while sending: nobody to answer
            logger.info("client disconnected while sending its request body")
            raise APIError(CLIENT_GONE, "the client disconnected", "invalid_request_error",
                           None) from None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:   # bad JSON or UTF-8, too deep, huge ints
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        check_unicode(data)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise from_validation_error(e) from None

    def ready():
        try:
            return engine.check_ready()
        except Exception as e:  # noqa: BLE001 - every engine state maps to an API error
            raise engine_error(e) from None

    async def completions(request: Request) -> Response:
        ready()
        return await completion.create(await parse(request, CompletionRequest), request)

    async def chat_completions(request: Request) -> Response:
        ready()
        return await chat.create(await parse(request, ChatCompletionRequest), request)

    async def create_response(request: Request) -> Response:
        ready()
        return await responses.create(await parse(request, ResponsesRequest), request)

    async def create_message(request: Request) -> Response:
        ready()
        return await anthropic.create(await parse(request, MessagesRequest), request)

    async def count_message_tokens(request: Request) -> Response:
        ready()
        return await anthropic.count_tokens(await parse(request, CountTokensRequest), request)

    async def response_by_id(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return responses.delete(response_id)
        return responses.retrieve(response_id)

    async def cancel_response(request: Request) -> Response:
        return responses.cancel(request.path_params["response_id"])

    async def embeddings(request: Request) -> Response:
        ready()
        return await embedding.create(await parse(request, EmbeddingRequest), request)

    def cards() -> list[ModelCard]:
        facts = {}
        if engine.is_ready:
            info = engine.model_info
            facts = dict(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                         eos_token_ids=sorted(info.eos_token_ids))
        return [ModelCard(id=name, root=engine.args.model, **facts)
                for name in config.served_model_names] + [
            ModelCard(**card) for card in names.adapter_cards()]

    async def models(request: Request) -> Response:
        return JSONResponse(ModelList(data=cards()).model_dump())

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        completion.check_model(name)
        return JSONResponse(next(c for c in cards() if c.id == name).model_dump())

    def probe(check):
        async def answer(request: Request) -> Response:
            try:
                check()
            except Exception as e:  # noqa: BLE001 - every engine state maps to an API error
                return error_response(engine_error(e))
            return Response(status_code=200)
        return answer

    health, readiness = probe(engine.check_alive), probe(engine.check_ready)

    async def version_route(request: Request) -> Response:
        return JSONResponse(VersionResponse(version=version("jaxpaged")).model_dump())

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry) if registry is not None else b"",
                        media_type=CONTENT_TYPE_LATEST)

    async def tokenize(request: Request) -> Response:
        ready()
        body = await parse(request, TokenizeRequest)
        completion.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            completion.check_text_length(body.prompt, "prompt")
            ids = await off_loop(tokenizer.encode, body.prompt, add_special_tokens=special)
        else:
            ids = await chat.render_request(body, bool(body.add_special_tokens))
        max_model_len = engine.model_info.max_model_len
        return JSONResponse(TokenizeResponse(count=len(ids), tokens=ids,
                                             max_model_len=max_model_len).model_dump())

    async def detokenize(request: Request) -> Response:
        ready()
        body = await parse(request, DetokenizeRequest)
        completion.check_model(body.model)
        vocab = engine.model_info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})",
                              "tokens")
        text = await off_loop(tokenizer.decode, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    async def load_lora_adapter(request: Request) -> Response:
        ready()
        body = await parse(request, LoadLoRAAdapterRequest)
        return Response(await names.load(body.lora_name, body.lora_path), 200)

    async def unload_lora_adapter(request: Request) -> Response:
        body = await parse(request, UnloadLoRAAdapterRequest)
        return Response(names.unload(body.lora_name), 200)

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(version("jaxpaged"), pooling, classify))

    embedding_routes = [] if classify else [Route("/v1/embeddings", embeddings, methods=["POST"])]
    routes = score_routes(scoring, ready, parse)
    routes += embedding_routes if pooling else [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", response_by_id, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"])]
    routes += [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", readiness, methods=["GET"]),
        Route("/version", version_route, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *([Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
           Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
          if config.allow_runtime_lora_updating else []),
        *(rl_routes(engine, ready, parse) if config.enable_rl_endpoints else []),
    ]

    def render(request: Request, exc: APIError) -> Response:
        anthropic_route = request.url.path.startswith(ANTHROPIC_PREFIX)
        return (anthropic_error_response if anthropic_route else error_response)(exc)

    async def api_error(request: Request, exc: APIError) -> Response:
        return render(request, exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        path, detail = request.url.path, exc.detail
        why = next((w for p, w in unserved.items() if path.startswith(p)), None)
        if exc.status_code == 404 and why is not None:
            detail = f"{why}; it serves {served}. {request.method} {path} is not available"
            return render(request, APIError(404, detail, kind))
        return render(request, APIError(exc.status_code, f"{detail}: {request.method} {path}",
                                        kind))

    async def internal_error(request: Request, exc: Exception) -> Response:
        return render(request, APIError(500, f"internal error: {exc!r}",
                                        "internal_server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.shutdown()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: api_error, HTTPException: http_error, Exception: internal_error})
    return APIKeyMiddleware(app, config.api_key) if config.api_key else app


def check_unicode(data) -> None:
    """Raises APIError 400 for a string with a lone surrogate (valid JSON, but no text: it
    cannot be tokenized or echoed), naming where it is."""
    try:   # one C-speed pass for the common case; walk only to name the field
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                field = path.lstrip(".") or "body"
                raise bad_request(f"'{field}' holds invalid Unicode (a lone surrogate)",
                                  field.split(".")[0]) from None
        elif isinstance(value, dict):
            stack.extend((v, f"{path}.{k}") for k, v in value.items())
            stack.extend((k, f"{path}.{k!r}") for k in value if isinstance(k, str))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(value))


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <api_key>`` or ``x-api-key: <api_key>`` (Anthropic's
    header) on :data:`PROTECTED_PREFIXES` paths (compared in constant time); answers 401
    otherwise, in OpenAI's shape (Anthropic's on its routes)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    def _authorized(self, headers: dict) -> bool:
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        bearer = hmac.compare_digest(given.strip(), self._expected) and \
            scheme.lower() == b"bearer"
        key = headers.get(b"x-api-key")
        return bearer or (key is not None and hmac.compare_digest(key.strip(), self._expected))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and \
                not self._authorized(dict(scope["headers"])):
            anthropic_route = scope["path"].startswith(ANTHROPIC_PREFIX)
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                                  "<key>' or 'x-api-key: <key>'.",
                             "authentication_error" if anthropic_route else
                             "invalid_request_error")
            response = (anthropic_error_response if anthropic_route else error_response)(error)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
