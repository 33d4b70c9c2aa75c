"""Pallas KV-write kernel vs the reference (interpret on CPU, compiled on GPU): exact, in place."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import write_kv
from pallas_kernels.reference import write_kv_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens, num_kv_heads", [(21, 3), (16, 1), (5, 8), (7, 12)])
def test_rows_land_in_their_slots(dtype, num_tokens, num_kv_heads):
    """Whole [KVH, D] rows (KVH a power of two: 1, 8) and per-head stores (3, 12)."""
    rng = np.random.default_rng(num_tokens)
    shape = (12, 16, num_kv_heads, 8)
    k_pages = jnp.asarray(rng.normal(size=shape), dtype)
    v_pages = jnp.asarray(rng.normal(size=shape), dtype)
    k = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, 8)), jnp.float32)
    slots = jnp.asarray(rng.permutation(12 * 16)[:num_tokens], jnp.int32)
    ref_k, ref_v = (np.asarray(a, np.float32) for a in write_kv_reference(k_pages, v_pages, k, v, slots))
    got_k, got_v = write_kv(k_pages, v_pages, k, v, slots)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), ref_k)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), ref_v)
    assert k_pages.is_deleted() and v_pages.is_deleted()  # donated: updated in place


@pytest.mark.parametrize("num_tokens, num_kv_heads", [(21, 3), (5, 8)])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.05, 0.004)])
def test_fp8_rows_land_quantized_in_their_slots(num_tokens, num_kv_heads, k_scale, v_scale):
    """The kernel stores exactly what the reference stores: k / k_scale in e4m3."""
    rng = np.random.default_rng(num_tokens + 100)
    shape = (12, 16, num_kv_heads, 8)
    pools = [jnp.asarray(rng.normal(size=shape), jnp.float8_e4m3fn) for _ in range(2)]
    k = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, 8)) * 3, jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, 8)) * 0.1, jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(12 * 16)[:num_tokens], jnp.int32)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    ref_k, ref_v = write_kv_reference(*pools, k, v, slots, **scales)
    got_k, got_v = write_kv(*pools, k, v, slots, **scales)
    assert got_k.dtype == got_v.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(ref_v, np.float32))
    assert pools[0].is_deleted() and pools[1].is_deleted()


@pytest.mark.parametrize("write", [write_kv, write_kv_reference])
@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_fp8_round_trip_error_bound(write, scale):
    """Write, then read back ``stored * scale``: within 2**-4 relative for e4m3 normals
    (|x| >= 2**-6 scale), 2**-10 scale absolute for subnormals; beyond 448 scale the value
    saturates to ±448 scale; infinities too; never NaN. The bound is reached (a 3-bit mantissa)."""
    rng = np.random.default_rng(int(scale * 100))
    n = 512
    magnitude = scale * 2.0 ** rng.uniform(-12, 10, size=(n, 1, 16))     # 2**-12 .. 2**10 (x scale)
    x = magnitude * rng.choice([-1.0, 1.0], size=magnitude.shape)
    x[:4, 0, 0] = [np.inf, -np.inf, 1e30, -1e30]
    pool = lambda: jnp.zeros((n // 16 + 1, 16, 1, 16), jnp.float8_e4m3fn)
    slots = jnp.arange(16, n + 16, dtype=jnp.int32)                  # pages 1.., not the null page
    rows = jnp.asarray(x, jnp.float32)
    k_pages, _ = write(pool(), pool(), rows, rows, slots, k_scale=scale, v_scale=scale)
    stored = np.asarray(k_pages, np.float64)[1:].reshape(x.shape)
    assert np.isfinite(stored).all()                                  # no NaN, no infinity
    saturated = np.abs(x) > 448.0 * scale
    np.testing.assert_array_equal(stored[saturated], np.sign(x[saturated]) * 448.0)
    back = stored * np.float64(np.float32(scale))
    normal = ~saturated & (np.abs(x) >= 2.0 ** -6 * scale)
    rel = np.abs(back - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0 ** -4
    assert rel.max() > 0.05                        # a 3-bit mantissa, not a wider format
    subnormal = np.abs(x) < 2.0 ** -6 * scale
    assert np.abs(back - x)[subnormal].max() <= 2.0 ** -10 * scale * (1 + 1e-6)
