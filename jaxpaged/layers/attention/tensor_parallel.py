"""Attention under ``shard_map``: each device attends with its own heads and pool slice.

The wrapped backend runs unchanged on every device of the mesh's ``tp`` axis with
``num_heads / tp`` query heads, ``num_kv_heads / tp`` KV heads and its slice of the KV pool
(see :mod:`jaxpaged.distributed.tensor_parallel` for the layout). Step metadata is
replicated. No communication happens inside attention (Megatron-LM, section 3: heads are
independent); the all-reduce follows in the row-parallel ``o_proj``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

from jaxpaged.distributed.tensor_parallel import TP_AXIS
from jaxpaged.layers.attention.base import AttentionBackend, BatchLayout, KVPages

_HEADS = P(None, TP_AXIS, None)             # [T, heads, head_dim]
_POOL = P(None, None, TP_AXIS, None)        # [num_pages, page_size, kv_heads, head_dim]


@dataclass(frozen=True)
class TensorParallelAttention(AttentionBackend):
    """``inner`` run per device over ``mesh``'s ``tp`` axis.

    Attributes:
        inner: the single-device backend (``xla``, ``pallas`` or ``cpu``).
        mesh: the engine's mesh.
    """

    inner: AttentionBackend
    mesh: Mesh

    @property
    def name(self) -> str:  # type: ignore[override]
        """The wrapped backend's name."""
        return self.inner.name

    def with_kv_scales(self, k_scale: float, v_scale: float) -> "TensorParallelAttention":
        """The wrapped backend with these scales (the same on every device: they are
        per-tensor, so a slice of the heads uses the whole layer's scales)."""
        return dataclasses.replace(self, inner=self.inner.with_kv_scales(k_scale, v_scale))

    def build_metadata(self, layout: BatchLayout):
        """The wrapped backend's metadata (replicated on every device)."""
        return self.inner.build_metadata(layout)

    def forward(self, q, k, v, kv_pages: KVPages, metadata, *, scale: float,
                sliding_window: int | None = None, soft_cap: float | None = None,
                sinks=None):
        """See :meth:`AttentionBackend.forward`; q, k, v, the pool and the sinks split by
        head."""
        options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if sinks is None:
            inner = partial(self.inner.forward, **options)
            args, specs = (), ()
        else:
            inner = lambda *a: self.inner.forward(*a[:-1], sinks=a[-1], **options)  # noqa: E731
            args, specs = (sinks,), (P(TP_AXIS),)
        per_device = shard_map(inner, mesh=self.mesh,
                               in_specs=(_HEADS, _HEADS, _HEADS, (_POOL, _POOL), P(), *specs),
                               out_specs=(_HEADS, (_POOL, _POOL)), check_vma=False)
        return per_device(q, k, v, kv_pages, metadata, *args)
