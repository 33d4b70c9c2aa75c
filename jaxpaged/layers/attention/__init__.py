"""Attention backends over the paged KV pool; ``get_attention_backend`` picks one by name."""

from jaxpaged.layers.attention.base import (NULL_PAGE, AttentionBackend, BatchLayout, KVPages,
                                            allocate_kv_pool, kv_bytes_per_page)
from jaxpaged.layers.attention.xla import XlaAttentionBackend

_BACKENDS = {"xla": XlaAttentionBackend}


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


__all__ = ["NULL_PAGE", "AttentionBackend", "BatchLayout", "KVPages", "allocate_kv_pool",
           "get_attention_backend", "kv_bytes_per_page"]
