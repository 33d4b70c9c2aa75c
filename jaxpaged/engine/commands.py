"""Commands to the engine thread (``AsyncEngine``) and, in a multi-host job, from process 0
to the other processes (``jaxpaged.distributed.step_sync`` pickles them). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from jaxpaged.core.input_processor import Prompt
from jaxpaged.sampling_params import SamplingParams


@dataclass(frozen=True, kw_only=True)
class AddRequest:
    """Queue a request (``Engine.add_request``'s arguments).

    Attributes:
        accepted: the ``asyncio.Future`` the engine thread settles once the engine accepted
            or refused the request; only on process 0, never sent to other processes.
    """

    request_id: str
    prompt: Prompt
    params: SamplingParams | None
    priority: int = 0
    lora_request: Any = None
    accepted: Any = field(default=None, compare=False, repr=False)

    def for_followers(self) -> AddRequest:
        """The command as the other processes of a multi-host job receive it."""
        return replace(self, accepted=None)


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request; unknown ids are ignored."""

    request_id: str


@dataclass(frozen=True, kw_only=True)
class EngineCall:
    """Run ``fn(engine)`` on the engine thread between two steps (the RL controls:
    ``AsyncEngine.call``); ``done`` is the ``asyncio.Future`` settled with its result or
    exception. One process only (never sent to other processes)."""

    fn: Any
    done: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class StopEngine:
    """End the engine loop (a server shutting down; every process of a job stops)."""


EngineCommand = AddRequest | AbortRequest | EngineCall | StopEngine
