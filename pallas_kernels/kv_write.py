"""KV write in Pallas: each new token's K and V rows into its pool slot, in place.

The pools are passed as inputs aliased to the outputs (``input_output_aliases``), so under a
jit that donates them the write touches only the new rows and the pool is never copied.
One program writes one token (vLLM's ``reshape_and_cache`` kernel also runs one thread
block per token): when the KV head count is a power of two, its whole ``[KVH, D]`` K row and
V row are each one store (Triton tiles must have power-of-two shapes); otherwise (e.g. 12
KV heads) one store per KV head. Rows are quantized for the pool's dtype on the way in
(``pallas_kernels.kv_quant``: divided by the layer's scale and, for an fp8 pool, saturated to
±448 and rounded to e4m3). Padding tokens carry slots of the null page and write there.

Lowering: Triton (see ``pallas_kernels/lowering.py``); interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels.kv_quant import quantize_kv
from pallas_kernels.lowering import pallas_call_options


def _kernel(slot_ref, k_ref, v_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref, *, k_scale,
            v_scale):
    del k_in_ref, v_in_ref  # aliased to the outputs
    t = pl.program_id(0)
    page_size, num_kv_heads = k_out_ref.shape[1], k_out_ref.shape[2]
    slot = slot_ref[t]
    page, row = slot // page_size, slot % page_size
    whole_row = num_kv_heads & (num_kv_heads - 1) == 0
    for h in [slice(None)] if whole_row else range(num_kv_heads):
        k_out_ref[page, row, h, :] = quantize_kv(k_ref[t, h, :], k_scale, k_out_ref.dtype)
        v_out_ref[page, row, h, :] = quantize_kv(v_ref[t, h, :], v_scale, v_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("k_scale", "v_scale", "interpret"),
                   donate_argnames=("k_pages", "v_pages"))
def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, *, k_scale: float = 1.0, v_scale: float = 1.0,
             interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Write new K/V rows into their slots (same contract as
    ``pallas_kernels.reference.write_kv_reference``).

    Args:
        k_pages, v_pages: [num_pages, page_size, KVH, D] pools (donated; D a power of two), in
            the model's dtype or float8_e4m3fn.
        k, v: [T, KVH, D] new rows.
        slot_mapping: [T] int32 flat slots ``page * page_size + row``.
        k_scale, v_scale: the layer's scales; rows are stored as k / k_scale, v / v_scale.
        interpret: force interpret mode (default: on unless running on a GPU).

    Returns:
        The updated ``(k_pages, v_pages)``.
    """
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, k_scale=k_scale, v_scale=v_scale)
    return pl.pallas_call(
        kernel, grid=(k.shape[0],), in_specs=[whole] * 5, out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1}, name="kv_write",
        **pallas_call_options(num_warps=1, num_stages=1, interpret=interpret),
    )(slot_mapping, k, v, k_pages, v_pages)
