"""Speculative decoding with a draft model: configuration, the bundled model as its own draft
(every proposal accepted) and a layer-skipped copy of it as a weaker draft, against plain
decoding (greedy token-identical; sampled distributions equal)."""

import json
import os
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged import LLM, SamplingParams
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from tests.conftest import STORIES
from tests.helpers.distributions import assert_same_first_tokens
from tests.helpers.random_llama import write_random_llama
from tests.test_continuous_batching import random_prompts
from tests.test_spec_decode import (COPY_PROMPTS, LIMITS, assert_no_compilation_after_start_up,
                                    assert_preemption_matches_plain)

K = 4
# (disable_by_batch_size: the static rule, so that every decode step speculates.)
SELF_DRAFT = {"method": "draft_model", "model": STORIES, "num_speculative_tokens": K,
              "disable_by_batch_size": 512}
GREEDY = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)


def layer_skipped_stories(directory, layers=(0, 1, 3, 4)) -> str:
    """The bundled model with only decoder ``layers`` (renumbered; embeddings and final norm
    kept): a weaker draft of the same vocabulary, as in layer-skipping self-speculation
    (Zhang et al., "Draft & Verify", ACL 2024). Skipping layer 2 of 5, greedy proposals
    on ``COPY_PROMPTS`` are ~47% accepted (random prompts ~28%)."""
    os.makedirs(directory, exist_ok=True)
    cfg = json.load(open(f"{STORIES}/config.json"))
    cfg["num_hidden_layers"] = len(layers)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    keep = {}
    for name, tensor in load_file(f"{STORIES}/model.safetensors").items():
        if not name.startswith("model.layers."):
            keep[name] = tensor
        elif (i := int(name.split(".")[2])) in layers:
            keep[name.replace(f".{i}.", f".{layers.index(i)}.", 1)] = tensor
    save_file(keep, os.path.join(directory, "model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def weak_draft(tmp_path_factory):
    return {"method": "draft_model", "num_speculative_tokens": K,
            "model": layer_skipped_stories(tmp_path_factory.mktemp("draft")),
            "disable_by_batch_size": 512}


@pytest.fixture(scope="module")
def engines(weak_draft):
    return (LLM(**LIMITS), LLM(speculative_config=SELF_DRAFT, **LIMITS),
            LLM(speculative_config=weak_draft, **LIMITS))


def _ids(outs):
    return [[o.token_ids for o in out.outputs] for out in outs]


def _assert_all_pages_free(llm):
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


# ---- configuration -------------------------------------------------------------------------

def test_config_and_bad_configs_name_the_field(tmp_path):
    c = SpeculativeConfig.from_dict(SELF_DRAFT)
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", STORIES, K)
    for value, field in [
            ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
            ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "model"),
            ({"method": "draft_model", "num_speculative_tokens": 2,
              "model": str(tmp_path / "missing")}, "model"),
            ({**SELF_DRAFT, "prompt_lookup_max": 3}, "prompt_lookup_max")]:
        with pytest.raises(SpeculativeConfigError) as e:
            EngineArgs(speculative_config=value)
        assert e.value.field == field and str(e.value).startswith(f"speculative_config.{field}:")
    for kw, name in [(dict(enable_lora=True), "enable_lora"),
                     (dict(tensor_parallel_size=2), "tensor_parallel_size=2")]:
        with pytest.raises(SpeculativeConfigError, match=f"EngineArgs.{name}") as e:
            EngineArgs(speculative_config=SELF_DRAFT, **kw)
        assert e.value.field == "method"
    from jaxpaged.distributed.pipeline_parallel import PipelineParallelError
    with pytest.raises(PipelineParallelError, match="speculative_config"):
        EngineArgs(speculative_config=SELF_DRAFT, pipeline_parallel_size=2)


def test_vocabulary_mismatch_and_unreadable_draft_are_refused_at_start(tmp_path, monkeypatch):
    other = write_random_llama(tmp_path / "v256", vocab_size=256)
    with pytest.raises(SpeculativeConfigError, match="vocab_size 256 differs .* 512") as e:
        LLM(speculative_config={**SELF_DRAFT, "model": other}, **LIMITS)
    assert e.value.field == "model"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeculativeConfigError, match="config.json") as e:
        LLM(speculative_config={**SELF_DRAFT, "model": str(tmp_path / "empty")}, **LIMITS)
    assert e.value.field == "model"
    # A config without weights is refused by name before the target loads (it raised a
    # bare FileNotFoundError after the target had loaded: a fresh-user report).
    (tmp_path / "cfgonly").mkdir()
    shutil.copy(os.path.join(STORIES, "config.json"), tmp_path / "cfgonly" / "config.json")
    loads = []
    monkeypatch.setattr("jaxpaged.engine.startup.build_worker", lambda *a, **k: loads.append(1))
    with pytest.raises(SpeculativeConfigError, match="no weights in") as e:
        LLM(speculative_config={**SELF_DRAFT, "model": str(tmp_path / "cfgonly")}, **LIMITS)
    assert e.value.field == "model" and not loads


def test_serve_refuses_a_bad_draft_before_listening(tmp_path, capsys):
    from jaxpaged.cli import build_parser
    from jaxpaged.server.launcher import run_server
    other = write_random_llama(tmp_path / "v256", vocab_size=256)
    args = build_parser().parse_args(["serve", "--port", "1", "--speculative-config",
                                      json.dumps({**SELF_DRAFT, "model": other})])
    assert run_server(args) == 2      # a flag error: nothing started (port 1 never bound)
    assert "error: --speculative-config.model: the draft's vocab_size 256" in capsys.readouterr().err


def test_a_pooling_engine_refuses_speculation():
    with pytest.raises(SpeculativeConfigError, match="pooling engine") as e:
        EngineArgs(runner="pooling", speculative_config={
            "method": "ngram", "num_speculative_tokens": 2})
    assert e.value.field == "<config>"


# ---- the bundled model as its own draft ----------------------------------------------------

def test_self_draft_accepts_every_proposal_and_equals_plain(engines):
    plain, spec, _ = engines
    totals = spec.engine.scheduler.spec.totals
    got = spec.generate(COPY_PROMPTS[:1], GREEDY, use_tqdm=False)
    assert _ids(got) == _ids(plain.generate(COPY_PROMPTS[:1], GREEDY, use_tqdm=False))
    # After the prefill's token, 15 steps of 4 accepted + 1 bonus, then 3 (max_tokens).
    assert (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) == \
        (16, 63, 63)
    assert totals.num_accepted_tokens_per_pos == [16, 16, 16, 15]
    prompts = (COPY_PROMPTS * 11)[:32]
    before = totals.num_draft_tokens
    got = spec.generate(prompts, GREEDY, use_tqdm=False)
    assert _ids(got) == _ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert totals.num_draft_tokens - before > 32 * 50
    assert totals.num_accepted_tokens == totals.num_draft_tokens
    _assert_all_pages_free(spec)


# ---- a weaker draft ------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [True, False])
def test_weak_draft_greedy_equals_plain_with_every_stop_rule(engines, weak_draft,
                                                            async_scheduling):
    plain, _, weak = engines
    if not async_scheduling:
        weak = LLM(speculative_config=weak_draft, async_scheduling=False, **LIMITS)
    prompts = random_prompts(12, 512, seed=5, max_len=60) + COPY_PROMPTS
    g = dict(temperature=0, max_tokens=40)
    cases = [SamplingParams(ignore_eos=True, **g),
             SamplingParams(stop=["Lily", " the"], **g),            # stop strings
             SamplingParams(stop_token_ids=[13, 278], **g),         # stop ids
             SamplingParams(temperature=0, max_tokens=7),           # length cuts a run
             SamplingParams(repetition_penalty=1.3, min_tokens=20, **g),
             SamplingParams(n=2, temperature=0, max_tokens=20)]     # forks, then speculates
    params = [cases[i % len(cases)] for i in range(len(prompts))]
    for batch in ([0], range(len(prompts))):     # batch 1, then 15 (with prefix-cache hits)
        totals = weak.engine.scheduler.spec.totals
        before = (totals.num_draft_tokens, totals.num_accepted_tokens)
        got = weak.generate([prompts[i] for i in batch], [params[i] for i in batch],
                            use_tqdm=False)
        want = plain.generate([prompts[i] for i in batch], [params[i] for i in batch],
                              use_tqdm=False)
        assert _ids(got) == _ids(want)
        assert [[o.text for o in x.outputs] for x in got] == \
            [[o.text for o in x.outputs] for x in want]
        assert [[o.finish_reason for o in x.outputs] for x in got] == \
            [[o.finish_reason for o in x.outputs] for x in want]
        proposed = totals.num_draft_tokens - before[0]
        accepted = totals.num_accepted_tokens - before[1]
        assert 0 < accepted < proposed            # a weaker draft: some rejected
        _assert_all_pages_free(weak)
    assert weak.engine.kv_cache_manager.stats.hits > 0


def test_catch_up_in_chunks_of_a_small_token_budget_equals_plain(engines, weak_draft):
    """Prompts of up to 100 tokens and a 32-token budget: the draft's first catch-up takes
    several steps, sequences finishing it in different ones."""
    plain = engines[0]
    small = LLM(speculative_config=weak_draft, enforce_eager=True, max_num_seqs=8,
                max_num_batched_tokens=32, max_model_len=256)
    prompts = random_prompts(8, 512, seed=11, max_len=100) + COPY_PROMPTS
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert max(len(p) for p in prompts[:8]) > 64
    assert _ids(small.generate(prompts, greedy, use_tqdm=False)) == \
        _ids(plain.generate(prompts, greedy, use_tqdm=False))
    assert small.engine.scheduler.spec.totals.num_accepted_tokens > 0
    _assert_all_pages_free(small)


def test_preemption_with_a_tiny_pool_matches_and_frees_every_page(engines, weak_draft):
    assert_preemption_matches_plain(engines[0], weak_draft)


def test_aborts_drop_the_drafts_state_and_free_pages(engines):
    _, spec, _ = engines
    engine = spec.engine
    for i, prompt in enumerate(COPY_PROMPTS):
        engine.add_request(f"a{i}", prompt, GREEDY)
    for _ in range(4):
        engine.step()
    assert set(engine.drafter._known) == {"a0", "a1", "a2"}
    engine.abort_request(["a0", "a2"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", COPY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    assert set(engine.drafter._known) == {"b"}     # finished ones are dropped
    _assert_all_pages_free(spec)


def test_seeded_sampled_outputs_repeat_and_equal_plain_decoding(engines):
    """The acceptance test reuses the row's plain draw (``rejection.py``), so a seeded
    request's tokens equal plain decoding's with the same seed however it speculated."""
    plain, _, weak = engines
    prompts = (COPY_PROMPTS * 8)[:24]
    params = [SamplingParams(temperature=t, top_p=p, seed=i, max_tokens=32, ignore_eos=True)
              for i, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.2, 1.0)] * 8)]
    totals = weak.engine.scheduler.spec.totals
    before = totals.num_accepted_tokens
    first = _ids(weak.generate(prompts, params, use_tqdm=False))
    assert totals.num_accepted_tokens - before > 50
    assert _ids(weak.generate(prompts, params, use_tqdm=False)) == first
    assert _ids(weak.generate(prompts[5:6], params[5:6], use_tqdm=False)) == first[5:6]
    assert first == _ids(plain.generate(prompts, params, use_tqdm=False))
    _assert_all_pages_free(weak)


def test_no_compilation_after_start_up_with_a_draft_model():
    llm = assert_no_compilation_after_start_up(SELF_DRAFT)
    assert llm.engine.drafter.num_compilations > 0        # the draft's shapes counted too


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.8)])
def test_sampled_first_three_tokens_follow_plain_sampling(weak_draft, params):
    """Chi-square over 4000 draws each of the first 3 tokens, draft-model speculation
    against plain decoding (``tests.helpers.distributions``), in waves of 200 so that
    nearly every sequence verifies proposals (~15 s and ~9 s on the 2-core CPU)."""
    kw = dict(enforce_eager=True, max_num_seqs=512, max_num_batched_tokens=1024,
              max_model_len=128)
    spec = LLM(speculative_config={**weak_draft, "num_speculative_tokens": 3}, **kw)
    assert_same_first_tokens(spec, LLM(**kw), COPY_PROMPTS[2], 4000, batch=200, **params)
    totals = spec.engine.scheduler.spec.totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    assert totals.num_draft_tokens > 4000
    _assert_all_pages_free(spec)

