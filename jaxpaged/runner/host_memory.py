"""Host memory that glibc's allocator keeps after XLA compilations, handed back to the OS.

XLA:CPU allocates and frees hundreds of MB while it compiles a step program. glibc keeps
freed heap memory in its arenas (one per thread that allocated, up to 8 per core), so a
server's resident memory kept the peak of its start-up and background compilations for its
whole life (``docs/measurements.md``, "Host memory"). :func:`release_freed_memory` returns
the free pages at the tops and inside the arenas (``malloc_trim``);
:func:`limit_malloc_arenas` caps the arenas (the ``MALLOC_ARENA_MAX`` of many Python servers'
deployment guides). Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

#: ``mallopt`` parameter number of ``M_ARENA_MAX`` (glibc's ``malloc.h``).
_M_ARENA_MAX = -8


@functools.lru_cache(maxsize=1)
def _glibc():
    """The C library if it is glibc (it has ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc's, absent from musl and macOS
        return libc
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Give the OS back the heap memory glibc holds free (``malloc_trim(0)``); True when
    some was released."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def limit_malloc_arenas(arenas: int) -> None:
    """Let glibc create at most ``arenas`` malloc arenas from now on (threads share them
    beyond that); call before the threads that allocate start.

    Raises:
        ValueError: ``arenas`` < 1.
    """
    if arenas < 1:
        raise ValueError(f"arenas must be >= 1, got {arenas}")
    libc = _glibc()
    if libc is not None and not libc.mallopt(_M_ARENA_MAX, arenas):
        logger.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
