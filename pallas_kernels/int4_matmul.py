"""``x @ W`` with W in AutoAWQ's packed 4-bit layout, dequantized tile by tile (Pallas).

``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]`` with ``q`` and ``z`` packed eight per
int32 along the output axis in AWQ's order (``jaxpaged.layers.awq``). One program computes a
``[block_m, block_n]`` tile of the output: it walks the input axis one group (``G`` rows) at a
time, loads the group's ``[G, block_n / 8]`` packed weights, its ``[1, block_n / 8]`` packed
zeros and ``[1, block_n]`` scales, unpacks them in registers (shift and mask: nibble ``i`` of
packed column c is output column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``, so output column
``8c + j`` sits at shift ``4 * (j // 2) + 16 * (j % 2)``), dequantizes to the activations'
dtype and accumulates ``x_tile @ w_tile`` in float32 (the structure of vLLM's ``awq_triton.py``
GEMM; the full float weights never exist in memory).

Lowering: Triton (``pallas_kernels/lowering.py``); interpret mode on CPU, where
``jaxpaged.layers.awq.AWQLinear`` uses XLA instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lowering import pallas_call_options


def _unpack(packed: jax.Array) -> jax.Array:
    """[r, c] int32 -> [r, 8c] int32 nibbles in natural column order."""
    j = lax.broadcasted_iota(jnp.int32, (1, 1, 8), 2)
    shifts = 4 * (j // 2) + 16 * (j % 2)
    values = (packed[:, :, None] >> shifts) & 0xF
    return values.reshape(packed.shape[0], packed.shape[1] * 8)


def _kernel(x_ref, qw_ref, qz_ref, s_ref, o_ref, *, group: int):
    k_groups = qz_ref.shape[0]

    def step(g, acc):
        x = x_ref[:, pl.ds(g * group, group)]
        q = _unpack(qw_ref[pl.ds(g * group, group), :])
        z = _unpack(qz_ref[pl.ds(g, 1), :])
        s = s_ref[pl.ds(g, 1), :].astype(jnp.float32)
        w = ((q - z).astype(jnp.float32) * s).astype(x.dtype)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k_groups, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def int4_matmul(x: jax.Array, qweight: jax.Array, qzeros: jax.Array, scales: jax.Array, *,
                block_m: int = 16, block_n: int = 128,
                interpret: bool | None = None) -> jax.Array:
    """``x @ dequantize_awq(qweight, qzeros, scales)`` in ``x``'s dtype.

    Args:
        x: [M, K] activations (bfloat16 or float32); M is padded to ``block_m`` inside.
        qweight: [K, N / 8] int32, AWQ-packed 4-bit weights.
        qzeros: [K / G, N / 8] int32, AWQ-packed 4-bit zero points (G: the group size, a power
            of two, at least 16).
        scales: [K / G, N] float scales.
        block_m, block_n: output tile (powers of two; ``block_n`` divides N, at least 16 each
            for Triton's ``dot``).
        interpret: force interpret mode (default: on unless running on a GPU).

    Returns:
        [M, N] of ``x.dtype``; accumulation in float32.

    Raises:
        ValueError: shapes that do not fit the layout or the tiles.
    """
    m, k = x.shape
    n = scales.shape[1]
    group = k // qzeros.shape[0]
    if (qweight.shape != (k, n // 8) or qzeros.shape[1] != n // 8 or group * qzeros.shape[0] != k
            or n % block_n or group & (group - 1) or group < 16):
        raise ValueError(f"int4_matmul: x {x.shape}, qweight {qweight.shape}, qzeros "
                         f"{qzeros.shape}, scales {scales.shape}, block_n {block_n}")
    padded = -(-m // block_m) * block_m
    x_p = jnp.pad(x, ((0, padded - m), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, group=group),
        grid=(padded // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, block_n // 8), lambda i, j: (0, j)),
                  pl.BlockSpec((k // group, block_n // 8), lambda i, j: (0, j)),
                  pl.BlockSpec((k // group, block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype),
        **pallas_call_options(num_warps=4, num_stages=2, interpret=interpret),
    )(x_p, qweight, qzeros, scales)
    return out[:m]
