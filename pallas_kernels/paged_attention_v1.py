"""Ragged paged attention v1 in Pallas: prefill chunks and decodes of many sequences in one launch.

Kept beside v2 (``pallas_kernels.paged_attention``, ``pallas_kernels.prefill_attention``) for
an A/B (``PallasAttentionBackend(kernel="v1")``). Its loop loads each page id in the
iteration that uses it, so Triton cannot pipeline it (one buffer, ``async_wait {num = 0}``:
``jaxpaged.benchmarks.kernels.schedule_check``).

Work decomposition. The caller groups query tokens into *query blocks* (``Bq`` consecutive
tokens of one sequence; ``Bq = 1`` for decode-only steps). One program handles one
(query block, KV head, split): its rows are the block's ``Bq`` tokens times the ``G`` query
heads that share the KV head (GQA), padded to a power of two >= 16 for the tensor-core dot.
It walks the sequence's page table page by page (``fori_loop``), loads the page's
``[page_size, head_dim]`` K and V tiles straight from the pool, and keeps an online softmax
in float32 (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, algorithm 1). Only
pages holding keys some row can see are visited: up to the block's last position (causal),
and from the first position inside the sliding window.

Split-K (flash-decoding, Dao et al. 2023 "Flash-Decoding for long-context inference"): with
few sequences and long contexts the page range is cut into ``num_splits`` parts run by
separate programs; each writes a partial output with its row max and sum, and a small jnp
epilogue merges them with log-sum-exp weights.

fp8 KV cache (``pallas_kernels.kv_quant``): a float8_e4m3fn page tile is converted to q's
dtype as it is loaded (exact: every e4m3 value is a bfloat16 and a float32), so the dots run
in the model's dtype with float32 accumulation as before. The layer's scales are folded in
rather than multiplied into every loaded element (attention is linear in K inside the scores
and in V): ``k_scale`` into the softmax scale (scores are ``q·k_stored * (scale * k_scale)``)
and ``v_scale`` into the normalised output; one multiply per score or output element instead
of one per K/V element per query block.

Lowering: Triton (see ``pallas_kernels/lowering.py`` for why); interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention_tiles import (group_size, next_pow2, online_softmax_step,
                                             softmax_start)
from pallas_kernels.lowering import pallas_call_options

#: Streaming multiprocessors of an H100/H200; the split heuristic aims for two programs each.
_TARGET_PROGRAMS = 2 * 132
#: A split covers at least this many pages.
_MIN_PAGES_PER_SPLIT = 8


def choose_num_splits(num_blocks: int, num_kv_heads: int, max_pages: int) -> int:
    """Split-K factor for a launch: 1 when there are enough programs to fill the GPU,
    otherwise enough splits to reach about two programs per SM, keeping >= 8 pages a split."""
    programs = num_blocks * num_kv_heads
    if programs >= _TARGET_PROGRAMS:
        return 1
    want = next_pow2(-(-_TARGET_PROGRAMS // programs))
    return max(1, min(want, max_pages // _MIN_PAGES_PER_SPLIT, 16))


def _kernel(q_ref, row_pos_ref, block_seq_ref, page_table_ref, k_ref, v_ref, *refs,
            scale, sliding_window, soft_cap, num_splits, v_scale, group, has_sinks):
    n, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sinks_ref, out_refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    q = q_ref[...]                                   # [R, D]
    row_pos = row_pos_ref[...]                       # [R] int32, -1 = padding row
    seq = block_seq_ref[n]
    page_size = k_ref.shape[1]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    num_pages = (jnp.max(row_pos) + page_size) // page_size      # pages up to the last key seen
    first_page = 0
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(row_pos >= 0, row_pos, jnp.iinfo(jnp.int32).max))
        first_page = jnp.maximum(lowest - sliding_window + 1, 0) // page_size
    per_split = (num_pages - first_page + num_splits - 1) // num_splits
    start = first_page + split * per_split
    end = jnp.maximum(jnp.minimum(start + per_split, num_pages), start)

    def body(p, carry):
        acc, m, l = carry
        page = page_table_ref[seq, p]
        k = k_ref[page, :, h, :].astype(q.dtype)     # [S, D] (from fp8: exact)
        v = v_ref[page, :, h, :].astype(q.dtype)
        return online_softmax_step(q, k, v, row_pos, p * page_size, acc, m, l, scale=scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap,
                                   precision=precision)      # scale includes k_scale

    rows, head_dim = q.shape
    sinks = None
    if has_sinks:           # split 0 holds the sink (row r: head h * G + r % G), merged once
        r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
        sinks = jnp.where(split == 0, sinks_ref[h * group + r % group], -jnp.inf)
    acc, m, l = jax.lax.fori_loop(start, end, body, (jnp.zeros((rows, head_dim), jnp.float32),
                                                     *softmax_start(rows, sinks)))
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    if v_scale != 1.0:       # split partials too: their merge is a convex combination
        out = out * v_scale
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = out.astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = out
        m_ref[...] = m
        l_ref[...] = l


def _merge_splits(o, m, l):
    """Merge split partials: o [..., splits, R, D] (each normalised), m (base-2 row maxima,
    ``pallas_kernels.attention_tiles``) and l [..., splits, R]."""
    m_max = jnp.max(m, axis=-2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = l * jnp.exp2(m - m_max)                                   # [..., splits, R]
    total = jnp.sum(w, axis=-2)
    merged = jnp.sum(w[..., None] * o, axis=-3)
    return merged / jnp.where(total == 0.0, 1.0, total)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "k_scale",
                                             "v_scale", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, block_seq: jax.Array, block_positions: jax.Array, *,
                    scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    num_splits: int | None = None,
                    num_warps: int = 4, num_stages: int = 2,
                    interpret: bool | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Causal paged attention for query blocks (same contract as
    ``pallas_kernels.reference.paged_attention_reference``).

    Args:
        q: [NB, Bq, num_heads, D] float32 or bfloat16 queries; D a power of two.
        k_pages, v_pages: [num_pages, page_size, num_kv_heads, D], q's dtype or
            float8_e4m3fn (an fp8 KV cache); page_size a power of two (16..128 in production).
        page_table: [B, P] int32; block_seq: [NB] int32; block_positions: [NB, Bq] int32
            (-1 = padding row).
        scale: score scale; sliding_window, soft_cap: optional (see the reference).
        k_scale, v_scale: the pool holds K / k_scale and V / v_scale (1.0 for a pool in q's
            dtype; the layer's scales for an fp8 pool).
        num_splits: split-K factor; None picks one with :func:`choose_num_splits`.
        num_warps, num_stages: Triton launch parameters.
        interpret: force interpret mode (default: on unless running on a GPU).
        sinks: [num_heads] float32 attention-sink logits (gpt-oss), or None: split 0 of each
            program starts its rows' softmax at their heads' sinks.

    Returns:
        [NB, Bq, num_heads, D] in q's dtype.

    Raises:
        ValueError: head counts that do not divide, or pools neither in q's dtype nor fp8.
    """
    nb, block_q, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = group_size(num_heads, k_pages, v_pages, q.dtype)
    rows = block_q * group
    rows_padded = max(16, next_pow2(rows))
    if num_splits is None:
        num_splits = choose_num_splits(nb, num_kv_heads, page_table.shape[1])

    # [NB, Bq, KVH*G, D] -> [NB, KVH, Bq*G, D]: row r of a program is query r // G, head r % G.
    qr = q.reshape(nb, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qr = qr.reshape(nb, num_kv_heads, rows, head_dim)
    row_pos = jnp.repeat(block_positions, group, axis=1)
    if rows_padded != rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
        row_pos = jnp.pad(row_pos, ((0, 0), (0, rows_padded - rows)), constant_values=-1)

    whole = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [
        pl.BlockSpec((None, None, rows_padded, head_dim), lambda n, h, s: (n, h, 0, 0)),
        pl.BlockSpec((None, rows_padded), lambda n, h, s: (n, 0)),
        whole, whole, whole, whole,
    ] + ([] if sinks is None else [whole])
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((nb, num_kv_heads, rows_padded, head_dim), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, rows_padded, head_dim),
                                  lambda n, h, s: (n, h, 0, 0))]
    else:
        split_shape = (nb, num_kv_heads, num_splits, rows_padded)
        out_shape = [jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, rows_padded, head_dim),
                                  lambda n, h, s: (n, h, s, 0, 0)),
                     pl.BlockSpec((None, None, None, rows_padded), lambda n, h, s: (n, h, s, 0)),
                     pl.BlockSpec((None, None, None, rows_padded), lambda n, h, s: (n, h, s, 0))]
    kernel = functools.partial(_kernel, scale=scale * k_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, num_splits=num_splits, v_scale=v_scale,
                               group=group, has_sinks=sinks is not None)
    outs = pl.pallas_call(
        kernel, grid=(nb, num_kv_heads, num_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, name="ragged_paged_attention",
        **pallas_call_options(num_warps=num_warps, num_stages=num_stages, interpret=interpret),
    )(qr, row_pos, block_seq, page_table, k_pages, v_pages,
      *(() if sinks is None else (sinks.astype(jnp.float32),)))
    out = outs[0] if num_splits == 1 else _merge_splits(*outs).astype(q.dtype)
    out = out[:, :, :rows].reshape(nb, num_kv_heads, block_q, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(nb, block_q, num_heads, head_dim)
