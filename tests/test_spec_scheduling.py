"""Speculation as ``Scheduler.schedule`` sees it, without a model: proposals while planning
(``SpecDecodeScheduling.drafts``), one ``finish_step`` on the final plan."""

from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.output_processor import OutputProcessor
from jaxpaged.core.request import Request
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.spec_decode.config import SpeculativeConfig
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer(DEFAULT_MODEL)


def make_scheduler(num_pages: int = 64) -> tuple[Scheduler, KVCacheManager]:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    kv = KVCacheManager(num_pages=num_pages, page_size=4, enable_prefix_caching=False)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 2, "prompt_lookup_min": 2,
                                        "disable_by_batch_size": 8})
    return Scheduler(config, kv, OutputProcessor(TOKENIZER, frozenset({2}), 64), spec), kv


def add(s: Scheduler, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, None, prompt, SamplingParams(ignore_eos=True), seed=0, max_tokens=20)
    s.output_processor.add_request(req, 0.0)
    s.add_request(req)
    return req


def step(s: Scheduler, tokens: list[list[int]]):
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=tokens))
    return out


def test_a_decode_only_step_verifies_and_a_step_with_a_prefill_drops_the_proposals():
    s, _ = make_scheduler()
    a = add(s, "a", [5, 6, 7, 8, 5, 6])
    step(s, [[7]])                       # prefill; "6 7" occurred before, followed by 8 5 6
    out = s.schedule()
    [sa] = out.scheduled
    assert (sa.start, sa.num_new_tokens, sa.draft_token_ids) == (6, 4, [8, 5, 6])
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[[8, 5, 9]]))
    assert a.output_token_ids == [7, 8, 5, 9] and a.num_computed_tokens == 9
    add(s, "b", [9, 10, 11])
    out = s.schedule()                   # a's proposal ("5 9" is new: none) and b's prefill
    assert [(x.request.request_id, x.num_new_tokens, x.draft_token_ids)
            for x in out.scheduled] == [("a", 1, None), ("b", 3, None)]
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[[7], [12]]))
    out = s.schedule()                   # a: "9 7" new; b's "11 12" new: plain decodes
    assert [x.draft_token_ids for x in out.scheduled] == [None, None]


def test_proposals_of_a_step_with_a_prefill_chunk_are_dropped_on_the_final_plan():
    s, kv = make_scheduler()
    a = add(s, "a", [5, 6, 7, 8, 5, 6])
    step(s, [[7]])
    add(s, "b", [9, 10, 11])
    out = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.draft_token_ids)
            for x in out.scheduled] == [("a", 6, 1, None), ("b", 0, 3, None)]
    assert a.num_computed_tokens == 7     # the proposals' positions were not computed
    # The pages allocated for the dropped proposals stay a's: 7 + 3 tokens need 3 pages.
    assert len(kv.page_table("a")) == 3
