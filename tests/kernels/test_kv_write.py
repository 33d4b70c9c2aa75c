"""Pallas KV-write kernel vs the reference (interpret on CPU, compiled on GPU): exact, in place."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import write_kv
from pallas_kernels.reference import write_kv_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens, num_kv_heads, tokens_per_program", [(21, 3, 8), (16, 1, 4), (5, 8, 8)])
def test_rows_land_in_their_slots(dtype, num_tokens, num_kv_heads, tokens_per_program):
    rng = np.random.default_rng(num_tokens)
    shape = (12, 16, num_kv_heads, 8)
    k_pages = jnp.asarray(rng.normal(size=shape), dtype)
    v_pages = jnp.asarray(rng.normal(size=shape), dtype)
    k = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, 8)), jnp.float32)
    slots = jnp.asarray(rng.permutation(12 * 16)[:num_tokens], jnp.int32)
    ref_k, ref_v = (np.asarray(a, np.float32) for a in write_kv_reference(k_pages, v_pages, k, v, slots))
    got_k, got_v = write_kv(k_pages, v_pages, k, v, slots,
                            tokens_per_program=tokens_per_program)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), ref_k)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), ref_v)
    assert k_pages.is_deleted() and v_pages.is_deleted()  # donated: updated in place
