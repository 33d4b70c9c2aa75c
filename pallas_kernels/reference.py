"""Pure-jnp oracles for the kernels of this package (also the engine's ``xla`` backend).

Both work on *query blocks*: ``block_q`` consecutive query tokens of one sequence, described
by the sequence index (a row of the page table) and the tokens' positions (-1 marks padding).
Pools may be in the model's dtype or fp8; either way they hold K / k_scale and V / v_scale
(``pallas_kernels.kv_quant``), which the references read literally: dequantized to q's dtype,
then attention as usual.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023), section 4.1 — attention over K/V gathered through a page table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import dequantize_kv, quantize_kv

#: Finite "minus infinity" for masked scores, so fully masked padding rows stay finite.
MASK_VALUE = -1e30


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              page_table: jax.Array, block_seq: jax.Array,
                              block_positions: jax.Array, *, scale: float,
                              sliding_window: int | None = None,
                              soft_cap: float | None = None, k_scale: float = 1.0,
                              v_scale: float = 1.0, sinks: jax.Array | None = None) -> jax.Array:
    """Causal paged attention for query blocks, softmax in float32.

    Args:
        q: [NB, Bq, num_heads, D] queries of each block.
        k_pages, v_pages: [num_pages, page_size, num_kv_heads, D] the layer's pool, in q's
            dtype or float8_e4m3fn.
        page_table: [B, P] int32 page ids per sequence.
        block_seq: [NB] int32 each block's sequence (row of ``page_table``).
        block_positions: [NB, Bq] int32 query positions; -1 for padding rows.
        scale: multiplies q·k (normally D ** -0.5).
        sliding_window: if set, a query at position p sees keys in (p - window, p].
        soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)`` (Gemma 2).
        k_scale, v_scale: the pool holds K / k_scale and V / v_scale.
        sinks: [num_heads] float32 attention-sink logits (gpt-oss), or None: each row's
            softmax denominator also holds ``exp(sink)`` of its head, a key without a value
            (transformers' ``GptOssAttention``: softmax over the scores and the sink, the
            sink's column dropped).

    Returns:
        [NB, Bq, num_heads, D] in q's dtype; padding rows are unspecified (finite).
    """
    nb, block_q, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    pages = page_table[block_seq]                                        # [NB, P]
    kv_len = pages.shape[1] * page_size
    shape = (nb, kv_len, num_kv_heads, head_dim)
    kb = dequantize_kv(k_pages[pages], k_scale, q.dtype).reshape(shape)
    vb = dequantize_kv(v_pages[pages], v_scale, q.dtype).reshape(shape)
    qb = q.reshape(nb, block_q, num_kv_heads, group, head_dim)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum("nqhgd,nlhd->nhgql", qb, kb, preferred_element_type=jnp.float32,
                        precision=precision) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, None, :]
    query_pos = block_positions[:, None, None, :, None]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    scores = jnp.where(mask, scores, MASK_VALUE)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group)[None, :, :, None, None]
        sink = jnp.broadcast_to(sink, scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), axis=-1)[..., :-1]
    out = jnp.einsum("nhgql,nlhd->nqhgd", probs.astype(vb.dtype), vb,
                     preferred_element_type=jnp.float32, precision=precision)
    return out.reshape(nb, block_q, num_heads, head_dim).astype(q.dtype)


def write_kv_reference(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                       slot_mapping: jax.Array, *, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V rows into their slots (in place when the pool is donated), quantized
    for the pool's dtype (:func:`pallas_kernels.kv_quant.quantize_kv`).

    Args:
        k_pages, v_pages: [num_pages, page_size, KVH, D], any float dtype (fp8 included).
        k, v: [T, KVH, D] new rows.
        slot_mapping: [T] int32 flat slots (``page * page_size + row``).
        k_scale, v_scale: the rows are stored as k / k_scale and v / v_scale.

    Returns:
        The updated ``(k_pages, v_pages)``.
    """
    num_pages, page_size = k_pages.shape[:2]

    def scatter(pages, rows, scale):
        flat = pages.reshape(num_pages * page_size, *pages.shape[2:])
        stored = quantize_kv(rows, scale, pages.dtype)
        return flat.at[slot_mapping].set(stored).reshape(pages.shape)

    return scatter(k_pages, k, k_scale), scatter(v_pages, v, v_scale)
