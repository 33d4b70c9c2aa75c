"""Float32 projections of few rows through the C++ small-rows matmul (XLA FFI) on the CPU.

A decode step multiplies every weight by as many rows as it has sequences (64 for W1), and
XLA:CPU's dot then spends about as long repacking the weight as multiplying, so few rows run
well below the machine's matmul peak. ``csrc/small_rows_matmul.cc`` reads the ``[out, in]``
weight where it lies and keeps the rows (transposed by XLA, in the fusion that produces them)
in cache, and is faster than XLA's dot on W1's 64-row shapes (``docs/measurements.md``,
"CPU matmul"; ``docs/benchmarks.md``, "Small-row matmuls").

The runner turns it on while tracing a forward step (:func:`small_rows_matmuls`) when
:func:`wanted`: the model runs on one CPU device with AVX-512 and the ``cpu`` attention
backend (so ``--attention-backend xla`` keeps the all-XLA numerical oracle, and sharded
weights stay with XLA's partitioner); :class:`~jaxpaged.layers.linear.Linear` then sends
float32 products of
:data:`MIN_ROWS`..:data:`MAX_ROWS` rows here. Results equal XLA's to float32 rounding (each
output a float32 sum of fused multiply-adds in order of ``k``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.cpu_build import SMALL_ROWS_MATMUL_TARGET, cpu_flags, load_cpu_kernels

#: Row counts the kernel takes: outside them XLA's dot was as fast or faster on W1's shapes
#: (``docs/measurements.md``, "CPU matmul").
MIN_ROWS, MAX_ROWS = 16, 128
#: The kernel's rows come in vectors of this many (the transposed input is padded to them).
_LANES = 16

_ENABLED: contextvars.ContextVar = contextvars.ContextVar("small_rows_matmuls", default=False)


@contextlib.contextmanager
def small_rows_matmuls(enabled: bool):
    """While tracing inside this context, float32 :class:`~jaxpaged.layers.linear.Linear`
    calls of :data:`MIN_ROWS`..:data:`MAX_ROWS` rows use :func:`small_rows_matmul` when
    ``enabled`` (the caller asks :func:`wanted`)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def applies(rows: int, dtype) -> bool:
    """Whether a product of ``rows`` rows in ``dtype`` traced now goes to the kernel."""
    return _ENABLED.get() and MIN_ROWS <= rows <= MAX_ROWS and jnp.dtype(dtype) == jnp.float32


def small_rows_matmul(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x . weight^T`` by the C++ kernel (its FFI target registered: :func:`available`).

    Args:
        x: [..., K] float32, at most a few hundred rows in all (any count works).
        weight: [N, K] float32 (torch's ``[out, in]`` layout).

    Returns:
        [..., N] float32.
    """
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    padded = -(-rows // _LANES) * _LANES
    xt = jnp.pad(x.reshape(rows, k), ((0, padded - rows), (0, 0))).T      # [K, Mp]
    y = jax.ffi.ffi_call(SMALL_ROWS_MATMUL_TARGET,
                         jax.ShapeDtypeStruct((rows, weight.shape[0]), jnp.float32))(xt, weight)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True on a CPU with AVX-512 when the kernel builds and matches float64 on a small product
    of odd widths (relative error <= 1e-5); never raises (a failure is logged once by the
    build).

    AVX-512 because the register blocks hold 24-28 vectors of 16 floats: the 32 registers of
    AVX-512, where the kernel was measured; with AVX2's 16 registers of 8 floats they would
    spill, so there XLA's dot is kept."""
    return (jax.default_backend() == "cpu" and "avx512f" in cpu_flags().split()
            and load_cpu_kernels() and _self_check() <= 1e-5)


def wanted(attention_backend: str, num_devices: int) -> bool:
    """Whether a model with the attention backend named ``attention_backend`` on
    ``num_devices`` devices should trace its forward inside :func:`small_rows_matmuls`: the
    ``cpu`` backend on one device, where the kernel is :func:`available`."""
    return attention_backend == "cpu" and num_devices == 1 and available()


def _self_check() -> float:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(37, 45)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(53, 45)), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(jax.jit(small_rows_matmul)(x, w), np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())
