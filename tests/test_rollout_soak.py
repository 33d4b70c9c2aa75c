"""A rollout soak (issue 44): 32 requests at a time, a weight update every N steps and a
pause (keep, wait, abort in turn) every M; no request is lost, no page leaks, and every
output carries the version that produced it: the tokens a request got after the last
weight change it saw are that version's greedy continuation of what it had before."""

import numpy as np
import pytest

from jaxpaged import SamplingParams
from tests.helpers.rl import llama_tensors, write_checkpoint
from tests.test_continuous_batching import random_prompts
from tests.test_weight_update import make_llm

NUM_REQUESTS, CONCURRENCY, UPDATE_EVERY, PAUSE_EVERY = 96, 32, 4, 7


@pytest.fixture(scope="module")
def weights():
    return [llama_tensors(0), llama_tensors(1)]


@pytest.mark.slow      # ~40 s on 2 shared CPU cores, most of it compiling three engines
def test_rollout_soak(tmp_path, weights):
    prompts = random_prompts(NUM_REQUESTS, 512, seed=11, max_len=24)
    lengths = np.random.default_rng(2).integers(4, 16, size=NUM_REQUESTS)
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)
              for n in lengths]
    dirs = [write_checkpoint(tmp_path / f"w{i}", w) for i, w in enumerate(weights)]
    llm = make_llm(dirs[0], max_num_seqs=CONCURRENCY, max_num_batched_tokens=128,
                   enable_prefix_caching=True)
    engine = llm.engine
    final, versions, queued, steps = {}, {}, 0, 0
    modes = ["keep", "wait", "keep", "abort"]

    def collect(outputs):
        for out in outputs:
            assert out.weight_version <= engine.weight_version
            seen = versions.setdefault(out.request_id, [])
            assert not seen or seen[-1][0] <= out.weight_version      # never goes back
            seen.append((out.weight_version, list(out.outputs[0].token_ids)))
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out

    while len(final) < NUM_REQUESTS:
        while queued < NUM_REQUESTS and engine.get_num_unfinished_requests() < CONCURRENCY:
            engine.add_request(str(queued), prompts[queued], params[queued])
            queued += 1
        collect(engine.step())
        steps += 1
        if steps % UPDATE_EVERY == 0:
            engine.update_weights(weights[(engine.weight_version + 1) % 2])
        if steps % PAUSE_EVERY == 0:
            mode = modes[(steps // PAUSE_EVERY) % len(modes)]
            engine.pause_generation(mode)     # (abort: the final outputs come from step())
            for _ in range(40):
                if engine.is_frozen:
                    break
                collect(engine.step())
            assert engine.is_frozen
            engine.resume_generation()
    assert sorted(final, key=int) == [str(i) for i in range(NUM_REQUESTS)]   # none lost
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache_manager
    assert kv.num_used_pages == 0 and kv.num_free_pages == kv.num_usable_pages
    aborted = [r for r, out in final.items() if out.outputs[0].finish_reason == "abort"]
    last = {}                    # request -> (its last version, the tokens it had before it)
    for rid, seen in versions.items():
        if rid in aborted:
            continue
        version = seen[-1][0]
        before = [ids for v, ids in seen if v < version]
        last[rid] = (version, before[-1] if before else [])
    for parity in (0, 1):
        rids = [r for r, (v, _) in last.items() if v % 2 == parity]
        fresh = make_llm(dirs[parity], max_num_seqs=CONCURRENCY, max_num_batched_tokens=128)
        conts = fresh.generate(
            [prompts[int(r)] + last[r][1] for r in rids],
            [SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=params[int(r)].max_tokens - len(last[r][1]))
             for r in rids], use_tqdm=False)
        for r, cont in zip(rids, conts):
            assert final[r].outputs[0].token_ids == last[r][1] + cont.outputs[0].token_ids, r
    assert engine.weight_version >= 5 and aborted and sum(bool(p) for _, p in last.values())
    print(f"{steps} steps, {engine.weight_version} updates, {len(aborted)} aborted, "
          f"{len(last)} outputs equal their last version's greedy continuation")
