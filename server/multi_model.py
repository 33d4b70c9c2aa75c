"""Several models in one ``jaxpaged serve`` (``--models-config FILE``).

Each model gets its own engine (its own thread, KV pool and scheduler) and its own app from
:func:`jaxpaged.server.app.build_app`; :class:`ModelRouter`, an ASGI app in front of them,
sends every request to the app that serves its ``model``: a JSON body's ``model`` field
(``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``, ...), the path of
``GET /v1/models/{name}``; ``/v1/responses/{id}`` (retrieve, delete, cancel) goes to the
model whose response store holds the id. ``GET /v1/models`` lists every model, ``GET /metrics`` merges the
engines' metrics (each labelled with its ``model_name``), ``/health`` and ``/ready`` answer 200
only when every engine does. A request without a ``model`` goes to the first model; an unknown
name gets the usual 404, listing every served name.

The config file is JSON:

.. code-block:: json

    {"models": [
      {"model": "/models/a", "served_model_name": ["a"], "kv_cache_memory_share": 0.6,
       "engine_args": {"max_num_seqs": 64}},
      {"model": "/models/b", "served_model_name": ["b", "b-latest"],
       "kv_cache_memory_share": 0.3}]}

``kv_cache_memory_share`` is the model's fraction of the device memory the server may use:
its engine runs with ``gpu_memory_utilization`` = share x ``--gpu-memory-utilization`` (the
shares must add up to at most 1), or, where ``--kv-cache-memory-bytes`` is given, that many
bytes x share; on a CPU without ``--kv-cache-memory-bytes`` it caps the engine's KV pool at
share x the CPU's default KV budget (``jaxpaged.runner.kv_sizing``). The start-up log says
which applied to each model. ``engine_args`` override the server's engine flags for that model (any
:class:`~jaxpaged.arg_utils.EngineArgs` field).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from starlette.responses import JSONResponse, Response

from jaxpaged.arg_utils import NOT_FLAGS, EngineArgs
from jaxpaged.server.app import APIKeyMiddleware
from jaxpaged.runner import kv_sizing
from jaxpaged.server.errors import error_response
from jaxpaged.server.serving import ServerConfig, engine_error, model_not_found

#: The fields a model entry may have.
ENTRY_FIELDS = ("model", "served_model_name", "kv_cache_memory_share", "engine_args")


@dataclass(frozen=True)
class ModelEntry:
    """One model of ``--models-config``.

    Attributes:
        model: the model directory (or GGUF file).
        served_model_name: the names clients use (default: ``[model]``).
        kv_cache_memory_share: its fraction of the server's device memory (0, 1].
        engine_args: EngineArgs fields that differ from the server's flags.
    """

    model: str
    served_model_name: list[str] = field(default_factory=list)
    kv_cache_memory_share: float = 1.0
    engine_args: dict = field(default_factory=dict)


def load_models_config(path: str) -> list[ModelEntry]:
    """The entries of the JSON file at ``path`` (format in the module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, no ``models`` list, an unknown or ill-typed field (named), a
            share outside (0, 1] or shares adding up past 1, a name served twice, or an
            ``engine_args`` key that is not an EngineArgs field.
    """
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise ValueError(f"--models-config {path}: not valid JSON: {e}") from None
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, list) or not models:
        raise ValueError(f"--models-config {path}: needs a non-empty 'models' list")
    known = {f.name for f in dataclasses.fields(EngineArgs)} - set(NOT_FLAGS)
    entries, names = [], []
    for i, item in enumerate(models):
        where = f"--models-config {path}: models[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("model"), str):
            raise ValueError(f"{where}: needs a 'model' path")
        if unknown := sorted(set(item) - set(ENTRY_FIELDS)):
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (allowed: {ENTRY_FIELDS})")
        served = item.get("served_model_name", [item["model"]])
        served = [served] if isinstance(served, str) else served
        if not isinstance(served, list) or not served or not all(
                isinstance(n, str) and n for n in served):
            raise ValueError(f"{where}.served_model_name: a name or a list of names")
        share = item.get("kv_cache_memory_share", 1.0 / len(models))
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"{where}.kv_cache_memory_share must be in (0, 1], got {share!r}")
        overrides = item.get("engine_args", {})
        if not isinstance(overrides, dict):
            raise ValueError(f"{where}.engine_args must be an object")
        if bad := sorted(set(overrides) - known):
            raise ValueError(f"{where}.engine_args: {bad[0]!r} is not an engine argument")
        names += served
        entries.append(ModelEntry(item["model"], served, float(share), overrides))
    if len(set(names)) != len(names):
        raise ValueError(f"--models-config {path}: a served model name is used twice: {names}")
    if sum(e.kv_cache_memory_share for e in entries) > 1 + 1e-9:
        raise ValueError(f"--models-config {path}: the kv_cache_memory_share values add up "
                         "to more than 1")
    return entries


def entry_engine_args(base: EngineArgs, entry: ModelEntry) -> EngineArgs:
    """The engine flags of ``entry``: ``base`` with its model, overrides and memory share."""
    memory = ({"kv_cache_memory_bytes": int(base.kv_cache_memory_bytes
                                            * entry.kv_cache_memory_share)}
              if base.kv_cache_memory_bytes else
              {"gpu_memory_utilization": base.gpu_memory_utilization
               * entry.kv_cache_memory_share})
    return dataclasses.replace(base, **{"model": entry.model, "tokenizer": None, **memory,
                                        "kv_cache_memory_share": entry.kv_cache_memory_share,
                                        **entry.engine_args})


def kv_memory_note(base: EngineArgs, entry: ModelEntry) -> str:
    """What ``entry``'s ``kv_cache_memory_share`` applies to under the server's flags
    ``base``, for the start-up log (without starting JAX: the backend is not known yet)."""
    args, own = entry_engine_args(base, entry), entry.engine_args
    share = f"kv_cache_memory_share {entry.kv_cache_memory_share:g}"
    if args.num_gpu_blocks_override is not None:
        return (f"{share} not applied: num_gpu_blocks_override="
                f"{args.num_gpu_blocks_override} sets the KV pages")
    if "kv_cache_memory_bytes" in own:
        return f"{share} not applied: its own kv_cache_memory_bytes={args.kv_cache_memory_bytes}"
    if args.kv_cache_memory_bytes is not None:
        return f"{share} of --kv-cache-memory-bytes: {args.kv_cache_memory_bytes} bytes of KV"
    gpu = (f"its own gpu_memory_utilization {args.gpu_memory_utilization:g}"
           if "gpu_memory_utilization" in own else
           f"gpu_memory_utilization {args.gpu_memory_utilization:.3g}")
    default = kv_sizing.DEFAULT_CPU_KV_CACHE_BYTES
    return (f"{share}: {gpu} on a GPU; on a CPU at most "
            f"{default * entry.kv_cache_memory_share / 2**30:.2f} GiB of KV (of the "
            f"{default / 2**30:.0f} GiB default)")


class EngineGroup:
    """The engines of one server, seen as one by the launcher (ready when all are, an error
    when any has one, drained and stopped together)."""

    def __init__(self, engines: list):
        self.engines = engines

    @property
    def is_ready(self) -> bool:
        return all(e.is_ready for e in self.engines)

    @property
    def is_loading(self) -> bool:
        return any(e.is_loading for e in self.engines)

    @property
    def error(self) -> BaseException | None:
        return next((e.error for e in self.engines if e.error is not None), None)

    @property
    def num_open_streams(self) -> int:
        return sum(e.num_open_streams for e in self.engines)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block (not in the event loop) until every engine is ready or one failed."""
        for engine in self.engines:
            if not engine.wait_ready(timeout):
                return False
        return True

    def begin_drain(self) -> None:
        for engine in self.engines:
            engine.begin_drain()

    def stop_requests(self) -> None:
        for engine in self.engines:
            engine.stop_requests()


class ModelRouter:
    """The ASGI app in front of the models' apps (module docstring).

    Args:
        routes: (served names, the app serving them, its engine, its metrics registry) per
            model, the first the default.
        max_request_body_bytes: larger bodies are passed on unread (the app answers 413).
    """

    def __init__(self, routes: list[tuple[list[str], object, object, object]],
                 max_request_body_bytes: int):
        self.routes = routes
        self.by_name = {name: app for names, app, _, _ in routes for name in names}
        self.default = routes[0][1]
        self.max_body = max_request_body_bytes
        self.names = [n for names, *_ in routes for n in names]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return await self.default(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/health", "/ready"):
            return await self._health(path, scope, receive, send)
        if method == "GET" and path == "/metrics":
            body = generate_latest(_MergedRegistries([r for *_, r in self.routes]))
            return await Response(body, media_type="text/plain; version=0.0.4")(
                scope, receive, send)
        if method == "GET" and path == "/v1/models":
            return await self._models(scope, receive, send)
        if method == "GET" and path.startswith("/v1/models/"):
            return await self._to(path[len("/v1/models/"):], scope, receive, send)
        if path.startswith("/v1/responses/"):
            return await self._stored_response(scope, receive, send)
        if method != "POST":
            return await self.default(scope, receive, send)
        body, cut = await _read_body(receive, self.max_body)
        model = None
        if not cut:
            try:
                data = json.loads(body)
                model = data.get("model") if isinstance(data, dict) else None
            except ValueError:
                pass                       # the default app answers the bad body
        return await self._to(model, scope, _replay(body, cut, receive), send)

    async def _to(self, model, scope, receive, send):
        if isinstance(model, str) and model and model not in self.by_name:
            return await error_response(model_not_found(model, self.names))(
                scope, receive, send)
        app = self.by_name.get(model, self.default) if isinstance(model, str) else self.default
        return await app(scope, receive, send)

    async def _stored_response(self, scope, receive, send):
        """The first model's answer that is not a 404 (each model keeps its own store)."""
        for _, app, _, _ in self.routes:
            start, parts = await _call(app, scope)
            if start["status"] != 404:
                break
        await send(start)
        await send({"type": "http.response.body", "body": b"".join(parts)})

    async def _health(self, path, scope, receive, send):
        for _, _, engine, _ in self.routes:
            try:
                engine.check_alive() if path == "/health" else engine.check_ready()
            except Exception as e:  # noqa: BLE001 - every engine state maps to an API error
                return await error_response(engine_error(e))(scope, receive, send)
        return await Response(status_code=200)(scope, receive, send)

    async def _models(self, scope, receive, send):
        data = []
        for _, app, _, _ in self.routes:
            start, parts = await _call(app, scope)
            body = json.loads(b"".join(parts) or b"{}")
            if start["status"] != 200:
                return await JSONResponse(body, start["status"])(scope, receive, send)
            data += body["data"]
        return await JSONResponse({"object": "list", "data": data})(scope, receive, send)

    async def _lifespan(self, receive, send):
        message = await receive()
        assert message["type"] == "lifespan.startup"
        for _, _, engine, _ in self.routes:
            engine.start()
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        stops = [threading.Thread(target=engine.shutdown) for _, _, engine, _ in self.routes]
        for t in stops:
            t.start()
        for t in stops:
            t.join()
        await send({"type": "lifespan.shutdown.complete"})


class _MergedRegistries:
    """The engines' registries as one collector: families of one name merged (each sample
    keeps its ``model_name`` label), so ``/metrics`` is valid exposition text."""

    def __init__(self, registries):
        self.registries = registries

    def collect(self):
        merged: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation,
                                                 family.type, family.unit)
                merged[family.name].samples += family.samples
        return iter(merged.values())


async def _read_body(receive, limit: int) -> tuple[bytes, bool]:
    """The request body, or its first chunks once past ``limit`` bytes (the rest left
    unread); and whether it was cut there."""
    parts, size, more = [], 0, True
    while more and size <= limit:
        message = await receive()
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        more = message.get("more_body", False)
    return b"".join(parts), more


def _replay(body: bytes, cut: bool, receive):
    """A ``receive`` that gives ``body`` again, then (if it was cut) the rest."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": cut}
        return await receive()
    return again


async def _call(app, scope) -> tuple[dict, list[bytes]]:
    """Call ``app`` with ``scope``'s request and an empty body: its response-start message
    and body parts."""
    start, parts = {"type": "http.response.start", "status": 500, "headers": []}, []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
    await app(dict(scope), receive, send)
    return start, parts


def make_multi_server(entries: list[ModelEntry], base: EngineArgs, config: ServerConfig,
                      make_model_server, log_stats: bool = True):
    """An engine and app for each entry (the launcher's ``make_model_server(engine_args,
    config, log_stats, manage_engine=False)``), and the router in front of them (behind the
    API-key check when ``config.api_key`` is set).

    Returns:
        (:class:`EngineGroup`, the ASGI app).

    Raises:
        FileNotFoundError / ValueError: as ``make_model_server``, for any entry.
    """
    routes = []
    for entry in entries:
        engine, app, registry = make_model_server(
            entry_engine_args(base, entry),
            dataclasses.replace(config, served_model_names=entry.served_model_name,
                                api_key=None), log_stats, manage_engine=False)
        routes.append((entry.served_model_name, app, engine, registry))
    router = ModelRouter(routes, config.max_request_body_bytes)
    group = EngineGroup([engine for _, _, engine, _ in routes])
    return group, (APIKeyMiddleware(router, config.api_key) if config.api_key else router)
