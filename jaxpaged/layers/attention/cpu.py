"""The ``cpu`` attention backend: query blocks through a C++ paged attention kernel (XLA FFI).

The ``xla`` backend walks 4-page chunks, each gathered into a materialized copy and reduced by
small YNNPACK calls, several passes over the KV a step reads; on W1 decode attention was most
of a CPU decode step (``docs/measurements.md``, "CPU attention"), and a prefill block of 16
queries computes all 16 rows even when one is real (a decode inside a mixed step). This
backend sends every query block (``block_q`` = 1 in a decode-only step, 16 otherwise, or a
speculative verify block's 1 + k) to ``csrc/paged_attention_cpu.cc``, which walks the page
table itself, reads each K/V page once per block with the softmax fused and skips padding
queries (:mod:`jaxpaged.layers.cpu_build` builds and registers it). It reads the
queries and writes the outputs in token order, so ``forward`` gathers nothing into blocks
and scatters nothing back (on W1's 2048-token prefill step those two copies were about as
long as the kernel itself, ``docs/benchmarks.md``). The KV write happens in the same call,
into the pool in place (aliased outputs), for unit K/V scales; pools the kernel does not read
(an fp8 pool, or one whose dtype differs from the queries') stay on the ``xla`` path (an
in-place scatter, then chunked attention); the ``xla`` backend remains the numerical oracle.

Reference: the online softmax of Milakov & Gimelshein (2018) over PagedAttention's page table
(Kwon et al., SOSP 2023), decodes structured as vLLM's paged attention v1 kernel and query
blocks as FlashAttention-2's tiles (Dao, 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.cpu_build import (PAGED_ATTENTION_TARGET, PAGED_ATTENTION_WRITE_TARGET,
                                      load_cpu_kernels)
from jaxpaged.layers.attention.xla import XlaAttentionBackend, paged_attention_chunked
from pallas_kernels.kv_quant import is_half_under_float32

#: Query and pool dtypes the kernel reads (the pool in the queries' dtype).
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def kernel_supports(q_dtype, pool_dtype) -> bool:
    """True when the kernel reads a pool of ``pool_dtype`` for queries of ``q_dtype``: the
    queries' own dtype, or float16 under float32 queries."""
    q = jnp.dtype(q_dtype)
    return q in KERNEL_DTYPES and (jnp.dtype(pool_dtype) == q
                                   or is_half_under_float32(q, pool_dtype))


def paged_attention_cpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, block_tokens: jax.Array, block_seq: jax.Array,
                        block_positions: jax.Array, *, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        k_scale: float = 1.0, v_scale: float = 1.0,
                        sinks: jax.Array | None = None) -> jax.Array:
    """Paged attention of a step's query tokens, in query blocks, by the C++ kernel (the FFI
    target must be registered: :func:`~jaxpaged.layers.cpu_build.load_cpu_kernels`).

    Args:
        q: [T, H, D] query tokens, float32 or bfloat16.
        k_pages, v_pages: [num_pages, page_size, KVH, D] in q's dtype, holding K / k_scale
            and V / v_scale; H a multiple of KVH (grouped-query attention).
        page_table: [B, P] int32.
        block_tokens: [NB, Bq] int32 the token (row of q) of each query of NB blocks of Bq
            tokens of one sequence each (Bq = 1 for decodes; out of [0, T): padding).
        block_seq: [NB] int32 each block's page-table row.
        block_positions: [NB, Bq] int32 each query's position (-1: a padding query).
        scale: softmax scale; sliding_window, soft_cap, sinks ([H] float32 attention-sink
            logits, gpt-oss; None: none): as
            :meth:`~jaxpaged.layers.attention.base.AttentionBackend.forward`.

    Returns:
        [T, H, D] in q's dtype: for each block query, softmax(scale * q.k) . v over the keys
        at positions ``<= position`` (and within the window; with sinks, each head's
        ``exp(sink)`` added to its denominator), accumulated in float32, in its
        token's row; zeros in the rows of tokens no block query names.
    """
    call = jax.ffi.ffi_call(PAGED_ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages,
                *_int32(page_table, block_tokens, block_seq, block_positions), _sinks(sinks),
                **_attributes(scale, sliding_window, soft_cap, k_scale, v_scale))


def write_and_attend_cpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k: jax.Array,
                         v: jax.Array, slot_mapping: jax.Array, page_table: jax.Array,
                         block_tokens: jax.Array, block_seq: jax.Array,
                         block_positions: jax.Array, *, scale: float,
                         sliding_window: int | None = None, soft_cap: float | None = None,
                         sinks: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step's new rows k, v [T, KVH, D] (the pools' dtype, stored as they are) into
    their ``slot_mapping`` [T] slots, then :func:`paged_attention_cpu` (unit K/V scales), in
    one kernel call that updates the pools in place (aliased outputs; under donation no
    copy): one XLA scatter less per pool and layer than ``write_kv`` before the kernel.

    Returns:
        ([T, H, D] attention output, the updated k_pages, v_pages).
    """
    call = jax.ffi.ffi_call(
        PAGED_ATTENTION_WRITE_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
         jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={1: 1, 2: 2})
    return call(q, k_pages, v_pages,
                *_int32(page_table, block_tokens, block_seq, block_positions), _sinks(sinks),
                k.astype(k_pages.dtype), v.astype(v_pages.dtype), slot_mapping.astype(jnp.int32),
                **_attributes(scale, sliding_window, soft_cap, 1.0, 1.0))


def _int32(*arrays):
    return [a.astype(jnp.int32) for a in arrays]


def _sinks(sinks) -> jax.Array:
    """The kernel's sinks operand: [H] float32, or an empty [0] array for a model without
    sinks (the kernel then starts every softmax at -inf and 0, as before sinks existed)."""
    return jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)


def _attributes(scale, sliding_window, soft_cap, k_scale, v_scale) -> dict:
    return dict(scale=np.float32(scale * k_scale), soft_cap=np.float32(soft_cap or 0.0),
                sliding_window=np.int32(sliding_window or 0), v_scale=np.float32(v_scale))


@dataclass(frozen=True)
class CpuAttentionBackend(XlaAttentionBackend):
    """The ``xla`` backend with its query blocks on the C++ kernel (see the module docstring).

    Build it through :func:`~jaxpaged.layers.attention.selection.get_attention_backend`,
    which registers the kernel first (and falls back to ``xla`` when it cannot be built).
    """

    name: str = "cpu"

    def forward(self, q, k, v, kv_pages, metadata, *, scale, sliding_window=None,
                soft_cap=None, sinks=None):
        """The KV write, then the kernel on the tokens in place (no gather into blocks), in
        one call (:func:`write_and_attend_cpu`) for unit K/V scales; a pool the kernel does
        not read: the ``xla`` backend's forward. Attention sinks go to the kernel."""
        if not kernel_supports(q.dtype, kv_pages[0].dtype):
            return super().forward(q, k, v, kv_pages, metadata, scale=scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap,
                                   **({} if sinks is None else {"sinks": sinks}))
        if self.k_scale == 1.0 and self.v_scale == 1.0:
            out, *kv_pages = write_and_attend_cpu(
                q, *kv_pages, k, v, metadata["slot_mapping"], metadata["page_table"],
                metadata["block_tokens"], metadata["block_seq"], metadata["block_positions"],
                scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
            return out, tuple(kv_pages)
        kv_pages = self.write_kv(kv_pages, k, v, metadata["slot_mapping"])
        out = paged_attention_cpu(q, *kv_pages, metadata["page_table"], metadata["block_tokens"],
                                  metadata["block_seq"], metadata["block_positions"],
                                  scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                  k_scale=self.k_scale, v_scale=self.v_scale, sinks=sinks)
        return out, kv_pages

    def attend(self, q_blocks, kv_pages, page_table, block_seq, block_positions, *, scale,
               sliding_window=None, soft_cap=None, sinks=None):
        """Query blocks [NB, Bq, H, D] over a pool the kernel reads: the kernel (sinks
        included); else :func:`~jaxpaged.layers.attention.xla.paged_attention_chunked`."""
        k_pages, v_pages = kv_pages
        options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                       k_scale=self.k_scale, v_scale=self.v_scale, sinks=sinks)
        if not kernel_supports(q_blocks.dtype, k_pages.dtype):
            return paged_attention_chunked(q_blocks, k_pages, v_pages, page_table, block_seq,
                                           block_positions, **options)
        nb, block_q, num_heads, head_dim = q_blocks.shape
        tokens = jnp.arange(nb * block_q, dtype=jnp.int32).reshape(nb, block_q)
        out = paged_attention_cpu(q_blocks.reshape(nb * block_q, num_heads, head_dim), k_pages,
                                  v_pages, page_table, tokens, block_seq, block_positions,
                                  **options)
        return out.reshape(q_blocks.shape)


def kernel_available() -> bool:
    """True when this process runs on the CPU and the kernel is built and registered."""
    return jax.default_backend() == "cpu" and load_cpu_kernels()

