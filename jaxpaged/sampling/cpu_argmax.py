"""A greedy step's tokens on the CPU: the argmax of the real logit rows only (XLA FFI).

The forward step's logits are padded to a row bucket (at least 8 rows), and XLA's reductions
read every row, padding included (``docs/measurements.md``, "Sampling on XLA:CPU"). The C++
kernel
(``jaxpaged/layers/csrc/argmax_rows.cc``) reads only the step's ``rows`` real rows and gives
each the same id as :func:`argmax_first` (the first index of the largest value, NaN counting
as the largest); padding rows get 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.layers.cpu_build import ARGMAX_ROWS_TARGET, load_cpu_kernels


def argmax_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    """Each real row's argmax (the FFI target registered: :func:`wanted`).

    Args:
        logits: [B, V] float32.
        rows: [] int32, how many leading rows are real (clamped to [0, B]).

    Returns:
        [B] int32: row ``r < rows`` its first index of the largest value (or of its first
        NaN), 0 for the padding rows.
    """
    return jax.ffi.ffi_call(ARGMAX_ROWS_TARGET,
                            jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))(
        logits.astype(jnp.float32), jnp.asarray(rows, jnp.int32))


def wanted(attention_backend: str, num_devices: int) -> bool:
    """Whether a forward step of a model with the attention backend named
    ``attention_backend`` on ``num_devices`` devices takes its greedy tokens from
    :func:`argmax_rows`: the ``cpu`` backend (whose C++ library holds the kernel) on one
    device."""
    return attention_backend == "cpu" and num_devices == 1 and load_cpu_kernels()
