"""The chunked gated delta rule (``pallas_kernels.deltanet_chunk``): the Pallas kernel (interpret
mode) and its XLA form against the token-by-token recurrence, from a nonzero state, over a
length that is not a multiple of the chunk; and one chunk's Triton lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.deltanet_chunk import (chunk_gated_delta, chunk_gated_delta_xla,
                                           recurrent_gated_delta)


def inputs(length=37, heads=3, dk=16, dv=8, seed=0):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(length, heads, dk))) * dk ** -0.5
    k = unit(rng.normal(size=(length, heads, dk)))
    v = rng.normal(size=(length, heads, dv))
    g = -rng.uniform(0.01, 1.5, (length, heads))          # decays exp(g) in (0.22, 0.99)
    beta = rng.uniform(0.05, 0.95, (length, heads))
    state = rng.normal(size=(heads, dk, dv))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_xla_chunks_match_the_recurrence(chunk):
    args = inputs()
    want_out, want_state = recurrent_gated_delta(*args)
    out, state = chunk_gated_delta_xla(*args, chunk=chunk)
    assert out.shape == want_out.shape == (37, 3, 8)
    assert np.abs(np.asarray(out - want_out)).max() < 2e-5
    assert np.abs(np.asarray(state - want_state)).max() < 2e-5


def test_pallas_kernel_matches_the_recurrence():
    args = inputs()
    want_out, want_state = recurrent_gated_delta(*args)
    out, state = chunk_gated_delta(*args, chunk=16, interpret=True)
    assert np.abs(np.asarray(out - want_out)).max() < 2e-5
    assert np.abs(np.asarray(state - want_state)).max() < 2e-5
    # the state matters: from zeros the outputs differ by far more than the tolerance
    zero = chunk_gated_delta(*args[:5], jnp.zeros_like(args[5]), chunk=16, interpret=True)[0]
    assert np.abs(np.asarray(zero - want_out)).max() > 0.1


def test_split_sequence_carries_the_state():
    """Two calls over halves of the sequence (the second from the first's state) equal one."""
    q, k, v, g, beta, state = inputs()
    want_out, want_state = recurrent_gated_delta(q, k, v, g, beta, state)
    first, mid = chunk_gated_delta(q[:20], k[:20], v[:20], g[:20], beta[:20], state,
                                   chunk=8, interpret=True)
    second, end = chunk_gated_delta(q[20:], k[20:], v[20:], g[20:], beta[20:], mid, chunk=8,
                                    interpret=True)
    assert np.abs(np.asarray(jnp.concatenate([first, second]) - want_out)).max() < 2e-5
    assert np.abs(np.asarray(end - want_state)).max() < 2e-5


def test_chunk_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        chunk_gated_delta_xla(*inputs(length=4), chunk=6)
    with pytest.raises(ValueError, match="power of two"):
        jax.eval_shape(lambda: chunk_gated_delta(*inputs(length=4), chunk=12))


def test_one_chunk_lowers_for_a_gpu():
    """The Pallas kernel over one chunk (as ``jaxpaged.layers.deltanet_segments`` calls it)
    lowers through Triton for an H200 (abstract device; no GPU needed)."""
    from pallas_kernels.lowering import lower_for_cuda
    args = inputs(length=32, heads=2, dk=128, dv=128)
    text = lower_for_cuda(lambda: chunk_gated_delta(*args, chunk=32, interpret=False)).as_text()
    assert "triton" in text
