"""The KV-tile loop shared by the v2 paged-attention kernels (decode and prefill).

One program owns ``R`` query rows of one KV head (GQA: the ``G`` query heads that share it,
for one decode token or a block of prefill tokens) and walks a range of KV *tiles*: ``tile``
consecutive key positions of its sequence, a size chosen for the hardware and independent of
``page_size``. A tile's K and V rows are gathered from the flat ``[num_pages * page_size,
KVH, D]`` view of the pool by a *slot vector* (``page_table[seq, key // page_size] *
page_size + key % page_size`` per key), so a tile may span several pages (page 16, tile 32)
or part of one (page 128, tile 32).

Software pipelining. The slot vector of tile ``i + 1`` is computed in iteration ``i`` and
passed through the ``fori_loop`` carry, so the addresses of the next K/V loads are known
before the current tile's dots. Triton's loop pipeliner can then issue tile ``i + 1``'s copies
into a second shared-memory buffer while tile ``i`` is computed (``num_stages`` buffers, an
``async_wait`` that leaves loads in flight). With the page id loaded inside the iteration
that uses it (v1), every iteration waits for its own page-table load and then for its own
K/V loads. ``jaxpaged.benchmarks.kernels.schedule_check`` verifies the difference on the Triton IR.

Softmax: online, in float32 (Milakov & Gimelshein 2018; FlashAttention-2, Dao 2023,
algorithm 1), the page table as in PagedAttention (Kwon et al., SOSP 2023, section 4.1).
Scores are kept in base-2 units, ``log2(e)`` folded into the score scale, and exponentiated
with ``exp2`` (as FlashAttention-2's and vLLM's Triton kernels do): on the GPU ``exp2`` is
one ``ex2.approx`` where ``exp`` is ~9 instructions an element (issue 41: the compiled
prefill loop ~836 -> ~561 instructions on paper, decode ~14% fewer). The running maxima and
log-sum-exps the kernels pass on are therefore base-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_words import widen_e4m3_tile
from pallas_kernels.kv_quant import check_pool_dtypes

#: log2(e): a score times it, exponentiated in base 2, is its natural exponential.
LOG2E = 1.4426950408889634


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def scores(q, k, precision):
    """[R, D] x [S, D] -> [R, S] float32. Heads narrower than 16 (too small for a
    tensor-core dot, the test sizes) use a broadcast multiply-sum."""
    if q.shape[-1] < 16:
        return jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :],
                       axis=-1)
    return jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)


def weighted_values(p, v, precision):
    """[R, S] float32 x [S, D] -> [R, D] float32 (broadcast multiply-sum for D < 16)."""
    if v.shape[-1] < 16:
        return jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
    return jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)


def group_size(q_heads: int, k_pages, v_pages, q_dtype) -> int:
    """GQA group size ``num_heads // num_kv_heads`` of a launch, after checking the pools.

    Raises:
        ValueError: head counts that do not divide, or pools neither in q's dtype nor fp8.
    """
    num_kv_heads = k_pages.shape[2]
    if q_heads % num_kv_heads:
        raise ValueError(f"num_heads={q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    check_pool_dtypes(q_dtype, k_pages.dtype, v_pages.dtype)
    return q_heads // num_kv_heads


def online_softmax_step(q, k, v, row_pos, first_key, acc, m, l, *, scale: float,
                        sliding_window: int | None, soft_cap: float | None, precision):
    """Fold one KV tile into the running softmax of ``q`` (FlashAttention-2, Dao 2023,
    algorithm 1, lines 8-10).

    Args:
        q: [R, D]; k, v: [S, D] the tile's keys and values in q's dtype; row_pos: [R] int32
            query positions (-1 = padding); first_key: int32 position of the tile's first key.
        acc: [R, D] f32 unnormalised output; m: [R] f32 row max of the scores in base-2
            units (natural-log scores times :data:`LOG2E`); l: [R] f32 row sum.
        scale, sliding_window, soft_cap: as in ``pallas_kernels.reference``.

    Returns:
        The updated ``(acc, m, l)``; keys after a row's position (causal) or outside its
        window contribute nothing.
    """
    s = scores(q, k, precision)                       # [R, S] f32
    if soft_cap is not None:
        s = (soft_cap * LOG2E) * jnp.tanh(s * (scale / soft_cap))
    else:
        s = s * (scale * LOG2E)                       # base-2 units
    key_pos = first_key + jax.lax.broadcasted_iota(jnp.int32, (1, k.shape[0]), 1)
    mask = key_pos <= row_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos > row_pos[:, None] - sliding_window
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    probs = jnp.exp2(s - m_safe[:, None])
    l = alpha * l + jnp.sum(probs, axis=1)
    acc = alpha[:, None] * acc + weighted_values(probs, v, precision)
    return acc, m_new, l


def tile_slots(page_table_ref, seq, tile_index, *, tile: int, page_size: int):
    """[tile] int32 flat pool slots of tile ``tile_index`` of sequence ``seq``.

    Page-table columns past the table's end are clamped to its last column: such keys lie
    beyond the sequence and are masked, so any valid page serves.
    """
    keys = tile_index * tile + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)
    column = jnp.minimum(keys // page_size, page_table_ref.shape[1] - 1)
    return page_table_ref[seq, column] * page_size + keys % page_size


def first_visible_tile(lowest_pos, sliding_window, tile: int):
    """First tile holding a key that the query at ``lowest_pos`` can see (0 without a
    window)."""
    if sliding_window is None:
        return jnp.int32(0)
    return jnp.maximum(lowest_pos - sliding_window + 1, 0) // tile


def softmax_start(rows: int, sinks=None):
    """(m, l) an online softmax of ``rows`` rows starts from: (-inf, 0); with ``sinks`` ([R]
    float32 attention-sink logits in natural units, -inf: none for that row) the sink in
    base 2 and 1, as if the sink were a first key without a value (gpt-oss)."""
    if sinks is None:
        return jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)
    return sinks * LOG2E, jnp.where(sinks == -jnp.inf, 0.0, 1.0).astype(jnp.float32)


FP8_E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def attend_tiles(q, row_pos, seq, head, start, end, page_table_ref, k_ref, v_ref, *,
                 tile: int, page_size: int, scale: float, sliding_window: int | None,
                 soft_cap: float | None, sinks=None):
    """Online-softmax attention of ``q`` over tiles ``[start, end)`` of ``seq``.

    Args:
        q: [R, D] query rows (q's dtype); row_pos: [R] int32 their positions (-1 = padding).
        seq, head: the page-table row and the KV head; start, end: int32 tile range.
        page_table_ref: [B, P] int32; k_ref, v_ref: [num_pages * page_size, KVH, D] pools
            (q's dtype or fp8, converted to q's dtype as loaded: exact from e4m3, through
            32-bit words (:func:`pallas_kernels.fp8_words.widen_e4m3_tile`); a bf16 q over an
            fp8 pool computes in float16).
        scale: score scale (``k_scale`` folded in); sliding_window, soft_cap as in
            ``pallas_kernels.reference.paged_attention_reference``.
        sinks: None, or [R] float32 attention-sink logits of the rows' heads (natural
            units; -inf: none for that row): the running maximum starts at the sink (in
            base 2) and the sum at 1, the sink being a key without a value.

    Returns:
        (acc [R, D] f32 unnormalised, m [R] f32 row max in base-2 units (-inf: nothing
        seen), l [R] f32 sum).
    """
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    slots_of = lambda i: tile_slots(page_table_ref, seq, i, tile=tile, page_size=page_size)
    if q.dtype == jnp.bfloat16 and k_ref.dtype == FP8_E4M3:
        # An fp8 pool's tiles are multiplied in float16: sm_90 converts two e4m3 values to
        # an f16 pair in one instruction (F2FP.F16.E4M3.UNPACK_B), while e4m3 -> bf16 went
        # through more (Triton 3.9's fp8 decode loop: 568 -> 476 instructions a 32-key
        # tile); e4m3 values and softmax weights are exact or closer in f16, and q fits
        # its range (|q| < 65504).
        q = q.astype(jnp.float16)

    def load(ref, slots):
        """[tile, D] rows of ``slots`` in q's dtype; fp8 through 32-bit words, so that the
        tile leaves shared memory in wide loads (``pallas_kernels.fp8_words``: the decode
        loop 476 -> 270 instructions a tile on sm_90; prefill's compiles the same)."""
        values = ref[slots, head, :]
        if ref.dtype == FP8_E4M3:
            values = widen_e4m3_tile(values)
        return values.astype(q.dtype)

    def body(i, carry):
        acc, m, l, slots = carry
        next_slots = slots_of(i + 1)                  # tile i+1's addresses, one tile ahead
        k = load(k_ref, slots)                        # [tile, D]
        v = load(v_ref, slots)
        acc, m, l = online_softmax_step(q, k, v, row_pos, i * tile, acc, m, l, scale=scale,
                                        sliding_window=sliding_window, soft_cap=soft_cap,
                                        precision=precision)
        return acc, m, l, next_slots

    rows, head_dim = q.shape
    init = (jnp.zeros((rows, head_dim), jnp.float32), *softmax_start(rows, sinks),
            slots_of(start))
    acc, m, l, _ = jax.lax.fori_loop(start, end, body, init)
    return acc, m, l
