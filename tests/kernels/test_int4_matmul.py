"""The Pallas int4 x bf16 AWQ matmul: interpret-mode values, and cross-lowering for an H200."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.layers import awq
from jaxpaged.layers.awq import AWQLinear, dequantize_awq, pack_int4
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.lowering import lower_for_cuda


def packed(rng, k, n, group):
    return (pack_int4(rng.integers(0, 16, (k, n))), pack_int4(rng.integers(0, 16, (k // group, n))),
            rng.uniform(0.001, 0.01, (k // group, n)).astype(np.float32))


@pytest.mark.parametrize("m, k, n, group, dtype, tol", [
    (5, 256, 256, 128, jnp.float32, 1e-5),     # M padded to the 16-row tile
    (16, 128, 384, 32, jnp.bfloat16, 2e-2),
])
def test_matches_xla_dequantize_then_matmul(m, k, n, group, dtype, tol):
    rng = np.random.default_rng(0)
    qweight, qzeros, scales = packed(rng, k, n, group)
    x = rng.normal(0, 1, (m, k)).astype(np.float32)
    want = x @ np.asarray(dequantize_awq(qweight, qzeros, scales, xp=np))
    got = int4_matmul(jnp.asarray(x, dtype), qweight, qzeros, scales, interpret=True)
    assert got.shape == (m, n) and got.dtype == dtype
    rel = np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max()
    assert rel < tol


def test_awq_linear_takes_the_kernel_where_it_applies(monkeypatch):
    assert not awq.use_pallas_kernel(256, 32)          # CPU: XLA's dequantize-then-matmul
    layer = AWQLinear(128, 256, False, jnp.float32, 32, nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(0, 1, (2, 3, 128)), jnp.float32)
    xla = layer(x)
    monkeypatch.setattr(awq, "use_pallas_kernel", lambda n, g: True)   # as on a GPU
    pallas = layer(x)
    assert pallas.shape == (2, 3, 256)
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), atol=1e-5)


def test_refuses_shapes_outside_the_layout():
    rng = np.random.default_rng(0)
    qweight, qzeros, scales = packed(rng, 256, 192, 128)
    with pytest.raises(ValueError, match="block_n 128"):
        int4_matmul(jnp.zeros((4, 256)), qweight, qzeros, scales, interpret=True)


@pytest.mark.parametrize("m, k, n", [(16, 4096, 14336), (256, 14336, 4096), (1, 4096, 6144)])
def test_lowers_for_h200_at_llama3_8b_shapes(m, k, n):
    """Llama-3-8B's gate/up (4096 -> 14336), down (14336 -> 4096) and fused q/k/v widths, G 128,
    bf16 activations, float16 scales as AutoAWQ stores them."""
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), jnp.bfloat16), sds((k, n // 8), jnp.int32),
            sds((k // 128, n // 8), jnp.int32), sds((k // 128, n), jnp.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = lower_for_cuda(lambda *a: int4_matmul(*a, interpret=False), *args).as_text()
    assert len(re.findall(r"__gpu\$xla\.gpu\.triton", text)) == 1
    assert "num_warps = 4" in text
