"""FORCE: a test hook that makes the engine emit exactly a scripted token sequence.

It wraps the runner's ``dispatch``: the real model step still runs (so the KV cache stays
consistent with what the engine feeds next), then each scripted request's sampled token is
replaced by the next token of its script. The engine must schedule synchronously (under async
scheduling the next step would read the real token on the device).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace


def force_tokens(monkeypatch, engine, scripts: dict[str, list[int]]) -> None:
    """From now on, request ``rid`` (index 0 sequence) emits ``scripts[rid]`` in order."""
    assert not engine.args.async_scheduling, "FORCE needs synchronous scheduling"
    real = engine.runner.dispatch

    def forced(out, scheduler_output):
        sampled = []
        for s, tokens in zip(scheduler_output.scheduled, out.sampled_token_ids):
            script = scripts.get(s.request.request_id)
            if script is not None and tokens:
                tokens = [script[s.request.num_output_tokens]] * len(tokens)
            sampled.append(tokens)
        return dataclasses.replace(out, sampled_token_ids=sampled)

    def dispatch(scheduler_output):
        pending = real(scheduler_output)
        return SimpleNamespace(result=lambda: forced(pending.result(), scheduler_output))

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)


def run_engine(engine, rid, prompt, params):
    """Drive one request to the end; returns every RequestOutput it produced."""
    engine.add_request(rid, prompt, params)
    outs = []
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs
