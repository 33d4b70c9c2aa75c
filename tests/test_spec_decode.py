"""Speculative decoding (n-gram proposals; draft models: ``test_spec_decode_draft.py``): configuration, proposals, the rejection sampler,
and end to end against plain decoding (greedy token-identical; sampled distributions equal)."""

import json
import logging
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jaxpaged import LLM, SamplingParams
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from jaxpaged.sampling.sampler import SamplingMetadata, sample
from jaxpaged.core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from jaxpaged.core.spec_decode.ngram import NgramProposer
from jaxpaged.sampling.rejection import verify
from tests.conftest import STORIES
from tests.helpers.distributions import assert_same_first_tokens
from tests.test_continuous_batching import random_prompts

# (disable_by_batch_size: the static rule, so that every step of these tests speculates.)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": 512}
LIMITS = dict(enforce_eager=True, max_num_seqs=64, max_num_batched_tokens=512,
              max_model_len=256)
# Prompts the bundled model's continuations copy from (stories repeat their phrases).
COPY_PROMPTS = ["Once upon a time there was a little girl named Lily. She liked to play. "
                "Once upon a time there was a little girl",
                "The cat sat on the mat. The cat sat on the",
                "Tom had a red ball. Tom had a big dog. Tom had a"]


# ---- configuration -------------------------------------------------------------------------

def test_config_takes_vllms_fields_and_defaults():
    c = SpeculativeConfig.from_dict(json.dumps(NGRAM))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min,
            c.disable_by_batch_size) == ("ngram", 4, 3, 1, 512)
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_max, only_max.prompt_lookup_min) == (4, 4)
    neither = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (neither.prompt_lookup_max, neither.prompt_lookup_min) == (5, 5)
    assert neither.disable_by_batch_size is None      # the adaptive rule
    assert SpeculativeConfig.from_dict(None) is None


@pytest.mark.parametrize("value, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ("{not json", "<json>"),
    ([1, 2], "<config>"),
])
def test_bad_configs_raise_naming_the_field(value, field):
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig.from_dict(value)
    assert e.value.field == field
    assert str(e.value).startswith(f"speculative_config.{field}:")
    with pytest.raises(SpeculativeConfigError):
        EngineArgs(speculative_config=value)


def test_cli_flag_parses_json():
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", json.dumps(NGRAM)]))
    assert SpeculativeConfig.from_dict(args.speculative_config).num_speculative_tokens == 4


def test_cli_generate_prints_the_acceptance_line_of_bench(monkeypatch, capsys):
    """``generate --speculative-config`` printed nothing about speculation; it prints
    ``jaxpaged bench``'s line (same function), on stderr so stdout keeps the completions."""
    from jaxpaged.benchmarks import results
    from jaxpaged.cli import main

    seen = []

    def spy(llm):
        seen.append(totals_of(llm))
        return seen[-1]

    totals_of = results.spec_decode_totals
    monkeypatch.setattr(results, "spec_decode_totals", spy)
    assert main(["generate", "--speculative-config", json.dumps(NGRAM), "--max-model-len",
                 "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                 "--temperature", "0", "--max-tokens", "24", "--ignore-eos",
                 COPY_PROMPTS[1]]) == 0
    out, err = capsys.readouterr()
    [totals] = seen
    assert totals.num_drafts > 0 and 0 < totals.num_draft_tokens <= 4 * totals.num_drafts
    assert results.spec_decode_line(totals) in err.splitlines()
    assert err.count("Speculative decoding: mean acceptance length") == 1
    assert len(out.splitlines()) == 1 and "Speculative" not in out


# ---- proposals -----------------------------------------------------------------------------

def test_ngram_proposals():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 9) == [4, 1, 2]       # 3-gram [1 2 3]
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]          # capped by the limit
    assert p.propose([5, 1, 2, 9, 1, 2], 9) == [9, 1, 2]
    assert p.propose([1, 2, 3, 4, 5], 9) == []                    # nothing recurs
    # The longest recurring suffix wins over a more recent shorter one: [7 8] occurs at the
    # start, [8] alone later.
    assert p.propose([7, 8, 1, 8, 2, 7, 8], 9) == [1, 8, 2]
    # Among equal matches the most recent.
    assert p.propose([4, 1, 4, 2, 4], 1) == [2]
    assert NgramProposer(3, 2, 3).propose([5, 1, 6, 1], 9) == []    # 1-gram only: too short
    assert p.propose([1, 2, 1], 0) == []


def test_speculating_runners_add_verification_shapes():
    from jaxpaged.runner.buckets import ShapeBuckets
    kw = dict(max_num_tokens=2048, max_num_seqs=256, max_pages_per_seq=32,
              page_buckets_by_width=False, max_padding=10**6)
    plain = ShapeBuckets(**kw)
    spec = ShapeBuckets(verify_block_q=5, **kw)
    assert spec.token_buckets == plain.token_buckets == [16, 2048]
    assert spec.seq_buckets == plain.seq_buckets == [8, 256]
    # batch 1 with 4 proposals: one 5-token block per sequence of the 8-sequence bucket
    assert spec.pad_sizes(5, 1, 5, 3, False, verify=True) == (40, 8, 32)
    assert spec.pad_sizes(200, 64, 200, 20, False, verify=True) == (1280, 256, 32)
    assert spec.pad_sizes(5, 1, 5, 3, False) == plain.pad_sizes(5, 1, 5, 3, False)
    extra = set(spec.step_shapes()) - set(plain.step_shapes())
    assert extra == {(40, 8, 32, False, 5), (1280, 256, 32, False, 5)}


def test_adaptive_rule_weighs_a_measured_cost_ratio_against_expected_tokens():
    from jaxpaged.core.spec_decode import adaptive
    now = [0.0]
    rule = adaptive.AdaptiveSpeculation(acceptance_is_free=True, clock=lambda: now[0])

    def step(expected, seconds_of):
        spec = rule.choose(expected)
        key = object()
        rule.scheduled(id(key), len(expected), len(expected), spec)
        now[0] += seconds_of(spec)
        rule.done(id(key), idle=True)
        now[0] += 100.0     # idle time between steps is not counted
        return spec

    plain_steps = adaptive.WARMUP_STEPS + adaptive.MIN_PLAIN_SAMPLES
    verify_steps = adaptive.WARMUP_STEPS + adaptive.MIN_VERIFY_SAMPLES
    # 64 sequences: a verification step costs 4x a plain one.
    big = lambda spec: 4.0 if spec else 1.0          # noqa: E731
    modes = [step([4.7] * 64, big) for _ in range(plain_steps + verify_steps)]
    assert modes == [False] * plain_steps + [True] * verify_steps     # each measured first
    assert rule.choose([4.7] * 64) is True          # 4.7 tokens a sequence > 1.15 * 4
    assert rule.choose([4.5] * 64) is False         # within the 15% margin: plain
    assert rule.choose([4.7] * 32 + [1.0] * 32) is False    # the mean decides
    # Another class borrows the ratio: 32 sequences measure plain steps only, then follow
    # the rule (the tail of a batch whose sequences finish unevenly pays no measuring).
    assert [step([4.7] * 32, big) for _ in range(plain_steps + 1)] == \
        [False] * plain_steps + [True]
    # Weight-bound (1 sequence, measured in its own class, ratio 1.2): 1.4 tokens pay.
    rule1 = adaptive.AdaptiveSpeculation(acceptance_is_free=True, clock=lambda: now[0])
    rule, saved = rule1, rule
    small = lambda spec: 1.2 if spec else 1.0        # noqa: E731
    assert [step([1.4], small) for _ in range(plain_steps + verify_steps + 1)] == \
        [False] * plain_steps + [True] * (verify_steps + 1)
    rule = saved
    # Exploring steps (the other mode) at decisions 32, 32 + 64, + 128, + 256, then every
    # 256 (3 decisions of the 64-sequence class were made above).
    later = [step([4.7] * 64, big) for _ in range(adaptive.EXPLORE_FIRST + 64 + 128 + 256 + 512)]
    explored = [i + 4 for i, spec in enumerate(later) if not spec]
    assert adaptive.EXPLORE_FIRST == 32 and adaptive.EXPLORE_MAX == 256
    assert explored == [32, 96, 224, 480, 736, 992]
    # Not speculating, n-gram acceptance known: it explores only near the break-even
    # (4.3 > 0.9 * 1.15 * 4) ...
    near = [step([4.3] * 64, big) for _ in range(256)]
    far = [step([2.0] * 64, big) for _ in range(512)]
    assert sum(near) == 1 and sum(far) == 0
    # ... while a draft model's class explores always.
    draft = adaptive.AdaptiveSpeculation(acceptance_is_free=False, clock=lambda: now[0])
    rule = draft
    modes = [step([2.0] * 64, big) for _ in range(plain_steps + verify_steps + 40)]
    assert modes[plain_steps + verify_steps:].count(True) == 1
    # Without idle time, the host's time between two steps counts: 0.5 s of host time makes
    # a plain step 1.5 s and a verification 2.3 s (ratio 1.53 < 1.8 tokens / 1.15).
    rule = adaptive.AdaptiveSpeculation(acceptance_is_free=True, clock=lambda: now[0])
    modes = []
    for _ in range(plain_steps + verify_steps + 1):
        modes.append(spec := rule.choose([1.8]))
        key = object()
        now[0] += 0.5       # the host between steps
        rule.scheduled(id(key), 1, 1, spec)
        now[0] += 1.8 if spec else 1.0
        rule.done(id(key), idle=False)
    assert modes == [False] * plain_steps + [True] * (verify_steps + 1)
    assert rule._classes[1].ratio.value == pytest.approx(2.3 / 1.5)


def test_a_sequences_acceptance_follows_its_checked_proposals():
    from jaxpaged.core.spec_decode import adaptive
    state = adaptive.SpecState()
    assert state.alpha == adaptive.PRIOR_ACCEPTANCE == 1.0
    state.record(1, 4)          # one accepted, the second rejected
    assert state.alpha == pytest.approx(0.75)
    state.record(2, 2)          # both accepted
    assert state.alpha == pytest.approx(1 - 0.25 * 0.75 ** 2)
    assert adaptive.expected_tokens(0.5, 3) == 1.875
    assert adaptive.expected_tokens(1.0, 4) == 5.0


def test_shadow_ngram_proposals_measure_acceptance_in_plain_steps(tmp_path):
    from jaxpaged.core.request import Request
    from jaxpaged.core.spec_decode.config import SpeculativeConfig
    from jaxpaged.core.spec_decode.scheduling import SpecDecodeScheduling
    spec = SpecDecodeScheduling(SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}), 100)
    req = Request("r", None, [5, 6, 7, 8, 5, 6], SamplingParams(), seed=0, max_tokens=20)
    spec.observe(req)           # proposes what followed the earlier "5 6": 7 8 5
    assert req.spec_state.shadow == (6, [7, 8, 5])
    req.all_token_ids.append(7)
    spec.observe(req)           # matches so far: waits
    assert req.spec_state.shadow == (6, [7, 8, 5]) and req.spec_state.alpha == 1.0
    req.all_token_ids.append(9)
    spec.observe(req)           # 1 accepted, then rejected; "7 9" never occurred: a miss
    state = req.spec_state
    assert state.alpha == pytest.approx(0.75 * 0.75) and state.shadow is None
    # Lookups that find nothing wait 1, 2, 4, 8, 8 ... tokens before the next.
    lookups = []
    for t in range(40):
        req.all_token_ids.append(100 + t)
        before = state.alpha
        spec.observe(req)
        lookups.append(state.alpha < before)
    assert [i for i, miss in enumerate(lookups) if miss] == [1, 4, 9, 18, 27, 36]
    draft = SpecDecodeScheduling(SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}), 100)
    other = Request("d", None, [5, 6, 7, 8, 5, 6], SamplingParams(), seed=0, max_tokens=20)
    draft.observe(other)        # a draft model's proposals are not free: no shadow
    assert other.spec_state is None


def test_adaptive_rule_times_a_step_of_a_class_it_was_not_asked_about():
    # The engine decides over the running sequences before the previous step's finished
    # ones leave, so a step can be scheduled with fewer sequences (another class) than the
    # decision saw (a fresh-user run: 40 then 20 requests, KeyError in done()).
    from jaxpaged.core.spec_decode import adaptive
    now = [0.0]
    rule = adaptive.AdaptiveSpeculation(acceptance_is_free=True, clock=lambda: now[0])
    assert rule.choose([5.0] * 40) is False
    rule.scheduled(1, 3, 3, False)      # 3 sequences left: class 2, never chosen for
    now[0] += 0.5
    rule.done(1, idle=False)
    assert rule._classes[(3).bit_length()].per_seq.steps == 1
    assert rule.choose([5.0] * 3) is False      # that class measures plain steps first


# ---- the rejection sampler -----------------------------------------------------------------

def _meta(n, temperature, seeds, top_p=1.0):
    return SamplingMetadata.from_host(
        [(temperature, 0, top_p, 0.0, temperature == 0.0, s, 10) for s in seeds], n)


def test_greedy_verification_is_the_longest_matching_prefix():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = jnp.asarray([best[0], (best[1] + 1) % 50, best[2], -1], jnp.int32)
    out, accepted = verify(logits, _meta(4, 0.0, [0] * 4), False, None, None, drafts)
    assert np.asarray(accepted).tolist() == [True, False, True, False]
    assert np.asarray(out.token_ids).tolist() == best.tolist()


def test_sampled_rows_accept_with_p_and_resample_without_the_rejected_token():
    rng = np.random.default_rng(1)
    n, vocab = 2000, 6
    row = rng.normal(size=vocab).astype(np.float32)
    p = np.exp(row.astype(np.float64))
    p /= p.sum()
    draft = 2
    logits = jnp.asarray(np.tile(row, (n, 1)))
    out, accepted = verify(logits, _meta(n, 1.0, range(n)), False, None, None,
                           jnp.full(n, draft, jnp.int32))
    tokens, accepted = np.asarray(out.token_ids), np.asarray(accepted)
    assert (tokens[accepted] == draft).all() and (tokens[~accepted] != draft).all()
    # Emitted tokens follow p exactly (accept w.p. p(x), else the residual): chi-square.
    counts = np.bincount(tokens, minlength=vocab)
    assert scipy_stats.chisquare(counts, p * n).pvalue > 0.01
    assert abs(accepted.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)
    # A row without a proposal draws the plain sampler's token (same key).
    plain = sample(logits, _meta(n, 1.0, range(n)))
    out, _ = verify(logits, _meta(n, 1.0, range(n)), False, None, None,
                    jnp.full(n, -1, jnp.int32))
    assert (np.asarray(out.token_ids) == np.asarray(plain.token_ids)).all()


# ---- end to end ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines():
    return LLM(**LIMITS), LLM(speculative_config=NGRAM, **LIMITS)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_pages_free(llm):
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_greedy_outputs_equal_plain_decoding_batch_1_and_32(engines):
    plain, spec = engines
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    totals = spec.engine.scheduler.spec.totals
    for prompts in (COPY_PROMPTS[:1], (COPY_PROMPTS * 11)[:32]):
        before = totals.num_accepted_tokens
        got = spec.generate(prompts, greedy, use_tqdm=False)
        assert _ids(got) == _ids(plain.generate(prompts, greedy, use_tqdm=False))
        assert [o.outputs[0].text for o in got] == [
            o.outputs[0].text for o in plain.generate(prompts, greedy, use_tqdm=False)]
        assert totals.num_accepted_tokens - before > 10 * len(prompts)   # it did speculate
        _assert_all_pages_free(spec)
    # The second batch found the first's prompt pages: prefix-cache hits with speculation.
    assert spec.engine.kv_cache_manager.stats.hits > 0
    assert totals.num_draft_tokens > totals.num_accepted_tokens > 0
    assert sum(totals.num_accepted_tokens_per_pos) == totals.num_accepted_tokens


def test_adaptive_rule_survives_batches_that_shrink_between_decision_and_step():
    # A fresh-user repro: 40 requests, most finishing early, then 20: sequences finished
    # between the adaptive rule's decision and the schedule put a step in a batch class the
    # rule had not seen, and the engine raised KeyError (the second batch's outputs lost).
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                  "prompt_lookup_min": 1}, **LIMITS)
    plain = LLM(**LIMITS)
    for r, (n, short) in enumerate([(40, 33), (20, 17)]):
        prompts = [f"Once upon a time {i} {r} the cat the dog" for i in range(n)]
        params = [SamplingParams(temperature=0, ignore_eos=True,
                                 max_tokens=8 + r if i < short else 70) for i in range(n)]
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(
            plain.generate(prompts, params, use_tqdm=False))
        _assert_all_pages_free(llm)


def test_random_prompts_and_every_sampling_rule_inside_accepted_runs(engines):
    plain, spec = engines
    prompts = random_prompts(12, 512, seed=5, max_len=60) + COPY_PROMPTS
    g = dict(temperature=0, max_tokens=40)
    cases = [
        SamplingParams(**g),
        SamplingParams(stop=["Lily", " the"], **g),               # stop strings
        SamplingParams(stop_token_ids=[13, 278], **g),            # stop ids
        SamplingParams(temperature=0, max_tokens=7),              # length cuts a run
        SamplingParams(logprobs=2, **g),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                       **g),
        SamplingParams(logit_bias={278: 3.0, 13: -2.0}, **g),
        SamplingParams(min_tokens=30, **g),
        SamplingParams(bad_words=["girl", "cat"], **g),
        SamplingParams(allowed_token_ids=list(range(250, 420)), **g),
        SamplingParams(n=2, temperature=0, max_tokens=20),       # cannot speculate: runs plain
        SamplingParams(prompt_logprobs=1, **g),                   # cannot speculate: runs plain
    ]
    params = [cases[i % len(cases)] for i in range(len(prompts))] + cases
    prompts = prompts + [COPY_PROMPTS[0]] * len(cases)
    totals = spec.engine.scheduler.spec.totals
    before = totals.num_accepted_tokens
    got = spec.generate(prompts, params, use_tqdm=False)
    assert totals.num_accepted_tokens - before > 50
    want = plain.generate(prompts, params, use_tqdm=False)
    for g_out, w_out, p in zip(got, want, params):
        assert [o.token_ids for o in g_out.outputs] == [o.token_ids for o in w_out.outputs], p
        assert [o.text for o in g_out.outputs] == [o.text for o in w_out.outputs]
        assert [o.finish_reason for o in g_out.outputs] == \
            [o.finish_reason for o in w_out.outputs]
        assert [o.stop_reason for o in g_out.outputs] == [o.stop_reason for o in w_out.outputs]
        if p.logprobs:
            for a, b in zip(g_out.outputs[0].logprobs, w_out.outputs[0].logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert any(o.outputs[0].finish_reason == "stop" for o in got)
    _assert_all_pages_free(spec)


def test_a_batch_of_max_num_seqs_speculates_in_verification_steps(engines):
    plain, spec = engines
    prompts = (COPY_PROMPTS * 22)[:LIMITS["max_num_seqs"]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    totals = spec.engine.scheduler.spec.totals
    drafts = totals.num_drafts
    kinds = []
    runner = spec.engine.runner
    dispatch = runner.dispatch

    def recording(scheduler_output):
        pending = dispatch(scheduler_output)
        kinds.append(pending.prepared.layout.verify_block_q)
        return pending

    runner.dispatch = recording
    try:
        got = spec.generate(prompts, greedy, use_tqdm=False)
    finally:
        del runner.dispatch
    assert _ids(got) == _ids(plain.generate(prompts, greedy, use_tqdm=False))
    # (324 drafts in ~10 steps of 64 sequences, k = 4) in verification steps
    assert totals.num_drafts - drafts > 4 * len(prompts)
    assert kinds.count(1 + NGRAM["num_speculative_tokens"]) > 4
    _assert_all_pages_free(spec)


def test_preemption_with_a_tiny_pool_matches_and_frees_every_page(engines):
    assert_preemption_matches_plain(engines[0], NGRAM)


def assert_preemption_matches_plain(plain, speculative_config):
    """16 sequences in a 24-page pool of 8 tokens, ``speculative_config`` against ``plain``:
    preemptions happen, outputs equal, every page is free after."""
    prompts = (COPY_PROMPTS * 6)[:16]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    small = LLM(speculative_config=speculative_config, enforce_eager=True, max_num_seqs=32,
                max_model_len=128, block_size=8, num_gpu_blocks_override=25)
    got = small.generate(prompts, greedy, use_tqdm=False)
    assert small.engine.num_preemptions > 0
    assert small.engine.scheduler.spec.totals.num_accepted_tokens > 0
    assert _ids(got) == _ids(plain.generate(prompts, greedy, use_tqdm=False))
    _assert_all_pages_free(small)


def test_random_llama_greedy_equal_and_seeded_runs_repeat(tmp_path):
    cfg = json.load(open(f"{STORIES}/config.json"))
    cfg.update(hidden_size=96, intermediate_size=200, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(f"{STORIES}/{name}", tmp_path / name)
    kw = dict(LIMITS, model=str(tmp_path), load_format="dummy")
    plain, spec = LLM(**kw), LLM(speculative_config=NGRAM, **kw)
    prompts = random_prompts(32, 512, seed=9, max_len=50)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        assert _ids(spec.generate(batch, greedy, use_tqdm=False)) == \
            _ids(plain.generate(batch, greedy, use_tqdm=False))
    assert spec.engine.scheduler.spec.totals.num_accepted_tokens > 0
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=32,
                             ignore_eos=True) for i in range(8)]
    first = _ids(spec.generate(prompts[:8], seeded, use_tqdm=False))
    alone = _ids(spec.generate(prompts[3:4], seeded[3:4], use_tqdm=False))
    assert _ids(spec.generate(prompts[:8], seeded, use_tqdm=False)) == first
    assert alone == first[3:4]       # independent of the batch
    _assert_all_pages_free(spec)


def test_seeded_sampled_outputs_equal_plain_decoding(engines):
    """The acceptance test reuses the row's plain draw (``rejection.py``): a seeded
    request's tokens are those of plain decoding with the same seed, however it speculated."""
    plain, spec = engines
    prompts = (COPY_PROMPTS * 8)[:24]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=i, max_tokens=48,
                             ignore_eos=True)
              for i, (t, p, k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 0), (1.2, 1.0, 20)] * 8)]
    totals = spec.engine.scheduler.spec.totals
    before = (totals.num_draft_tokens, totals.num_accepted_tokens)
    got = _ids(spec.generate(prompts, params, use_tqdm=False))
    assert totals.num_accepted_tokens - before[1] > 100
    assert totals.num_draft_tokens - before[0] > totals.num_accepted_tokens - before[1]
    assert got == _ids(plain.generate(prompts, params, use_tqdm=False))
    _assert_all_pages_free(spec)


def test_metrics_and_the_log_line(engines, caplog):
    _, spec = engines
    prom = PrometheusStatLogger("m", 256)
    line = LoggingStatLogger(interval=0.0)
    spec.engine.stat_loggers[:] = [prom, line]
    try:
        with caplog.at_level(logging.INFO, logger="jaxpaged.metrics"):
            spec.generate(COPY_PROMPTS, SamplingParams(temperature=0, max_tokens=40,
                                                       ignore_eos=True), use_tqdm=False)
    finally:
        spec.engine.stat_loggers.clear()

    def value(name, **labels):
        return prom.registry.get_sample_value(f"jaxpaged:{name}_total",
                                              {"model_name": "m", **labels})

    drafts, proposed = value("spec_decode_num_drafts"), value("spec_decode_num_draft_tokens")
    accepted = value("spec_decode_num_accepted_tokens")
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    assert sum(value("spec_decode_num_accepted_tokens_per_pos", position=str(i))
               for i in range(4)) == accepted
    assert any("Mean acceptance length" in r.getMessage() for r in caplog.records)


def test_no_compilation_after_start_up_with_speculation():
    assert_no_compilation_after_start_up(NGRAM)


def assert_no_compilation_after_start_up(speculative_config) -> LLM:
    """A precompiled speculating engine runs greedy, sampled and adjusted requests without
    compiling again; returns it."""
    llm = LLM(speculative_config=speculative_config, max_num_seqs=8, max_model_len=64,
              max_num_batched_tokens=32)
    assert llm.engine.wait_until_compiled()
    compiled = llm.engine.stats().num_compilations
    prompts = [COPY_PROMPTS[1]] * 3 + [COPY_PROMPTS[2]]
    params = [SamplingParams(temperature=0, max_tokens=20, logprobs=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2,
                             min_tokens=5),
              SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=20)]
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.spec.totals.num_drafts > 0
    assert llm.engine.stats().num_compilations == compiled
    return llm


@pytest.mark.slow
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.8)])
def test_sampled_first_three_tokens_follow_plain_sampling(params):
    """Two-sample chi-square over 4000 draws each of the first 3 tokens (prefixes of length
    1, 2, 3), speculative against plain, on a prompt where about 30-40% of proposals are
    accepted (so both acceptance and the residual draw are exercised)."""
    kw = dict(enforce_eager=True, max_num_seqs=512, max_num_batched_tokens=1024,
              max_model_len=128)
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 2, "prompt_lookup_min": 1,
                                   "disable_by_batch_size": 512}, **kw)
    plain = LLM(**kw)
    n = 4000
    assert_same_first_tokens(spec, plain, COPY_PROMPTS[2], n, batch=100, **params)
    totals = spec.engine.scheduler.spec.totals
    assert 0.2 * totals.num_draft_tokens < totals.num_accepted_tokens \
        < 0.8 * totals.num_draft_tokens
    assert totals.num_draft_tokens > n / 2
    _assert_all_pages_free(spec)
