"""Qwen3-Next (issue 45): Gated DeltaNet layers with per-sequence state slots beside the paged
pool, against transformers' own ``Qwen3NextForCausalLM`` (committed tiny random checkpoint,
``tests/fixtures/make_family_references.py``): float32 logits within 1e-4, 32 identical greedy
tokens through ``LLM.generate`` with chunked prefill, preemption and prefix-cache hits, and no
leaked slot (prefix caching's own tests: ``tests/test_qwen3_next_prefix.py``)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.errors import SamplingParamsError
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.state_slots import StateSlotKVCacheManager, StateSlots
from jaxpaged.layers.attention import BatchLayout, allocate_kv_pool, get_attention_backend
from jaxpaged.layers.gated_deltanet import ragged_gated_delta
from jaxpaged.layers.recurrent_pool import (num_kv_layers, recurrent_pool, state_bytes,
                                           state_shapes)
from jaxpaged.models.loader import load_model
from tests.conftest import FIXTURES

MODEL = os.path.join(FIXTURES, "qwen3_next")
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def fixture(file):
    return np.load(os.path.join(MODEL, file))


def forward_logits(ids, starts=(0,), width=None, page_size=8, backend="xla",
                   model=MODEL) -> np.ndarray:
    """Logits of one sequence ``ids`` run as consecutive jitted forwards over chunks beginning
    at ``starts`` (slot 1 carried between them as the engine's steps carry it), each padded
    to ``width`` tokens (default: the whole sequence) with padding tokens in the scratch slot;
    ``model`` a checkpoint directory or GGUF file."""
    cfg = ModelConfig.from_pretrained(model)
    backend = get_attention_backend(backend)
    graphdef, state = nnx.split(load_model(model, cfg, dtype=jnp.float32, backend=backend))

    @jax.jit
    def run(state, ids, positions, pool, meta):
        model = nnx.merge(graphdef, state)
        hidden, pool = model(ids, positions, pool, meta)
        return model.compute_logits(hidden), pool

    t = len(ids)
    width = width or t
    num_pages = -(-t // page_size)
    pool = recurrent_pool(cfg, lambda n: allocate_kv_pool(
        n, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim, jnp.float32),
        num_slots=2, dtype=jnp.float32)
    pages = np.arange(1, num_pages + 1, dtype=np.int32)
    out = []
    for a, b in zip(starts, list(starts[1:]) + [t]):
        pad = lambda x, fill=0: np.concatenate([x, np.full(width - (b - a), fill, np.int32)])
        positions = np.arange(a, b, dtype=np.int32)
        layout = BatchLayout(
            query_start_loc=np.array([0, b - a], np.int32), seq_lens=np.array([b], np.int32),
            positions=pad(positions),
            slot_mapping=pad(pages[positions // page_size] * page_size + positions % page_size),
            page_table=pages[None], num_seqs=1, num_tokens=b - a,
            state_slots=pad(np.full(b - a, 1, np.int32), -1))
        meta = {k: jnp.asarray(v) for k, v in backend.build_metadata(layout).items()}
        meta.update(slot_mapping=layout.slot_mapping, page_table=layout.page_table,
                    state_slots=layout.state_slots)
        logits, pool = run(state, pad(ids[a:b].astype(np.int32)), layout.positions, pool, meta)
        out.append(np.asarray(logits)[:b - a])
    return np.concatenate(out)


def test_settings_parsed():
    cfg = ModelConfig.from_pretrained(MODEL)
    la = cfg.family.linear_attention
    assert cfg.architecture == "Qwen3NextForCausalLM" and cfg.qk_norm
    assert la.layers == (True, False, True, True)
    assert (la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_kernel) == (
        2, 4, 16, 8, 4)
    assert la.shared_expert_intermediate_size == 32 and cfg.family.rotary_dim == 4
    assert cfg.family.moe_layers == (True, True, False, True)
    assert cfg.sliding_windows == (None,) * 4 and num_kv_layers(cfg) == 1
    # conv state: 3 inputs of 2 * 2 * 16 + 4 * 8 channels; SSM: [Hv, Dk, Dv]; 2 slots + scratch
    assert state_shapes(cfg, 2) == ((3, 3, 96), (3, 4, 16, 8))
    assert state_bytes(cfg, 2, jnp.float32) == 3 * (3 * 3 * 96 + 3 * 4 * 16 * 8) * 4


def test_logits_match_transformers():
    ids, ref = fixture("input_ids.npy"), fixture("logits.npy")
    logits = forward_logits(ids)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() < 1e-4


def test_chunks_carry_the_state():
    """The same 41 tokens in chunks of 1 to 8, each padded to 8 tokens (the conv window
    crosses every boundary; padding writes only the scratch slot)."""
    ids, ref = fixture("input_ids.npy"), fixture("logits.npy")
    logits = forward_logits(ids, starts=(0, 1, 3, 8, 16, 24, 25, 30, 38), width=8)
    assert np.abs(logits - ref).max() < 1e-4


def engine(**kw):
    """Chunked prefill (8 tokens a step), 4-token pages, 24 pages for three 41-token
    sequences (11 pages each in the one attention layer): preemption."""
    args = dict(enforce_eager=True, model=MODEL, tokenizer=DEFAULT_MODEL, max_num_seqs=3,
                block_size=4, max_model_len=64, max_num_batched_tokens=8,
                enable_prefix_caching=True, num_gpu_blocks_override=24)
    return LLM(**{**args, **kw})


def assert_slots_free(llm):
    """Every live state slot and page free; every cached-state slot free or holding an
    entry (none reserved)."""
    kv = llm.engine.kv_cache_manager
    assert kv.state_slots.num_free == kv.state_slots.num_slots == 3
    assert kv.num_used_pages == 0
    cached = kv.cached_states
    assert cached.num_free + cached.num_cached == cached.num_slots == 6


@pytest.mark.parametrize("backend", ["xla", "cpu", pytest.param("pallas", marks=pytest.mark.slow)])
def test_generate_matches_transformers(backend):
    llm = engine(attention_backend=backend)
    prompt, want = fixture("greedy_prompt.npy").tolist(), fixture("greedy_tokens.npy").tolist()
    assert llm.generate([prompt], GREEDY_32, use_tqdm=False)[0].outputs[0].token_ids == want
    outs = llm.generate([prompt] * 3, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert llm.engine.num_preemptions > 0
    # The first run saved the state at its 2 full pages: every copy hits them (a preempted
    # one again on resuming).
    assert [o.num_cached_tokens for o in outs] == [8, 8, 8]
    assert_slots_free(llm)
    # Prompt logprobs of the 41 ids, prefilled 8 tokens a step: transformers' log-softmax.
    ids, ref = fixture("input_ids.npy"), fixture("logits.npy").astype(np.float64)
    out = llm.generate([ids.tolist()], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    got = [out.prompt_logprobs[p][int(ids[p])].logprob for p in range(1, len(ids))]
    assert np.abs(np.array(got) - ref[np.arange(len(ids) - 1), ids[1:]]).max() < 1e-4


def test_two_devices_match_transformers():
    """tp=2 on host devices: attention heads and expert columns split, the DeltaNet layers
    and their states replicated (and copied between slots on prefix hits)."""
    llm = engine(tensor_parallel_size=2, attention_backend="xla")
    prompt, want = fixture("greedy_prompt.npy").tolist(), fixture("greedy_tokens.npy").tolist()
    outs = llm.generate([prompt] * 3, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    # The first copy's state saved at 8 tokens (its first chunk), the others restore it.
    assert [o.num_cached_tokens for o in outs] == [0, 8, 8]
    assert llm.engine.num_preemptions > 0
    assert_slots_free(llm)


def test_soak_leaves_every_slot_free():
    """24 requests of mixed lengths through a pool that preempts: each of three later copies
    of a prompt gives the first run's tokens, and no state slot or page stays held."""
    llm = engine(num_gpu_blocks_override=20)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 9, 17, 30, 5, 12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    outs = llm.generate(prompts * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == first * 3
    assert llm.engine.num_preemptions > 0
    assert_slots_free(llm)
    with pytest.raises(SamplingParamsError, match="parallel sampling"):
        llm.generate([prompts[0]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)


def test_state_slot_manager_takes_and_gives_back():
    kv = StateSlotKVCacheManager(KVCacheManager(5, 4, enable_prefix_caching=False), 2)
    assert kv.allocate_slots("a", 4) and kv.allocate_slots("b", 4)
    assert (kv.state_slot("a"), kv.state_slot("b"), kv.state_slot("c")) == (0, 1, -1)
    assert not kv.allocate_slots("c", 4)                 # no slot: no pages taken either
    assert kv.num_free_pages == 2 and kv.page_table("c") == []
    assert kv.allocate_slots("a", 8) and kv.state_slot("a") == 0     # grows, same slot
    kv.free("a")                                         # finished or preempted
    assert kv.allocate_slots("c", 4) and kv.state_slot("c") == 0
    assert kv.find_cached_prefix("d", [1, 2, 3, 4, 5]) == 0      # prefix caching off
    assert kv.cached_states is None and kv.take_state_copies() == ([], [])
    with pytest.raises(ValueError, match="num_slots"):
        StateSlots(0)


def test_unsupported_settings_are_named():
    with pytest.raises(UnsupportedModelError, match="pipeline_parallel_size > 1"):
        engine(pipeline_parallel_size=2)
    cfg = dict(architectures=["Qwen3NextForCausalLM"], vocab_size=256, hidden_size=64,
               intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               head_dim=16, layer_types=["linear_attention", "mamba"])
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        ModelConfig.from_dict(cfg)
    with pytest.raises(UnsupportedModelError, match="linear_num_value_heads"):
        ModelConfig.from_dict({**cfg, "layer_types": None, "linear_num_key_heads": 3,
                               "linear_num_value_heads": 4})


def test_decode_step_at_once_equals_in_order():
    """A decode-only step (distinct slots; padding tokens share the scratch slot 4): the
    vectorised one-step update gives the token-by-token scan's outputs and states."""
    rng = np.random.default_rng(1)
    t, c, kernel, (nk, dk, nv, dv) = 5, 2 * 2 * 16 + 4 * 8, 4, (2, 16, 4, 8)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    args = (f32(t, c), -jnp.abs(f32(t, nv)), jax.nn.sigmoid(f32(t, nv)),
            jnp.array([2, 0, 3, 4, 4], jnp.int32), jnp.array([False, True, False, True, True]),
            f32(c, kernel), f32(5, kernel - 1, c), f32(5, nv, dk, dv), nk, dk, nv, dv)
    want = ragged_gated_delta(*args)
    got = ragged_gated_delta(*args, distinct=jnp.asarray(True))
    for rows, w, g in zip((3, 4, 4), want, got):     # real tokens' outputs; slots 0..3
        assert np.abs(np.asarray(w[:rows]) - np.asarray(g[:rows])).max() < 1e-5
    assert np.abs(np.asarray(want[2][2] - args[7][2])).max() > 0.01     # slot 2 was updated
