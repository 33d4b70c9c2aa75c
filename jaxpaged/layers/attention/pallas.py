"""The ``pallas`` attention backend: the Pallas kernels of ``pallas_kernels``.

On a GPU they lower through Triton; elsewhere they run in Pallas interpret mode (slow, for
tests). Two kernel generations are kept for an A/B (``kernel``, a field for benchmarks, not
a user flag):

- ``v2`` (default): decodes and prefill blocks apart (host metadata from
  :mod:`jaxpaged.layers.attention.decode_prefill`): the split-K decode kernel
  (``pallas_kernels.paged_attention``) and, in a step with prefill chunks, the prefill kernel
  (``pallas_kernels.prefill_attention``) as a second launch.
- ``v1``: every token in query blocks of one launch (``pallas_kernels.paged_attention_v1``),
  with the query-block plumbing the ``xla`` backend shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxpaged.layers.attention.base import BatchLayout
from jaxpaged.layers.attention.decode_prefill import build_decode_prefill_metadata
from jaxpaged.layers.attention.query_blocks import QueryBlockBackend
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.paged_attention_v1 import paged_attention as paged_attention_v1
from pallas_kernels.prefill_attention import paged_prefill_attention

KERNELS = ("v1", "v2")


@dataclass(frozen=True)
class PallasAttentionBackend(QueryBlockBackend):
    """Ragged paged attention and KV write as Pallas kernels.

    Attributes:
        interpret: run the kernels in interpret mode (None: on unless on a GPU).
        kernel: ``"v2"`` (decode and prefill launches) or ``"v1"`` (one query-block launch).

    Raises:
        ValueError: an unknown ``kernel`` (or a bad scale, see ``QueryBlockBackend``).
    """

    name: str = "pallas"
    interpret: bool | None = None
    kernel: str = "v2"

    def __post_init__(self):
        super().__post_init__()
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")

    def build_metadata(self, layout: BatchLayout):
        """v2: decode and prefill-block arrays
        (:func:`~jaxpaged.layers.attention.decode_prefill.build_decode_prefill_metadata`);
        v1: query blocks."""
        if self.kernel == "v1":
            return super().build_metadata(layout)
        return build_decode_prefill_metadata(layout)

    def forward(self, q, k, v, kv_pages, metadata, *, scale: float,
                sliding_window: int | None = None, soft_cap: float | None = None,
                sinks=None):
        """See :meth:`AttentionBackend.forward`. v2: the decode launch, plus the prefill
        launch when the bucket has prefill blocks, each scattered back to token order."""
        if self.kernel == "v1":
            return super().forward(q, k, v, kv_pages, metadata, scale=scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap,
                                   sinks=sinks)
        kv_pages = self.write_kv(kv_pages, k, v, metadata["slot_mapping"])
        t, num_heads, head_dim = q.shape
        q_padded = jnp.concatenate([q, jnp.zeros((1, num_heads, head_dim), q.dtype)])
        options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                       sinks=sinks)
        decode_tokens = metadata["decode_tokens"]
        out = self.decode(q_padded[decode_tokens], kv_pages, metadata, **options)
        result = jnp.zeros((t + 1, num_heads, head_dim), q.dtype).at[decode_tokens].set(out)
        prefill_tokens = metadata["prefill_tokens"]
        if prefill_tokens.shape[0]:
            out = paged_prefill_attention(q_padded[prefill_tokens], *kv_pages,
                                          metadata["page_table"], metadata["prefill_seq"],
                                          metadata["prefill_positions"], k_scale=self.k_scale,
                                          v_scale=self.v_scale, interpret=self.interpret,
                                          **options)
            result = result.at[prefill_tokens].set(out)
        return result[:t], kv_pages

    def decode(self, q_decode, kv_pages, metadata, *, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None, sinks=None):
        """v2's decode launch alone (no KV write, no scatter back): ``q_decode`` [ND, H, D]
        the decode tokens' queries in ``metadata["decode_tokens"]`` order -> [ND, H, D]
        (``pallas_kernels.paged_attention.paged_decode_attention``; also timed on its own by
        ``benchmarks/kernels/paged_attention.py``)."""
        return paged_decode_attention(q_decode, *kv_pages, metadata["page_table"],
                                      metadata["decode_seq"], metadata["decode_positions"],
                                      metadata["decode_kv_tokens"], scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap,
                                      k_scale=self.k_scale, v_scale=self.v_scale,
                                      interpret=self.interpret, sinks=sinks)

    def write_kv(self, kv_pages, k, v, slot_mapping):
        """Pallas KV-write kernel, pool aliased in place."""
        return write_kv(*kv_pages, k, v, slot_mapping, k_scale=self.k_scale,
                        v_scale=self.v_scale, interpret=self.interpret)

    def attend(self, q_blocks, kv_pages, page_table, block_seq, block_positions, *, scale,
               sliding_window=None, soft_cap=None, sinks=None):
        """v1 ragged paged attention over query blocks (the ``kernel="v1"`` path)."""
        return paged_attention_v1(q_blocks, *kv_pages, page_table, block_seq, block_positions,
                                  scale=scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap, k_scale=self.k_scale,
                                  v_scale=self.v_scale, interpret=self.interpret, sinks=sinks)
