"""The route handlers of ``server/app.py``: module-level functions over ``request.app.state``,
which :func:`jaxpaged.server.app.build_app` fills once (``engine``, ``config``,
``tokenizer``, ``registry``, the serving objects ``completion``, ``chat``, ``responses``,
``anthropic``, ``embedding``, ``scoring``, ``models``, and ``pooling`` / ``classify``).
Each reads a body with :func:`~jaxpaged.server.http_body.parse` and refuses work while the
engine takes none (:func:`~jaxpaged.server.http_body.ready`).
"""

from __future__ import annotations

from importlib.metadata import version

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.server.errors import bad_request, error_response
from jaxpaged.server.http_body import parse, ready
from jaxpaged.server.openapi import openapi_document
from jaxpaged.server.protocol import (CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                      ModelCard, ModelList, TokenizeResponse, VersionResponse)
from jaxpaged.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from jaxpaged.server.protocol_chat import ChatCompletionRequest, TokenizeRequest
from jaxpaged.server.protocol_responses import ResponsesRequest
from jaxpaged.server.serving import engine_error, off_loop
from jaxpaged.server.serving_embedding import EmbeddingRequest
from jaxpaged.server.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

# ---- generation -------------------------------------------------------------------------------


async def _call(request: Request, model, serving: str, method: str = "create") -> Response:
    """The generation routes' common body: refuse while the engine is not ready, validate
    the JSON body as ``model``, then ``request.app.state.<serving>.<method>(body, request)``.

    Raises:
        APIError: 503 while loading, 400 for a body that ``model`` refuses.
    """
    ready(request)
    body = await parse(request, model)
    return await getattr(getattr(request.app.state, serving), method)(body, request)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    return await _call(request, CompletionRequest, "completion")


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    return await _call(request, ChatCompletionRequest, "chat")


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    return await _call(request, ResponsesRequest, "responses")


async def response_by_id(request: Request) -> Response:
    """``GET`` / ``DELETE /v1/responses/{response_id}``: a stored response."""
    responses, response_id = request.app.state.responses, request.path_params["response_id"]
    if request.method == "DELETE":
        return responses.delete(response_id)
    return responses.retrieve(response_id)


async def cancel_response(request: Request) -> Response:
    """``POST /v1/responses/{response_id}/cancel``."""
    return request.app.state.responses.cancel(request.path_params["response_id"])


async def create_message(request: Request) -> Response:
    """``POST /v1/messages`` (Anthropic's Messages API)."""
    return await _call(request, MessagesRequest, "anthropic")


async def count_message_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``."""
    return await _call(request, CountTokensRequest, "anthropic", "count_tokens")


async def embeddings(request: Request) -> Response:
    """``POST /v1/embeddings`` (a pooling server)."""
    return await _call(request, EmbeddingRequest, "embedding")


# ---- models, health, metrics --------------------------------------------------------------------


def _cards(state) -> list[ModelCard]:
    engine, facts = state.engine, {}
    if engine.is_ready:
        info = engine.model_info
        facts = dict(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                     eos_token_ids=sorted(info.eos_token_ids))
    return [ModelCard(id=name, root=engine.args.model, **facts)
            for name in state.config.served_model_names] + [
        ModelCard(**card) for card in state.models.adapter_cards()]


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the served names and the loaded adapters."""
    return JSONResponse(ModelList(data=_cards(request.app.state)).model_dump())


async def show_model(request: Request) -> Response:
    """``GET /v1/models/{name}``; 404 for a name not served."""
    name = request.path_params["name"]
    request.app.state.completion.check_model(name)
    return JSONResponse(next(c for c in _cards(request.app.state) if c.id == name).model_dump())


def _probe(check) -> Response:
    try:
        check()
    except Exception as e:  # noqa: BLE001 - every engine state maps to an API error
        return error_response(engine_error(e))
    return Response(status_code=200)


async def health(request: Request) -> Response:
    """``GET /health``: 200 while the engine is alive (draining included), else its error."""
    return _probe(request.app.state.engine.check_alive)


async def readiness(request: Request) -> Response:
    """``GET /ready``: 200 while the engine takes new requests, else its error."""
    return _probe(request.app.state.engine.check_ready)


async def show_version(request: Request) -> Response:
    """``GET /version``."""
    return JSONResponse(VersionResponse(version=version("jaxpaged")).model_dump())


async def metrics(request: Request) -> Response:
    """``GET /metrics``: the Prometheus registry as text (empty without one)."""
    registry = request.app.state.registry
    return Response(generate_latest(registry) if registry is not None else b"",
                    media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    """``GET /openapi.json``: the routes this server serves."""
    state = request.app.state
    return JSONResponse(openapi_document(version("jaxpaged"), state.pooling, state.classify))


# ---- tokens and adapters --------------------------------------------------------------------------


async def tokenize(request: Request) -> Response:
    """``POST /tokenize``: a prompt's or a chat's token ids."""
    ready(request)
    state = request.app.state
    body = await parse(request, TokenizeRequest)
    state.completion.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        state.completion.check_text_length(body.prompt, "prompt")
        ids = await off_loop(state.tokenizer.encode, body.prompt, add_special_tokens=special)
    else:
        ids = await state.chat.render_request(body, bool(body.add_special_tokens))
    max_model_len = state.engine.model_info.max_model_len
    return JSONResponse(TokenizeResponse(count=len(ids), tokens=ids,
                                         max_model_len=max_model_len).model_dump())


async def detokenize(request: Request) -> Response:
    """``POST /detokenize``: token ids' text; 400 for ids outside the vocabulary."""
    ready(request)
    state = request.app.state
    body = await parse(request, DetokenizeRequest)
    state.completion.check_model(body.model)
    vocab = state.engine.model_info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})",
                          "tokens")
    text = await off_loop(state.tokenizer.decode, body.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


async def load_lora_adapter(request: Request) -> Response:
    """``POST /v1/load_lora_adapter``."""
    ready(request)
    body = await parse(request, LoadLoRAAdapterRequest)
    return Response(await request.app.state.models.load(body.lora_name, body.lora_path), 200)


async def unload_lora_adapter(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter``."""
    body = await parse(request, UnloadLoRAAdapterRequest)
    return Response(request.app.state.models.unload(body.lora_name), 200)
