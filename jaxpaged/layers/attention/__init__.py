"""Attention backends over the paged KV pool; ``get_attention_backend`` picks one by name."""

from jaxpaged.layers.attention.base import (NULL_PAGE, AttentionBackend, BatchLayout, KVPages,
                                            allocate_kv_pool, kv_bytes_per_page,
                                            resolve_kv_cache_dtype)
from jaxpaged.layers.attention.selection import ATTENTION_BACKENDS, get_attention_backend

__all__ = ["ATTENTION_BACKENDS", "NULL_PAGE", "AttentionBackend", "BatchLayout", "KVPages",
           "allocate_kv_pool", "get_attention_backend", "kv_bytes_per_page",
           "resolve_kv_cache_dtype"]
