"""The scheduler's decisions, checked token by token without a model."""

from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.request import Request, RequestStatus
from jaxpaged.engine.scheduler import Scheduler, SchedulerConfig
from jaxpaged.sampling_params import SamplingParams


def make(rid, n_prompt):
    return Request(rid, None, list(range(1, n_prompt + 1)), SamplingParams(), seed=0, max_tokens=100)


def run_step(sched, out, token=7):
    """What the engine does after the model step: advance and append sampled tokens."""
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.request.all_token_ids.append(token)


def plan(out):
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_chunks_prefill_and_decodes_go_first():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64), kv)
    a, b = make("a", 6), make("b", 12)
    s.add_request(a), s.add_request(b)
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
    s.add_request(c)                                 # joins at the next step
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 8, 1), ("b", 13, 1), ("c", 0, 3)]
    s.finish_request(a)
    assert a.status is RequestStatus.FINISHED and kv.page_table("a") == []


def test_max_num_seqs_limits_running():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), kv)
    for i in range(3):
        s.add_request(make(f"r{i}", 2))
    assert plan(s.schedule()) == [("r0", 0, 2), ("r1", 0, 2)]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preempts_newest_and_requeues_at_front():
    kv = KVCacheManager(num_pages=5, page_size=2, enable_prefix_caching=False)      # 4 usable pages = 8 tokens
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=8), kv)
    a, b = make("a", 4), make("b", 4)
    s.add_request(a), s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("a", 0, 4), ("b", 0, 4)] and kv.num_free_pages == 0
    run_step(s, out)
    out = s.schedule()            # a needs a 3rd page: b (newest) is preempted
    assert plan(out) == [("a", 4, 1)]
    assert out.preempted == [b] and s.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7] and list(s.waiting) == [b]
    run_step(s, out)
    s.finish_request(a)
    out = s.schedule()            # b resumes by recomputing prompt + its generated token
    assert plan(out) == [("b", 0, 5)] and out.scheduled[0].samples


def test_preempt_all_requeues_every_running_sequence_in_order():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), kv)
    a, b, c = make("a", 5), make("b", 6), make("c", 3)
    for arrival, r in enumerate((a, b, c)):
        r.arrival = arrival
        s.add_request(r)
    run_step(s, s.schedule())             # a and b run, c waits
    assert s.num_waiting_seqs == 1
    s.preempt_all()
    assert s.running == [] and s.waiting == [a, b, c] and s.num_preemptions == 2
    assert kv.num_free_pages == kv.num_usable_pages
    assert (a.num_computed_tokens, a.output_token_ids) == (0, [7])
    assert plan(s.schedule()) == [("a", 0, 6), ("b", 0, 7)]    # recompute, arrival order


def test_num_waiting_seqs_counts_parallel_sampling_sequences():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64), kv)
    s.add_request(make("a", 3))
    s.add_request(Request("n", None, [1, 2], SamplingParams(n=3), seed=0, max_tokens=5,
                          n_samples=3))
    assert s.num_waiting_seqs == 4


def test_request_preempting_itself_when_alone():
    kv = KVCacheManager(num_pages=3, page_size=2, enable_prefix_caching=False)      # 2 usable pages
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=4), kv)
    a = make("a", 4)
    s.add_request(a)
    run_step(s, s.schedule())
    out = s.schedule()            # needs a 3rd page; the only victim is itself
    assert out.scheduled == [] and out.preempted == [a]


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    kv = KVCacheManager(num_pages=7, page_size=2, enable_prefix_caching=False)  # 6 usable pages
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=8,
                                  policy="priority"), kv)
    reqs = {}
    for i, prio in enumerate([5, 0, 3]):
        r = make(f"p{prio}", 4)
        r.priority, r.arrival = prio, i
        reqs[prio] = r
        s.add_request(r)
    out = s.schedule()                       # two seats: priorities 0 and 3 run first
    assert plan(out) == [("p0", 0, 4), ("p3", 0, 4)]
    run_step(s, out)
    late = make("p1", 2)
    late.priority, late.arrival = 1, 3
    s.add_request(late)
    assert [r.request_id for r in s.waiting] == ["p1", "p5"]
    for _ in range(2):                       # decode until the pool runs out
        run_step(s, s.schedule())
    out = s.schedule()
    assert out.preempted and out.preempted[0] is reqs[3]   # lowest priority of the running
    assert reqs[0].status is RequestStatus.RUNNING


def test_partial_prefill_limits():
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, max_model_len=64,
                                  max_num_partial_prefills=1, long_prefill_token_threshold=6), kv)
    for rid, n in [("a", 30), ("b", 30), ("c", 3)]:
        s.add_request(make(rid, n))
    out = s.schedule()
    # a is capped at 6 tokens; b may not start a second partial prefill, so the queue waits.
    assert plan(out) == [("a", 0, 6)]
    s2 = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, max_model_len=64,
                                   max_num_partial_prefills=2, long_prefill_token_threshold=6),
                   KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False))
    for rid, n in [("a", 30), ("b", 30), ("c", 3)]:
        s2.add_request(make(rid, n))
    assert plan(s2.schedule()) == [("a", 0, 6), ("b", 0, 6), ("c", 0, 3)]
