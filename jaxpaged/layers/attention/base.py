"""The attention backend interface and the KV page pool layout.

KV page pool layout (the one place it is defined)
-------------------------------------------------
For each of the model's layers the pool holds one pair ``(k_pages, v_pages)``, each

    [num_pages, page_size, num_kv_heads, head_dim]   in the KV cache dtype.

The KV cache dtype is the model's dtype (``--kv-cache-dtype auto``) or float8_e4m3fn
(``fp8`` / ``fp8_e4m3``, one byte per element: half of a bfloat16 model's KV, a quarter of a
float32 model's). Each layer has two per-tensor scales, ``k_scale`` and ``v_scale`` (vLLM's
names), and the pool stores ``K / k_scale`` and ``V / v_scale`` rounded to its dtype, fp8
saturating at ±448 (``pallas_kernels.kv_quant``); attention reads ``stored * scale``. The
scales are static floats of the layer's backend (:meth:`AttentionBackend.with_kv_scales`), not
arrays of the pool: 1.0 unless calibrated (``jaxpaged.runner.kv_scales``). The engine keeps
them at 1.0 for a pool in the model's dtype, which then holds K and V themselves.

A token at position ``p`` of a request whose page table is ``page_table`` lives in page
``page_table[p // page_size]`` at row ``p % page_size``; its flat *slot* is
``page * page_size + row``. Page 0 is the *null page*: it is never handed to a request,
padding tokens write their K/V there and padding page-table entries point at it (vLLM v1
reserves its block 0 the same way). The whole pool is preallocated once and passed to the
jitted step as a donated argument, so every update happens in place.

A backend turns one step's host-side batch description (:class:`BatchLayout`) into device
metadata once per step (:meth:`AttentionBackend.build_metadata`), then, inside the jitted
step and once per layer, writes the step's new K/V rows into the pool and computes causal
attention for every query token (:meth:`AttentionBackend.forward`). Prefill chunks and
decodes of different requests share one call.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.cpu_build import LAZY_ZEROS_TARGET, load_cpu_kernels

from jaxpaged.constants import KV_CACHE_DTYPES, NULL_PAGE  # noqa: F401 (NULL_PAGE re-exported)
from pallas_kernels.kv_quant import FP8_DTYPE

KVPages = tuple[jax.Array, jax.Array]


@dataclass(frozen=True)
class BatchLayout:
    """Host-side description of one step's ragged batch (numpy, already padded).

    Shapes use T = padded token count, B = padded sequence count, P = padded pages per
    sequence. Sequences ``[num_seqs, B)`` and tokens ``[num_tokens, T)`` are padding.

    Attributes:
        query_start_loc: [B + 1] int32; tokens of sequence i are
            ``[query_start_loc[i], query_start_loc[i+1])`` (padding sequences are empty).
        seq_lens: [B] int32; each sequence's KV length after this step (0 for padding).
        positions: [T] int32; absolute position of every token (0 for padding).
        slot_mapping: [T] int32; flat pool slot each new token's K/V is written to
            (slots of the null page for padding).
        page_table: [B, P] int32; page ids of every sequence (NULL_PAGE for padding).
        num_seqs: real sequence count; num_tokens: real token count.
        verify_block_q: 0, or for a speculative verification step (every sequence has
            1 .. ``verify_block_q`` tokens: its decode token and its proposals; T is
            ``B * verify_block_q``) the query-block size that holds any sequence's tokens,
            so attention runs one small block per sequence
            (``docs/speculative_decoding.md``, "The verify step").
        group_page_tables: None, or for a model whose layers form KV cache groups
            (``jaxpaged.core.kv_groups``) [G - 1, B, P] int32, the page tables of groups
            1 .. G-1 (``page_table`` is group 0's).
        group_slot_mappings: None, or [G - 1, T] int32, each such group's slot mapping.
        state_slots: None, or for a model with recurrent layers
            (``jaxpaged.core.state_slots``) [T] int32, each token's state slot (-1: padding).
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    page_table: np.ndarray
    num_seqs: int
    num_tokens: int
    verify_block_q: int = 0
    group_page_tables: np.ndarray | None = None
    group_slot_mappings: np.ndarray | None = None
    state_slots: np.ndarray | None = None

    @property
    def is_decode_only(self) -> bool:
        """True when every real sequence has exactly one new token."""
        return self.num_tokens == self.num_seqs


class AttentionBackend(abc.ABC):
    """Paged attention over the KV page pool (see the module docstring for the layout).

    Implementations must be hashable and immutable: they are static parts of the jitted
    step. ``build_metadata`` runs on the host without JAX; ``forward`` runs inside jit. A
    backend carries one layer's KV scales, so a model whose layers have different scales holds
    one backend per layer (``jaxpaged.runner.kv_scales``).
    """

    #: The name used by ``--attention-backend``.
    name: str

    @abc.abstractmethod
    def build_metadata(self, layout: BatchLayout) -> dict[str, np.ndarray]:
        """Host arrays this backend needs each step, derived from ``layout``.

        Every value must have a shape that depends only on the padded sizes (T, B, P),
        so that the jitted step compiles once per bucket.
        """

    @abc.abstractmethod
    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: KVPages,
                metadata: dict[str, jax.Array], *, scale: float,
                sliding_window: int | None = None, soft_cap: float | None = None,
                sinks: jax.Array | None = None) -> tuple[jax.Array, KVPages]:
        """Write this step's K/V into the pool, then attend.

        Args:
            q: [T, num_heads, head_dim] queries (RoPE applied).
            k, v: [T, num_kv_heads, head_dim] this step's keys and values.
            kv_pages: the layer's ``(k_pages, v_pages)``, each
                [num_pages, page_size, num_kv_heads, head_dim] in the KV cache dtype (k and
                v are stored quantized, attention reads them dequantized).
            metadata: device copies of ``build_metadata``'s arrays plus the common
                ``slot_mapping``, ``page_table``, ``seq_lens``, ``query_start_loc``, ``positions``.
            scale: softmax scale, normally ``head_dim ** -0.5``.
            sliding_window: if set, a query at position p sees only keys at positions in
                (p - sliding_window, p] (Mistral; Beltagy et al., "Longformer", 2020).
            soft_cap: if set, scaled scores s become ``soft_cap * tanh(s / soft_cap)``
                (Gemma 2).
            sinks: if set, [num_heads] float32 attention-sink logits (gpt-oss; OpenAI's
                gpt-oss model card, section 2.1): each query's softmax over its visible keys
                gets one more term ``exp(sink)`` of its head in the denominator, with no
                value (``softmax([scores, sink])`` with the sink's weight dropped). Passed
                only by models that have them, so a backend without sinks never sees it.

        Returns:
            ([T, num_heads, head_dim] attention output in q's dtype, updated kv_pages).
            Rows of padding tokens are unspecified.
        """

    @abc.abstractmethod
    def with_kv_scales(self, k_scale: float, v_scale: float) -> "AttentionBackend":
        """This backend for a layer whose pool stores K / k_scale and V / v_scale.

        Raises:
            ValueError: a scale that is not a finite positive number.
        """


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The pool dtype for ``--kv-cache-dtype``: ``auto`` is the model's dtype; ``float16``
    (llama.cpp's default K/V type, ``-ctk f16``) stores half the bytes of a float32 model's;
    ``fp8`` and ``fp8_e4m3`` (vLLM's two spellings of one format) are float8_e4m3fn.

    Raises:
        ValueError: any other name (vLLM's ``fp8_e5m2`` is not supported), or ``float16``
            under a model that is not float32 (the kernels read a float16 pool only under
            float32 queries: ``pallas_kernels.kv_quant.is_half_under_float32``).
    """
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype == "float16":
        if jnp.dtype(model_dtype) != jnp.float32:
            raise ValueError(f"EngineArgs.kv_cache_dtype 'float16' needs a float32 model "
                             f"(--dtype float32); this one is {jnp.dtype(model_dtype).name}")
        return jnp.dtype(jnp.float16)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return jnp.dtype(FP8_DTYPE)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from "
                     f"{list(KV_CACHE_DTYPES)}")


def allocate_kv_pool(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                     head_dim: int, dtype, sharding: jax.sharding.Sharding | None = None
                     ) -> list[KVPages]:
    """Preallocate the zero-filled pool: ``num_layers`` pairs of
    [num_pages, page_size, num_kv_heads, head_dim] arrays of the KV cache ``dtype``, each
    placed with ``sharding`` (every device allocates only its own slice) or on the default
    device.

    On one CPU device the zeros come from ``csrc/lazy_zeros.cc`` where the kernel library
    builds: the host commits a page of the pool only when a step first writes it, so the
    process's resident memory grows with the tokens held, not with the budget."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    one_cpu = (sharding is None or len(sharding.device_set) == 1) and \
        jax.default_backend() == "cpu" and load_cpu_kernels()
    zeros = _zeros_program(shape, np.dtype(dtype), sharding, one_cpu)
    return [(zeros(), zeros()) for _ in range(num_layers)]


@functools.lru_cache(maxsize=32)
def _zeros_program(shape: tuple, dtype, sharding, one_cpu: bool):
    """The jitted zero-fill of one pool array (kept: a pool reallocated after a sleep or a
    failed step compiles nothing)."""
    make = (lambda: jax.ffi.ffi_call(LAZY_ZEROS_TARGET, jax.ShapeDtypeStruct(shape, dtype))()
            ) if one_cpu else (lambda: jnp.zeros(shape, dtype))
    return jax.jit(make, out_shardings=sharding)


def kv_bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                      dtype) -> int:
    """Bytes one page occupies across all layers, K and V together, in the KV cache ``dtype``
    (one byte an element for fp8, so a byte budget holds twice the pages of a bfloat16
    pool and four times those of a float32 pool)."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
