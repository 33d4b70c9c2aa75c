"""Qwen3-Next (issue 45): Gated DeltaNet layers with a per-sequence recurrent state beside the
paged pool, against transformers' own ``Qwen3NextForCausalLM`` (committed tiny random
checkpoint, ``tests/fixtures/make_family_references.py``): float32 logits within 1e-4, whole and
in chunks."""

import os

import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import BatchLayout, allocate_kv_pool, get_attention_backend
from jaxpaged.layers.recurrent_pool import num_kv_layers, recurrent_pool, state_shapes
from jaxpaged.models.loader import load_model
from tests.conftest import FIXTURES

MODEL = os.path.join(FIXTURES, "qwen3_next")


def fixture(file):
    return np.load(os.path.join(MODEL, file))


def forward_logits(ids, starts=(0,), page_size=8, backend="xla") -> np.ndarray:
    """Logits of one sequence ``ids`` run as consecutive forwards over chunks beginning at
    ``starts`` (one state slot, carried between the chunks as the engine's steps do)."""
    cfg = ModelConfig.from_pretrained(MODEL)
    backend = get_attention_backend(backend)
    model = load_model(MODEL, cfg, dtype=jnp.float32, backend=backend)
    t = len(ids)
    num_pages = -(-t // page_size)
    pool = recurrent_pool(cfg, lambda n: allocate_kv_pool(
        n, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim, jnp.float32),
        num_slots=2, dtype=jnp.float32)
    pages = np.arange(1, num_pages + 1, dtype=np.int32)
    out = []
    for a, b in zip(starts, list(starts[1:]) + [t]):
        positions = np.arange(a, b, dtype=np.int32)
        layout = BatchLayout(
            query_start_loc=np.array([0, b - a], np.int32), seq_lens=np.array([b], np.int32),
            positions=positions,
            slot_mapping=(pages[positions // page_size] * page_size
                          + positions % page_size).astype(np.int32),
            page_table=pages[None], num_seqs=1, num_tokens=b - a,
            state_slots=np.full(b - a, 1, np.int32))
        meta = {k: jnp.asarray(v) for k, v in backend.build_metadata(layout).items()}
        meta.update(slot_mapping=jnp.asarray(layout.slot_mapping),
                    page_table=jnp.asarray(layout.page_table),
                    state_slots=jnp.asarray(layout.state_slots))
        hidden, pool = model(jnp.asarray(ids[a:b], jnp.int32), jnp.asarray(positions), pool, meta)
        out.append(np.asarray(model.compute_logits(hidden)))
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


def test_logits_match_transformers():
    ids, ref = fixture("input_ids.npy"), fixture("logits.npy")
    logits = forward_logits(ids)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() < 1e-4


def test_chunks_carry_the_state():
    """The same 41 tokens in chunks of 1 to 16 (the conv window crosses every boundary)."""
    ids, ref = fixture("input_ids.npy"), fixture("logits.npy")
    logits = forward_logits(ids, starts=(0, 1, 3, 8, 24, 25, 30))
    assert np.abs(logits - ref).max() < 1e-4


