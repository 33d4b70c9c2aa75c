"""Pallas ragged paged attention against the jnp reference (interpret mode on CPU, compiled on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.attention.pallas import PallasAttentionBackend
from jaxpaged.layers.attention.xla import (XlaAttentionBackend, gather_pages,
                                          paged_attention_chunked)
from pallas_kernels.kv_quant import FP8_DTYPE, quantize_kv
from pallas_kernels.paged_attention_v1 import choose_num_splits, paged_attention
from pallas_kernels.reference import paged_attention_reference, write_kv_reference
from tests.kernels.ragged_batches import block_inputs, device_metadata, make_batch, random_seqs

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim, page_size", [(8, 16), (64, 16), (128, 32)])
def test_ragged_batch_matches_reference(dtype, group, head_dim, page_size, kernel="v2"):
    """The v2 kernels (decode and prefill launches) through the backend's forward: output
    against the xla backend, pool bit for bit."""
    rng = np.random.default_rng(group * 1000 + head_dim + page_size)
    num_kv_heads = 2
    batch = make_batch(rng, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, page_size=page_size, dtype=dtype,
                       seqs=random_seqs(rng, 5, page_size))
    results = []
    for backend in (XlaAttentionBackend(), PallasAttentionBackend(kernel=kernel)):
        meta = device_metadata(backend, batch.layout)
        out, (kp, vp) = jax.jit(backend.forward, static_argnames="scale")(
            batch.q, batch.k, batch.v, (batch.k_pages, batch.v_pages), meta,
            scale=head_dim ** -0.5)
        results.append((np.asarray(out, np.float32), np.asarray(kp, np.float32),
                        np.asarray(vp, np.float32)))
    (ref_out, ref_k, ref_v), (out, k, v) = results
    n = batch.layout.num_tokens
    assert np.abs(out[:n] - ref_out[:n]).max() <= TOL[dtype]
    np.testing.assert_array_equal(k[1:], ref_k[1:])  # page 0 = null page: padding writes
    np.testing.assert_array_equal(v[1:], ref_v[1:])


@pytest.mark.parametrize("dtype, group, head_dim, page_size", [
    (jnp.float32, 1, 8, 16), (jnp.bfloat16, 8, 64, 16), (jnp.float32, 4, 128, 32)])
def test_ragged_batch_matches_reference_v1(dtype, group, head_dim, page_size):
    """The v1 kernel (one query-block launch) kept for the A/B."""
    test_ragged_batch_matches_reference(dtype, group, head_dim, page_size, kernel="v1")


@pytest.mark.parametrize("kernel", ["v1", "v2"])
def test_decode_only_batch(kernel):
    rng = np.random.default_rng(7)
    batch = make_batch(rng, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=jnp.float32, seqs=[(int(c), 1) for c in rng.integers(1, 200, 6)],
                       pad_tokens=2, pad_seqs=2)
    assert batch.layout.is_decode_only
    outs = []
    for backend in (XlaAttentionBackend(), PallasAttentionBackend(kernel=kernel)):
        meta = device_metadata(backend, batch.layout)
        out, _ = backend.forward(batch.q, batch.k, batch.v, (batch.k_pages, batch.v_pages),
                                 meta, scale=0.125)
        outs.append(np.asarray(out)[:6])
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_groups", [1, 3, 4, 9])
@pytest.mark.parametrize("block_q", [1, 16])
def test_xla_chunked_runs_match_reference_in_any_block_order(num_groups, block_q, dtype):
    """Each run of blocks stops at its own last chunk; correct whatever the block order, for
    decode blocks (multiply-and-reduce) and prefill blocks (matmuls) in either dtype."""
    rng = np.random.default_rng(num_groups * 10 + block_q)
    args, valid = block_inputs(rng, nb=7, block_q=block_q, group=2, dtype=dtype)
    ref = np.asarray(paged_attention_reference(*args, scale=0.125), np.float32)
    out = paged_attention_chunked(*args, scale=0.125, num_groups=num_groups)
    assert out.dtype == dtype
    assert np.abs(np.asarray(out, np.float32) - ref)[valid].max() <= TOL[dtype]


def test_query_blocks_sorted_longest_first():
    rng = np.random.default_rng(5)
    batch = make_batch(rng, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=jnp.float32, seqs=[(3, 20), (70, 1), (0, 5), (150, 1)],
                       pad_tokens=3, pad_seqs=1)
    meta = XlaAttentionBackend().build_metadata(batch.layout)
    last = meta["block_positions"].max(axis=1)
    assert list(last) == sorted(last, reverse=True)
    assert last[0] == 150 and last[-1] == -1
    assert sorted(meta["block_tokens"][meta["block_positions"] >= 0]) == list(range(27))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_matches_reference(num_splits):
    rng = np.random.default_rng(num_splits)
    args, valid = block_inputs(rng, nb=4, block_q=1, group=4)
    ref = np.asarray(paged_attention_reference(*args, scale=0.125))
    out = np.asarray(paged_attention(*args, scale=0.125, num_splits=num_splits))
    assert np.abs(out - ref)[valid].max() <= 1e-5


SLIDING_KERNELS = {
    "pallas": lambda *a, **kw: paged_attention(*a, **kw, num_splits=1),
    "pallas-split2": lambda *a, **kw: paged_attention(*a, **kw, num_splits=2),
    "xla": lambda *a, **kw: paged_attention_chunked(*a, **kw, num_groups=3),
}


@pytest.mark.parametrize("sliding_window, soft_cap", [(24, None), (None, 3.0), (5, 10.0),
                                                     (40, None)])
@pytest.mark.parametrize("block_q", [1, 16])
@pytest.mark.parametrize("kernel", list(SLIDING_KERNELS))
def test_sliding_window_and_soft_cap(sliding_window, soft_cap, block_q, kernel):
    """Both backends' kernels, for prefill and decode blocks; windows shorter and longer
    than the xla backend's 32-key chunk (so whole chunks are skipped)."""
    rng = np.random.default_rng(11 + block_q)
    args, valid = block_inputs(rng, nb=6, block_q=block_q, group=2)
    kw = dict(scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    ref = np.asarray(paged_attention_reference(*args, **kw))
    causal = np.asarray(paged_attention_reference(*args, scale=0.125))
    assert np.abs(causal - ref)[valid].max() > 1e-2     # the option changes the result
    out = np.asarray(SLIDING_KERNELS[kernel](*args, **kw))
    assert np.abs(out - ref)[valid].max() <= 1e-5


@pytest.mark.parametrize("page_size", [64, 128])
def test_large_pages_bfloat16(page_size):
    rng = np.random.default_rng(page_size)
    args, valid = block_inputs(rng, nb=3, block_q=16, group=4, head_dim=128,
                               page_size=page_size, dtype=jnp.bfloat16)
    ref = np.asarray(paged_attention_reference(*args, scale=128 ** -0.5), np.float32)
    out = np.asarray(paged_attention(*args, scale=128 ** -0.5), np.float32)
    assert np.abs(out - ref)[valid].max() <= 2e-2


def test_rejects_mismatched_inputs():
    rng = np.random.default_rng(0)
    (q, k, v, pt, bs, bp), _ = block_inputs(rng, nb=2, block_q=1, group=2)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(q, k.astype(jnp.bfloat16), v, pt, bs, bp, scale=1.0)
    with pytest.raises(ValueError, match="share a dtype"):      # an fp8 K pool with a float V pool
        paged_attention(q, k.astype(FP8_DTYPE), v, pt, bs, bp, scale=1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention_chunked(q, k.astype(FP8_DTYPE), v, pt, bs, bp, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(q[:, :, :3], k, v, pt, bs, bp, scale=1.0)


def test_choose_num_splits():
    assert choose_num_splits(num_blocks=256, num_kv_heads=8, max_pages=512) == 1
    assert choose_num_splits(num_blocks=1, num_kv_heads=8, max_pages=512) == 16
    assert choose_num_splits(num_blocks=4, num_kv_heads=8, max_pages=512) == 16
    assert choose_num_splits(num_blocks=4, num_kv_heads=8, max_pages=32) == 4
    assert choose_num_splits(num_blocks=1, num_kv_heads=8, max_pages=4) == 1


# ---- fp8 KV cache ---------------------------------------------------------------------------

#: Per-tensor scales for the fp8 tests: unit-normal K/V then span about +-200 and +-400 in e4m3.
FP8_SCALES = dict(k_scale=0.02, v_scale=0.01)
#: Max |fp8 attention - float attention| for unit-normal q, K, V (head_dim 64, scale 1/8): the
#: quantization error of K and V (measured 0.07-0.09), not the kernels'.
FP8_TOL = 0.15

FP8_KERNELS = {**SLIDING_KERNELS, "pallas-auto-splits": paged_attention}


@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_q", [1, 16])
@pytest.mark.parametrize("kernel", list(FP8_KERNELS))
def test_fp8_pool_matches_reference(kernel, block_q, dtype, sliding_window):
    """Both backends' kernels on an fp8 pool with scales, decode and prefill blocks: equal
    to the reference reading the same pool (the compute dtype's tolerance), and within
    fp8's quantization error of attention over the unquantized K and V."""
    rng = np.random.default_rng(21 + block_q)
    (q, k, v, *rest), valid = block_inputs(rng, nb=6, block_q=block_q, group=2, dtype=dtype)
    k8 = quantize_kv(k, FP8_SCALES["k_scale"], FP8_DTYPE)
    v8 = quantize_kv(v, FP8_SCALES["v_scale"], FP8_DTYPE)
    kw = dict(scale=0.125, sliding_window=sliding_window)
    out = np.asarray(FP8_KERNELS[kernel](q, k8, v8, *rest, **kw, **FP8_SCALES), np.float32)
    ref = np.asarray(paged_attention_reference(q, k8, v8, *rest, **kw, **FP8_SCALES), np.float32)
    unquantized = np.asarray(paged_attention_reference(q, k, v, *rest, **kw), np.float32)
    assert np.abs(out - ref)[valid].max() <= TOL[dtype]
    error = np.abs(out - unquantized)[valid]
    assert 1e-3 < error.max() <= FP8_TOL          # quantized for real, and not worse than fp8


FP8_BACKENDS = {"xla": XlaAttentionBackend, "pallas": PallasAttentionBackend,
                "pallas-v1": lambda **kw: PallasAttentionBackend(kernel="v1", **kw)}


@pytest.mark.parametrize("dtype, backend", [
    (jnp.float32, "xla"), (jnp.float32, "pallas"), (jnp.float32, "pallas-v1"),
    (jnp.bfloat16, "xla"), (jnp.bfloat16, "pallas")])
def test_backend_forward_on_fp8_pool(backend, dtype):
    """A ragged batch through ``forward`` (write, then attend) on an fp8 pool: the pool equals
    the reference write bit for bit, the output the reference attention over that pool."""
    rng = np.random.default_rng(31)
    head_dim, page_size, num_kv_heads, group = 64, 16, 2, 4
    batch = make_batch(rng, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, page_size=page_size, dtype=dtype,
                       seqs=random_seqs(rng, 5, page_size))
    pool = tuple(quantize_kv(p, s, FP8_DTYPE) for p, s in
                 ((batch.k_pages, FP8_SCALES["k_scale"]), (batch.v_pages, FP8_SCALES["v_scale"])))
    impl = FP8_BACKENDS[backend](**FP8_SCALES)
    meta = device_metadata(impl, batch.layout)
    scale = head_dim ** -0.5
    out, (kp, vp) = jax.jit(impl.forward, static_argnames="scale")(
        batch.q, batch.k, batch.v, pool, meta, scale=scale)
    ref_k, ref_v = write_kv_reference(*pool, batch.k, batch.v, meta["slot_mapping"], **FP8_SCALES)
    assert kp.dtype == vp.dtype == FP8_DTYPE
    np.testing.assert_array_equal(np.asarray(kp, np.float32)[1:], np.asarray(ref_k, np.float32)[1:])
    np.testing.assert_array_equal(np.asarray(vp, np.float32)[1:], np.asarray(ref_v, np.float32)[1:])
    meta = device_metadata(XlaAttentionBackend(), batch.layout)      # query blocks for the oracle
    q_blocks = jnp.concatenate([batch.q, jnp.zeros_like(batch.q[:1])])[meta["block_tokens"]]
    ref = paged_attention_reference(q_blocks, ref_k, ref_v, meta["page_table"], meta["block_seq"],
                                    meta["block_positions"], scale=scale, **FP8_SCALES)
    valid = np.asarray(meta["block_positions"]) >= 0
    ref_tokens = np.asarray(ref, np.float32)[valid]
    got_tokens = np.asarray(out, np.float32)[np.asarray(meta["block_tokens"])[valid]]
    assert np.abs(got_tokens - ref_tokens).max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, FP8_DTYPE])
def test_gather_pages_as_rows_equals_indexing(dtype):
    """The row-view page gather the xla backend uses returns ``pages[ids]`` bit for bit."""
    rng = np.random.default_rng(3)
    pages = jnp.asarray(rng.standard_normal((11, 16, 3, 8)), dtype)
    ids = jnp.asarray(rng.integers(0, 11, (5, 4)), jnp.int32)
    out = jax.jit(gather_pages)(pages, ids)
    assert out.shape == (5, 4, 16, 3, 8) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(pages[ids], np.float32))
