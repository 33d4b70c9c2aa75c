"""The ``cpu`` attention backend: decode blocks through a C++ paged decode kernel (XLA FFI).

The ``xla`` backend's decode blocks walk 4-page chunks, each gathered into a materialized
copy and reduced by two small YNNPACK calls, three passes over the KV the step reads; on W1
decode attention was ~70% of a CPU decode step (``docs/benchmarks.md``, "W1 step profile").
This backend sends decode blocks (one query token each, ``block_q = 1``: every block of a
decode-only step) to ``csrc/paged_decode_cpu.cc``, which walks the page table itself and
reads each K/V page once with the softmax fused (:mod:`jaxpaged.layers.attention.cpu_build`
builds and registers it). Everything else stays on the ``xla`` path, which remains the
numerical oracle: prefill query blocks, the KV write, and pools the kernel does not read
(an fp8 pool, or one whose dtype differs from the queries').

Reference: the online softmax of Milakov & Gimelshein (2018) over PagedAttention's page table
(Kwon et al., SOSP 2023), structured as vLLM's paged attention v1 decode kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention.cpu_build import PAGED_DECODE_TARGET, load_paged_decode
from jaxpaged.layers.attention.xla import XlaAttentionBackend, paged_attention_chunked

#: Query and pool dtypes the kernel reads (the pool in the queries' dtype).
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def kernel_supports(q_dtype, pool_dtype) -> bool:
    """True when the kernel reads a pool of ``pool_dtype`` for queries of ``q_dtype``."""
    return jnp.dtype(q_dtype) in KERNEL_DTYPES and jnp.dtype(pool_dtype) == jnp.dtype(q_dtype)


def paged_decode_cpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                     page_table: jax.Array, block_seq: jax.Array, block_positions: jax.Array,
                     *, scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> jax.Array:
    """Paged decode attention by the C++ kernel (the FFI target must be registered:
    :func:`~jaxpaged.layers.attention.cpu_build.load_paged_decode`).

    Args:
        q: [NB, H, D] one query per block, float32 or bfloat16.
        k_pages, v_pages: [num_pages, page_size, KVH, D] in q's dtype, holding K / k_scale
            and V / v_scale; H a multiple of KVH (grouped-query attention).
        page_table: [B, P] int32; block_seq: [NB] int32 each block's page-table row;
        block_positions: [NB] int32 each query's position (-1: a padding block, output 0).
        scale: softmax scale; sliding_window, soft_cap: as
            :meth:`~jaxpaged.layers.attention.base.AttentionBackend.forward`.

    Returns:
        [NB, H, D] in q's dtype: softmax(scale * q.k) . v over the keys at positions
        ``<= position`` (and within the window), accumulated in float32.
    """
    call = jax.ffi.ffi_call(PAGED_DECODE_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, page_table.astype(jnp.int32),
                block_seq.astype(jnp.int32), block_positions.astype(jnp.int32),
                scale=np.float32(scale * k_scale), soft_cap=np.float32(soft_cap or 0.0),
                sliding_window=np.int32(sliding_window or 0), v_scale=np.float32(v_scale))


@dataclass(frozen=True)
class CpuAttentionBackend(XlaAttentionBackend):
    """The ``xla`` backend with decode blocks on the C++ kernel (see the module docstring).

    Build it through :func:`~jaxpaged.layers.attention.selection.get_attention_backend`,
    which registers the kernel first (and falls back to ``xla`` when it cannot be built).
    """

    name: str = "cpu"

    def attend(self, q_blocks, kv_pages, page_table, block_seq, block_positions, *, scale,
               sliding_window=None, soft_cap=None):
        """Decode blocks ([NB, 1, H, D]) with a pool the kernel reads: the kernel; else
        :func:`~jaxpaged.layers.attention.xla.paged_attention_chunked`."""
        k_pages, v_pages = kv_pages
        if q_blocks.shape[1] != 1 or not kernel_supports(q_blocks.dtype, k_pages.dtype):
            return paged_attention_chunked(q_blocks, k_pages, v_pages, page_table, block_seq,
                                           block_positions, scale=scale,
                                           sliding_window=sliding_window, soft_cap=soft_cap,
                                           k_scale=self.k_scale, v_scale=self.v_scale)
        out = paged_decode_cpu(q_blocks[:, 0], k_pages, v_pages, page_table, block_seq,
                               block_positions[:, 0], scale=scale,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               k_scale=self.k_scale, v_scale=self.v_scale)
        return out[:, None]


def decode_self_check(num_kv_heads: int, num_heads: int, head_dim: int, page_size: int,
                      dtype) -> float:
    """Max abs difference between the kernel and the ``xla`` backend's chunked attention on
    four decode blocks over a shuffled random pool of ``dtype`` (contexts 1, a page boundary,
    three pages and a half, and a padding block), both jitted. The kernel must be loaded."""
    rng = np.random.default_rng(0)
    pages_per_seq = 4
    num_pages = 3 * pages_per_seq + 1
    page_table = rng.permutation(np.arange(1, num_pages)).reshape(3, pages_per_seq)
    page_table = jnp.asarray(page_table, jnp.int32)
    positions = jnp.asarray([[0], [page_size - 1], [3 * page_size + page_size // 2], [-1]],
                            jnp.int32)
    block_seq = jnp.asarray([0, 1, 2, 0], jnp.int32)
    q = jnp.asarray(rng.normal(size=(4, 1, num_heads, head_dim)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim)), dtype)
            for _ in range(2))
    scale = head_dim ** -0.5
    kernel = jax.jit(lambda *a: paged_decode_cpu(a[0][:, 0], *a[1:5], a[5][:, 0], scale=scale))
    oracle = jax.jit(lambda *a: paged_attention_chunked(*a, scale=scale)[:, 0])
    args = (q, k, v, page_table, block_seq, positions)
    ours, theirs = (np.asarray(f(*args), np.float32)[:3] for f in (kernel, oracle))
    return float(np.abs(ours - theirs).max())


def kernel_available() -> bool:
    """True when this process runs on the CPU and the kernel is built and registered."""
    return jax.default_backend() == "cpu" and load_paged_decode()
