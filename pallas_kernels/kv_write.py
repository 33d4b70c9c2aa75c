"""KV write in Pallas: each new token's K and V rows into its pool slot, in place.

The pools are passed as inputs aliased to the outputs (``input_output_aliases``), so under a
jit that donates them the write touches only the new rows and the pool is never copied.
One program writes ``tokens_per_program`` consecutive tokens; within a token, one store per
KV head (Triton tiles must have power-of-two shapes, and KV head counts such as 12 are not).
Rows are quantized for the pool's dtype on the way in (``pallas_kernels.kv_quant``: divided by
the layer's scale and, for an fp8 pool, saturated to ±448 and rounded to e4m3).

Lowering: Triton (see ``pallas_kernels/lowering.py``); interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels.kv_quant import quantize_kv
from pallas_kernels.lowering import pallas_call_options


def _kernel(slot_ref, k_ref, v_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref, *,
            tokens_per_program, num_tokens, k_scale, v_scale):
    del k_in_ref, v_in_ref  # aliased to the outputs
    first = pl.program_id(0) * tokens_per_program
    page_size, num_kv_heads = k_out_ref.shape[1], k_out_ref.shape[2]

    def body(i, carry):
        t = first + i

        @pl.when(t < num_tokens)
        def _():
            slot = slot_ref[t]
            page, row = slot // page_size, slot % page_size
            for h in range(num_kv_heads):
                k_out_ref[page, row, h, :] = quantize_kv(k_ref[t, h, :], k_scale, k_out_ref.dtype)
                v_out_ref[page, row, h, :] = quantize_kv(v_ref[t, h, :], v_scale, v_out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, tokens_per_program, body, 0)


@functools.partial(jax.jit, static_argnames=("k_scale", "v_scale", "tokens_per_program",
                                             "interpret"),
                   donate_argnames=("k_pages", "v_pages"))
def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, *, k_scale: float = 1.0, v_scale: float = 1.0,
             tokens_per_program: int = 8,
             interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Write new K/V rows into their slots (same contract as
    ``pallas_kernels.reference.write_kv_reference``).

    Args:
        k_pages, v_pages: [num_pages, page_size, KVH, D] pools (donated; D a power of two), in
            the model's dtype or float8_e4m3fn.
        k, v: [T, KVH, D] new rows.
        slot_mapping: [T] int32 flat slots ``page * page_size + row``.
        k_scale, v_scale: the layer's scales; rows are stored as k / k_scale, v / v_scale.
        tokens_per_program: tokens one program writes.
        interpret: force interpret mode (default: on unless running on a GPU).

    Returns:
        The updated ``(k_pages, v_pages)``.
    """
    num_tokens = k.shape[0]
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, tokens_per_program=tokens_per_program,
                               num_tokens=num_tokens, k_scale=k_scale, v_scale=v_scale)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(num_tokens, tokens_per_program),),
        in_specs=[whole] * 5, out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1}, name="kv_write",
        **pallas_call_options(num_warps=1, num_stages=1, interpret=interpret),
    )(slot_mapping, k, v, k_pages, v_pages)
