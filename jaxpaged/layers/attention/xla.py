"""The ``xla`` attention backend: gather pages through the page table, masked attention in jnp.

Runs on every platform, is the CPU default and the numerical oracle for the Pallas kernels.

Method: query tokens are grouped into *query blocks* of ``block_q`` consecutive tokens of one
sequence (a decode-only step uses ``block_q = 1``, so each block is one sequence's single
token; otherwise ``block_q = 16`` and a prefill chunk spans several blocks). Each block gathers
its sequence's pages ([P * page_size] keys), scores its queries against them in float32 with a
causal mask (key position <= query position), and the results are scattered back to token order.
Memory per layer is O(num_blocks * P * page_size * num_kv_heads * head_dim), independent of how
prefill and decode tokens are mixed. This is the standard paged-attention computation of Kwon et
al., "Efficient Memory Management for Large Language Model Serving with PagedAttention"
(SOSP 2023), section 4.1, written as dense gathers instead of a fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention.base import AttentionBackend, BatchLayout, KVPages, write_kv

#: Query tokens per block when a step holds prefill chunks.
PREFILL_BLOCK_Q = 16
#: Finite "minus infinity" so fully masked padding rows stay finite.
_MASK_VALUE = -1e30


def num_query_blocks(num_tokens_padded: int, num_seqs_padded: int, decode_only: bool) -> int:
    """Padded block count for a bucket: one per sequence when decoding, else enough for any
    split of T tokens over B sequences (each sequence wastes at most one partial block)."""
    if decode_only:
        return num_seqs_padded
    return -(-num_tokens_padded // PREFILL_BLOCK_Q) + num_seqs_padded


@dataclass(frozen=True)
class XlaAttentionBackend(AttentionBackend):
    """Paged attention in plain jnp (see the module docstring)."""

    name: str = "xla"

    def build_metadata(self, layout: BatchLayout) -> dict[str, np.ndarray]:
        """Query-block arrays for ``layout``.

        Returns:
            ``block_tokens`` [NB, Bq] int32 token index of each block row (T for padding),
            ``block_seq`` [NB] int32 the block's sequence (row of the page table),
            ``block_positions`` [NB, Bq] int32 query positions (-1 for padding).
        """
        t_pad = layout.positions.shape[0]
        b_pad = layout.seq_lens.shape[0]
        decode_only = layout.is_decode_only
        block_q = 1 if decode_only else PREFILL_BLOCK_Q
        nb = num_query_blocks(t_pad, b_pad, decode_only)
        block_tokens = np.full((nb, block_q), t_pad, np.int32)
        block_seq = np.zeros((nb,), np.int32)
        block_positions = np.full((nb, block_q), -1, np.int32)
        qsl = layout.query_start_loc
        if decode_only:
            n = layout.num_seqs
            block_tokens[:n, 0] = qsl[:n]
            block_seq[:n] = np.arange(n)
            block_positions[:n, 0] = layout.positions[qsl[:n]]
        else:
            b = 0
            for i in range(layout.num_seqs):
                for s in range(int(qsl[i]), int(qsl[i + 1]), block_q):
                    e = min(s + block_q, int(qsl[i + 1]))
                    block_tokens[b, : e - s] = np.arange(s, e)
                    block_positions[b, : e - s] = layout.positions[s:e]
                    block_seq[b] = i
                    b += 1
        return {"block_tokens": block_tokens, "block_seq": block_seq,
                "block_positions": block_positions}

    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: KVPages,
                metadata: dict[str, jax.Array], *, scale: float) -> tuple[jax.Array, KVPages]:
        """See :meth:`AttentionBackend.forward`."""
        kv_pages = write_kv(kv_pages, k, v, metadata["slot_mapping"])
        k_pages, v_pages = kv_pages
        t, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_pages.shape
        group = num_heads // num_kv_heads
        block_tokens = metadata["block_tokens"]
        nb, block_q = block_tokens.shape

        q_padded = jnp.concatenate([q, jnp.zeros((1, num_heads, head_dim), q.dtype)])
        qb = q_padded[block_tokens].reshape(nb, block_q, num_kv_heads, group, head_dim)
        pages = metadata["page_table"][metadata["block_seq"]]                # [NB, P]
        kv_len = pages.shape[1] * page_size
        kb = k_pages[pages].reshape(nb, kv_len, num_kv_heads, head_dim)
        vb = v_pages[pages].reshape(nb, kv_len, num_kv_heads, head_dim)

        scores = jnp.einsum("nqhgd,nlhd->nhgql", qb, kb,
                            preferred_element_type=jnp.float32) * scale
        key_pos = jnp.arange(kv_len, dtype=jnp.int32)
        mask = key_pos[None, None, None, None, :] <= metadata["block_positions"][:, None, None, :, None]
        scores = jnp.where(mask, scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("nhgql,nlhd->nqhgd", probs.astype(vb.dtype), vb,
                         preferred_element_type=jnp.float32)
        out = out.reshape(nb, block_q, num_heads, head_dim).astype(q.dtype)
        result = jnp.zeros((t + 1, num_heads, head_dim), q.dtype).at[block_tokens].set(out)
        return result[:t], kv_pages
