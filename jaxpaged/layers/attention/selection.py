"""``--attention-backend {auto,xla,pallas,cpu}``: pick a backend, with a start-up self-check.

``auto`` picks ``pallas`` on a GPU only after the kernels reproduce the ``xla`` reference on a
small mixed prefill/decode batch over a pool of the engine's KV cache dtype (fp8 included);
any exception or mismatch logs a warning and falls back to ``xla``. On the CPU ``auto`` picks
``cpu`` (the C++ paged attention kernel, :mod:`jaxpaged.layers.attention.cpu`) when the
model's dtype is float32 or bfloat16 with a KV pool of that dtype, the kernel builds, and its
output matches the ``xla`` backend's on the same small mixed batch and on a decode-only one
(a pass is recorded beside the kernel library and not checked again:
:mod:`jaxpaged.layers.attention.self_check_record`); otherwise ``xla``. ``cpu`` asked for by
name also falls back to ``xla`` (with a warning) when the kernel cannot be built.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.constants import ATTENTION_BACKENDS
from jaxpaged.layers.attention.base import AttentionBackend, BatchLayout
from jaxpaged.layers.attention.cpu import CpuAttentionBackend, kernel_available, kernel_supports
from jaxpaged.layers.attention.pallas import PallasAttentionBackend
from jaxpaged.layers.attention.self_check_record import record_error, recorded_error
from jaxpaged.layers.attention.xla import XlaAttentionBackend
from pallas_kernels.kv_quant import quantize_kv

logger = logging.getLogger(__name__)


def get_attention_backend(name: str, *, num_kv_heads: int = 8, num_heads: int = 32,
                          head_dim: int = 128, page_size: int = 16, dtype=jnp.bfloat16,
                          kv_cache_dtype=None) -> AttentionBackend:
    """The backend called ``name`` (``auto`` resolved as described in the module docstring).

    The shape arguments describe the model (``dtype``) and its pool (``kv_cache_dtype``,
    default ``dtype``), for ``auto``'s self-check.

    Raises:
        ValueError: an unknown name.
    """
    if name == "xla":
        return XlaAttentionBackend()
    if name == "pallas":
        return PallasAttentionBackend()
    if name == "cpu":
        if jax.default_backend() != "cpu":
            logger.warning("the cpu attention backend runs only on the CPU; using xla")
        return CpuAttentionBackend() if kernel_available() else XlaAttentionBackend()
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}; choose from {list(ATTENTION_BACKENDS)}")
    if jax.default_backend() == "cpu":
        return _auto_on_cpu(num_kv_heads, num_heads, head_dim, page_size, dtype,
                            dtype if kv_cache_dtype is None else kv_cache_dtype)
    if jax.default_backend() != "gpu":
        return XlaAttentionBackend()
    try:
        err = self_check(PallasAttentionBackend(), num_kv_heads, num_heads, head_dim, page_size,
                         dtype, kv_cache_dtype)
    except Exception as e:  # noqa: BLE001 - any kernel failure means: do not use it
        logger.warning("pallas attention failed its self-check (%s: %s); using xla",
                       type(e).__name__, e)
        return XlaAttentionBackend()
    tolerance = 1e-4 if dtype == jnp.float32 else 2e-2
    if not err <= tolerance:
        logger.warning("pallas attention differs from the xla reference by %.3g (> %.0e); "
                       "using xla", err, tolerance)
        return XlaAttentionBackend()
    logger.info("attention backend: pallas (self-check max error %.3g)", err)
    return PallasAttentionBackend()


def _auto_on_cpu(num_kv_heads, num_heads, head_dim, page_size, dtype, kv_cache_dtype):
    """``cpu`` if the kernel reads this pool, builds and passes :func:`self_check` on a mixed
    step and on a decode-only one (or a pass of the same check is on record:
    :mod:`jaxpaged.layers.attention.self_check_record`)."""
    if not kernel_supports(dtype, kv_cache_dtype) or not kernel_available():
        return XlaAttentionBackend()
    check = dict(backend="cpu", num_kv_heads=num_kv_heads, num_heads=num_heads,
                 head_dim=head_dim, page_size=page_size, dtype=jnp.dtype(dtype).name)
    err = recorded_error(check)
    if err is not None:
        logger.info("attention backend: cpu (self-check on record, max error %.3g)", err)
        return CpuAttentionBackend()
    try:
        err = max(self_check(CpuAttentionBackend(), num_kv_heads, num_heads, head_dim,
                             page_size, dtype, decode_only=decode_only)
                  for decode_only in (False, True))
    except Exception as e:  # noqa: BLE001 - any kernel failure means: do not use it
        logger.warning("cpu attention failed its self-check (%s: %s); using xla",
                       type(e).__name__, e)
        return XlaAttentionBackend()
    tolerance = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    if not err <= tolerance:
        logger.warning("cpu attention differs from the xla reference by %.3g (> %.0e); "
                       "using xla", err, tolerance)
        return XlaAttentionBackend()
    record_error(check, err)
    logger.info("attention backend: cpu (self-check max error %.3g)", err)
    return CpuAttentionBackend()


def self_check(backend: AttentionBackend, num_kv_heads: int, num_heads: int, head_dim: int,
               page_size: int, dtype, kv_cache_dtype=None, decode_only: bool = False) -> float:
    """Max abs difference between ``backend`` and the xla backend over one step through
    ``build_metadata`` and ``forward`` (KV write, then attention): a 20-token prefill chunk
    starting at position 5 and one decode at position 37, plus padding, over a random pool of
    ``kv_cache_dtype`` (default ``dtype``); with ``decode_only``, the chunk's last token alone
    (a decode at position 24). Each sequence's page-table row holds
    :func:`self_check_pages` shuffled pages, enough for 38 tokens at any ``page_size``.

    Raises:
        ValueError: ``page_size`` < 1.
    """
    pages_per_seq = self_check_pages(page_size)
    rng = np.random.default_rng(0)
    num_pages = 2 * pages_per_seq
    kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
    pool = rng.normal(size=(2, num_pages, page_size, num_kv_heads, head_dim))
    page_table = rng.permutation(num_pages).astype(np.int32).reshape(2, pages_per_seq)
    decode_pos = 37
    chunk = np.arange(24, 25) if decode_only else np.arange(5, 25)
    n = len(chunk) + 1                                  # real tokens
    t_pad = 4 if decode_only else 24
    positions = np.concatenate([chunk, [decode_pos], np.zeros(t_pad - n)]).astype(np.int32)
    rows = np.concatenate([np.zeros(n - 1, np.int64), [1]])
    slots = page_table[rows, positions[:n] // page_size] * page_size + positions[:n] % page_size
    layout = BatchLayout(query_start_loc=np.asarray([0, n - 1, n], np.int32),
                         seq_lens=np.asarray([25, decode_pos + 1], np.int32),
                         positions=positions,
                         slot_mapping=np.concatenate([slots, np.zeros(t_pad - n)]).astype(np.int32),
                         page_table=page_table, num_seqs=2, num_tokens=n)
    q, k, v = (jnp.asarray(rng.normal(size=(t_pad, h, head_dim)), dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    outs = []
    for impl in (backend, XlaAttentionBackend()):
        metadata = impl.build_metadata(layout)
        metadata.update(slot_mapping=layout.slot_mapping, page_table=page_table,
                        seq_lens=layout.seq_lens, query_start_loc=layout.query_start_loc,
                        positions=positions)
        kv_pages = tuple(quantize_kv(jnp.asarray(p, dtype), 1.0, kv_cache_dtype) for p in pool)
        out, _ = impl.forward(q, k, v, kv_pages, {n: jnp.asarray(a) for n, a in metadata.items()},
                              scale=head_dim ** -0.5)
        outs.append(np.asarray(out, np.float32)[:n])
    return float(np.abs(outs[0] - outs[1]).max())


def self_check_pages(page_size: int) -> int:
    """Pages per sequence in :func:`self_check`'s page table: at least 4, and enough for the
    38 tokens (positions 0..37) of its longest sequence at ``page_size`` tokens a page.

    Raises:
        ValueError: ``page_size`` < 1.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return max(4, -(-38 // page_size))
