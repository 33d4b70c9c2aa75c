"""A GGUF file's packed weights, laid out once and kept for the next start-up (numpy only).

Keeping a GGUF's projections packed (:meth:`GGUFCheckpoint.get_packed
<jaxpaged.models.gguf_loader.GGUFCheckpoint.get_packed>`) decodes every tensor's ggml blocks
and lays them out for the kernel (:func:`jaxpaged.layers.packed_layout.pack_weight`), several
times slower than reading the laid-out arrays back (``docs/measurements.md``, "GGUF"). The
laid-out arrays are appended, as they are made, to one data file (``arrays.bin``, each array
64-byte aligned) and named in an index (``index.jsonl``, a line per tensor written after its
bytes); the next load maps the data file and reads each array as a view of it. (One ``.npy``
file per array cost a warm start ~0.1-0.2 s of single-threaded Python opening and parsing
SmolLM2's 633 files.)

An entry belongs to one file (its real path, size and modification time) and to this
version of the code that lays it out (a digest of ``gguf_blocks.py``, ``gguf_loader.py`` and
``packed_layout.py``): a changed file or layout never reads an old entry. Writers append
under an exclusive ``flock`` and write a tensor's index line only after its bytes, so a load
that stops half-way leaves the tensors it finished, and a torn last line is skipped. The
cache lives beside the compiled steps (``<compilation cache>/gguf-packed``), so an empty
compilation cache is a cold start; ``--compilation-cache-dir ''`` turns both off. Only files
up to :data:`MAX_FILE_BYTES` are kept (a larger model's second copy would cost more disk than
its repacking costs time).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import mmap
import os

import numpy as np

from jaxpaged.atomic_file import digest_files

logger = logging.getLogger(__name__)

#: GGUF files larger than this are not cached (bytes; an 8B model at 4 bits fits).
MAX_FILE_BYTES = 8 << 30
#: Each array's offset in the data file is a multiple of this (bytes).
ALIGNMENT = 64


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A digest of the modules whose code decides the packed layout."""
    from jaxpaged.layers import packed_layout

    here = os.path.dirname(__file__)     # (by path: gguf_loader imports this module)
    return digest_files([os.path.join(here, "gguf_blocks.py"),
                         os.path.join(here, "gguf_loader.py"), packed_layout.__file__])[:16]


class PackedWeightCache:
    """The packed arrays of one GGUF file under ``directory`` (None: a cache that holds
    nothing and writes nothing).

    Args:
        directory: the cache's root (``<compilation cache>/gguf-packed``) or None.
        gguf_path: the GGUF file whose tensors it holds.
    """

    def __init__(self, directory: str | None, gguf_path: str):
        self._folder = None
        self._index: dict[str, dict] | None = None
        self._data: mmap.mmap | None = None
        if directory is None:
            return
        stat = os.stat(gguf_path)
        if stat.st_size > MAX_FILE_BYTES:
            return
        key = hashlib.sha256(repr((os.path.realpath(gguf_path), stat.st_size,
                                   stat.st_mtime_ns, _code_digest(), "arrays.bin")).encode()).hexdigest()
        self._folder = os.path.join(directory, key[:24])

    def _file(self, name: str) -> str:
        return os.path.join(self._folder, name)

    def _entries(self) -> dict[str, dict]:
        """The index: ``"<tensor>.<leaf>"`` -> ``{"offset", "dtype", "shape"}`` of each array
        whose bytes lie within the data file (a torn or unreadable line is skipped)."""
        if self._index is None:
            self._index = {}
            try:
                size = os.path.getsize(self._file("arrays.bin"))
                with open(self._file("index.jsonl")) as f:
                    lines = f.read().splitlines()
            except OSError:
                return self._index
            for line in lines:
                try:
                    entry = json.loads(line)
                    arrays = {f"{entry['name']}.{leaf}": a for leaf, a in entry["arrays"].items()}
                    if all(a["offset"] + a["bytes"] <= size for a in arrays.values()):
                        self._index.update(arrays)
                except (ValueError, KeyError, TypeError):
                    continue
        return self._index

    def get(self, name: str, leaves: tuple[str, ...]) -> dict[str, np.ndarray] | None:
        """Tensor ``name``'s arrays ``leaves`` as stored (read-only views of the mapped data
        file), or None if any is missing or unreadable."""
        if self._folder is None:
            return None
        entries = [self._entries().get(f"{name}.{leaf}") for leaf in leaves]
        if any(e is None for e in entries):
            return None
        try:
            if self._data is None:
                with open(self._file("arrays.bin"), "rb") as f:
                    self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return {leaf: np.frombuffer(self._data, np.dtype(e["dtype"]),
                                        int(np.prod(e["shape"])), e["offset"]).reshape(e["shape"])
                    for leaf, e in zip(leaves, entries)}
        except (OSError, ValueError, TypeError):
            return None

    def put(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        """Keep tensor ``name``'s ``arrays`` (appended under an exclusive lock, its index
        line last); a failure to write is logged once and turns the cache off (the load goes
        on)."""
        if self._folder is None:
            return
        try:
            os.makedirs(self._folder, mode=0o700, exist_ok=True)
            with open(self._file("lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                entry = {}
                with open(self._file("arrays.bin"), "ab") as f:
                    offset = f.seek(0, os.SEEK_END)
                    for leaf, array in arrays.items():
                        array = np.ascontiguousarray(array)
                        f.write(b"\0" * (-offset % ALIGNMENT))
                        offset += -offset % ALIGNMENT
                        entry[leaf] = {"offset": offset, "bytes": array.nbytes,
                                       "dtype": array.dtype.str, "shape": list(array.shape)}
                        f.write(array.tobytes())
                        offset += array.nbytes
                with open(self._file("index.jsonl"), "a") as f:
                    f.write(json.dumps({"name": name, "arrays": entry}) + "\n")
        except OSError as e:
            logger.warning("cannot keep packed GGUF weights in %s (%s); repacking on every "
                           "load", self._folder, e)
            self._folder = None
