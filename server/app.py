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

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxpaged.engine.async_engine import AsyncEngine
from jaxpaged.server import routes as handlers
from jaxpaged.server.errors import APIError, anthropic_error_response, error_response
from jaxpaged.server.serving import ServerConfig
from jaxpaged.server.serving_anthropic import AnthropicServingMessages
from jaxpaged.server.serving_chat import OpenAIServingChat
from jaxpaged.server.serving_completion import OpenAIServingCompletion
from jaxpaged.server.serving_responses import OpenAIServingResponses
from jaxpaged.server.serving_embedding import OpenAIServingEmbedding
from jaxpaged.server.serving_rl import RL_PATHS, rl_routes
from jaxpaged.server.serving_score import OpenAIServingScore, score_routes
from jaxpaged.server.serving_models import ServingModels

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
    """The ASGI app serving ``engine``: the handlers of ``server/routes.py`` (and of
    ``serving_score.py`` / ``serving_rl.py``) over the parts this puts on ``app.state``.

    Args:
        engine: the engine (started by the app's lifespan when ``manage_engine``).
        config: HTTP-layer settings.
        tokenizer: a tokenizer instance for the event loop (not the engine's).
        registry: the Prometheus registry ``/metrics`` exposes.
        manage_engine: start the engine at start-up and stop it at shutdown.
    """
    models = ServingModels(config.served_model_names, engine, config.lora_modules)
    chat = OpenAIServingChat(engine, config, tokenizer, models)
    pooling = engine.args.pooler is not None
    classify = pooling and engine.args.pooler.task == "classify"
    routes = score_routes()
    if pooling:
        routes += [] if classify else [Route("/v1/embeddings", handlers.embeddings,
                                             methods=["POST"])]
    else:
        routes += GENERATION_ROUTES
    routes += COMMON_ROUTES
    if config.allow_runtime_lora_updating:
        routes += LORA_ROUTES
    if config.enable_rl_endpoints:
        routes += rl_routes()
    app = Starlette(routes=routes, lifespan=_lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state = State(dict(
        engine=engine, config=config, tokenizer=tokenizer, registry=registry,
        manage_engine=manage_engine, models=models, chat=chat,
        completion=OpenAIServingCompletion(engine, config, tokenizer, models),
        responses=OpenAIServingResponses(chat), anthropic=AnthropicServingMessages(chat),
        embedding=OpenAIServingEmbedding(engine, config, tokenizer, models),
        scoring=OpenAIServingScore(engine, config, tokenizer, models),
        pooling=pooling, classify=classify,
        unserved=(UNSERVED_BY_CLASSIFIER if classify else UNSERVED_BY_POOLING if pooling
                  else UNSERVED_ROUTES),
        served=(SCORE_ROUTES if classify else f"/v1/embeddings, {SCORE_ROUTES}" if pooling
                else "/v1/completions, /v1/chat/completions, /v1/responses and /v1/messages")))
    return APIKeyMiddleware(app, config.api_key) if config.api_key else app


#: The routes of a generating server.
GENERATION_ROUTES = [
    Route("/v1/completions", handlers.completions, methods=["POST"]),
    Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
    Route("/v1/responses", handlers.create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", handlers.response_by_id, methods=["GET", "DELETE"]),
    Route("/v1/responses/{response_id}/cancel", handlers.cancel_response, methods=["POST"]),
    Route("/v1/messages", handlers.create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", handlers.count_message_tokens, methods=["POST"])]
#: The routes of every server.
COMMON_ROUTES = [
    Route("/v1/models", handlers.list_models, methods=["GET"]),
    Route("/v1/models/{name:path}", handlers.show_model, methods=["GET"]),
    Route("/health", handlers.health, methods=["GET"]),
    Route("/ready", handlers.readiness, methods=["GET"]),
    Route("/version", handlers.show_version, methods=["GET"]),
    Route("/metrics", handlers.metrics, methods=["GET"]),
    Route("/tokenize", handlers.tokenize, methods=["POST"]),
    Route("/detokenize", handlers.detokenize, methods=["POST"]),
    Route("/openapi.json", handlers.openapi, methods=["GET"])]
#: ``--allow-runtime-lora-updating``'s routes.
LORA_ROUTES = [
    Route("/v1/load_lora_adapter", handlers.load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", handlers.unload_lora_adapter, methods=["POST"])]


def _render(request: Request, exc: APIError) -> Response:
    anthropic_route = request.url.path.startswith(ANTHROPIC_PREFIX)
    return (anthropic_error_response if anthropic_route else error_response)(exc)


async def _api_error(request: Request, exc: APIError) -> Response:
    return _render(request, exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """The framework's errors (404, 405) in OpenAI's shape; a route this kind of server does
    not serve says why and what it serves."""
    kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
    path, detail, state = request.url.path, exc.detail, request.app.state
    why = next((w for p, w in state.unserved.items() if path.startswith(p)), None)
    if exc.status_code == 404 and why is not None:
        detail = f"{why}; it serves {state.served}. {request.method} {path} is not available"
        return _render(request, APIError(404, detail, kind))
    return _render(request, APIError(exc.status_code, f"{detail}: {request.method} {path}",
                                     kind))


async def _internal_error(request: Request, exc: Exception) -> Response:
    return _render(request, APIError(500, f"internal error: {exc!r}", "internal_server_error"))


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    """Starts the engine with the app and stops it at shutdown (``manage_engine``)."""
    engine, manage = app.state.engine, app.state.manage_engine
    if manage:
        engine.start()
    try:
        yield
    finally:
        if manage:
            engine.shutdown()


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
