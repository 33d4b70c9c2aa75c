"""The C++ argmax of a step's real logit rows (``jaxpaged.sampling.cpu_argmax``): the same
ids as ``argmax_first`` (and numpy's argmax) on ties, NaNs, infinities and every remainder of
16 lanes, zeros for padding rows, and which runners use it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.cpu_build import load_cpu_kernels
from jaxpaged.sampling.cpu_argmax import argmax_rows, wanted
from jaxpaged.sampling.sampler import argmax_first

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="needs g++ on the CPU")


def _rows(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12, vocab)).astype(np.float32)
    x[1, [vocab // 3, vocab - 1]] = x[1].max() + 1.0          # a tie: the first wins
    x[2, :] = -np.inf                                          # all -inf: index 0
    x[3, vocab - 1] = np.nan                                   # a NaN counts as the largest
    x[4, [vocab // 2, 1]] = np.nan                             # the first NaN
    x[5, vocab - 1] = np.inf                                   # +inf in the tail
    x[6, :] = 0.0                                              # all equal
    x[7, 0] = x[7].max() + 1.0                                 # the first element
    x[8, vocab - 1] = x[8].max() + 1.0                         # the last (a remainder lane)
    return x


@pytest.mark.parametrize("vocab", [2, 15, 16, 17, 512, 49152, 32003])
def test_ids_equal_argmax_first_and_numpy(vocab):
    x = _rows(vocab, vocab)
    got = np.asarray(jax.jit(argmax_rows)(jnp.asarray(x), np.int32(12)))
    assert got.dtype == np.int32 and got.shape == (12,)
    np.testing.assert_array_equal(got, np.asarray(argmax_first(jnp.asarray(x))))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))   # numpy: NaN first as well
    if vocab > 16:
        assert got[1] == vocab // 3 and got[2] == 0 and got[3] == vocab - 1
        assert got[4] == 1 and got[5] == vocab - 1 and got[7] == 0 and got[8] == vocab - 1


@pytest.mark.parametrize("rows,want_real", [(0, 0), (1, 1), (5, 5), (12, 12), (40, 12),
                                            (-3, 0)])
def test_padding_rows_get_zero(rows, want_real):
    x = _rows(100, 1)
    got = np.asarray(jax.jit(argmax_rows)(jnp.asarray(x), np.int32(rows)))
    np.testing.assert_array_equal(got[:want_real], np.argmax(x, axis=-1)[:want_real])
    assert np.all(got[want_real:] == 0)


def test_many_rows_split_over_the_threads():
    x = np.random.default_rng(7).normal(size=(64, 32000)).astype(np.float32)
    got = np.asarray(jax.jit(argmax_rows)(jnp.asarray(x), np.int32(64)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_cpu_backend_on_one_device_only():
    assert wanted("cpu", 1)
    assert not wanted("xla", 1) and not wanted("cpu", 2)
