"""The ``xla`` attention backend: paged attention in plain jnp, page chunk by page chunk.

Runs on every platform, and is the numerical oracle of the others; on the CPU the ``cpu``
backend (:mod:`jaxpaged.layers.attention.cpu`) sends its query blocks to a C++ kernel and
keeps this one's KV write. Instead of gathering every query block's whole
sequence of pages at once (``pallas_kernels.reference``, the numerical oracle, which writes a
``[blocks, pages * page_size, heads, dim]`` copy of the KV cache per layer), it walks the page
table a chunk of :data:`PAGES_PER_CHUNK` pages at a time with an online softmax. The query
blocks are split into :data:`NUM_GROUPS` runs of neighbours, and each run stops after the
last chunk any of its queries can see; since the blocks arrive sorted by last position
(:mod:`jaxpaged.layers.attention.query_blocks`), short sequences and early prefill blocks
stop early instead of walking to the batch's longest sequence. Each needed page is read once
per query block, and the padding of the page-table bucket costs nothing. Chunk boundaries
sit at fixed token positions, so a sequence's result does not depend on what else is in the
batch.

The chunk is small on purpose: on XLA:CPU the chunk's K/V gather is materialized, and a
few pages keep it in cache (the chunk and run sizes were chosen by measuring W1's decode
step: ``docs/measurements.md``, "XLA attention"). Decode blocks gather their pages as
whole rows of a flat view of the pool (:func:`gather_pages`). Float32 decode blocks (one
query row) compute their scores and weighted values as multiply-and-reduce instead of
matrix-vector products, which XLA:CPU runs one small dot at a time; bfloat16 decode blocks
use bf16 dots, which YNNPACK runs natively (:class:`_DecodeDotProducts`).

An fp8 pool (``pallas_kernels.kv_quant``) is read the way the Pallas kernel reads it: each
gathered chunk is converted to q's dtype (exact from e4m3), ``k_scale`` is folded into the
softmax scale and ``v_scale`` into the normalised output, so only the chunk is ever widened and
the score and value math keeps the model's dtype with float32 accumulation.

Reference: the online softmax of Milakov & Gimelshein, "Online normalizer calculation for
softmax" (2018) as used by FlashAttention (Dao et al., 2022), over PagedAttention's page
table (Kwon et al., SOSP 2023, section 4.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpaged.layers.attention.query_blocks import QueryBlockBackend
from pallas_kernels.kv_quant import check_pool_dtypes
from pallas_kernels.reference import MASK_VALUE, write_kv_reference

#: Pages per iteration of the chunk loop (64 keys at the default page size of 16).
PAGES_PER_CHUNK = 4

#: Runs of query blocks with their own loop trip count.
NUM_GROUPS = 8


def paged_attention_chunked(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_table: jax.Array, block_seq: jax.Array,
                            block_positions: jax.Array, *, scale: float,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            num_groups: int = NUM_GROUPS,
                            sinks: jax.Array | None = None) -> jax.Array:
    """Causal paged attention for query blocks, online softmax in float32.

    Args and result as :func:`pallas_kernels.reference.paged_attention_reference`:
    q [NB, Bq, H, D]; k_pages, v_pages [num_pages, page_size, KVH, D]; page_table [B, P]
    int32; block_seq [NB] int32; block_positions [NB, Bq] int32 (-1 = padding);
    ``sliding_window`` (a query at p sees keys in (p - window, p]) and ``soft_cap``
    (scores -> cap * tanh(scores / cap)) optional; pools in q's dtype or float8_e4m3fn,
    holding K / k_scale and V / v_scale. Returns [NB, Bq, H, D] in q's dtype
    (padding rows finite, unspecified). ``num_groups`` runs of neighbouring blocks get
    their own trip counts (any block order is correct; blocks sorted by last position,
    descending, do the least work); with a sliding window a run also starts at the first
    chunk any of its queries can see. ``sinks`` ([num_heads] float32 attention-sink logits,
    gpt-oss) start each row's running maximum at its head's sink and its sum at 1, so the
    sink joins the softmax denominator and adds no value.

    Raises:
        ValueError: pools neither in q's dtype nor fp8.
    """
    check_pool_dtypes(q.dtype, k_pages.dtype, v_pages.dtype)
    pages = page_table[block_seq]                                         # [NB, P]
    pad = -pages.shape[1] % PAGES_PER_CHUNK
    if pad:      # the null page fills the last chunk; its keys are beyond every query
        pages = jnp.pad(pages, ((0, 0), (0, pad)))
    def attend(q, pages, block_positions):
        return _attend_run(q, k_pages, v_pages, pages, block_positions, scale * k_scale,
                           v_scale, sliding_window, soft_cap, sinks)

    nb = q.shape[0]
    num_runs = min(num_groups, nb)
    if num_runs == 1:
        return attend(q, pages, block_positions)
    # Equal runs (the last padded with blocks that see nothing), walked by one loop: one
    # copy of the run's body in the program instead of one per run (unrolled runs made the
    # program several times longer to lower and compile: docs/measurements.md).
    size = -(-nb // num_runs)
    extra = num_runs * size - nb
    if extra:
        q = jnp.pad(q, ((0, extra),) + ((0, 0),) * 3)
        pages = jnp.pad(pages, ((0, extra), (0, 0)))
        block_positions = jnp.pad(block_positions, ((0, extra), (0, 0)), constant_values=-1)

    def run(r, out):
        start = r * size
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)  # noqa: E731
        return jax.lax.dynamic_update_slice_in_dim(
            out, attend(rows(q), rows(pages), rows(block_positions)), start, axis=0)

    out = jax.lax.fori_loop(0, num_runs, run, jnp.zeros(q.shape, q.dtype))
    return out[:nb] if extra else out


def _attend_run(q, k_pages, v_pages, pages, block_positions, scale, v_scale, sliding_window,
                soft_cap, sinks=None):
    """:func:`paged_attention_chunked` for one run of blocks; pages [NB, P] (P a multiple
    of PAGES_PER_CHUNK); ``scale`` already includes ``k_scale``. The chunk loop covers only
    the chunks the run's queries can see."""
    nb, block_q, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    chunk = PAGES_PER_CHUNK * page_size
    products = _MatmulProducts if block_q > 1 else (
        _DecodeProducts if q.dtype == jnp.float32 else _DecodeDotProducts)
    qb = q.reshape(nb, block_q, num_kv_heads, group, head_dim)

    def body(c, carry):
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(pages, c * PAGES_PER_CHUNK, PAGES_PER_CHUNK, axis=1)
        kc = products.gather(k_pages, ids).reshape(nb, chunk, num_kv_heads, head_dim)
        vc = products.gather(v_pages, ids).reshape(nb, chunk, num_kv_heads, head_dim)
        kc, vc = kc.astype(q.dtype), vc.astype(q.dtype)
        key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        s = products.scores(qb, kc) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos, query_pos = products.broadcast_positions(key_pos, block_positions)
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        s = jnp.where(visible, s, MASK_VALUE)
        axis = products.KEY_AXIS
        m_new = jnp.maximum(m, s.max(axis))
        p = jnp.exp(s - jnp.expand_dims(m_new, axis))
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis)
        acc = acc * correction[..., None] + products.weighted_values(p, vc)
        return m_new, l, acc

    shape = products.row_shape(nb, block_q, num_kv_heads, group)
    if sinks is None:
        m0, l0 = jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)
    else:                   # the sink as a first key without a value (sinks: [KVH * G])
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
        m0 = jnp.broadcast_to(sink if len(shape) == 3 else sink[..., None], shape)
        l0 = jnp.ones(shape, jnp.float32)
    init = (m0, l0, jnp.zeros(shape + (head_dim,), jnp.float32))
    num_chunks = jnp.max(block_positions) // chunk + 1                   # the rest is unseen
    first_chunk = 0
    if sliding_window is not None:      # chunks wholly before every query's window are unseen
        lowest = jnp.min(jnp.where(block_positions >= 0, block_positions, num_chunks * chunk))
        first_chunk = jnp.minimum(jnp.maximum(lowest - sliding_window + 1, 0) // chunk,
                                  num_chunks)
    _, l, acc = jax.lax.fori_loop(first_chunk, num_chunks, body, init)
    out = acc / l[..., None]
    if v_scale != 1.0:
        out = out * v_scale
    return products.to_blocks(out).astype(q.dtype)


def gather_pages(pages: jax.Array, ids: jax.Array) -> jax.Array:
    """``pages[ids]`` gathered as whole rows: pages [num_pages, page_size, KVH, D], ids [...]
    int32 -> [..., page_size, KVH, D], the same values.

    The pool is viewed as [num_pages, page_size * KVH * D] (a free reshape) so each index
    selects one contiguous row. XLA:CPU's gather loop then copies a page per index instead of
    walking the [page_size, KVH, D] slice element by element, which is faster for decode
    blocks (``docs/benchmarks.md``, "Decode attention on XLA:CPU").
    """
    rows = pages.reshape(pages.shape[0], -1)[ids]
    return rows.reshape(ids.shape + pages.shape[1:])


class _MatmulProducts:
    """Prefill blocks (Bq = 16): scores and values as batched matmuls, rows laid out
    [NB, KVH, G, Bq] (the dot's own output order, so nothing is transposed per chunk)."""

    KEY_AXIS = -1

    @staticmethod
    def gather(pages, ids):      # (gather_pages was slower for prefill: docs/measurements.md)
        return pages[ids]

    @staticmethod
    def row_shape(nb, block_q, num_kv_heads, group):
        return nb, num_kv_heads, group, block_q

    @staticmethod
    def scores(qb, kc):                                     # -> [NB, KVH, G, Bq, L]
        return jnp.einsum("nqhgd,nlhd->nhgql", qb, kc, preferred_element_type=jnp.float32,
                          precision=_precision(qb))

    @staticmethod
    def broadcast_positions(key_pos, block_positions):      # to the scores' [.., Bq, L]
        return key_pos, block_positions[:, None, None, :, None]

    @staticmethod
    def weighted_values(p, vc):                             # -> [NB, KVH, G, Bq, D]
        return jnp.einsum("nhgql,nlhd->nhgqd", p.astype(vc.dtype), vc,
                          preferred_element_type=jnp.float32, precision=_precision(vc))

    @staticmethod
    def to_blocks(out):
        nb, num_kv_heads, group, block_q, head_dim = out.shape
        return out.transpose(0, 3, 1, 2, 4).reshape(nb, block_q, num_kv_heads * group, head_dim)


class _DecodeProducts:
    """Decode blocks (Bq = 1): scores and values as multiply-and-reduce, rows laid out
    [NB, KVH, G] and scores [NB, L, KVH, G]. A one-row query makes every matmul a
    matrix-vector product; XLA:CPU runs those batched over (block, head) one small dot at a
    time, while the elementwise form is one fused loop nest over the chunk, about twice as
    fast (``docs/measurements.md``, "XLA attention")."""

    KEY_AXIS = 1
    gather = staticmethod(gather_pages)

    @staticmethod
    def row_shape(nb, block_q, num_kv_heads, group):
        return nb, num_kv_heads, group

    @staticmethod
    def scores(qb, kc):                                     # -> [NB, L, KVH, G]
        q = qb[:, 0].astype(jnp.float32)
        return (q[:, None] * kc[:, :, :, None, :].astype(jnp.float32)).sum(-1)

    @staticmethod
    def broadcast_positions(key_pos, block_positions):      # to the scores' [NB, L, ..]
        return key_pos[None, :, None, None], block_positions[:, :1, None, None]

    @staticmethod
    def weighted_values(p, vc):                             # -> [NB, KVH, G, D]
        return (p[..., None] * vc[:, :, :, None, :].astype(jnp.float32)).sum(1)

    @staticmethod
    def to_blocks(out):
        nb, num_kv_heads, group, head_dim = out.shape
        return out.reshape(nb, 1, num_kv_heads * group, head_dim)


class _DecodeDotProducts(_DecodeProducts):
    """Decode blocks in a 16-bit dtype: the same products as batched dots of the stored
    dtype with float32 results (the weights rounded to that dtype for the values, as
    :class:`_MatmulProducts` and the Pallas kernels do). XLA:CPU's YNNPACK runs bf16 dots
    natively where the CPU has AVX512-BF16, without widening the chunk, faster than the
    multiply-and-reduce form in bfloat16 and slower in float32 (``docs/benchmarks.md``,
    "Decode attention on XLA:CPU")."""

    @staticmethod
    def scores(qb, kc):                                     # -> [NB, L, KVH, G]
        return jnp.einsum("nhgd,nlhd->nlhg", qb[:, 0], kc, preferred_element_type=jnp.float32)

    @staticmethod
    def weighted_values(p, vc):                             # -> [NB, KVH, G, D]
        return jnp.einsum("nlhg,nlhd->nhgd", p.astype(vc.dtype), vc,
                          preferred_element_type=jnp.float32)


def _precision(x):
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


@dataclass(frozen=True)
class XlaAttentionBackend(QueryBlockBackend):
    """Paged attention in plain jnp over query blocks."""

    name: str = "xla"

    def write_kv(self, kv_pages, k, v, slot_mapping):
        """jnp scatter (in place under donation)."""
        return write_kv_reference(*kv_pages, k, v, slot_mapping, k_scale=self.k_scale,
                                  v_scale=self.v_scale)

    def attend(self, q_blocks, kv_pages, page_table, block_seq, block_positions, *, scale,
               sliding_window=None, soft_cap=None, sinks=None):
        """Chunked online-softmax attention (:func:`paged_attention_chunked`)."""
        return paged_attention_chunked(q_blocks, *kv_pages, page_table, block_seq,
                                       block_positions, scale=scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap,
                                       k_scale=self.k_scale, v_scale=self.v_scale, sinks=sinks)
