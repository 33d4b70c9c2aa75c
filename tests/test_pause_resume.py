"""pause_generation(mode) / resume_generation (issue 44), on the engine step by step."""

import pytest

from jaxpaged import SamplingParams
from tests.helpers.rl import backend_compiles, llama_tensors, write_checkpoint
from tests.test_weight_update import PROMPTS, make_llm

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LATE = [1, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def w1():
    return llama_tensors(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, w1):
    return (write_checkpoint(tmp_path_factory.mktemp("w0"), llama_tensors(0)),
            write_checkpoint(tmp_path_factory.mktemp("w1"), w1))


@pytest.fixture(scope="module")
def reference(dirs):
    """Greedy ids of the uninterrupted run under W0, and a fresh LLM on W1."""
    llm = make_llm(dirs[0])
    outs = llm.generate(PROMPTS + [LATE], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], make_llm(dirs[1])


def add_all(engine, prompts, tag="r"):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, PARAMS)


def run_to_end(engine, final=None):
    final = {} if final is None else final
    while engine.has_unfinished_requests():
        assert not engine.is_frozen
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def frozen_steps(engine, final):
    """Step a paused engine until it is frozen, keeping finished outputs; then check that
    steps run nothing."""
    for _ in range(50):
        if engine.is_frozen:
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.is_frozen
    running = {g: [len(s.request.all_token_ids) for s in grp.seqs]
               for g, grp in engine.output_processor.groups.items()}
    assert engine.step() == [] and engine.step() == []
    assert {g: [len(s.request.all_token_ids) for s in grp.seqs]
            for g, grp in engine.output_processor.groups.items()} == running


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_keep_resumes_as_uninterrupted(dirs, reference, async_scheduling):
    engine = make_llm(dirs[0], async_scheduling=async_scheduling).engine
    add_all(engine, PROMPTS)
    final = {}
    for _ in range(4):
        engine.step()
    compiles = backend_compiles()
    engine.pause_generation("keep")
    engine.add_request("late", LATE, PARAMS)         # held, not lost
    frozen_steps(engine, final)
    assert engine.is_paused and not final
    engine.resume_generation()
    assert backend_compiles() == compiles
    run_to_end(engine, final)
    ids = reference[0]
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == ids[:-1]
    assert final["late"].outputs[0].token_ids == ids[-1]
    assert all(o.num_preemptions == 0 and o.weight_version == 0 for o in final.values())
    assert engine.kv_cache_manager.num_used_pages == 0


def test_keep_with_new_weights_continues_under_the_new_policy(dirs, reference, w1):
    engine = make_llm(dirs[0]).engine
    add_all(engine, PROMPTS)
    for _ in range(5):
        engine.step()
    engine.pause_generation("keep")
    final = {}
    frozen_steps(engine, final)
    prefixes = {g: list(grp.seqs[0].request.output_token_ids)
                for g, grp in engine.output_processor.groups.items()}
    assert all(0 < len(p) < PARAMS.max_tokens for p in prefixes.values())
    assert engine.update_weights(w1) == 1
    engine.resume_generation()
    run_to_end(engine, final)
    fresh = reference[1]
    for i, prompt in enumerate(PROMPTS):
        prefix = prefixes[f"r{i}"]
        out = final[f"r{i}"]
        assert out.outputs[0].token_ids[:len(prefix)] == prefix
        cont = fresh.generate([prompt + prefix], SamplingParams(
            temperature=0, max_tokens=PARAMS.max_tokens - len(prefix), ignore_eos=True),
            use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids[len(prefix):] == cont
        assert out.weight_version == 1 and out.num_preemptions == 1
    assert engine.kv_cache_manager.num_used_pages == 0


def test_abort_finishes_requests_and_queues_new_ones(dirs, reference):
    engine = make_llm(dirs[0]).engine
    add_all(engine, PROMPTS)
    for _ in range(3):
        engine.step()
    aborted = engine.pause_generation("abort")
    assert sorted(o.request_id for o in aborted) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted)
    finals = [o for o in engine.step() if o.finished]     # (after the step in flight's)
    assert sorted(o.request_id for o in finals) == sorted(o.request_id for o in aborted)
    assert engine.kv_cache_manager.num_used_pages == 0
    engine.add_request("late", LATE, PARAMS)
    final = {}
    frozen_steps(engine, final)
    engine.resume_generation()
    assert run_to_end(engine)["late"].outputs[0].token_ids == reference[0][-1]


def test_wait_lets_started_requests_finish_and_holds_new_ones(dirs, reference):
    engine = make_llm(dirs[0]).engine
    add_all(engine, PROMPTS)
    engine.step()
    engine.pause_generation("wait")
    engine.add_request("late", LATE, PARAMS)
    final = {}
    frozen_steps(engine, final)
    assert sorted(final) == [f"r{i}" for i in range(len(PROMPTS))]
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
        reference[0][:-1]
    assert engine.output_processor.groups["late"].seqs[0].request.output_token_ids == []
    engine.resume_generation()
    assert run_to_end(engine)["late"].outputs[0].token_ids == reference[0][-1]


def test_bad_mode_and_abort_of_a_held_request(dirs):
    engine = make_llm(dirs[0]).engine
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.pause_generation("stop")
    engine.pause_generation("keep")
    engine.add_request("held", LATE, PARAMS)
    engine.abort_request("held")
    assert not engine.has_unfinished_requests()
    engine.resume_generation()
    assert engine.step() == [] and not engine.is_paused
