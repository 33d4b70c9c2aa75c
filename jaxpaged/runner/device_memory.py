"""Device memory in use, per device, for ``jaxpaged:device_memory_used_bytes``.

A GPU's runtime counts it (``Device.memory_stats()["bytes_in_use"]``, the allocator's figure:
weights, the KV pool, activations and whatever else the process holds there). XLA:CPU keeps
no such count (``memory_stats()`` is None), so there it is the bytes of the live arrays'
shards on each device (``jax.live_arrays()``): weights, the KV pool and the step's buffers.
"""

from __future__ import annotations

import jax


def device_memory_used(devices: list) -> dict[str, int]:
    """``str(device)`` -> bytes in use on it, for each of ``devices``."""
    used, counted = {}, []
    for device in devices:
        stats = device.memory_stats()
        if stats and "bytes_in_use" in stats:
            used[str(device)] = int(stats["bytes_in_use"])
        else:
            counted.append(device)
    if counted:
        totals = dict.fromkeys(counted, 0)
        for array in jax.live_arrays():
            for shard in array.addressable_shards:
                if shard.device in totals:
                    totals[shard.device] += shard.data.nbytes
        used.update({str(d): n for d, n in totals.items()})
    return used
