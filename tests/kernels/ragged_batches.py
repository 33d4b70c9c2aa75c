"""Random ragged batches for kernel tests: mixed prefill chunks and decodes over a shuffled pool,
and query blocks for the kernel-level tests."""

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


def random_seqs(rng, n, page_size, max_ctx=90):
    """A mix of decodes, first prefill chunks and mid-sequence chunks; last pages mostly
    partial."""
    seqs = []
    for i in range(n):
        kind = i % 3
        ctx = int(rng.integers(1, max_ctx))
        if kind == 0:
            seqs.append((ctx, 1))                                  # decode
        elif kind == 1:
            seqs.append((0, int(rng.integers(1, 40))))             # first prefill chunk
        else:
            seqs.append((ctx, int(rng.integers(2, 30))))           # chunk starting mid-sequence
    return seqs


def block_inputs(rng, *, nb, block_q, group, head_dim=64, page_size=16, dtype=jnp.float32):
    num_kv_heads = 2
    pages = 12
    pool = lambda: jnp.asarray(rng.normal(size=(40, page_size, num_kv_heads, head_dim)), dtype)
    page_table = jnp.asarray(rng.permutation(np.arange(1, 40))[:3 * pages].reshape(3, pages),
                             jnp.int32)
    positions = np.full((nb, block_q), -1, np.int32)
    for b in range(nb):
        start = int(rng.integers(0, pages * page_size - block_q))
        n = int(rng.integers(1, block_q + 1))
        positions[b, :n] = np.arange(start, start + n)
    q = jnp.asarray(rng.normal(size=(nb, block_q, num_kv_heads * group, head_dim)), dtype)
    block_seq = jnp.asarray(rng.integers(0, 3, nb), jnp.int32)
    return (q, pool(), pool(), page_table, block_seq, jnp.asarray(positions)), positions >= 0


def device_metadata(backend, layout: BatchLayout) -> dict:
    meta = backend.build_metadata(layout)
    meta.update(slot_mapping=layout.slot_mapping, page_table=layout.page_table,
                seq_lens=layout.seq_lens, query_start_loc=layout.query_start_loc,
                positions=layout.positions)
    return {k: jnp.asarray(v) for k, v in meta.items()}
