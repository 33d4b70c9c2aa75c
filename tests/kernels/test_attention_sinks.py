"""Attention sinks (gpt-oss) in every attention path: the jnp reference against a direct
softmax over [scores, sink], then the xla backend's chunked attention, the Pallas v2 decode
(any split count) and prefill kernels and the v1 kernel (interpret mode on CPU) against the
reference, the ``cpu`` backend's C++ kernel (decode, one-query and row-tile paths) against
the ``xla`` backend, and the kernels with sinks cross-lowered for an H200 (Triton)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.attention.cpu import CpuAttentionBackend, kernel_available
from jaxpaged.layers.attention.pallas import PallasAttentionBackend
from jaxpaged.layers.attention.xla import XlaAttentionBackend, paged_attention_chunked
from pallas_kernels.paged_attention_v1 import paged_attention as paged_attention_v1
from pallas_kernels.reference import paged_attention_reference
from tests.kernels.ragged_batches import block_inputs, device_metadata, make_batch, random_seqs
from tests.kernels.test_cuda_lowering import KVH, QH, lowered_text, sds, triton_calls, v2_args
from tests.kernels.test_paged_attention_v2 import v2

SCALE = 0.125


def sinks_for(num_heads, seed=0):
    """Sink logits large enough to move every row (scores here are ~N(0, 1))."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=num_heads) + 1.0, jnp.float32)


def test_reference_puts_the_sink_in_the_denominator_only():
    """One block of 3 queries over 2 pages: the reference equals softmax over the visible
    scores and the head's sink, the sink's weight dropped (transformers' eager gpt-oss)."""
    rng = np.random.default_rng(0)
    (q, kp, vp, table, seq, pos), _ = block_inputs(rng, nb=1, block_q=3, group=2, head_dim=16)
    pos = jnp.asarray([[5, 6, 7]], jnp.int32)
    sinks = sinks_for(4)
    out = np.asarray(paged_attention_reference(q, kp, vp, table, seq, pos, scale=SCALE,
                                               sinks=sinks))
    pages = np.asarray(table)[int(seq[0])]
    keys = np.asarray(kp)[pages].reshape(-1, 2, 16)[:8]           # positions 0..7
    values = np.asarray(vp)[pages].reshape(-1, 2, 16)[:8]
    for i, p in enumerate([5, 6, 7]):
        for h in range(4):
            s = np.asarray(q)[0, i, h] @ keys[:p + 1, h // 2].T * SCALE
            e = np.exp(np.concatenate([s, [float(sinks[h])]]) - s.max())
            want = (e[:-1] / e.sum()) @ values[:p + 1, h // 2]
            np.testing.assert_allclose(out[0, i, h], want, atol=1e-5)
    plain = np.asarray(paged_attention_reference(q, kp, vp, table, seq, pos, scale=SCALE))
    assert np.abs(plain - out).max() > 1e-2


@pytest.mark.parametrize("block_q, sliding_window", [(1, None), (1, 24), (16, None), (16, 5)])
def test_xla_chunked_matches_reference(block_q, sliding_window):
    rng = np.random.default_rng(block_q)
    args, valid = block_inputs(rng, nb=6, block_q=block_q, group=4)
    sinks = sinks_for(8)
    kw = dict(scale=SCALE, sliding_window=sliding_window)
    ref = np.asarray(paged_attention_reference(*args, sinks=sinks, **kw))
    out = np.asarray(paged_attention_chunked(*args, sinks=sinks, **kw))
    assert np.abs(out - ref)[valid].max() <= 1e-5
    assert np.abs(np.asarray(paged_attention_reference(*args, **kw)) - ref)[valid].max() > 1e-3


@pytest.mark.parametrize("block_q, num_slots", [(1, 1), (1, 3), (32, None)])
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_pallas_v2_matches_reference(block_q, num_slots, sliding_window):
    """Decodes (one split, or three: the sink counted once by the merge) and prefill blocks."""
    rng = np.random.default_rng(7 + block_q)
    args, valid = block_inputs(rng, nb=5, block_q=block_q, group=2)
    sinks = sinks_for(4, seed=block_q)
    kw = dict(scale=SCALE, sliding_window=sliding_window)
    ref = np.asarray(paged_attention_reference(*args, sinks=sinks, **kw))
    out = np.asarray(v2(*args, sinks=sinks, num_slots=num_slots, kv_tokens=1, **kw)
                     if block_q == 1 else v2(*args, sinks=sinks, **kw))
    assert np.abs(out - ref)[valid].max() <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 2])
def test_pallas_v1_matches_reference(num_splits):
    rng = np.random.default_rng(num_splits)
    args, valid = block_inputs(rng, nb=4, block_q=4, group=2)
    sinks = sinks_for(4, seed=3)
    ref = np.asarray(paged_attention_reference(*args, scale=SCALE, sinks=sinks))
    out = np.asarray(paged_attention_v1(*args, scale=SCALE, sinks=sinks, num_splits=num_splits,
                                        interpret=True))
    assert np.abs(out - ref)[valid].max() <= 1e-5


@pytest.mark.parametrize("backend", [CpuAttentionBackend(), PallasAttentionBackend(interpret=True),
                                     PallasAttentionBackend(interpret=True, kernel="v1")])
def test_backends_forward_with_sinks_equal_xla(backend):
    """A ragged step of decodes and prefill chunks: the backend's forward with sinks equals the
    xla backend's (the cpu backend through its C++ kernel), and the sinks change it."""
    rng = np.random.default_rng(5)
    batch = make_batch(rng, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8,
                       dtype=jnp.float32, seqs=random_seqs(rng, 5, 8, max_ctx=40))
    sinks = sinks_for(4, seed=9)
    t = batch.layout.num_tokens

    def run(b, **kw):
        pools = (jnp.array(batch.k_pages, copy=True), jnp.array(batch.v_pages, copy=True))
        out, _ = b.forward(batch.q, batch.k, batch.v, pools,
                           device_metadata(b, batch.layout), scale=SCALE, **kw)
        return np.asarray(out)[:t]

    want = run(XlaAttentionBackend(), sinks=sinks)
    assert np.abs(run(backend, sinks=sinks) - want).max() <= 1e-5
    assert np.abs(run(XlaAttentionBackend()) - want).max() > 1e-3


@pytest.mark.skipif(not kernel_available(), reason="no C++ compiler")
@pytest.mark.parametrize("block_q, group, head_dim, dtype, sliding_window", [
    (1, 3, 64, jnp.float32, None),   # decodes, accumulators in registers (SmolLM2's G and D)
    (1, 3, 64, jnp.float32, 20),
    (1, 2, 16, jnp.float32, None),   # decodes, one_query.h (the gpt-oss fixture's G and D)
    (16, 4, 64, jnp.float32, None),  # prefill blocks: row tiles, one-query for sparse blocks
    (16, 4, 64, jnp.float32, 20),
    (16, 2, 16, jnp.float32, 20),
    (1, 3, 64, jnp.bfloat16, 20), (16, 4, 64, jnp.bfloat16, None)])
def test_cpu_kernel_with_sinks_matches_xla(block_q, group, head_dim, dtype, sliding_window):
    """The C++ kernel's query blocks (up to 12 pages of 16 keys each) with sinks against the
    xla backend's chunked attention with the same sinks (float32: 1e-5; bf16 pools: 2e-2),
    and the sinks move its output (the kernel reads them)."""
    rng = np.random.default_rng(block_q * 10 + group + head_dim)
    args, valid = block_inputs(rng, nb=8, block_q=block_q, group=group, head_dim=head_dim,
                               dtype=dtype)
    q, kp, vp, table, seq, pos = args
    sinks = sinks_for(2 * group, seed=group)
    kw = dict(scale=SCALE, sliding_window=sliding_window)
    want = np.asarray(paged_attention_chunked(*args, sinks=sinks, **kw), np.float32)
    cpu = CpuAttentionBackend()
    got = np.asarray(cpu.attend(q, (kp, vp), table, seq, pos, sinks=sinks, **kw), np.float32)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.abs(got - want)[valid].max() <= tolerance
    plain = np.asarray(cpu.attend(q, (kp, vp), table, seq, pos, **kw), np.float32)
    assert np.abs(plain - want)[valid].max() > 10 * tolerance


@pytest.mark.parametrize("batch, block_q, launches", [(1, 1, 2), (256, 1, 1), (16, 32, 1)])
def test_v2_kernels_with_sinks_lower_for_h200(batch, block_q, launches):
    """gpt-oss's attention (head_dim 64, window 128, bf16) with sinks through the Pallas ->
    Triton lowering for an H200: the split-K decode and its merge, one-split decode, prefill."""
    kernel, args = v2_args(batch, 4096, block_q, jnp.bfloat16, head_dim=64, pool_pages=1024)
    fn = functools.partial(kernel, scale=0.125, sliding_window=128, interpret=False)
    text = lowered_text(lambda *a: fn(*a[:-1], sinks=a[-1]), *args, sds((QH,), jnp.float32))
    assert triton_calls(text) == launches


def test_v1_kernel_with_sinks_lowers_for_h200():
    args = (sds((16, 16, QH, 64), jnp.bfloat16), sds((1024, 16, KVH, 64), jnp.bfloat16),
            sds((1024, 16, KVH, 64), jnp.bfloat16), sds((16, 64), jnp.int32),
            sds((16,), jnp.int32), sds((16, 16), jnp.int32), sds((QH,), jnp.float32))
    fn = functools.partial(paged_attention_v1, scale=0.125, num_splits=2, interpret=False)
    assert triton_calls(lowered_text(lambda *a: fn(*a[:-1], sinks=a[-1]), *args)) == 1
