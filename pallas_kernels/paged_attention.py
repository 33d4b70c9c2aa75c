"""Paged decode attention v2 in Pallas: one query token per sequence, split-K, tiles in flight.

Work decomposition (Flash-Decoding, Dao et al. 2023 "Flash-Decoding for long-context
inference"; vLLM's paged attention v2 partitions the same way). A program handles one
(decode sequence, KV head, split): its rows are the ``G`` query heads sharing the KV head
(GQA), padded to ``R = max(16, G)`` rows in registers for the tensor-core dot but loaded and
stored as the ``G`` real rows. It walks its share of the sequence's 32-key tiles with the
prefetching loop of :mod:`pallas_kernels.attention_tiles` (``num_warps`` 4, 2 over an fp8
pool, ``num_stages`` 3), so one tile's K/V copies are in flight while the previous tile is
computed.

Split-K. The grid has ``S`` split slots per (sequence, KV head), ``S`` fixed by the bucket
(enough for about twice the programs that fit on the GPU when the bucket's sequences are
all present, more than 16 at batch 1). How many slots a sequence uses is decided inside the
kernel from the real work: the decode KV tokens summed over the step's sequences
(``kv_tokens``, from the host) give the tiles per program that make the launch about
:data:`TARGET_PROGRAMS` programs (:data:`NUM_SMS` x :data:`PROGRAMS_PER_SM`, the residency
``jaxpaged.benchmarks.kernels.schedule_check`` verifies), and each sequence gets
``ceil(its tiles / that)`` splits. A batch of 33 long sequences therefore runs two splits
each (no cliff between 32 and 48 sequences), a single long sequence up to 64. Unused slots
exit at once. Each split writes its normalised partial output and log-sum-exp for the real
rows only; one small Pallas
program per (sequence, KV head) merges them (:func:`merge_splits`), :data:`MERGE_SLOTS` slots
an iteration so that their loads are in flight together (vLLM's ``reduce_segments`` loads all
segments at once; one slot an iteration paid an L2 round trip each: on sm_90, Triton 3.9, 62
SASS instructions a slot and no load ahead of its use; 8 at once, 41 a slot, 56 registers).

fp8 pools and scales are handled as in v1 (``pallas_kernels.kv_quant``): tiles converted to
q's dtype as loaded (float16 for a bf16 q, through 32-bit words: ``pallas_kernels.fp8_words``),
``k_scale`` folded into the softmax scale, ``v_scale`` into the output.
Lowering: Triton (``pallas_kernels/lowering.py``); interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.attention_tiles import (attend_tiles, first_visible_tile, group_size,
                                             next_pow2)
from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.lowering import pallas_call_options

#: Keys per KV tile of the decode loop (independent of page_size).
DECODE_TILE = 32
#: Streaming multiprocessors of an H100 SXM / H200.
NUM_SMS = 132
#: Decode programs resident per SM (checked on the compiled kernel by the schedule check).
PROGRAMS_PER_SM = 4
#: Programs a decode launch aims for.
TARGET_PROGRAMS = NUM_SMS * PROGRAMS_PER_SM
#: A split covers at least this many tiles (256 keys): each split pays its program's start
#: (the page-table walk before the first tile lands) and a slot of the merge (issue 41).
MIN_TILES_PER_SPLIT = 8
#: Upper bound of the split slots of a launch.
MAX_SPLITS = 128
DECODE_WARPS, DECODE_STAGES = 4, 3
#: Warps of a decode program over an fp8 pool. Its loop (tiles widened through 32-bit words,
#: ``pallas_kernels.fp8_words``) is bound by shared memory, much of it every warp re-reading
#: q each tile; with 2 warps a tile costs 2 x 421 warp instructions and 2 x 244 wavefronts
#: against 4 x 270 and 4 x 146 with 4, at 128 registers and 6 programs an SM instead of 4
#: (sm_90, Triton 3.9): 1.83x bf16 on paper instead of 1.53x
#: (``jaxpaged.benchmarks.kernels.decode_paper_model``).
DECODE_WARPS_FP8 = 2
#: Split slots the merge reads per loop iteration (their loads in flight together).
MERGE_SLOTS = 8


def decode_warps(kv_dtype) -> int:
    """Warps of a decode program over a pool of ``kv_dtype``."""
    return DECODE_WARPS_FP8 if is_fp8(kv_dtype) else DECODE_WARPS


def max_splits(num_seqs: int, num_kv_heads: int, max_pages: int, page_size: int) -> int:
    """Split slots per (sequence, KV head) for a bucket of ``num_seqs`` sequences of up to
    ``max_pages`` pages: enough for 2 x :data:`TARGET_PROGRAMS` programs, no more than
    the longest sequence's tiles allow at :data:`MIN_TILES_PER_SPLIT` a split."""
    want = -(-2 * TARGET_PROGRAMS // (num_seqs * num_kv_heads))
    tiles = -(-max_pages * page_size // DECODE_TILE)
    return max(1, min(want, -(-tiles // MIN_TILES_PER_SPLIT), MAX_SPLITS))


def split_range(first_tile, num_tiles, kv_tokens, split, *, num_kv_heads: int,
                num_slots: int):
    """Tile range ``[start, end)`` of split ``split`` of a sequence (int32 scalars, jnp).

    ``num_tiles`` tiles from ``first_tile``; ``kv_tokens`` is the decode KV tokens summed over
    the launch. Tiles per split: ``max(MIN_TILES_PER_SPLIT, ceil(total tiles * KVH /
    TARGET_PROGRAMS))``; the sequence uses ``ceil(num_tiles / that)`` of its ``num_slots``
    slots (capped), the rest get an empty range.
    """
    total_tiles = (kv_tokens + DECODE_TILE - 1) // DECODE_TILE
    per_program = jnp.maximum(MIN_TILES_PER_SPLIT,
                              (total_tiles * num_kv_heads + TARGET_PROGRAMS - 1)
                              // TARGET_PROGRAMS)
    used = jnp.clip((num_tiles + per_program - 1) // per_program, 1, num_slots)
    per_split = (num_tiles + used - 1) // used
    start = first_tile + split * per_split
    end = jnp.minimum(start + per_split, first_tile + num_tiles)
    return start, jnp.maximum(end, start)


def _rows(base, group, rows):
    """Row indices ``base + min(r, group - 1)`` for r < rows, and the mask r < group."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    return base + jnp.minimum(r, group - 1), r < group


def _decode_kernel(q_ref, seq_ref, pos_ref, kv_tokens_ref, page_table_ref, k_ref, v_ref,
                   *refs, num_kv_heads, group, rows, page_size, scale, sliding_window,
                   soft_cap, v_scale, num_slots, has_sinks):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sinks_ref, out_refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    q_rows, _ = _rows((b * num_kv_heads + h) * group, group, rows)
    q = q_ref[q_rows, :]                                       # [R, D]; rows >= G repeat
    pos = pos_ref[b]
    seq = seq_ref[b]
    first = first_visible_tile(pos, sliding_window, DECODE_TILE)
    num_tiles = jnp.where(pos >= 0, pos // DECODE_TILE + 1 - first, 0)
    start, end = split_range(first, num_tiles, kv_tokens_ref[0], split,
                             num_kv_heads=num_kv_heads, num_slots=num_slots)
    sinks = None
    if has_sinks:            # the first split holds the sink (merged once, as a key)
        heads, _ = _rows(h * group, group, rows)
        sinks = jnp.where(split == 0, sinks_ref[heads], -jnp.inf)
    acc, m, l = attend_tiles(q, jnp.full((rows,), pos, jnp.int32), seq, h, start, end,
                             page_table_ref, k_ref, v_ref, tile=DECODE_TILE,
                             page_size=page_size, scale=scale,
                             sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    if v_scale != 1.0:       # split partials too: their merge is a convex combination
        out = out * v_scale
    out_row = ((b * num_kv_heads + h) * num_slots + split) * group
    _, mask = _rows(out_row, group, rows)
    o_ref = out_refs[0]
    plt.store(o_ref.at[pl.ds(out_row, rows), :], out.astype(o_ref.dtype), mask=mask[:, None])
    if num_slots > 1:
        # (base 2, as m: attention_tiles)
        lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(jnp.where(l == 0.0, 1.0, l)))
        plt.store(out_refs[1].at[pl.ds(out_row, rows)], lse, mask=mask)


def _merge_kernel(o_ref, lse_ref, out_ref, *, group, rows, num_slots):
    n = pl.program_id(0)
    _, mask = _rows(0, group, rows)

    def body(i, carry):
        # MERGE_SLOTS slots an iteration: their loads do not wait on one another (one L2
        # round trip for all of them), and the running output is rescaled once.
        acc, m, den = carry
        parts = []
        for u in range(MERGE_SLOTS):
            s = i * MERGE_SLOTS + u
            row = (n * num_slots + s) * group
            live = mask & (s < num_slots)
            parts.append((plt.load(lse_ref.at[pl.ds(row, rows)], mask=live, other=-jnp.inf),
                          plt.load(o_ref.at[pl.ds(row, rows), :], mask=live[:, None],
                                   other=0.0)))
        m_new = functools.reduce(jnp.maximum, [lse for lse, _ in parts], m)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        acc, den = alpha[:, None] * acc, alpha * den
        for lse, o in parts:
            w = jnp.exp2(lse - m_safe)
            acc, den = acc + w[:, None] * o, den + w
        return acc, m_new, den

    init = (jnp.zeros((rows, o_ref.shape[1]), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, _, den = jax.lax.fori_loop(0, -(-num_slots // MERGE_SLOTS), body, init)
    out = acc / jnp.where(den == 0.0, 1.0, den)[:, None]
    plt.store(out_ref.at[pl.ds(n * group, rows), :], out.astype(out_ref.dtype),
              mask=mask[:, None])


def merge_splits(o: jax.Array, lse: jax.Array, *, num_programs: int, group: int,
                 num_slots: int, dtype, interpret: bool | None) -> jax.Array:
    """Merge split partials with log-sum-exp weights in one Pallas launch.

    Args:
        o: [num_programs * num_slots * group + R, D] float32 normalised partial outputs;
        lse: [same rows] float32 their log-sum-exp in base 2 (-inf for an empty split); row
            ``(n * num_slots + s) * group + g`` is program ``n``'s split ``s``, head ``g``.

    Returns:
        [num_programs * group + R, D] in ``dtype`` (the last R rows are padding).
    """
    rows = max(16, next_pow2(group))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_merge_kernel, group=group, rows=rows, num_slots=num_slots)
    return pl.pallas_call(
        kernel, grid=(num_programs,), in_specs=[whole, whole], out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_programs * group + rows, o.shape[1]), dtype),
        name="paged_decode_merge",
        **pallas_call_options(num_warps=4, num_stages=2, interpret=interpret),
    )(o, lse)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "k_scale",
                                             "v_scale", "num_slots", "interpret"))
def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, decode_seq: jax.Array,
                           decode_positions: jax.Array, kv_tokens: jax.Array, *,
                           scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, num_slots: int | None = None,
                           interpret: bool | None = None,
                           sinks: jax.Array | None = None) -> jax.Array:
    """Paged attention of one query token per decode sequence (v2 decode kernel).

    Args:
        q: [ND, num_heads, D] float32 or bfloat16, one token per decode; D a power of two.
        k_pages, v_pages: [num_pages, page_size, KVH, D], q's dtype or float8_e4m3fn;
            any page_size (16..128 in production).
        page_table: [B, P] int32; decode_seq: [ND] int32 each decode's page-table row;
        decode_positions: [ND] int32 its query position (-1 = padding; such rows are zero).
        kv_tokens: [1] int32, the sum of ``positions + 1`` over the real decodes (sizes the
            split-K; any value gives the same result).
        scale, sliding_window, soft_cap, k_scale, v_scale: as in
            ``pallas_kernels.reference.paged_attention_reference``.
        num_slots: split slots per (sequence, KV head); None: :func:`max_splits`.
        interpret: force interpret mode (default: on unless running on a GPU).
        sinks: [num_heads] float32 attention-sink logits (gpt-oss), or None: split 0 of each
            (decode, KV head) starts its softmax at the sink (``attention_tiles.attend_tiles``),
            so the merge counts it once.

    Returns:
        [ND, num_heads, D] in q's dtype.

    Raises:
        ValueError: head counts that do not divide, or pools neither in q's dtype nor fp8.
    """
    nd, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = group_size(num_heads, k_pages, v_pages, q.dtype)
    rows = max(16, next_pow2(group))
    if num_slots is None:
        num_slots = max_splits(nd, num_kv_heads, page_table.shape[1], page_size)
    flat = lambda p: p.reshape(num_pages * page_size, num_kv_heads, head_dim)
    out_rows = nd * num_kv_heads * num_slots * group + rows
    out_dtype = q.dtype if num_slots == 1 else jnp.float32
    out_shape = [jax.ShapeDtypeStruct((out_rows, head_dim), out_dtype)]
    if num_slots > 1:
        out_shape.append(jax.ShapeDtypeStruct((out_rows,), jnp.float32))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _decode_kernel, num_kv_heads=num_kv_heads, group=group, rows=rows, page_size=page_size, scale=scale * k_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, v_scale=v_scale,
        num_slots=num_slots, has_sinks=sinks is not None)
    extra = () if sinks is None else (sinks.astype(jnp.float32),)
    outs = pl.pallas_call(
        kernel, grid=(nd, num_kv_heads, num_slots), in_specs=[whole] * (7 + len(extra)),
        out_specs=[whole] * len(out_shape), out_shape=out_shape,
        name="paged_decode_attention",
        **pallas_call_options(num_warps=decode_warps(k_pages.dtype),
                              num_stages=DECODE_STAGES, interpret=interpret),
    )(q.reshape(nd * num_heads, head_dim), decode_seq, decode_positions, kv_tokens,
      page_table, flat(k_pages), flat(v_pages), *extra)
    out = outs[0]
    if num_slots > 1:
        out = merge_splits(*outs, num_programs=nd * num_kv_heads, group=group,
                           num_slots=num_slots, dtype=q.dtype, interpret=interpret)
    return out[:nd * num_heads].reshape(nd, num_heads, head_dim)
