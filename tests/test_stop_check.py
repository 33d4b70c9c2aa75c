"""Token-id stop rules (``jaxpaged.core.stop_check``) on their own, and the scheduler's one
decision combining them with the output processor's stop strings."""

from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.output_processor import OutputProcessor
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.stop_check import STOP_EOS, STOP_LENGTH, check_stop
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.tokenizer import load_tokenizer

EOS = 2


def req_with(output: list[int], max_tokens: int = 10, **params) -> Request:
    r = Request("r", None, [5, 6, 7], SamplingParams(**params), seed=0, max_tokens=max_tokens)
    r.all_token_ids.extend(output)
    return r


def test_eos_then_stop_ids_then_length_in_vllm_order():
    eos = frozenset({EOS, 3})
    assert check_stop(req_with([9]), eos, 64) is None
    assert check_stop(req_with([3]), eos, 64) == STOP_EOS
    assert check_stop(req_with([EOS], ignore_eos=True), eos, 64) is None
    assert check_stop(req_with([9], stop_token_ids=[9]), eos, 64) == ("stop", 9)
    # An EOS that is also the last allowed token is an EOS stop, not a length stop.
    assert check_stop(req_with([9, EOS], max_tokens=2), eos, 64) == STOP_EOS
    assert check_stop(req_with([9, 8], max_tokens=2), eos, 64) == STOP_LENGTH
    assert check_stop(req_with([9, 8]), eos, 5) == STOP_LENGTH      # 3 + 2 tokens = the limit
    assert check_stop(req_with([9, 8]), eos, 6) is None


def test_min_tokens_holds_back_eos_and_stop_ids_but_not_length():
    eos = frozenset({EOS})
    assert check_stop(req_with([EOS], min_tokens=2), eos, 64) is None
    assert check_stop(req_with([9, 4], min_tokens=3, stop_token_ids=[4]), eos, 64) is None
    assert check_stop(req_with([9, 9, EOS], min_tokens=3), eos, 64) == STOP_EOS
    assert check_stop(req_with([9, 9], max_tokens=2, min_tokens=5), eos, 64) == STOP_LENGTH


def test_stop_string_outranks_length_and_stop_id_skips_the_text():
    tok = load_tokenizer(DEFAULT_MODEL)
    kv = KVCacheManager(num_pages=32, page_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                  kv, OutputProcessor(tok, frozenset({EOS}), 64))
    word = tok.encode("hello", add_special_tokens=False)    # "▁he", "ll", "o"
    a = Request("a", None, [1, 5], SamplingParams(stop=["hello"]), seed=0,
                max_tokens=len(word))
    b = Request("b", None, [1, 5], SamplingParams(stop_token_ids=[word[0]]), seed=0,
                max_tokens=10)
    for r in (a, b):
        s.output_processor.add_request(r, 0.0)
        s.add_request(r)
    s.schedule()
    stopped = [s.append_token(a, t, None) for t in word]
    assert stopped == [False] * (len(word) - 1) + [True]
    assert (a.finish_reason, a.stop_reason, a.status) == ("stop", "hello", RequestStatus.FINISHED)
    assert s.output_processor.seqs["a"].detokenizer.visible_text(True) == " "
    assert s.append_token(b, word[0], None) is True
    assert (b.finish_reason, b.stop_reason) == ("stop", word[0])
    assert s.output_processor.seqs["b"].detokenizer.visible_text(True) == ""
    assert s.running == [] and kv.page_table("a") == [] and kv.page_table("b") == []


def test_append_token_finishes_exactly_where_check_stop_fires():
    """append_token skips check_stop for tokens that cannot stop: over sequences with EOS,
    stop ids, min_tokens, max_tokens and max_model_len, every sequence finishes at the token
    and with the reason that check_stop, called on every token, gives."""
    import random
    tok = load_tokenizer(DEFAULT_MODEL)
    rng = random.Random(0)
    cases = [dict(), dict(ignore_eos=True), dict(stop_token_ids=[11, 12]), dict(min_tokens=4),
             dict(min_tokens=3, stop_token_ids=[11]), dict(ignore_eos=True, min_tokens=8)]
    for case_index, params in enumerate(cases * 4):
        kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
        max_model_len = rng.choice([12, 64])
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=max_model_len),
                      kv, OutputProcessor(tok, frozenset({EOS}), max_model_len))
        r = Request("r", None, [5, 6, 7], SamplingParams(**params), seed=0,
                    max_tokens=rng.choice([5, 20]))
        s.output_processor.add_request(r, 0.0)
        s.add_request(r)
        s.schedule()
        shadow = req_with([], max_tokens=r.max_tokens, **params)
        for step in range(40):
            token = rng.choice([EOS, 11, 12, 20, 21, 22, 23])
            shadow.all_token_ids.append(token)
            expected = check_stop(shadow, frozenset({EOS}), max_model_len)
            assert s.append_token(r, token, None) is (expected is not None), (case_index, step)
            if expected is not None:
                assert (r.finish_reason, r.stop_reason) == expected
                break
        else:
            raise AssertionError(f"case {case_index} never stopped")
