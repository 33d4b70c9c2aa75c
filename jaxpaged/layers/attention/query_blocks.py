"""Query blocks: the work unit of the ``xla`` backend and of the v1 Pallas kernel.

(The v2 Pallas kernels take decodes and prefill blocks apart instead:
:mod:`jaxpaged.layers.attention.decode_prefill`.)

Query tokens are grouped into blocks of ``block_q`` consecutive tokens of one sequence
(``block_q = 1`` for decode-only steps, so each block is one sequence's single token;
``block_q = BatchLayout.verify_block_q`` for a speculative verification step, one block per
sequence holding its decode token and proposals; otherwise ``block_q = 16`` and a prefill
chunk spans several blocks). A block knows its
sequence (a row of the page table) and its tokens' positions, which is all a paged attention
computation needs. The number of blocks is padded to depend only on the bucket sizes, so the
jitted step compiles once per bucket. Memory and work then scale with the blocks, however
prefill and decode tokens are mixed.

Blocks are ordered by their last query position, longest first (padding blocks last), so a
kernel that walks the page table can give each run of neighbouring blocks its own stopping
point (see :mod:`jaxpaged.layers.attention.xla`). The order never changes a result, only
how much padding a kernel touches.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention.base import AttentionBackend, BatchLayout, KVPages

#: Query tokens per block when a step holds prefill chunks.
PREFILL_BLOCK_Q = 16


def num_query_blocks(num_tokens_padded: int, num_seqs_padded: int, decode_only: bool,
                     verify: bool = False) -> int:
    """Padded block count for a bucket: one per sequence when decoding or verifying, else
    enough for any split of T tokens over B sequences (each sequence wastes at most one
    partial block)."""
    if decode_only or verify:
        return num_seqs_padded
    return -(-num_tokens_padded // PREFILL_BLOCK_Q) + num_seqs_padded


@dataclass(frozen=True)
class QueryBlockBackend(AttentionBackend):
    """Builds query blocks on the host; ``forward`` writes K/V, gathers the queries into
    blocks, calls :meth:`attend` and scatters the result back to token order.

    Attributes:
        k_scale, v_scale: the layer's KV scales (see the pool layout in
            :mod:`jaxpaged.layers.attention.base`); static, so each distinct value is
            compiled into the step as a constant.

    Raises:
        ValueError: a scale that is not a finite positive number.
    """

    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")

    def with_kv_scales(self, k_scale: float, v_scale: float) -> "QueryBlockBackend":
        """See :meth:`AttentionBackend.with_kv_scales`."""
        return dataclasses.replace(self, k_scale=float(k_scale), v_scale=float(v_scale))

    def build_metadata(self, layout: BatchLayout) -> dict[str, np.ndarray]:
        """Query-block arrays for ``layout``.

        Returns:
            ``block_tokens`` [NB, Bq] int32 token index of each block row (T for padding),
            ``block_seq`` [NB] int32 the block's sequence (row of the page table),
            ``block_positions`` [NB, Bq] int32 query positions (-1 for padding);
            blocks sorted by last position, descending.
        """
        t_pad = layout.positions.shape[0]
        b_pad = layout.seq_lens.shape[0]
        decode_only = layout.is_decode_only
        verify = layout.verify_block_q
        block_q = 1 if decode_only else verify or PREFILL_BLOCK_Q
        nb = num_query_blocks(t_pad, b_pad, decode_only, bool(verify))
        block_tokens = np.full((nb, block_q), t_pad, np.int32)
        block_seq = np.zeros((nb,), np.int32)
        block_positions = np.full((nb, block_q), -1, np.int32)
        qsl = layout.query_start_loc
        if decode_only:
            n = layout.num_seqs
            block_tokens[:n, 0] = qsl[:n]
            block_seq[:n] = np.arange(n)
            block_positions[:n, 0] = layout.positions[qsl[:n]]
        elif verify:     # one block per sequence, its tokens from the block's first row
            n = layout.num_seqs
            rows = np.arange(block_q)
            real = rows[None, :] < (qsl[1:n + 1] - qsl[:n])[:, None]
            tokens = qsl[:n, None] + rows[None, :]
            block_tokens[:n] = np.where(real, tokens, t_pad)
            block_positions[:n] = np.where(real, layout.positions[np.minimum(tokens, t_pad - 1)],
                                           -1)
            block_seq[:n] = np.arange(n)
        else:
            b = 0
            for i in range(layout.num_seqs):
                for s in range(int(qsl[i]), int(qsl[i + 1]), block_q):
                    e = min(s + block_q, int(qsl[i + 1]))
                    block_tokens[b, : e - s] = np.arange(s, e)
                    block_positions[b, : e - s] = layout.positions[s:e]
                    block_seq[b] = i
                    b += 1
        order = np.argsort(-block_positions.max(axis=1), kind="stable")
        return {"block_tokens": block_tokens[order], "block_seq": block_seq[order],
                "block_positions": block_positions[order]}

    def forward(self, q, k, v, kv_pages: KVPages, metadata, *, scale: float,
                sliding_window: int | None = None, soft_cap: float | None = None,
                sinks: jax.Array | None = None):
        """See :meth:`AttentionBackend.forward`."""
        kv_pages = self.write_kv(kv_pages, k, v, metadata["slot_mapping"])
        t, num_heads, head_dim = q.shape
        block_tokens = metadata["block_tokens"]
        q_padded = jnp.concatenate([q, jnp.zeros((1, num_heads, head_dim), q.dtype)])
        out = self.attend(q_padded[block_tokens], kv_pages, metadata["page_table"],
                          metadata["block_seq"], metadata["block_positions"], scale=scale,
                          sliding_window=sliding_window, soft_cap=soft_cap,
                          **({} if sinks is None else {"sinks": sinks}))
        result = jnp.zeros((t + 1, num_heads, head_dim), q.dtype).at[block_tokens].set(out)
        return result[:t], kv_pages

    @abc.abstractmethod
    def write_kv(self, kv_pages: KVPages, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array) -> KVPages:
        """Scatter [T, KVH, D] rows into the pool at ``slot_mapping`` [T], stored as
        k / k_scale and v / v_scale in the pool's dtype."""

    @abc.abstractmethod
    def attend(self, q_blocks: jax.Array, kv_pages: KVPages, page_table: jax.Array,
               block_seq: jax.Array, block_positions: jax.Array, *, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None,
               sinks: jax.Array | None = None) -> jax.Array:
        """[NB, Bq, num_heads, D] queries -> [NB, Bq, num_heads, D] attention outputs
        (``sliding_window``, ``soft_cap`` and ``sinks`` as in
        :meth:`AttentionBackend.forward`), reading
        the pool as stored value times k_scale / v_scale."""
