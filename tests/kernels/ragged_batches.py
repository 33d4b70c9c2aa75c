"""Random ragged batches for kernel tests: mixed prefill chunks and decodes over a shuffled pool."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention import NULL_PAGE, BatchLayout


@dataclass
class RaggedBatch:
    layout: BatchLayout
    q: jnp.ndarray          # [T, QH, D]
    k: jnp.ndarray          # [T, KVH, D] new rows
    v: jnp.ndarray
    k_pages: jnp.ndarray    # [num_pages, S, KVH, D] pool with the sequences' earlier context
    v_pages: jnp.ndarray


def make_batch(rng: np.random.Generator, *, num_heads: int, num_kv_heads: int, head_dim: int,
               page_size: int, dtype, seqs: list[tuple[int, int]], pad_tokens: int = 5,
               pad_seqs: int = 2) -> RaggedBatch:
    """``seqs`` = [(num_computed_tokens, num_new_tokens)]: a decode is (ctx, 1), a first
    prefill chunk (0, n), a later chunk (ctx, n) starting mid-sequence. Pages are drawn in
    shuffled pool order; the pool holds random stale data everywhere."""
    pages_per_seq = [-(-(c + n) // page_size) for c, n in seqs]
    num_pages = sum(pages_per_seq) + 3
    order = rng.permutation(np.arange(1, num_pages))
    p_max = max(pages_per_seq)
    b = len(seqs) + pad_seqs
    t = sum(n for _, n in seqs) + pad_tokens
    page_table = np.full((b, p_max), NULL_PAGE, np.int32)
    qsl = np.full(b + 1, t - pad_tokens, np.int32)
    seq_lens = np.zeros(b, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mapping = np.zeros(t, np.int32)   # padding writes land in the null page
    used, tok = 0, 0
    for i, (ctx, n) in enumerate(seqs):
        table = order[used:used + pages_per_seq[i]]
        used += pages_per_seq[i]
        page_table[i, :len(table)] = table
        qsl[i] = tok
        pos = np.arange(ctx, ctx + n)
        positions[tok:tok + n] = pos
        slot_mapping[tok:tok + n] = table[pos // page_size] * page_size + pos % page_size
        seq_lens[i] = ctx + n
        tok += n
    layout = BatchLayout(query_start_loc=qsl, seq_lens=seq_lens, positions=positions,
                         slot_mapping=slot_mapping, page_table=page_table,
                         num_seqs=len(seqs), num_tokens=tok)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return RaggedBatch(layout, arr(t, num_heads, head_dim), arr(t, num_kv_heads, head_dim),
                       arr(t, num_kv_heads, head_dim),
                       arr(num_pages, page_size, num_kv_heads, head_dim),
                       arr(num_pages, page_size, num_kv_heads, head_dim))


def device_metadata(backend, layout: BatchLayout) -> dict:
    meta = backend.build_metadata(layout)
    meta.update(slot_mapping=layout.slot_mapping, page_table=layout.page_table,
                seq_lens=layout.seq_lens, query_start_loc=layout.query_start_loc,
                positions=layout.positions)
    return {k: jnp.asarray(v) for k, v in meta.items()}
