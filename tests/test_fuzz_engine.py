"""Hypothesis over ``SamplingParams`` and prompts given to ``Engine.add_request`` and
``LLM.generate``: any value, valid or not, either is refused with a typed error naming what
is wrong (``SamplingParamsError`` / ``ValueError`` / ``TypeError``, nothing queued) or runs
to a well-formed finish, and the engine keeps serving: a request running alongside gets
exactly its solo output, and every KV page is free afterwards."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxpaged import LLM, SamplingParams
from jaxpaged.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParamsError

VOCAB = 512                 # the bundled model's
MAX_MODEL_LEN = 32
#: A request that runs beside every fuzzed one; it must come out as it does alone.
SENTINEL = [1, 403, 407, 261]
SENTINEL_PARAMS = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)

token = st.integers(0, VOCAB - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
#: A value of a wrong type or out of every range (for any field).
junk = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
    st.text(max_size=3), st.lists(st.integers(-3, 2 * VOCAB), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(-3, 3), max_size=2),
    st.sampled_from([float("nan"), float("inf"), -1, 2**64, -2**63 - 1, "", [], {}]))
#: Each field's valid values, edges included.
VALID = {
    "n": st.integers(1, 4),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, exclude_min=True, allow_infinity=False),
    "temperature": st.floats(0, allow_infinity=False),
    "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(-1, 2**40),
    "min_p": st.floats(0, 1), "seed": st.none() | st.integers(-2**63, 2**64 - 1),
    "max_tokens": st.integers(1, 6), "min_tokens": st.integers(0, 6),
    "stop": st.none() | st.text(min_size=1, max_size=3)
    | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.none() | st.lists(token, max_size=3),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
    "logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "prompt_logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "logit_bias": st.none() | st.dictionaries(token, finite, max_size=4),
    "allowed_token_ids": st.none() | st.lists(token, min_size=1, max_size=6),
    "bad_words": st.none() | st.lists(st.text(min_size=1, max_size=5), max_size=3),
    "output_kind": st.sampled_from(list(RequestOutputKind)),
}


@st.composite
def sampling_kwargs(draw):
    """Valid values for some fields, then (often) a junk value for one or two of them."""
    names = draw(st.lists(st.sampled_from(sorted(VALID)), unique=True, max_size=8))
    kwargs = {name: draw(VALID[name]) for name in names}
    if kwargs.get("min_tokens", 0) > kwargs.get("max_tokens", 16):
        kwargs["min_tokens"] = kwargs.get("max_tokens", 16)
    for name in draw(st.lists(st.sampled_from(sorted(VALID)), unique=True, max_size=2)):
        kwargs[name] = draw(junk)
    return kwargs


any_text = st.text(st.characters(codec=None), max_size=40)     # lone surrogates included
valid_prompt = st.one_of(
    st.lists(token, min_size=1, max_size=MAX_MODEL_LEN), st.text(max_size=40),
    st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(token, min_size=1, max_size=20)),
    st.builds(lambda text, salt: {"prompt": text, "cache_salt": salt}, st.text(max_size=20),
              st.text(max_size=5)),
    st.builds(np.array, st.lists(token, min_size=1, max_size=20)))
bad_prompt = st.one_of(
    st.lists(st.integers(-2**70, 2**70), max_size=2 * MAX_MODEL_LEN), st.lists(junk, max_size=3),
    any_text, junk, st.just({}), st.builds(lambda x: {"prompt_token_ids": x}, junk),
    st.builds(lambda x: {"prompt": x}, junk), st.binary(max_size=5),
    st.builds(np.array, st.lists(st.floats(), min_size=1, max_size=3)))


@pytest.fixture(scope="module")
def fuzz_llm():
    """A small engine (one token bucket, one sequence bucket, one page bucket), so that the
    fuzzed requests compile few step shapes."""
    return LLM(enforce_eager=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
               max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def sentinel_alone(fuzz_llm):
    return fuzz_llm.generate(SENTINEL, SENTINEL_PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def drain(engine, max_steps: int = 400) -> dict[str, list]:
    """Step until the engine is empty; every output by request id."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"the engine did not finish in {max_steps} steps")


def final_sequences(outs: list, kind: RequestOutputKind) -> dict[int, tuple[list, list, str]]:
    """Per sequence index: all its token ids, all its logprobs, and its finish reason."""
    seqs: dict[int, tuple[list, list, str]] = {}
    for out in outs if kind == RequestOutputKind.DELTA else outs[-1:]:
        for o in out.outputs:
            ids, lps, _ = seqs.get(o.index, ([], [], None))
            seqs[o.index] = (ids + list(o.token_ids), lps + list(o.logprobs or []),
                             o.finish_reason)
    return seqs


def check_output(params: SamplingParams, num_prompt: int, outs: list) -> None:
    assert outs and outs[-1].finished
    seqs = final_sequences(outs, params.output_kind)
    assert sorted(seqs) == list(range(params.n))
    limit = min(params.max_tokens or MAX_MODEL_LEN, MAX_MODEL_LEN - num_prompt) or 1
    for ids, logprobs, finish in seqs.values():
        assert finish in ("stop", "length")
        assert 1 <= len(ids) <= limit and all(0 <= t < VOCAB for t in ids)
        if params.allowed_token_ids and not params.min_tokens:
            assert set(ids) <= set(params.allowed_token_ids)
        if params.logprobs is not None:
            assert len(logprobs) == len(ids)
            for t, entry in zip(ids, logprobs):
                assert t in entry and not math.isnan(entry[t].logprob)
                assert len(entry) <= params.logprobs + 1
    if params.prompt_logprobs is not None:
        prompt_lps = outs[-1].prompt_logprobs
        assert len(prompt_lps) == num_prompt and prompt_lps[0] is None


def check_idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(kwargs=sampling_kwargs(), prompt=st.one_of(valid_prompt, bad_prompt))
def test_add_request_any_input(fuzz_llm, sentinel_alone, kwargs, prompt):
    engine = fuzz_llm.engine
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as e:
        assert e.param in kwargs, e          # names a field that was given
        event("SamplingParams refused")
        return
    engine.add_request("sentinel", SENTINEL, SENTINEL_PARAMS)
    try:
        engine.add_request("fuzz", prompt, params)
        accepted = True
    except (ValueError, TypeError):          # SamplingParamsError is a ValueError
        accepted = False
    event("request accepted" if accepted else "request refused")
    outputs = drain(engine)
    assert outputs["sentinel"][-1].outputs[0].token_ids == sentinel_alone
    if accepted:
        num_prompt = len(outputs["fuzz"][-1].prompt_token_ids)
        check_output(params, num_prompt, outputs["fuzz"])
    else:
        assert "fuzz" not in outputs
    check_idle(engine)


@FUZZ
@given(prompts=st.lists(st.one_of(valid_prompt, valid_prompt, bad_prompt), min_size=1,
                        max_size=3),
       kwargs=st.lists(sampling_kwargs(), min_size=1, max_size=3))
def test_generate_any_input(fuzz_llm, prompts, kwargs):
    """``LLM.generate`` with a batch of prompts and one params per prompt (or a list of the
    wrong length): a typed error leaves nothing queued; otherwise one finished output each."""
    try:
        params = [SamplingParams(**k) for k in kwargs]
    except SamplingParamsError:
        event("SamplingParams refused")
        return
    params = params[0] if len(params) == 1 else params
    try:
        outs = fuzz_llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, TypeError):
        event("generate refused")
        check_idle(fuzz_llm.engine)
        return
    event("generated")
    if isinstance(prompts[0], int):         # a list of ints is one token-id prompt
        prompts = [prompts]
    assert len(outs) == len(prompts)
    for out, p in zip(outs, params if isinstance(params, list) else [params] * len(prompts)):
        check_output(p, len(out.prompt_token_ids), [out])
    check_idle(fuzz_llm.engine)


def test_one_token_prompt_logprobs(fuzz_llm):
    """Found by the fuzz above: a one-token prompt asking for prompt logprobs got None (or
    [None] when batched with a longer prompt that asked for them too); it is [None], as the
    first token of any prompt has no logprob."""
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    alone = fuzz_llm.generate([[1]], p, use_tqdm=False)[0]
    batched = fuzz_llm.generate([[1], [1, 403, 407]], p, use_tqdm=False)
    assert alone.prompt_logprobs == [None] == batched[0].prompt_logprobs
    assert len(batched[1].prompt_logprobs) == 3 and batched[1].prompt_logprobs[0] is None
    assert alone.outputs[0].token_ids == batched[0].outputs[0].token_ids
