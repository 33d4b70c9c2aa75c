"""The RL control routes, as vLLM spells them: off unless ``--enable-rl-endpoints`` (or
vLLM's ``VLLM_SERVER_DEV_MODE=1``), behind the API key like ``/v1/*``.

- ``POST /pause?mode=abort|wait|keep`` (default ``abort``; vLLM's
  ``wait_for_inflight_requests=true`` means ``wait``): answered once the engine is paused
  (``wait``: once the admitted requests finished); ``POST /resume``; ``GET /is_paused``.
- ``POST /sleep?level=1|2``, ``POST /wake_up?tags=weights&tags=kv_cache`` (no tag: both),
  ``GET /is_sleeping``.
- ``POST /reset_prefix_cache``; ``POST /update_weights_from_disk`` with
  ``{"model_path": "<directory of safetensors>"}``; ``GET /weight_version``.

Each runs on the engine thread between two steps (``AsyncEngine.call``); the engine's
methods (``jaxpaged.engine.rollout``, ``jaxpaged.engine.sleep``) document the behaviour.
Bad parameters and refused updates get a 400 in OpenAI's error shape naming the field.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxpaged.server.api_model import ApiModel
from jaxpaged.engine.rollout import PAUSE_MODES
from jaxpaged.engine.sleep import SLEEP_TAGS, WeightsNotLoadedError
from jaxpaged.runner.weight_update import WeightUpdateError
from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.http_body import parse, ready

#: The routes' paths (the API key guards them).
RL_PATHS = ("/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping",
            "/reset_prefix_cache", "/update_weights_from_disk", "/weight_version")
#: Seconds between two checks of a ``wait`` pause for its admitted requests to finish.
WAIT_POLL_S = 0.02


class UpdateWeightsFromDiskRequest(ApiModel):
    """``POST /update_weights_from_disk``'s body."""

    model_path: str


async def _call(request: Request, fn, param: str | None = None):
    """``fn(engine)`` on the engine thread of ``request.app.state.engine`` (an
    ``AsyncEngine``), its errors as API errors (400 for bad input, naming ``param`` when
    given; 409 for a state that refuses it)."""
    ready(request)
    try:
        return await request.app.state.engine.call(fn)
    except (ValueError, TypeError, WeightsNotLoadedError, WeightUpdateError,
            FileNotFoundError) as e:
        raise bad_request(str(e), param) from None
    except (RuntimeError, NotImplementedError) as e:
        raise APIError(409, str(e), "invalid_request_error") from None


async def pause(request: Request) -> Response:
    """``POST /pause?mode=abort|wait|keep``."""
    q = request.query_params
    mode = q["mode"] if "mode" in q else (     # (an empty mode= is refused, not "abort")
        "wait" if q.get("wait_for_inflight_requests", "").lower() in ("1", "true")
        else "abort")
    if mode not in PAUSE_MODES:
        raise bad_request(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "mode")
    await _call(request, lambda e: e.pause_generation(mode))
    while mode == "wait" and not await _call(request, lambda e: e.is_frozen):
        await asyncio.sleep(WAIT_POLL_S)
    return JSONResponse({"status": "paused", "mode": mode})


async def resume(request: Request) -> Response:
    """``POST /resume``."""
    await _call(request, lambda e: e.resume_generation())
    return JSONResponse({"status": "resumed"})


async def is_paused(request: Request) -> Response:
    """``GET /is_paused``."""
    return JSONResponse({"is_paused": await _call(request, lambda e: e.is_paused)})


async def sleep(request: Request) -> Response:
    """``POST /sleep?level=1|2``."""
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise bad_request(f"level must be 1 or 2, got {raw!r}", "level")
    await _call(request, lambda e: e.sleep(int(raw)))
    return JSONResponse({"status": "sleeping", "level": int(raw)})


async def wake_up(request: Request) -> Response:
    """``POST /wake_up?tags=weights&tags=kv_cache`` (no tag: both)."""
    tags = request.query_params.getlist("tags") or None
    bad = [t for t in tags or () if t not in SLEEP_TAGS]
    if bad:
        raise bad_request(f"unknown tags {bad}; choose from {list(SLEEP_TAGS)}", "tags")
    await _call(request, lambda e: e.wake_up(tags))
    return JSONResponse({"status": "awake" if not await _call(request, lambda e: e.is_sleeping)
                         else "sleeping"})


async def is_sleeping(request: Request) -> Response:
    """``GET /is_sleeping``."""
    return JSONResponse({"is_sleeping": await _call(request, lambda e: e.is_sleeping)})


async def reset_prefix_cache(request: Request) -> Response:
    """``POST /reset_prefix_cache``."""
    return JSONResponse({"success": await _call(request, lambda e: e.reset_prefix_cache())})


async def update_from_disk(request: Request) -> Response:
    """``POST /update_weights_from_disk`` with ``{"model_path": ...}``."""
    body = await parse(request, UpdateWeightsFromDiskRequest)
    version = await _call(request, lambda e: e.update_weights(body.model_path), "model_path")
    return JSONResponse({"success": True, "weight_version": version})


async def weight_version(request: Request) -> Response:
    """``GET /weight_version``."""
    return JSONResponse({"weight_version": await _call(request, lambda e: e.weight_version)})


def rl_routes() -> list[Route]:
    """The routes of :data:`RL_PATHS`, over ``request.app.state.engine``."""
    post, get = ["POST"], ["GET"]
    return [Route("/pause", pause, methods=post), Route("/resume", resume, methods=post),
            Route("/is_paused", is_paused, methods=get), Route("/sleep", sleep, methods=post),
            Route("/wake_up", wake_up, methods=post),
            Route("/is_sleeping", is_sleeping, methods=get),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=post),
            Route("/update_weights_from_disk", update_from_disk, methods=post),
            Route("/weight_version", weight_version, methods=get)]
