"""The ``xla`` attention backend: gather pages through the page table, masked attention in jnp.

Runs on every platform, is the CPU default and the numerical oracle for the Pallas kernels
(its math is ``pallas_kernels.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpaged.layers.attention.query_blocks import QueryBlockBackend
from pallas_kernels.reference import paged_attention_reference, write_kv_reference


@dataclass(frozen=True)
class XlaAttentionBackend(QueryBlockBackend):
    """Paged attention in plain jnp over query blocks."""

    name: str = "xla"

    def write_kv(self, kv_pages, k, v, slot_mapping):
        """jnp scatter (in place under donation)."""
        return write_kv_reference(*kv_pages, k, v, slot_mapping)

    def attend(self, q_blocks, kv_pages, page_table, block_seq, block_positions, *, scale):
        """Gather + masked softmax (``paged_attention_reference``)."""
        return paged_attention_reference(q_blocks, *kv_pages, page_table, block_seq,
                                         block_positions, scale=scale)
