"""A GGUF file's packed weights, laid out once and kept for the next start-up (numpy only).

Keeping a GGUF's projections packed (:meth:`GGUFCheckpoint.get_packed
<jaxpaged.models.gguf_loader.GGUFCheckpoint.get_packed>`) decodes every tensor's ggml blocks
and lays them out for the kernel (:func:`jaxpaged.layers.packed_layout.pack_weight`), several
times slower than reading the laid-out arrays back (``docs/measurements.md``, "GGUF"). The
laid-out arrays are written here as they are made, one ``.npy`` file
per array, and read back on the next load of the same file.

An entry belongs to one file (its real path, size and modification time) and to this
version of the code that lays it out (a digest of ``gguf_blocks.py``, ``gguf_loader.py`` and
``packed_layout.py``): a changed file or layout never reads an old entry. Files are written
whole or not at all (a temporary name, then renamed), so a load that stops half-way leaves
entries that are each complete. The cache lives beside the compiled steps
(``<compilation cache>/gguf-packed``), so an empty compilation cache is a cold start;
``--compilation-cache-dir ''`` turns both off. Only files up to :data:`MAX_FILE_BYTES` are
kept (a larger model's second copy would cost more disk than its repacking costs time).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

import numpy as np

from jaxpaged.atomic_file import digest_files, write_atomically

logger = logging.getLogger(__name__)

#: GGUF files larger than this are not cached (bytes; an 8B model at 4 bits fits).
MAX_FILE_BYTES = 8 << 30


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A digest of the modules whose code decides the packed layout."""
    from jaxpaged.layers import packed_layout
    from jaxpaged.models import gguf_blocks, gguf_loader

    return digest_files(m.__file__ for m in (gguf_blocks, gguf_loader, packed_layout))[:16]


class PackedWeightCache:
    """The packed arrays of one GGUF file under ``directory`` (None: a cache that holds
    nothing and writes nothing).

    Args:
        directory: the cache's root (``<compilation cache>/gguf-packed``) or None.
        gguf_path: the GGUF file whose tensors it holds.
    """

    def __init__(self, directory: str | None, gguf_path: str):
        self._folder = None
        if directory is None:
            return
        stat = os.stat(gguf_path)
        if stat.st_size > MAX_FILE_BYTES:
            return
        key = hashlib.sha256(repr((os.path.realpath(gguf_path), stat.st_size,
                                   stat.st_mtime_ns, _code_digest())).encode()).hexdigest()
        self._folder = os.path.join(directory, key[:24])

    def _path(self, name: str, leaf: str) -> str:
        return os.path.join(self._folder, f"{name}.{leaf}.npy")

    def get(self, name: str, leaves: tuple[str, ...]) -> dict[str, np.ndarray] | None:
        """Tensor ``name``'s arrays ``leaves`` as stored, or None if any is missing or
        unreadable."""
        if self._folder is None:
            return None
        try:
            return {leaf: np.load(self._path(name, leaf)) for leaf in leaves}
        except (OSError, ValueError):
            return None

    def put(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        """Keep tensor ``name``'s ``arrays``; a failure to write is logged once and turns
        the cache off (the load goes on)."""
        if self._folder is None:
            return
        try:
            for leaf, array in arrays.items():
                write_atomically(self._path(name, leaf),
                                 lambda f, a=array: np.save(f, a, allow_pickle=False))
        except OSError as e:
            logger.warning("cannot keep packed GGUF weights in %s (%s); repacking on every "
                           "load", self._folder, e)
            self._folder = None
