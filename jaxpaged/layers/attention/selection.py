"""``--attention-backend {auto,xla,pallas}``: pick a backend, with a start-up self-check.

``auto`` picks ``pallas`` on a GPU only after the kernels reproduce the ``xla`` reference on a
small mixed prefill/decode batch over a pool of the engine's KV cache dtype (fp8 included);
any exception or mismatch logs a warning and falls back to ``xla``. Everywhere else ``auto``
is ``xla`` (the kernels would run in the slow interpreter).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.constants import ATTENTION_BACKENDS
from jaxpaged.layers.attention.base import AttentionBackend
from jaxpaged.layers.attention.pallas import PallasAttentionBackend
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
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}; choose from {list(ATTENTION_BACKENDS)}")
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


def self_check(backend: AttentionBackend, num_kv_heads: int, num_heads: int, head_dim: int,
               page_size: int, dtype, kv_cache_dtype=None) -> float:
    """Max abs difference between ``backend`` and the xla reference on one random batch of
    two sequences: a 20-token prefill chunk starting at position 5 and one decode at 37,
    over a pool of ``kv_cache_dtype`` (default ``dtype``) that both read alike."""
    rng = np.random.default_rng(0)
    num_pages = 8
    kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
    pool = lambda: quantize_kv(
        jnp.asarray(rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim)), dtype),
        1.0, kv_cache_dtype)
    kv_pages = (pool(), pool())
    page_table = jnp.asarray([[3, 1, 6, 2], [5, 7, 4, 0]], jnp.int32)
    q_blocks = jnp.asarray(rng.normal(size=(3, 16, num_heads, head_dim)), dtype)
    positions = np.full((3, 16), -1, np.int32)
    positions[0] = np.arange(5, 21)
    positions[1, :4] = np.arange(21, 25)
    positions[2, 0] = min(37, 4 * page_size - 1)
    args = (q_blocks, kv_pages, page_table, jnp.asarray([0, 0, 1], jnp.int32),
            jnp.asarray(positions))
    scale = head_dim ** -0.5
    got = np.asarray(backend.attend(*args, scale=scale), np.float32)
    want = np.asarray(XlaAttentionBackend().attend(*args, scale=scale), np.float32)
    valid = positions >= 0
    return float(np.abs(got - want)[valid].max())
