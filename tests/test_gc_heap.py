"""The engine freezes the GC heap after start-up and after steps that compile
(``jaxpaged/engine/gc_heap.py``)."""

import gc
import weakref

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.gc_heap import GEN0_THRESHOLD, CompileAwareHeapFreezer


class _Node:
    pass


def test_freezer_freezes_when_the_compile_count_moves_and_collects_first():
    freezer = CompileAwareHeapFreezer()
    assert freezer.update(0) is True          # the first call always freezes
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(100)]          # 100 tracked lists made after the freeze
    assert freezer.update(0) is False         # same count: nothing frozen (frozen objects
    assert gc.get_freeze_count() <= frozen    # of earlier tests' threads may die meanwhile)
    cycle = _Node()
    cycle.self = cycle
    dead = weakref.ref(cycle)
    del cycle                                  # garbage only the cyclic collector frees
    assert dead() is not None
    assert freezer.update(3) is True
    assert dead() is None                      # collected before the freeze, not frozen
    # Frozen objects are no longer tracked: the list and each of its 100 lists. (Not the
    # freeze count: objects frozen earlier, e.g. by other tests' threads, may die meanwhile
    # and lower it; one CI run saw it 2 short of frozen + 101.)
    tracked = {id(o) for o in gc.get_objects()}
    assert id(kept) not in tracked and not any(id(k) in tracked for k in kept)


def test_engine_freezes_after_start_up_and_after_a_step_that_compiled():
    llm = LLM(enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    assert not any(o is runner for o in gc.get_objects())   # frozen at the end of __init__
    compilations = runner.num_compilations
    frozen = gc.get_freeze_count()
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert runner.num_compilations > compilations             # eager: the steps compiled
    assert gc.get_freeze_count() > frozen                     # and the heap was frozen after
    frozen, compilations = gc.get_freeze_count(), runner.num_compilations
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
    assert runner.num_compilations == compilations            # the same shapes again
    assert gc.get_freeze_count() <= frozen     # no compile, no freeze (frozen objects may die)


def test_first_freeze_raises_the_young_generation_threshold_and_never_lowers_it():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, saved[1], saved[2])
        CompileAwareHeapFreezer().update(0)
        assert gc.get_threshold() == (GEN0_THRESHOLD, saved[1], saved[2])
        gc.set_threshold(GEN0_THRESHOLD * 2, saved[1], saved[2])
        CompileAwareHeapFreezer().update(0)
        assert gc.get_threshold()[0] == GEN0_THRESHOLD * 2
        gc.set_threshold(0, saved[1], saved[2])       # automatic collection off: kept off
        CompileAwareHeapFreezer().update(0)
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*saved)


def test_start_up_runs_without_automatic_collection_and_turns_it_back_on(monkeypatch):
    from jaxpaged.engine import gc_heap
    from jaxpaged.models import loader

    seen = []
    load = loader.load_model
    monkeypatch.setattr("jaxpaged.runner.worker.load_model",
                        lambda *a, **k: seen.append(gc.isenabled()) or load(*a, **k))
    assert gc.isenabled()
    LLM(enforce_eager=True, max_num_seqs=2, max_num_batched_tokens=64)
    assert seen == [False] and gc.isenabled()       # off while loading, on again after

    @gc_heap.collector_paused
    def fails():
        assert not gc.isenabled()
        raise ValueError("start-up failed")

    try:
        fails()
    except ValueError:
        pass
    assert gc.isenabled()                           # back on after a failed start-up too
    gc_heap.pause_for_start_up()                    # a server's pause spans the engine's
    try:
        assert not gc.isenabled()
        gc_heap.collector_paused(lambda: None)()
        assert not gc.isenabled()
    finally:
        gc_heap.end_start_up_pause()
    assert gc.isenabled()
    gc_heap.end_start_up_pause()                    # (a second end changes nothing)
    gc.disable()
    try:
        gc_heap.pause_for_start_up()
        gc_heap.end_start_up_pause()                # never turns on what it did not turn off
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("pipeline_parallel_size", [1, 2])
def test_a_dropped_engine_frees_its_runner_by_reference_count(pipeline_parallel_size):
    """The engine freezes the GC heap, so a runner kept only by a reference cycle (e.g. with
    its step executor, ``jaxpaged.runner.step_executor``) would never be freed: its weights,
    KV pool and compiled steps would stay for the life of the process. Dropping the engine
    must free the runner with the cyclic collector off."""
    llm = LLM(enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, pipeline_parallel_size=pipeline_parallel_size)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    runner = weakref.ref(llm.engine.runner)
    pool = weakref.ref(llm.engine.runner._kv_caches[0][0])
    gc.disable()
    try:
        del llm, out
        assert runner() is None and pool() is None
    finally:
        gc.enable()
