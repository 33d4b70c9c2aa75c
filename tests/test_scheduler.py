"""The scheduler's decisions and ``update_from_output``, checked token by token without a
model: each step's ``ModelRunnerOutput`` is written by the test."""

from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.output_processor import OutputProcessor
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer(DEFAULT_MODEL)
EOS = 2


def scheduler(config: SchedulerConfig, kv: KVCacheManager) -> Scheduler:
    return Scheduler(config, kv, OutputProcessor(TOKENIZER, frozenset({EOS}), config.max_model_len))


def add(s: Scheduler, *reqs: Request) -> None:
    """Queue requests as ``Engine.add_request`` does (output state first)."""
    for req in reqs:
        s.output_processor.add_request(req, 0.0)
        s.add_request(req)


def make(rid, n_prompt, **params):
    return Request(rid, None, list(range(1, n_prompt + 1)), SamplingParams(**params), seed=0,
                   max_tokens=params.get("max_tokens") or 100, n_samples=params.get("n", 1))


def run_step(sched, out, token=7):
    """Apply the model step's result: ``token`` for every sequence that samples."""
    return sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[
        [token] * s.num_samples for s in out.scheduled]))


def plan(out):
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_chunks_prefill_and_decodes_go_first():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64), kv)
    a, b = make("a", 6), make("b", 12)
    add(s, a, b)
    out = s.schedule()
    assert plan(out) == [("a", 0, 6), ("b", 0, 4)]
    assert [x.samples for x in out.scheduled] == [True, False]
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 6, 1), ("b", 4, 8)]   # decode first, then the rest of b
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 7, 1), ("b", 12, 1)]
    c = make("c", 3)
    add(s, c)                                 # joins at the next step
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 8, 1), ("b", 13, 1), ("c", 0, 3)]
    s.finish_request(a, "abort")
    assert a.status is RequestStatus.FINISHED and kv.page_table("a") == []


def test_max_num_seqs_limits_running():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), kv)
    for i in range(3):
        add(s, make(f"r{i}", 2))
    assert plan(s.schedule()) == [("r0", 0, 2), ("r1", 0, 2)]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preempts_newest_and_requeues_at_front():
    kv = KVCacheManager(num_pages=5, page_size=2, enable_prefix_caching=False)      # 4 usable pages = 8 tokens
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=8), kv)
    a, b = make("a", 4), make("b", 4)
    add(s, a, b)
    out = s.schedule()
    assert plan(out) == [("a", 0, 4), ("b", 0, 4)] and kv.num_free_pages == 0
    run_step(s, out)
    out = s.schedule()            # a needs a 3rd page: b (newest) is preempted
    assert plan(out) == [("a", 4, 1)]
    assert out.preempted == [b] and s.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7] and list(s.waiting) == [b]
    run_step(s, out)
    s.finish_request(a, "abort")
    out = s.schedule()            # b resumes by recomputing prompt + its generated token
    assert plan(out) == [("b", 0, 5)] and out.scheduled[0].samples


def test_preempt_all_requeues_every_running_sequence_in_order():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), kv)
    a, b, c = make("a", 5), make("b", 6), make("c", 3)
    for arrival, r in enumerate((a, b, c)):
        r.arrival = arrival
        add(s, r)
    run_step(s, s.schedule())             # a and b run, c waits
    assert s.num_waiting_seqs == 1
    s.preempt_all()
    assert s.running == [] and s.waiting == [a, b, c] and s.num_preemptions == 2
    assert kv.num_free_pages == kv.num_usable_pages
    assert (a.num_computed_tokens, a.output_token_ids) == (0, [7])
    assert plan(s.schedule()) == [("a", 0, 6), ("b", 0, 7)]    # recompute, arrival order


def test_num_waiting_seqs_counts_parallel_sampling_sequences():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64), kv)
    add(s, make("a", 3))
    add(s, Request("n", None, [1, 2], SamplingParams(n=3), seed=0, max_tokens=5,
                          n_samples=3))
    assert s.num_waiting_seqs == 4


def test_request_preempting_itself_when_alone():
    kv = KVCacheManager(num_pages=3, page_size=2, enable_prefix_caching=False)      # 2 usable pages
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=8), kv)
    a = make("a", 4)
    add(s, a)
    run_step(s, s.schedule())
    out = s.schedule()            # needs a 3rd page; the only victim is itself
    assert out.scheduled == [] and out.preempted == [a]


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    kv = KVCacheManager(num_pages=7, page_size=2, enable_prefix_caching=False)  # 6 usable pages
    s = scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=8,
                                  policy="priority"), kv)
    reqs = {}
    for i, prio in enumerate([5, 0, 3]):
        r = make(f"p{prio}", 4)
        r.priority, r.arrival = prio, i
        reqs[prio] = r
        add(s, r)
    out = s.schedule()                       # two seats: priorities 0 and 3 run first
    assert plan(out) == [("p0", 0, 4), ("p3", 0, 4)]
    run_step(s, out)
    late = make("p1", 2)
    late.priority, late.arrival = 1, 3
    add(s, late)
    assert [r.request_id for r in s.waiting] == ["p1", "p5"]
    for _ in range(2):                       # decode until the pool runs out
        run_step(s, s.schedule())
    out = s.schedule()
    assert out.preempted and out.preempted[0] is reqs[3]   # lowest priority of the running
    assert reqs[0].status is RequestStatus.RUNNING


def sjf_scheduler(num_pages=64, max_num_seqs=8, aging=4):
    kv = KVCacheManager(num_pages=num_pages, page_size=4, enable_prefix_caching=False)
    return scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1000,
                                     max_model_len=100, policy="sjf",
                                     sjf_aging_requests=aging), kv)


def test_sjf_orders_by_remaining_work_plus_aging():
    s = sjf_scheduler()
    # (prompt, max_tokens): remaining work 90, 10, 50, 10, 10, 10 tokens; with K = 4 and
    # max_model_len 100 the keys are arrival + 4 * work / 100: 3.6, 1.4, 4.0, 3.4, 4.4, 5.4.
    for i, (prompt, max_tokens) in enumerate([(60, 30), (5, 5), (40, 10), (5, 5), (5, 5),
                                              (5, 5)]):
        r = make(f"r{i}", prompt, max_tokens=max_tokens)
        r.arrival = i
        add(s, r)
    assert [r.request_id for r in s.waiting] == ["r1", "r3", "r0", "r2", "r4", "r5"]


def test_sjf_bound_no_request_is_overtaken_by_k_later_arrivals():
    import numpy as np

    rng = np.random.default_rng(0)
    for aging in (0, 1, 8, 32):
        s = sjf_scheduler(aging=aging)
        for i in range(200):
            prompt = int(rng.integers(1, 80))
            r = make(f"r{i}", prompt, max_tokens=int(rng.integers(1, 101 - prompt)))
            r.arrival = i
            add(s, r)
        arrivals = [r.arrival for r in s.waiting]
        overtaken_by = [sum(a > arrivals[i] for a in arrivals[:i]) for i in range(200)]
        assert max(overtaken_by) < max(aging, 1)     # K = 0: exactly first come first served
        if aging == 0:
            assert arrivals == list(range(200))
        if aging == 32:
            assert max(overtaken_by) >= 8            # short jobs do overtake long ones


def test_sjf_preempts_the_running_request_last_in_its_order():
    s = sjf_scheduler(num_pages=9, max_num_seqs=3, aging=50)   # 8 usable pages of 4 tokens
    for i, (prompt, max_tokens) in enumerate([(8, 80), (8, 4), (8, 30)]):
        r = make(f"r{i}", prompt, max_tokens=max_tokens)
        r.arrival = i
        add(s, r)
    out = s.schedule()
    assert {x.request.request_id for x in out.scheduled} == {"r0", "r1", "r2"}   # 6 pages
    while not out.preempted:
        run_step(s, out)
        out = s.schedule()
    # r0 has the most work left (80 tokens to go against 30 and 4), so it gives its pages.
    assert [r.request_id for r in out.preempted] == ["r0"]


def test_partial_prefill_limits():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, max_model_len=64,
                                  max_num_partial_prefills=1, long_prefill_token_threshold=6), kv)
    for rid, n in [("a", 30), ("b", 30), ("c", 3)]:
        add(s, make(rid, n))
    out = s.schedule()
    # a is capped at 6 tokens; b may not start a second partial prefill, so the queue waits.
    assert plan(out) == [("a", 0, 6)]
    s2 = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, max_model_len=64,
                                   max_num_partial_prefills=2, long_prefill_token_threshold=6),
                   KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False))
    for rid, n in [("a", 30), ("b", 30), ("c", 3)]:
        add(s2, make(rid, n))
    assert plan(s2.schedule()) == [("a", 0, 6), ("b", 0, 6), ("c", 0, 3)]


# ---- update_from_output: the one place a step's result is applied -----------------------------


def test_update_from_output_advances_appends_and_applies_stop_rules():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64), kv)
    a, b = make("a", 3), make("b", 3, min_tokens=3)
    c, d = make("c", 5, max_tokens=2), make("d", 2, stop_token_ids=[9])
    add(s, a, b, c, d)
    out = s.schedule()
    assert plan(out) == [("a", 0, 3), ("b", 0, 3), ("c", 0, 5), ("d", 0, 2)]
    assert [x.page_ids for x in out.scheduled] == [kv.page_table(r) for r in "abcd"]
    assert out.scheduled_new_reqs == [a, b, c, d] and out.page_copies == []
    groups = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[[7], [7], [7], [9]]))
    assert [g.request_id for g in groups] == ["a", "b", "c", "d"]
    assert [r.num_computed_tokens for r in (a, b, c)] == [3, 3, 5]
    assert (d.finish_reason, d.stop_reason, d.status) == ("stop", 9, RequestStatus.FINISHED)
    assert kv.page_table("d") == [] and d not in s.running
    out = s.schedule()
    assert plan(out) == [("a", 3, 1), ("b", 3, 1), ("c", 5, 1)] and out.scheduled_new_reqs == []
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[[EOS], [EOS], [7]]))
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == ("stop", None, [7, EOS])
    assert b.finish_reason is None and b.output_token_ids == [7, EOS]   # min_tokens=3 holds EOS
    assert c.finish_reason == "length" and s.running == [b]
    assert kv.num_free_pages == kv.num_usable_pages - len(kv.page_table("b"))


def test_update_from_output_forks_parallel_sampling_and_copies_shared_page():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64), kv)
    n = make("n", 3, n=3, seed=0)
    add(s, n)
    out = s.schedule()
    assert plan(out) == [("n", 0, 3)] and out.scheduled[0].num_samples == 3
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[[5, 6, 8]]))
    ids = ["n", "n\x1f1", "n\x1f2"]
    assert [r.request_id for r in s.running] == ids
    assert [r.output_token_ids for r in s.running] == [[5], [6], [8]]
    assert [(r.index, r.seed, r.n_samples) for r in s.running] == [(0, 0, 1), (1, 1, 1), (2, 2, 1)]
    shared = list(kv.page_table("n"))
    assert [kv.page_table(i) for i in ids] == [shared] * 3 and len(shared) == 1
    assert [seq.request.request_id for seq in s.output_processor.groups["n"].seqs] == ids
    out = s.schedule()                # position 3 of the shared page: the first two copy it
    assert plan(out) == [(i, 3, 1) for i in ids]
    tables = [x.page_ids for x in out.scheduled]
    assert out.page_copies == [(shared[0], tables[0][0]), (shared[0], tables[1][0])]
    assert tables[2] == shared and len({t[0] for t in tables}) == 3


def test_prefix_cache_counters_come_from_the_manager():
    kv = KVCacheManager(num_pages=64, page_size=2, enable_prefix_caching=True)
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64), kv)
    x = make("x", 5)
    add(s, x)
    run_step(s, s.schedule())
    s.finish_request(x, "abort")
    y = make("y", 5)
    add(s, y)
    out = s.schedule()
    assert plan(out) == [("y", 4, 1)] and y.num_cached_tokens == 4
    assert (kv.stats.queries, kv.stats.hits) == (5 + 5, 0 + 4)


def test_fail_step_finishes_every_sequence_of_the_step_with_error():
    kv = KVCacheManager(num_pages=64, page_size=2, enable_prefix_caching=True)
    s = scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64), kv)
    a, b = make("a", 4), make("b", 4)
    add(s, a, b)
    out = s.schedule()
    groups = s.fail_step(out)
    assert [g.request_id for g in groups] == ["a", "b"]
    assert [(r.finish_reason, r.status) for r in (a, b)] == [("error", RequestStatus.FINISHED)] * 2
    assert kv.num_free_pages == kv.num_usable_pages and s.running == []
    c = make("c", 4)
    add(s, c)
    assert plan(s.schedule()) == [("c", 0, 4)]      # the failed step's pages left the cache
