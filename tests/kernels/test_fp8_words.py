"""``pallas_kernels.fp8_words.widen_e4m3_tile``: fp8 tiles to float16 through 32-bit words.

Every e4m3 bit pattern, in every position of a word, must come out as the float16 a direct
conversion gives (bit for bit; a byte landing in another column would show), in plain jnp
and inside a Pallas kernel in interpret mode (how the decode and prefill kernels run it on
CPU). The compiled form is checked by the schedule test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.fp8_words import widen_e4m3_tile

FP8 = jnp.float8_e4m3fn


def all_patterns(rows, cols, seed):
    """[rows, cols] float8_e4m3fn holding every byte 0..255 (rows * cols >= 256), shuffled,
    so that each word position meets many patterns."""
    rng = np.random.default_rng(seed)
    data = np.resize(rng.permutation(256).astype(np.uint8), rows * cols).reshape(rows, cols)
    return jnp.asarray(data.view(FP8))


def f16_bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


@pytest.mark.parametrize("rows, cols", [(8, 32), (32, 128), (16, 64)])
def test_every_pattern_widens_exactly_in_its_column(rows, cols):
    tile = all_patterns(rows, cols, seed=cols)
    got = widen_e4m3_tile(tile)
    assert got.dtype == jnp.float16 and got.shape == (rows, cols)
    np.testing.assert_array_equal(f16_bits(got), f16_bits(tile.astype(jnp.float16)))
    # the values themselves: 448 is e4m3fn's largest, 2**-9 its smallest subnormal
    values = np.asarray(got, np.float32)
    assert np.nanmax(values) == 448.0 and np.nanmin(np.abs(values)[values != 0]) == 2.0 ** -9


def test_widths_that_are_not_whole_words_convert_directly():
    tile = all_patterns(43, 6, seed=1)
    np.testing.assert_array_equal(f16_bits(widen_e4m3_tile(tile)),
                                  f16_bits(tile.astype(jnp.float16)))


def test_inside_a_pallas_kernel_gathering_rows():
    """As the attention loop uses it: rows gathered by a slot vector from a flat pool ref."""
    pool = all_patterns(64 * 2, 32, seed=7).reshape(64, 2, 32)
    slots = jnp.asarray(np.random.default_rng(3).permutation(64)[:16], jnp.int32)

    def kernel(slots_ref, pool_ref, out_ref):
        out_ref[...] = widen_e4m3_tile(pool_ref[slots_ref[...], 1, :])

    whole = pl.BlockSpec(memory_space=pl.ANY)
    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float16),
                         in_specs=[whole, whole], out_specs=whole, interpret=True)(slots, pool)
    np.testing.assert_array_equal(f16_bits(got), f16_bits(pool[slots, 1].astype(jnp.float16)))
