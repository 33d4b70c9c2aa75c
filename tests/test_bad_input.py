"""Bad input raises clear errors and leaves other requests unaffected."""

import pytest

from jaxpaged import EngineArgs, LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(enforce_eager=True, max_model_len=64, max_num_seqs=8)


@pytest.mark.parametrize("prompt, error, match", [
    ([1] + [5] * 64, ValueError, r"length 65\) is longer than the maximum model length of 64"),
    ([], ValueError, "empty"),
    ([1, 5, 512], ValueError, r"\[512\] are outside the vocabulary \[0, 512\)"),
    ([1, -3], ValueError, "outside the vocabulary"),
    ("", ValueError, None),  # the tokenizer adds BOS: not empty, so this one is accepted
    (3.5, TypeError, "prompt must be"),
    ([1, "a"], TypeError, "list of integers"),
    ({"text": "x"}, ValueError, "prompt_token_ids"),
])
def test_bad_prompt_rejected_and_engine_keeps_serving(llm, prompt, error, match):
    engine = llm.engine
    engine.add_request("good", [1, 403, 407], GREEDY)
    engine.step()  # "good" is now running
    if prompt == "":
        engine.add_request("bad", prompt, GREEDY)  # accepted: [BOS]
        engine.abort_request("bad")
    else:
        with pytest.raises(error, match=match):
            engine.add_request("bad", prompt, GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    solo = llm.generate([[1, 403, 407]], GREEDY, use_tqdm=False)[0]
    assert set(outs) == {"good"}
    assert outs["good"].outputs[0].token_ids == solo.outputs[0].token_ids
    kv = engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


def test_duplicate_request_id(llm):
    llm.engine.add_request("dup", [1, 5], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", [1, 6], GREEDY)
    llm.engine.abort_request("dup")
    assert not llm.engine.has_unfinished_requests()


def test_generate_with_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 5], [1, 9999]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([[1, 5]], [GREEDY, GREEDY], use_tqdm=False)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("seed", 1.5),
    ("max_tokens", 0), ("max_tokens", -1), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
])
def test_sampling_params_out_of_range(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_sampling_params_vllm_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.seed) == (1.0, 1.0, 0, 0.0, 16, None)
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)
    assert SamplingParams(top_k=-1).top_k == 0
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3)
    assert greedy.is_greedy and (greedy.top_p, greedy.top_k) == (1.0, 0)
    assert SamplingParams(stop="x").stop_strings == ("x",)


@pytest.mark.parametrize("field, value", [
    ("block_size", 0), ("block_size", 12), ("max_num_seqs", 0), ("max_model_len", -5),
    ("kv_cache_memory_bytes", 0), ("dtype", "float16"),
])
def test_engine_args_out_of_range(field, value):
    with pytest.raises(ValueError, match=rf"EngineArgs\.{field} "):
        EngineArgs(**{field: value})


def test_pool_too_small_for_max_model_len():
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=64"):
        LLM(enforce_eager=True, max_model_len=64, block_size=16, num_gpu_blocks_override=4)


def test_max_model_len_beyond_trained_context():
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        LLM(enforce_eager=True, max_model_len=1024)


def test_prompt_at_max_model_len_finishes_with_length(llm):
    out = llm.generate([[1] * 64], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_huge_top_k_keeps_everything_and_bad_step_input_leaves_engine_usable(llm):
    huge = llm.generate([[1, 403]], SamplingParams(top_k=2**40, temperature=0, max_tokens=5),
                        use_tqdm=False)[0]
    plain = llm.generate([[1, 403]], SamplingParams(temperature=0, max_tokens=5),
                         use_tqdm=False)[0]
    assert huge.outputs[0].token_ids == plain.outputs[0].token_ids


def test_failed_generate_leaves_nothing_queued(llm, monkeypatch):
    calls = {"n": 0}
    real_step = llm.engine.step

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 5]] * 4, SamplingParams(max_tokens=30), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("temperature", True), ("ignore_eos", "no"),
    ("skip_special_tokens", "False"), ("stop", 5), ("stop_token_ids", 5), ("seed", 2**64),
    ("n", 0), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
    ("presence_penalty", 2.5), ("repetition_penalty", 0), ("min_tokens", -1),
    ("logit_bias", {1: float("nan")}), ("allowed_token_ids", []), ("bad_words", [""]),
    ("output_kind", 7),
])
def test_sampling_params_wrong_types(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_params_changed_after_construction_are_checked_and_used(llm):
    p = SamplingParams(temperature=0, max_tokens=60)
    p.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("Once upon a time", p, use_tqdm=False)
    p.max_tokens = 60
    p.stop = "Lily"
    out = llm.generate("Once upon a time", p, use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == "Lily" and out.text == ", there was a little girl named "


@pytest.mark.parametrize("call, error, match", [
    (lambda llm: llm.generate("a", {"temperature": 0}), TypeError, "sampling_params must be"),
    (lambda llm: llm.generate(None), TypeError, "prompts must be"),
    (lambda llm: llm.generate(5), TypeError, "prompts must be"),
    (lambda llm: llm.engine.add_request(5, [1, 2]), TypeError, "request_id must be a string"),
    (lambda llm: llm.engine.add_request("x", [1, 2], {"n": 1}), TypeError, "SamplingParams"),
    (lambda llm: llm.engine.add_request("x", [1, 2], priority="high"), TypeError, "priority"),
    (lambda llm: llm.generate("\ud800"), ValueError, "cannot be tokenized"),
])
def test_wrong_argument_types(llm, call, error, match):
    with pytest.raises(error, match=match):
        call(llm)
    assert not llm.engine.has_unfinished_requests()


def test_numpy_token_ids_accepted(llm):
    import numpy as np

    out = llm.generate(np.array([1, 403, 407]), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 403, 407]


@pytest.mark.parametrize("field, value", [
    ("block_size", True), ("max_num_seqs", True), ("seed", -7), ("seed", 1.5), ("seed", None),
    ("seed", 2**70), ("gpu_memory_utilization", 1.5), ("scheduling_policy", "lifo"),
    ("long_prefill_token_threshold", -1), ("max_num_partial_prefills", 0),
])
def test_engine_args_wrong_types(field, value):
    with pytest.raises(ValueError, match=rf"EngineArgs\.{field} "):
        EngineArgs(**{field: value})


def test_kv_pool_larger_than_memory_is_refused():
    with pytest.raises(ValueError, match="does not fit in the device"):
        LLM(enforce_eager=True, kv_cache_memory_bytes=10**15)


def test_bad_model_directories(tmp_path):
    import shutil

    from tests.conftest import STORIES

    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LLM(model=str(bad_json), enforce_eager=True)
    truncated = tmp_path / "truncated"
    shutil.copytree(STORIES, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(model=str(truncated), enforce_eager=True)
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{STORIES}/{f}", no_tok)
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        LLM(model=str(no_tok), enforce_eager=True)


def test_float32_overflowing_temperature_and_penalty_are_refused():
    """Found by the fresh-user review: 1e308 became inf in the float32 sampler."""
    from jaxpaged.sampling_params import SamplingParams, SamplingParamsError
    for field in ("temperature", "repetition_penalty"):
        with pytest.raises(SamplingParamsError, match=rf"{field}.*at most 3\.403e\+38"):
            SamplingParams(**{field: 1e308}).verify()
        SamplingParams(**{field: 1e38}).verify()


def test_too_many_bad_words_are_refused():
    from jaxpaged.sampling_params import MAX_BAD_WORDS, SamplingParams, SamplingParamsError
    SamplingParams(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)]).verify()
    with pytest.raises(SamplingParamsError, match=r"bad_words.*at most 1024 words, got 1025"):
        SamplingParams(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS + 1)]).verify()
