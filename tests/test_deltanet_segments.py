"""The chunked multi-token path of Qwen3-Next's Gated DeltaNet (issue 45,
``jaxpaged.layers.deltanet_segments``) against the token-by-token scan it replaced: ragged
batches of several sequences, resets mid-batch, segments whose lengths are not multiples of
the chunk, padding tokens; outputs and both states in float32 within 1e-5."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.deltanet_segments import (chunk_function, prefill_kernel,
                                               ragged_segments)
from jaxpaged.layers.gated_deltanet import ragged_gated_delta as eager_gated_delta

HEADS = (2, 16, 4, 8)                                   # Hk, Dk, Hv, Dv (the fixture's)
CONV_DIM, KERNEL = 2 * 2 * 16 + 4 * 8, 4
SCRATCH = 5                                             # slots 0..4, then the scratch row

# (slot, first position, length) of each run, in batch order: a continued chunked prefill
# (slot 2 from position 7), a 1-token decode (slot 0), a fresh 21-token prompt (slot 4), a
# 2-token continuation whose conv window reaches into the stored state (slot 1), a fresh
# 9-token prompt (slot 3), then 3 padding tokens.
RUNS = ((2, 7, 5), (0, 12, 1), (4, 0, 21), (1, 30, 2), (3, 0, 9), (-1, 0, 3))


@functools.partial(jax.jit, static_argnums=(8, 9, 10, 11),
                   static_argnames=("prefill", "chunk", "interpret"))
def ragged_gated_delta(*args, **kwargs):
    """``ragged_gated_delta`` compiled as the model's step compiles it (one program)."""
    return eager_gated_delta(*args, **kwargs)


def batch(runs=RUNS, seed=0):
    """The arguments of ``ragged_gated_delta`` for ``runs`` (random float32 inputs and
    states, nonzero everywhere), and the [T] bool mask of real tokens."""
    rng = np.random.default_rng(seed)
    slots = np.concatenate([np.full(n, s, np.int32) for s, _, n in runs])
    positions = np.concatenate([np.arange(p, p + n, dtype=np.int32) for _, p, n in runs])
    real = slots >= 0
    t = len(slots)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    args = (f32(t, CONV_DIM), -jnp.abs(f32(t, HEADS[2])), jax.nn.sigmoid(f32(t, HEADS[2])),
            jnp.asarray(np.where(real, slots, SCRATCH)), jnp.asarray(positions == 0),
            f32(CONV_DIM, KERNEL) * 0.5, f32(SCRATCH + 1, KERNEL - 1, CONV_DIM),
            f32(SCRATCH + 1, HEADS[2], HEADS[1], HEADS[3]), *HEADS)
    return args, real


@functools.cache
def scanned(seed=0):
    """The token-by-token scan's result for ``batch(seed=seed)`` (the oracle)."""
    return ragged_gated_delta(*batch(seed=seed)[0], prefill="scan")


def max_gap(want, got, real, rows=SCRATCH):
    """The largest difference of real tokens' outputs and the states' slot rows."""
    (w_out, w_conv, w_ssm), (g_out, g_conv, g_ssm) = want, got
    return max(float(np.abs(np.asarray(w_out)[real] - np.asarray(g_out)[real]).max()),
               float(np.abs(np.asarray(w_conv[:rows] - g_conv[:rows])).max()),
               float(np.abs(np.asarray(w_ssm[:rows] - g_ssm[:rows])).max()))


def test_segments_and_chunks():
    """Exact segment facts for the runs above with chunks of 4 tokens."""
    args, real = batch()
    s = ragged_segments(args[3], args[4], jnp.asarray(real), SCRATCH + 1, 4)
    starts = np.cumsum([0] + [n for _, _, n in RUNS])          # 0 5 6 27 29 38 41
    assert np.asarray(s.first)[:38].tolist() == np.repeat(starts[:5], [5, 1, 21, 2, 9]).tolist()
    assert np.asarray(s.end)[:38].tolist() == np.repeat(starts[1:6], [5, 1, 21, 2, 9]).tolist()
    fresh = np.asarray(s.fresh)[starts[:5]].tolist()
    assert fresh == [False, False, True, False, True]
    assert np.asarray(s.latest).tolist() == [5, 28, 4, 37, 26, -1]     # slots 0..4, scratch
    chunks = [0, 4, 5, 6, 10, 14, 18, 22, 26, 27, 29, 33, 37]
    assert int(s.num_chunks) == len(chunks)
    assert np.asarray(s.chunk_starts)[:len(chunks)].tolist() == chunks


@pytest.mark.parametrize("chunk", [4, 32])
def test_chunked_xla_equals_the_scan(chunk):
    """Chunks of 4 (several per segment, partial and one-token last ones) and of 32 (the
    default: one per segment here)."""
    args, real = batch()
    want = scanned()
    got = ragged_gated_delta(*args, real=jnp.asarray(real), chunk=chunk)
    assert max_gap(want, got, real) < 1e-5
    assert np.all(np.asarray(got[0])[~real] == 0)                    # padding: zero outputs
    # the scratch row is left as it was (the scan lets padding write it)
    assert np.array_equal(np.asarray(got[2][SCRATCH]), np.asarray(args[7][SCRATCH]))
    # every slot was written, and the stored states mattered
    assert np.abs(np.asarray(got[2][:SCRATCH] - args[7][:SCRATCH])).max(axis=(1, 2, 3)).min() > 0.01
    zero = ragged_gated_delta(*args[:6], jnp.zeros_like(args[6]), jnp.zeros_like(args[7]),
                              *HEADS, real=jnp.asarray(real), chunk=chunk)
    assert np.abs(np.asarray(zero[0] - got[0])[:6]).max() > 0.01


def test_chunked_pallas_equals_the_scan():
    args, real = batch()
    want = scanned()
    got = ragged_gated_delta(*args, real=jnp.asarray(real), prefill="pallas", chunk=8,
                             interpret=True)
    assert max_gap(want, got, real) < 1e-5


def test_resets_in_one_slot_without_slots():
    """A metadata without slots: every token in the scratch slot, two prompts one after the
    other (the second resets mid-batch), no padding; the scratch row ends as the scan's."""
    args, real = batch(((SCRATCH, 0, 13), (SCRATCH, 0, 6)), seed=2)
    want = ragged_gated_delta(*args, prefill="scan")
    got = ragged_gated_delta(*args, chunk=8)
    assert max_gap(want, got, real, rows=SCRATCH + 1) < 1e-5


def test_bad_prefill_settings_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        chunk_function("xla", 12)
    with pytest.raises(ValueError, match="'xla' or 'pallas'"):
        chunk_function("triton", 16)



def test_the_backend_picks_the_chunk():
    from jaxpaged.layers.attention.pallas import PallasAttentionBackend
    from jaxpaged.layers.attention.xla import XlaAttentionBackend
    assert prefill_kernel(XlaAttentionBackend()) == ("xla", None)
    assert prefill_kernel(None) == ("xla", None)
    assert prefill_kernel(PallasAttentionBackend(interpret=True)) == ("pallas", True)
