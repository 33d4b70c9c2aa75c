"""How many KV pages the pool gets.

Order of precedence: ``--num-gpu-blocks-override`` (an exact page count), then
``--kv-cache-memory-bytes`` (a byte budget), then, on a GPU, ``--gpu-memory-utilization``
(default 0.92, vLLM's) of the device's memory minus what the weights and a profiling step at
``max_num_batched_tokens`` use; elsewhere (CPU) :data:`DEFAULT_CPU_KV_CACHE_BYTES`, capped at
what ``max_num_seqs`` requests of ``max_model_len`` tokens could ever use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import jax

logger = logging.getLogger(__name__)

#: KV budget on a CPU when none is given (vLLM's CPU backend also defaults to 4 GiB).
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


def num_kv_pages(*, bytes_per_page: int, pages_per_seq: int, max_num_seqs: int,
                 num_gpu_blocks_override: int | None, kv_cache_memory_bytes: int | None,
                 gpu_memory_utilization: float,
                 profile_peak_bytes: Callable[[], int | None], num_devices: int = 1,
                 device=None, kv_cache_memory_share: float = 1.0) -> int:
    """Pages for the pool (the null page included).

    Args:
        bytes_per_page: K and V bytes of one page across all layers, on one device.
        num_devices: devices holding pools (every replica's slices of every page); CPU
            devices share the host's memory, so the CPU default budget covers all of them
            together.
        device: the device whose memory a GPU budget comes from (default: the first local one).
        pages_per_seq: pages of one ``max_model_len`` request.
        max_num_seqs: the most concurrent requests.
        num_gpu_blocks_override, kv_cache_memory_bytes, gpu_memory_utilization: the flags.
        profile_peak_bytes: runs a profiling step and returns the device's peak bytes in use
            (None where the device reports no memory statistics); called only on a GPU.
        kv_cache_memory_share: the fraction of the CPU default budget this engine may take
            (``--models-config``; a GPU's share is already in ``gpu_memory_utilization``).

    Raises:
        ValueError: the GPU has no memory left for KV pages at this utilization.
    """
    if num_gpu_blocks_override is not None:
        return num_gpu_blocks_override
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes // bytes_per_page
    if jax.default_backend() == "gpu":
        stats = (device or jax.local_devices()[0]).memory_stats() or {}
        total = stats.get("bytes_limit", 0)
        peak = profile_peak_bytes() or stats.get("bytes_in_use", 0)
        budget = int(total * gpu_memory_utilization) - peak
        if budget < bytes_per_page * pages_per_seq:
            raise ValueError(
                f"no room for the KV cache: {gpu_memory_utilization:.2f} x {total / 2**30:.1f} GiB "
                f"minus {peak / 2**30:.1f} GiB used by weights and activations leaves "
                f"{budget / 2**30:.2f} GiB; raise --gpu-memory-utilization or lower --max-model-len")
        logger.info("GPU memory: %.1f GiB total, %.1f GiB peak in the profiling step, "
                    "%.1f GiB for KV", total / 2**30, peak / 2**30, budget / 2**30)
        return budget // bytes_per_page
    budget = int(DEFAULT_CPU_KV_CACHE_BYTES * kv_cache_memory_share)
    cap = budget // (bytes_per_page * num_devices)
    need = max_num_seqs * pages_per_seq + 1
    cap_text = f"the {DEFAULT_CPU_KV_CACHE_BYTES / 2**30:.0f} GiB default cap"
    if kv_cache_memory_share != 1:
        cap_text = (f"kv_cache_memory_share {kv_cache_memory_share:g} of {cap_text} "
                    f"({budget / 2**30:.2f} GiB)")
    if need <= cap:
        logger.info("CPU KV budget: what max_num_seqs=%d requests of %d pages need (%.1f MiB)%s",
                    max_num_seqs, pages_per_seq, need * bytes_per_page * num_devices / 2**20,
                    "" if kv_cache_memory_share == 1 else f", under {cap_text}")
    else:
        logger.info("CPU KV budget: %s (max_num_seqs=%d requests of %d pages would need %.1f "
                    "GiB; --kv-cache-memory-bytes sets another); pages take host memory as "
                    "they are first written", cap_text, max_num_seqs, pages_per_seq,
                    need * bytes_per_page * num_devices / 2**30)
    return min(cap, need)


def device_memory_bytes() -> int | None:
    """Memory of the default device: the GPU's ``bytes_limit``, or the host's physical
    memory for a CPU; None if unknown."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits(num_pages: int, bytes_per_page: int, num_devices: int = 1) -> None:
    """Refuse a pool larger than the device's memory before trying to allocate it
    (``bytes_per_page`` per device; on a CPU the ``num_devices`` share the host's memory).

    Raises:
        ValueError: stating the pool's and the device's sizes.
    """
    total = device_memory_bytes()
    shared = num_devices if jax.default_backend() == "cpu" else 1
    need = num_pages * bytes_per_page * shared
    if total is not None and need > total:
        raise ValueError(f"a KV pool of {num_pages} pages ({need / 2**30:.1f} GiB) does not fit in "
                         f"the device's {total / 2**30:.1f} GiB; lower --kv-cache-memory-bytes or "
                         f"--num-gpu-blocks-override")
