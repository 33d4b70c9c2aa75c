"""Fault injection for tests: callables for ``Engine.fault_injector`` (docs/reliability.md).

    engine.fault_injector = FailSteps()                  # the next model step raises
    engine.fault_injector = FailSteps(request_id="a")    # the first step that runs "a"
    engine.fault_injector = FailSteps(error=EngineKilled("boom"))   # kills an AsyncEngine's loop

Set it on the engine the test drives (``llm.engine``, or ``live_server.engine.engine`` for a
server; each of ``engine.replicas`` under data parallelism); assign None to remove it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InjectedFault(RuntimeError):
    """The error a test injects into a model step (an ``Exception``: the step's requests
    fail, the engine keeps serving)."""


class EngineKilled(BaseException):
    """An error that escapes ``Engine.step`` (not an ``Exception``): it ends an
    ``AsyncEngine``'s loop, as a fatal failure would."""


@dataclass
class FailSteps:
    """Raise ``error`` in the next ``times`` model steps (or only in those that run
    ``request_id``).

    Attributes:
        request_id: a user request id the step must run (None: any step).
        times: how many steps fail.
        error: what is raised.
        lose_kv_pool: a ``ModelRunner`` whose KV pool is deleted first, as a device failure
            after the pool was donated to the step would leave it.
        failed_steps: the step indices that failed, with the request ids each ran.
    """

    request_id: str | None = None
    times: int = 1
    error: BaseException = field(default_factory=lambda: InjectedFault("injected fault"))
    lose_kv_pool: object = None
    failed_steps: list[tuple[int, list[str]]] = field(default_factory=list)

    def __call__(self, step_index: int, request_ids: list[str]) -> None:
        if len(self.failed_steps) >= self.times:
            return
        if self.request_id is not None and self.request_id not in request_ids:
            return
        self.failed_steps.append((step_index, request_ids))
        if self.lose_kv_pool is not None:
            for k_pages, v_pages in self.lose_kv_pool._kv_caches:
                k_pages.delete()
                v_pages.delete()
        raise self.error
