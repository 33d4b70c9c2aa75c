"""``--async-scheduling`` (each step scheduled and dispatched before the previous one's tokens
are on the host) gives the same outputs as synchronous scheduling, output for output (each one
step later): greedy, seeded sampling, stop strings and stop token ids, min_tokens, n > 1,
logprobs, delta outputs and prefix-cache hits on the bundled model; under preemption the same
final outputs; an aborted request gets no output after the abort."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.engine.engine import Engine
from jaxpaged.sampling_params import RequestOutputKind

SHARED = "Once upon a time, there was a little girl named Lily. She loved to play"


def requests():
    """(request id, prompt, params) of a mixed workload."""
    greedy = SamplingParams(temperature=0, max_tokens=24)
    return [
        ("greedy", "Once upon a time", greedy),
        ("prefix-a", SHARED + " outside", greedy),
        ("prefix-b", SHARED + " with her", greedy),        # hits prefix-a's pages
        ("seeded", "The dog", SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20)),
        ("stop", "Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"])),
        ("stop-id", "The cat", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[13])),
        ("min", "Tim and", SamplingParams(temperature=0, max_tokens=12, min_tokens=10, stop=["."])),
        ("n3", "A big", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, logprobs=2)),
        ("delta", "One day", SamplingParams(temperature=0.7, seed=11, max_tokens=16,
                                            output_kind=RequestOutputKind.DELTA)),
        ("aborted", "The sun", SamplingParams(temperature=0, max_tokens=40)),
    ]


def run(async_scheduling: bool, **limits):
    """Every output of every request, in the order the engine returned them, with the steps
    taken; ``aborted`` is aborted after the engine's 6th step."""
    engine = Engine(EngineArgs(enforce_eager=True, async_scheduling=async_scheduling, **limits))
    for rid, prompt, params in requests():
        engine.add_request(rid, prompt, params)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(dataclasses.asdict(out))
        steps += 1
        if steps == 6:
            engine.abort_request("aborted")
    return outputs, engine.num_preemptions


def final(outputs: list[dict], delta: bool) -> dict:
    """A request's last output without its preemption count; of a ``delta`` request, also
    what all its outputs carried per sequence (its whole text and ids)."""
    streamed: dict[int, tuple[str, list[int]]] = {}
    for out in outputs if delta else ():
        for c in out["outputs"]:
            text, ids = streamed.get(c["index"], ("", []))
            streamed[c["index"]] = (text + c["text"], ids + c["token_ids"])
    last = {k: v for k, v in outputs[-1].items() if k != "num_preemptions"}
    last["outputs"] = [{k: v for k, v in c.items() if k not in ("logprobs", "cumulative_logprob")}
                       for c in last["outputs"]]
    return last | {"streamed": streamed}


def logprob_values(outputs: list[dict]) -> tuple[list, list[float]]:
    """A request's last output's logprob entries: (token ids and ranks, the values)."""
    keys, values = [], []
    for c in outputs[-1]["outputs"]:
        values.append(c["cumulative_logprob"] or 0.0)
        for entry in c["logprobs"] or []:
            keys.append([(t, e["rank"], e["decoded_token"]) for t, e in entry.items()])
            values += [e["logprob"] for e in entry.values()]
    return keys, values


@pytest.mark.parametrize("limits", [
    pytest.param(dict(max_num_seqs=16), id="plain"),
    # 23 usable pages of 4 tokens for 12 sequences of up to 64: preemption (recompute)
    pytest.param(dict(max_num_seqs=16, block_size=4, num_gpu_blocks_override=24,
                      max_model_len=64), id="preemption", marks=pytest.mark.slow),
])
def test_async_scheduling_gives_the_sync_outputs(limits):
    sync, sync_preemptions = run(False, **limits)
    async_, async_preemptions = run(True, **limits)
    aborted_async, aborted_sync = async_.pop("aborted"), sync.pop("aborted")
    if "num_gpu_blocks_override" not in limits:
        # The output of the step that ran just before the abort is one the synchronous
        # engine had returned already; under async scheduling it would come after the
        # abort: dropped.
        assert aborted_async == aborted_sync[:-1]
        assert async_ == sync       # every output of every other request, field for field
        assert async_preemptions == sync_preemptions == 0
    else:
        # The async scheduler decides a step before the previous one's finishes free their
        # pages, so it may preempt other sequences (recompute loses nothing): the final
        # outputs are the same but for the preemption counts.
        assert sync_preemptions > 0 and async_preemptions > 0
        ids = aborted_sync[-1]["outputs"][0]["token_ids"]
        for out in aborted_async:
            got = out["outputs"][0]["token_ids"]
            assert got == ids[:len(got)]
        assert {rid: final(outs, rid == "delta") for rid, outs in async_.items()} == \
            {rid: final(outs, rid == "delta") for rid, outs in sync.items()}
        for rid in sync:    # recomputed in other batches: float rounding differs
            keys, values = logprob_values(sync[rid])
            assert logprob_values(async_[rid])[0] == keys
            np.testing.assert_allclose(logprob_values(async_[rid])[1], values, atol=1e-4)
    finals = {rid: outs[-1]["outputs"] for rid, outs in sync.items()}
    assert (finals["stop"][0]["finish_reason"], finals["stop"][0]["stop_reason"]) == ("stop", "Lily")
    assert len(finals["n3"]) == 3 and finals["prefix-b"]
    assert sync["prefix-b"][-1]["num_cached_tokens"] > 0


def test_abort_after_the_last_step_drops_its_output_but_counts_the_real_finish():
    """A request whose last token came in step N, which async scheduling reports only after
    step N+1: aborting it in between gives no further output (as for any aborted request),
    and its statistics count it by its real finish reason, not as an abort, as the
    synchronous engine, which had reported it already, does."""
    params = SamplingParams(temperature=0, max_tokens=1)
    results = {}
    for async_scheduling in (False, True):
        engine = Engine(EngineArgs(enforce_eager=True, async_scheduling=async_scheduling))
        finished = []
        engine.stat_loggers.append(type("Sink", (), {
            "record": lambda self, scheduler_stats, iteration_stats: finished.extend(
                r.finish_reason for r in iteration_stats.finished_requests)})())
        engine.add_request("one", "Once upon a time", params)
        engine.add_request("other", "The dog", SamplingParams(temperature=0, max_tokens=3))
        outputs = engine.step()             # sync: the outputs; async: reported one step later
        engine.abort_request("one")
        while engine.has_unfinished_requests():
            outputs += engine.step()
        results[async_scheduling] = (
            [(o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs],
            sorted(finished))
    sync_outputs, sync_finished = results[False]
    async_outputs, async_finished = results[True]
    assert sync_outputs[0][0] == "one" and sync_outputs[0][2] == "length"
    assert [o for o in async_outputs if o[0] == "one"] == []
    assert async_outputs == sync_outputs[1:]       # "other": every output the same
    assert sync_finished == async_finished == ["length", "length"]


def test_a_step_failing_on_the_device_fails_it_and_the_step_after_it():
    """Async scheduling: when a dispatched step's result raises (the device failed), its
    requests and those of the step dispatched after it (which read its tokens) end with
    ``"error"``; the pages are freed and a later request runs as on a fresh engine."""
    engine = Engine(EngineArgs(enforce_eager=True))
    assert engine.args.async_scheduling        # the default
    real, calls = engine.runner.dispatch, []

    def dispatch(scheduler_output):
        pending = real(scheduler_output)
        calls.append([s.request.request_id for s in scheduler_output.scheduled])
        if len(calls) != 3:
            return pending

        def result():
            pending.result()
            raise RuntimeError("device lost")
        return SimpleNamespace(result=result)

    engine.runner.dispatch = dispatch
    greedy = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("a", "Once upon a time", greedy)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert (final.request_id, final.outputs[0].finish_reason) == ("a", "error")
    assert "RuntimeError: device lost" in final.error
    assert len(final.outputs[0].token_ids) == 2     # steps 1 and 2 applied, 3 and 4 failed
    assert len(calls) == 4
    kv = engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages
    engine.add_request("b", "Once upon a time", greedy)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    reference = Engine(EngineArgs(enforce_eager=True, async_scheduling=False))
    reference.add_request("b", "Once upon a time", greedy)
    expected = []
    while reference.has_unfinished_requests():
        expected += reference.step()
    assert outputs[-1].outputs[0].token_ids == expected[-1].outputs[0].token_ids
    assert len(outputs[-1].outputs[0].token_ids) == 8
