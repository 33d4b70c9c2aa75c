"""The v2 Pallas kernels (decode with split-K, prefill blocks) against the jnp reference.

Interpret mode on CPU (compiled on a GPU). Query blocks of one token go to the decode kernel,
longer ones to the prefill kernel, so every case of the reference's contract runs on both.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_quant import FP8_DTYPE, quantize_kv
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from pallas_kernels.reference import paged_attention_reference
from tests.kernels.ragged_batches import block_inputs

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
FP8_SCALES = dict(k_scale=0.02, v_scale=0.01)


def v2(q, k_pages, v_pages, page_table, block_seq, block_positions, *, num_slots=None,
       kv_tokens=None, **kw):
    """The reference's query-block contract on the v2 kernels."""
    if q.shape[1] > 1:
        return paged_prefill_attention(q, k_pages, v_pages, page_table, block_seq,
                                       block_positions, **kw)
    pos = block_positions[:, 0]
    if kv_tokens is None:
        kv_tokens = int(np.sum(np.maximum(np.asarray(pos) + 1, 0)))
    out = paged_decode_attention(q[:, 0], k_pages, v_pages, page_table, block_seq, pos,
                                 jnp.asarray([kv_tokens], jnp.int32), num_slots=num_slots, **kw)
    return out[:, None]


@pytest.mark.parametrize("num_slots, kv_tokens", [(1, None), (2, None), (3, None), (8, 1),
                                                  (8, 10**6)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_split_k_matches_reference(num_slots, kv_tokens, group):
    """Any slot count and any split sizing (kv_tokens only schedules: 1 = as many splits as
    the slots allow, 10**6 = one split) give the reference's result; padding rows are zero."""
    rng = np.random.default_rng(num_slots + group)
    args, valid = block_inputs(rng, nb=5, block_q=1, group=group)
    ref = np.asarray(paged_attention_reference(*args, scale=0.125))
    out = np.asarray(v2(*args, scale=0.125, num_slots=num_slots, kv_tokens=kv_tokens))
    assert np.abs(out - ref)[valid].max() <= 1e-5
    assert (out[~valid] == 0).all()


@pytest.mark.parametrize("num_slots", [8, 19])
def test_merge_of_many_used_splits(num_slots):
    """A 2432-token sequence split over every slot (19: three merge iterations of
    ``MERGE_SLOTS`` = 8 slots, the last with 3) and a padding row, against the reference."""
    rng = np.random.default_rng(num_slots)
    page_size, kv_heads, group, head_dim, pages = 16, 2, 4, 64, 160
    pool = lambda: jnp.asarray(rng.normal(size=(2 * pages + 1, page_size, kv_heads, head_dim)),
                               jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, 2 * pages + 1)).reshape(2, pages),
                        jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, 1, kv_heads * group, head_dim)), jnp.float32)
    positions = jnp.asarray([[19 * 4 * 32 - 1], [-1], [700]], jnp.int32)   # 19 splits of 4 tiles
    args = (q, pool(), pool(), table, jnp.asarray([0, 1, 1], jnp.int32), positions)
    ref = np.asarray(paged_attention_reference(*args, scale=0.125))
    out = np.asarray(v2(*args, scale=0.125, num_slots=num_slots, kv_tokens=1))
    assert np.abs(out - ref)[[0, 2]].max() <= 1e-5
    assert (out[1] == 0).all()


@pytest.mark.parametrize("sliding_window, soft_cap", [(24, None), (None, 3.0), (5, 10.0),
                                                     (40, None)])
@pytest.mark.parametrize("block_q, num_slots", [(1, 1), (1, 3), (16, None), (32, None)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap, block_q, num_slots):
    """Windows shorter and longer than a 32-key tile (whole tiles skipped)."""
    rng = np.random.default_rng(11 + block_q)
    args, valid = block_inputs(rng, nb=6, block_q=block_q, group=2)
    kw = dict(scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    ref = np.asarray(paged_attention_reference(*args, **kw))
    causal = np.asarray(paged_attention_reference(*args, scale=0.125))
    assert np.abs(causal - ref)[valid].max() > 1e-2     # the option changes the result
    out = np.asarray(v2(*args, **kw, num_slots=num_slots))
    assert np.abs(out - ref)[valid].max() <= 1e-5


@pytest.mark.parametrize("group, split", [(4, 1), (5, 2), (8, 2), (16, 4)])
def test_prefill_blocks_split_over_programs_above_128_rows(group, split):
    """A 32-token block at G > 4 runs as ``split`` programs of fewer tokens; the rows they
    give are the reference's (sliding window included)."""
    from pallas_kernels.prefill_attention import prefill_split

    assert prefill_split(32, group) == split
    rng = np.random.default_rng(group)
    args, valid = block_inputs(rng, nb=3, block_q=32, group=group)
    for kw in (dict(scale=0.125), dict(scale=0.125, sliding_window=20)):
        ref = np.asarray(paged_attention_reference(*args, **kw))
        out = np.asarray(v2(*args, **kw))
        assert np.abs(out - ref)[valid].max() <= 1e-5


@pytest.mark.parametrize("block_q", [1, 32])
@pytest.mark.parametrize("page_size", [64, 128])
def test_large_pages_bfloat16(page_size, block_q):
    """Tiles of 32 and 64 keys inside one page."""
    rng = np.random.default_rng(page_size + block_q)
    args, valid = block_inputs(rng, nb=3, block_q=block_q, group=4, head_dim=128,
                               page_size=page_size, dtype=jnp.bfloat16)
    ref = np.asarray(paged_attention_reference(*args, scale=128 ** -0.5), np.float32)
    out = np.asarray(v2(*args, scale=128 ** -0.5), np.float32)
    assert np.abs(out - ref)[valid].max() <= 2e-2


@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_q", [1, 16])
def test_fp8_pool_matches_reference(block_q, dtype, sliding_window):
    """An fp8 pool with scales: equal to the reference reading the same pool, and within
    fp8's quantization error (0.15, as for v1) of attention over the unquantized K and V."""
    rng = np.random.default_rng(21 + block_q)
    (q, k, v, *rest), valid = block_inputs(rng, nb=6, block_q=block_q, group=2, dtype=dtype)
    k8 = quantize_kv(k, FP8_SCALES["k_scale"], FP8_DTYPE)
    v8 = quantize_kv(v, FP8_SCALES["v_scale"], FP8_DTYPE)
    kw = dict(scale=0.125, sliding_window=sliding_window)
    out = np.asarray(v2(q, k8, v8, *rest, **kw, **FP8_SCALES, num_slots=2), np.float32)
    ref = np.asarray(paged_attention_reference(q, k8, v8, *rest, **kw, **FP8_SCALES), np.float32)
    unquantized = np.asarray(paged_attention_reference(q, k, v, *rest, **kw), np.float32)
    assert np.abs(out - ref)[valid].max() <= TOL[dtype]
    assert 1e-3 < np.abs(out - unquantized)[valid].max() <= 0.15


@pytest.mark.parametrize("block_q", [1, 16])
def test_rejects_mismatched_inputs(block_q):
    rng = np.random.default_rng(0)
    (q, k, v, pt, bs, bp), _ = block_inputs(rng, nb=2, block_q=block_q, group=2)
    with pytest.raises(ValueError, match="share a dtype"):
        v2(q, k.astype(jnp.bfloat16), v, pt, bs, bp, scale=1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        v2(q, k.astype(FP8_DTYPE), v, pt, bs, bp, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        v2(q[:, :, :3], k, v, pt, bs, bp, scale=1.0)
