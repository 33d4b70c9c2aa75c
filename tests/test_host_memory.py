"""``jaxpaged.runner.host_memory``: glibc's free heap memory handed back after compilations."""

import pytest

from jaxpaged.runner import host_memory


def resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_free_heap_pages_between_live_blocks_go_back_to_the_os():
    # 400 MB in 4 kB blocks (heap blocks, below the mmap threshold), every 16th kept: the
    # heap cannot shrink from its top, so freeing the others leaves ~375 MB of free pages
    # inside glibc's arena until malloc_trim hands them back.
    blocks = [bytearray(4096) for _ in range(100_000)]
    kept = blocks[::16]
    del blocks
    before = resident_kb()
    assert host_memory.release_freed_memory()
    assert resident_kb() < before - 200_000
    assert len(kept) == 6250


def test_arena_limit_is_checked():
    host_memory.limit_malloc_arenas(2)
    with pytest.raises(ValueError, match="arenas must be >= 1"):
        host_memory.limit_malloc_arenas(0)
