"""Passed attention self-checks kept on disk beside the CPU kernel library.

``--attention-backend auto`` on a CPU compares the C++ kernel with the ``xla`` backend on two
small steps before it uses it (``jaxpaged.layers.attention.selection``), op by op, a visible
part of a start-up, warm or cold (``docs/measurements.md``, "Attention self-check"). The
outcome depends only on the kernel's and the backends' code, the compiler, the
CPU, the jax/jaxlib versions and the check's shapes and dtypes, so a pass is recorded under
``<cache root>/kernels`` (where the library itself is cached, ``jaxpaged.layers.cpu_build``),
named by a digest of all of them, and a later start-up with the same digest takes the recorded
error instead of checking again. Failures are not recorded (the check runs again, and falls
back again). ``JAXPAGED_DISABLE_COMPILE_CACHE=1`` turns the record off, as it does the compile
cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

from jaxpaged.atomic_file import digest_files, write_text_atomically

logger = logging.getLogger(__name__)

#: Folders (under ``jaxpaged/layers``) whose sources a check's outcome depends on.
_SOURCE_FOLDERS = ("attention", "csrc")


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """SHA-256 of the attention backends' Python files and the CPU kernels' C++ sources."""
    layers = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return digest_files(os.path.join(layers, folder, name) for folder in _SOURCE_FOLDERS
                        for name in sorted(os.listdir(os.path.join(layers, folder)))
                        if name.endswith((".py", ".cc", ".h")))


def record_path(check: dict) -> str | None:
    """Where a pass of the self-check described by ``check`` (backend name, shapes, dtypes:
    any repr-able values) is recorded; None while ``JAXPAGED_DISABLE_COMPILE_CACHE`` is
    set."""
    import jax
    import jaxlib

    from jaxpaged.layers.cpu_build import CXX_ENV, cpu_flags
    from jaxpaged.constants import DISABLE_ENV, cache_root

    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    parts = (sorted((k, repr(v)) for k, v in check.items()), _source_digest(),
             jax.__version__, jaxlib.__version__, cpu_flags(), os.environ.get(CXX_ENV) or "g++")
    name = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
    return os.path.join(cache_root(), "kernels", f"self-check-{name}.txt")


def recorded_error(check: dict) -> float | None:
    """The max error a passed self-check ``check`` recorded, or None (none recorded, an
    unreadable record, or the record turned off)."""
    path = record_path(check)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def record_error(check: dict, err: float) -> None:
    """Record that self-check ``check`` passed with max error ``err`` (atomically; a record
    that cannot be written is skipped with a debug message)."""
    path = record_path(check)
    if path is None:
        return
    try:
        write_text_atomically(path, repr(err))
    except OSError as e:
        logger.debug("self-check not recorded: %s", e)
