"""Backend selection and the engine on the Pallas backend (interpret mode on CPU)."""

import logging
import os

import jax.numpy as jnp
import pytest

from jaxpaged import LLM, EngineArgs, SamplingParams
from jaxpaged.layers.attention import get_attention_backend
from jaxpaged.layers.attention import selection
from jaxpaged.layers.attention.pallas import PallasAttentionBackend
from tests.conftest import STORIES, STORIES_REFERENCE, read_reference_ids


def test_engine_on_pallas_reproduces_reference_greedy_outputs():
    llm = LLM(enforce_eager=True, attention_backend="pallas", max_num_seqs=8)
    assert llm.engine.runner._backend.name == "pallas"
    bos = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)[0]
    assert bos.outputs[0].token_ids == read_reference_ids("expected_greedy_t0_n256.token_ids.txt")
    once = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60),
                        use_tqdm=False)[0]
    with open(os.path.join(STORIES_REFERENCE, "expected_greedy_prompt_OnceUponATime_n64.txt")) as f:
        assert "Once upon a time" + once.outputs[0].text + "\n" == f.read()


def test_auto_is_cpu_on_cpu_unless_the_kernel_cannot_build(monkeypatch):
    from jaxpaged.layers import cpu_build
    assert get_attention_backend("auto").name == "cpu"
    monkeypatch.setenv(cpu_build.CXX_ENV, "/nonexistent/g++")
    assert get_attention_backend("auto").name == "xla"
    assert get_attention_backend("xla").name == "xla"
    assert get_attention_backend("pallas").name == "pallas"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")
    with pytest.raises(ValueError, match="EngineArgs.attention_backend"):
        EngineArgs(attention_backend="flash")


def test_pallas_kernel_generation_is_checked():
    assert PallasAttentionBackend().kernel == "v2"
    assert PallasAttentionBackend(kernel="v1").kernel == "v1"
    with pytest.raises(ValueError, match="kernel must be one of"):
        PallasAttentionBackend(kernel="v3")


@pytest.mark.parametrize("dtype, page_size", [(jnp.float32, 16), (jnp.bfloat16, 16),
                                             (jnp.float32, 4)])
def test_self_check_passes_in_interpret_mode(dtype, page_size):
    """(4-token pages: 10 pages a sequence in the check's table, issue 45.)"""
    err = selection.self_check(PallasAttentionBackend(interpret=True), 2, 8, 64, page_size,
                               dtype)
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_self_check_on_an_fp8_pool(dtype):
    """``auto``'s start-up check over the pool an fp8 KV cache gives the kernels."""
    err = selection.self_check(PallasAttentionBackend(interpret=True), 2, 8, 64, 16, dtype,
                               jnp.float8_e4m3fn)
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2)


def test_auto_falls_back_to_xla_when_kernels_fail(monkeypatch, caplog):
    """Pretend to be on a GPU: the kernels then try the real (non-interpret) lowering, which
    cannot run on this CPU, so the self-check fails and auto must fall back with a warning."""
    monkeypatch.setattr(selection.jax, "default_backend", lambda: "gpu")
    with caplog.at_level(logging.WARNING, logger=selection.__name__):
        backend = get_attention_backend("auto", num_kv_heads=2, num_heads=4, head_dim=64)
    assert backend.name == "xla"
    assert "self-check" in caplog.text


def test_auto_picks_pallas_when_self_check_passes(monkeypatch):
    monkeypatch.setattr(selection.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(selection, "self_check", lambda *a: 1e-6)
    assert get_attention_backend("auto").name == "pallas"
    monkeypatch.setattr(selection, "self_check", lambda *a: 0.5)
    assert get_attention_backend("auto").name == "xla"


@pytest.mark.slow
def test_pallas_engine_matches_xla_on_a_batch_of_the_gqa_fixture():
    """Nightly: 16 mixed-length prompts through both backends (pallas in interpret mode)."""
    from tests.conftest import FIXTURES
    from tests.test_continuous_batching import random_prompts

    d = os.path.join(FIXTURES, "llama_gqa_untied")
    prompts = random_prompts(16, 320, seed=5, max_len=100)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend in ("xla", "pallas"):
        llm = LLM(model=d, tokenizer=STORIES, enforce_eager=True, attention_backend=backend,
                  block_size=16, max_num_seqs=16, max_num_batched_tokens=256)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)]
    assert outs["pallas"] == outs["xla"]
