"""Paged prefill attention v2 in Pallas: query blocks of prefill chunks, launched apart from
the decodes.

A program handles one (query block, KV head): ``Bq`` consecutive prefill tokens of one
sequence (32 in the engine) times the ``G`` query heads sharing the KV head, so
``32 x G`` rows (128 for Llama-3-8B's G = 4) against each KV tile: a matrix-matrix dot that
keeps the tensor cores busy (FlashAttention-2, Dao 2023, algorithm 1 and section 3.2: one
program per query block, K/V tiles streamed through shared memory). The tiles are 64 keys
for up to 128 rows and 32 keys above that (register budget), walked with the prefetching loop
of :mod:`pallas_kernels.attention_tiles`; ``num_warps`` 4 up to 64 rows, 8 at 128, 16 above
(:func:`prefill_launch`), and ``num_stages`` 3. Only tiles holding keys some row can see are visited (up to the block's
last position; from the first inside the sliding window). No split-K: a prefill step has
enough query blocks to fill the GPU.

Because decodes run in their own launch (:mod:`pallas_kernels.paged_attention`), a mixed
step costs about a decode-only step plus this launch; decodes do not pay a prefill block's
rows and registers. fp8 pools and scales as in the decode kernel.
Lowering: Triton (``pallas_kernels/lowering.py``); interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention_tiles import (attend_tiles, first_visible_tile, group_size,
                                             next_pow2)
from pallas_kernels.lowering import pallas_call_options

PREFILL_STAGES = 3


#: The most query rows (block tokens x G) one prefill program holds: 128 rows with 64-key
#: tiles and 8 warps take 128 registers a thread on sm_90 without spilling; 256 rows (a
#: 32-token block at Llama-3-70B's G = 8) spilled 144 bytes a thread even at 32-key tiles and
#: 16 warps (``jaxpaged.benchmarks.kernels.schedule_check``).
MAX_PROGRAM_ROWS = 128


def prefill_split(block_q: int, group: int) -> int:
    """How many programs share one query block of ``block_q`` tokens at ``group`` query
    heads a KV head: the fewest (a power of two dividing ``block_q``) whose rows fit
    :data:`MAX_PROGRAM_ROWS` (each reads the block's K/V tiles itself), 1 when one fits."""
    split = 1
    while block_q * group > split * MAX_PROGRAM_ROWS and block_q % (2 * split) == 0:
        split *= 2
    return split


def program_rows(block_q: int, group: int) -> int:
    """The query rows a program of an unsplit ``block_q``-token block holds at ``group``
    query heads a KV head: ``block_q x group`` padded to a power of two, at least 16 (the
    smallest MMA)."""
    return max(16, next_pow2(block_q * group))


def prefill_launch(rows: int) -> tuple[int, int]:
    """(KV tile keys, num_warps) for a program of ``rows`` query rows: 64 keys and 4 warps up
    to 64 rows, 8 warps at 128 rows; 32 keys and 16 warps above (only a block that
    :func:`prefill_split` cannot split: it spills on sm_90)."""
    if rows <= MAX_PROGRAM_ROWS:
        return 64, (8 if rows == MAX_PROGRAM_ROWS else 4)
    return 32, 16


def _prefill_kernel(q_ref, row_pos_ref, block_seq_ref, page_table_ref, k_ref, v_ref, *refs,
                    tile, page_size, scale, sliding_window, soft_cap, v_scale, group):
    n, h = pl.program_id(0), pl.program_id(1)
    sinks_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    row_pos = row_pos_ref[...]                                   # [R], -1 = padding row
    last = jnp.max(row_pos)
    lowest = jnp.min(jnp.where(row_pos >= 0, row_pos, jnp.iinfo(jnp.int32).max))
    start = jnp.where(last >= 0, first_visible_tile(lowest, sliding_window, tile), 0)
    end = jnp.maximum((last + tile) // tile, start)              # no tile for padding blocks
    sinks = None
    if sinks_ref is not None:         # row r: query r // G, head h * G + r % G
        r = jax.lax.broadcasted_iota(jnp.int32, row_pos.shape, 0)
        sinks = sinks_ref[h * group + r % group]
    acc, _, l = attend_tiles(q_ref[...], row_pos, block_seq_ref[n], h, start, end,
                             page_table_ref, k_ref, v_ref, tile=tile, page_size=page_size,
                             scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                             sinks=sinks)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    if v_scale != 1.0:
        out = out * v_scale
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "k_scale",
                                             "v_scale", "interpret"))
def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_table: jax.Array, block_seq: jax.Array,
                            block_positions: jax.Array, *, scale: float,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            interpret: bool | None = None,
                            sinks: jax.Array | None = None) -> jax.Array:
    """Causal paged attention for prefill query blocks (v2 prefill kernel; same contract as
    ``pallas_kernels.reference.paged_attention_reference``).

    Args:
        q: [NB, Bq, num_heads, D] float32 or bfloat16; D a power of two.
        k_pages, v_pages: [num_pages, page_size, KVH, D], q's dtype or float8_e4m3fn.
        page_table: [B, P] int32; block_seq: [NB] int32; block_positions: [NB, Bq] int32
            (-1 = padding row).
        scale, sliding_window, soft_cap, k_scale, v_scale, sinks: as in the reference (each
            row's softmax starts at its head's sink: ``attention_tiles.attend_tiles``).
        interpret: force interpret mode (default: on unless running on a GPU).

    Returns:
        [NB, Bq, num_heads, D] in q's dtype (padding rows zero).

    Raises:
        ValueError: head counts that do not divide, or pools neither in q's dtype nor fp8.
    """
    nb, block_q, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = group_size(num_heads, k_pages, v_pages, q.dtype)
    split = prefill_split(block_q, group)
    if split > 1:      # query rows are independent: a block's halves give the same rows
        out = paged_prefill_attention(
            q.reshape(nb * split, block_q // split, num_heads, head_dim), k_pages, v_pages,
            page_table, jnp.repeat(block_seq, split),
            block_positions.reshape(nb * split, block_q // split), scale=scale,
            sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
            v_scale=v_scale, interpret=interpret, sinks=sinks)
        return out.reshape(nb, block_q, num_heads, head_dim)
    rows = block_q * group
    rows_padded = program_rows(block_q, group)
    tile, num_warps = prefill_launch(rows_padded)

    # [NB, Bq, KVH*G, D] -> [NB, KVH, Bq*G, D]: row r of a program is query r // G, head r % G.
    qr = q.reshape(nb, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qr = qr.reshape(nb, num_kv_heads, rows, head_dim)
    row_pos = jnp.repeat(block_positions, group, axis=1)
    if rows_padded != rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
        row_pos = jnp.pad(row_pos, ((0, 0), (0, rows_padded - rows)), constant_values=-1)

    whole = pl.BlockSpec(memory_space=pl.ANY)
    block = pl.BlockSpec((None, None, rows_padded, head_dim), lambda n, h: (n, h, 0, 0))
    kernel = functools.partial(_prefill_kernel, tile=tile, page_size=page_size,
                               scale=scale * k_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, v_scale=v_scale, group=group)
    extra = () if sinks is None else (sinks.astype(jnp.float32),)
    flat = lambda p: p.reshape(num_pages * page_size, num_kv_heads, head_dim)
    out = pl.pallas_call(
        kernel, grid=(nb, num_kv_heads),
        in_specs=[block, pl.BlockSpec((None, rows_padded), lambda n, h: (n, 0)),
                  whole, whole, whole, whole] + [whole] * len(extra),
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((nb, num_kv_heads, rows_padded, head_dim), q.dtype),
        name="paged_prefill_attention",
        **pallas_call_options(num_warps=num_warps, num_stages=PREFILL_STAGES,
                              interpret=interpret),
    )(qr, row_pos, block_seq, page_table, flat(k_pages), flat(v_pages), *extra)
    out = out[:, :, :rows].reshape(nb, num_kv_heads, block_q, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(nb, block_q, num_heads, head_dim)
