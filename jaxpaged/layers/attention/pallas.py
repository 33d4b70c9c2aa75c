"""The ``pallas`` attention backend: the Pallas kernels of ``pallas_kernels``.

On a GPU they lower through Triton; elsewhere they run in Pallas interpret mode (slow, for
tests). Same query-block plumbing as the ``xla`` backend, so the two differ only in the
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpaged.layers.attention.query_blocks import QueryBlockBackend
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_attention


@dataclass(frozen=True)
class PallasAttentionBackend(QueryBlockBackend):
    """Ragged paged attention and KV write as Pallas kernels.

    Attributes:
        interpret: run the kernels in interpret mode (None: on unless on a GPU).
    """

    name: str = "pallas"
    interpret: bool | None = None

    def write_kv(self, kv_pages, k, v, slot_mapping):
        """Pallas KV-write kernel, pool aliased in place."""
        return write_kv(*kv_pages, k, v, slot_mapping, k_scale=self.k_scale,
                        v_scale=self.v_scale, interpret=self.interpret)

    def attend(self, q_blocks, kv_pages, page_table, block_seq, block_positions, *, scale,
               sliding_window=None, soft_cap=None):
        """Pallas ragged paged attention."""
        return paged_attention(q_blocks, *kv_pages, page_table, block_seq, block_positions,
                               scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                               k_scale=self.k_scale, v_scale=self.v_scale,
                               interpret=self.interpret)
