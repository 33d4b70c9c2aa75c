"""A model step that raises fails only the requests it ran (Engine.step): their pages are
freed, the pages it was to fill leave the prefix cache, a consumed KV pool is reallocated,
and every other request's output equals its output without the fault."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.cli import main
from jaxpaged.runner.model_runner import ModelRunner
from tests.helpers.faults import FailSteps, InjectedFault

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MESSAGE = "the model step running this request failed: InjectedFault: injected fault"


def prompt_of(length: int, seed: int) -> list[int]:
    """A distinct prompt per seed (so tests sharing an engine share no cached page)."""
    return [1] + np.random.default_rng(seed).integers(3, 512, size=length - 1).tolist()


@pytest.fixture(scope="module")
def llm():
    # Two seats: two requests run, the others wait.
    return LLM(enforce_eager=True, block_size=16, max_model_len=64, max_num_seqs=2)


@pytest.fixture
def engine(llm):
    yield llm.engine
    llm.engine.fault_injector = None
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


def reference(stories_llm, prompt):
    """The tokens of ``prompt`` on another engine, where no fault ever happened."""
    return stories_llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def drain(engine) -> dict:
    """Step until the engine is empty; the final output of every request."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_failed_step_fails_only_its_requests(engine, stories_llm):
    prompts = {rid: prompt_of(12 + i, seed=100 + i) for i, rid in enumerate("abcd")}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.step()                          # a and b prefill (two seats); c and d wait
    engine.step()
    engine.fault_injector = injector = FailSteps()
    finals = drain(engine)
    assert [ids for _, ids in injector.failed_steps] == [["a", "b"]]
    for rid in "ab":
        out = finals[rid]
        assert out.error == MESSAGE and out.outputs[0].finish_reason == "error"
        assert out.outputs[0].token_ids == reference(stories_llm, prompts[rid])[:2]
    for rid in "cd":
        out = finals[rid]
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == reference(stories_llm, prompts[rid])


def test_pages_of_a_failed_prefill_leave_the_prefix_cache(llm, engine, stories_llm):
    prompt = prompt_of(40, seed=200)       # two full pages, both filled by the first step
    engine.fault_injector = FailSteps(request_id="x")
    engine.add_request("x", prompt, GREEDY)
    assert drain(engine)["x"].error == MESSAGE
    # A hit on those pages would read K/V that the failed step never wrote.
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == reference(stories_llm, prompt)
    third = llm.generate([prompt], GREEDY, use_tqdm=False)[0]   # cached once computed
    assert third.num_cached_tokens == 32
    assert third.outputs[0].token_ids == again.outputs[0].token_ids


def test_lost_kv_pool_is_reallocated_and_the_cache_emptied(llm, engine, stories_llm):
    cached = prompt_of(40, seed=300)
    assert llm.generate([cached], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    prompts = {rid: prompt_of(20, seed=310 + i) for i, rid in enumerate("abc")}
    engine.fault_injector = FailSteps(request_id="a", lose_kv_pool=engine.runner)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    finals = drain(engine)
    assert finals["a"].error == finals["b"].error == MESSAGE
    assert finals["c"].outputs[0].token_ids == reference(stories_llm, prompts["c"])
    assert not engine.runner.kv_pool_lost
    again = llm.generate([cached], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0     # the cached pages' contents went with the pool
    assert again.outputs[0].token_ids == reference(stories_llm, cached)


def test_generate_returns_failed_requests_with_their_error(llm, engine, stories_llm):
    prompts = [prompt_of(10, seed=400), prompt_of(11, seed=401), prompt_of(12, seed=402)]
    engine.fault_injector = FailSteps(request_id=None)      # the first step: two seats
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert outs[0].error == outs[1].error == MESSAGE and outs[2].error is None
    assert outs[2].outputs[0].token_ids == reference(stories_llm, prompts[2])


def test_fault_injector_sees_step_index_and_parallel_sampling_request_once(engine):
    seen = []
    engine.fault_injector = lambda step, ids: seen.append((step, ids))
    engine.add_request("n2", prompt_of(10, seed=500), SamplingParams(n=2, max_tokens=2, seed=1))
    assert drain(engine)["n2"].finished
    assert [ids for _, ids in seen] == [["n2"], ["n2"]]     # prefill, then both forks decode
    assert seen[1][0] == seen[0][0] + 1


def test_cli_generate_reports_a_failed_prompt(monkeypatch, capsys):
    def broken(self, scheduler_output):
        raise InjectedFault("injected fault")

    monkeypatch.setattr(ModelRunner, "dispatch", broken)
    assert main(["generate", "--max-tokens", "2", "Once upon a time"]) == 1
    assert f"jaxpaged: error: prompt 1 failed: {MESSAGE}" in capsys.readouterr().err
