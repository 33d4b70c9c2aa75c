"""Weight-only quantization (``--quantization int8|fp8``): the quantizer, the layer, the
bundled model's agreement with its float32 reference, tensor parallelism, fp8 checkpoints."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxpaged.layers.linear import linear
from jaxpaged.layers.quantization import QuantizedLinear, per_channel_scale, quantize_weight


def _weight(seed=0, shape=(48, 24)):
    """A kernel whose channels span four orders of magnitude, with one all-zero channel."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.logspace(-3, 1, shape[1], dtype=np.float32)
    w[:, 5] = 0.0
    return w


def _dequantize(kernel, scale):
    return np.asarray(kernel).astype(np.float32) * np.asarray(scale)


def test_int8_error_at_most_half_a_step_per_channel():
    w = _weight()
    q, scale = quantize_weight(w, "int8")
    assert q.dtype == np.int8 and q.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == (w.shape[1],)
    np.testing.assert_allclose(scale[w.any(0)], np.abs(w).max(0)[w.any(0)] / 127, rtol=1e-6)
    assert np.abs(q).max() == 127 and q.min() >= -127
    err = np.abs(_dequantize(q, scale) - w)
    assert (err <= scale / 2 * (1 + 1e-5)).all()
    assert (err.max(0) >= scale / 8).sum() > 20      # real rounding happened in most channels


def test_fp8_error_within_e4m3_rounding_per_channel():
    w = _weight(1)
    q, scale = quantize_weight(w, "fp8")
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (w.shape[1],)
    np.testing.assert_allclose(scale[w.any(0)], np.abs(w).max(0)[w.any(0)] / 448, rtol=1e-6)
    assert np.abs(q.astype(np.float32)).max() == 448
    err = np.abs(_dequantize(q, scale) - w)
    # Half a unit in the last place: 2**-4 of the value (3 mantissa bits), 2**-10 * scale in
    # E4M3's subnormal range.
    bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
    assert (err <= bound).all()
    assert err.max() > 0


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_zero_channel_and_numpy_jax_agree(method):
    w = _weight(2)
    q, scale = quantize_weight(w, method)
    assert np.isfinite(scale).all() and scale[5] == 1.0 and not np.asarray(q[:, 5], np.float32).any()
    qj, sj = jax.jit(lambda x: quantize_weight(x, method, xp=jnp))(w)
    np.testing.assert_array_equal(np.asarray(qj), q)
    np.testing.assert_array_equal(np.asarray(sj), scale)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown quantization method 'int4'"):
        quantize_weight(_weight(), "int4")
    with pytest.raises(ValueError, match="unknown quantization method 'int4'"):
        linear(4, 4, False, jnp.float32, nnx.Rngs(0), "int4")


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_linear_equals_float_matmul_with_dequantized_weights(method, dtype):
    layer = linear(48, 24, True, dtype, nnx.Rngs(0), method)
    assert isinstance(layer, QuantizedLinear)
    q, scale = quantize_weight(_weight(3), method)
    bias = np.random.default_rng(4).standard_normal(24).astype(np.float32)
    layer.kernel.set_value(jnp.asarray(q))
    layer.scale.set_value(jnp.asarray(scale))
    layer.bias.set_value(jnp.asarray(bias, dtype))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((7, 48)), dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (7, 24)
    expected = np.asarray(x, np.float32) @ _dequantize(q, scale) + np.asarray(jnp.asarray(bias, dtype), np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), expected,
                               rtol=tol, atol=tol * np.abs(expected).max())


def test_per_channel_scale_layouts():
    np.testing.assert_array_equal(per_channel_scale(np.float32(0.5), 3), [0.5] * 3)
    np.testing.assert_array_equal(per_channel_scale(np.array([0.5]), 3), [0.5] * 3)
    np.testing.assert_array_equal(per_channel_scale(np.array([[1.0], [2.0], [3.0]]), 3), [1, 2, 3])
    with pytest.raises(ValueError, match=r"weight_scale of shape \[2, 2\] is neither"):
        per_channel_scale(np.ones((2, 2)), 3)
