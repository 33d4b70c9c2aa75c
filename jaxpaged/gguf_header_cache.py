"""A GGUF file's header as :func:`jaxpaged.gguf_file.read_gguf` read it, kept for the next
start-up (JSON; no JAX, no ``gguf``).

Reading SmolLM2's header (98k vocabulary and merge strings) and importing ``gguf`` for its
type table took ~0.13 s of every warm start's single-threaded Python, on the path to the
server's first tokenizer (``docs/measurements.md``, "GGUF"). An entry keeps the metadata
(its long arrays as their place in the file, read only when asked for: the tokenizer needs
them only to convert itself afresh), the metadata digest and the tensor table (names, types,
offsets, view shapes); a load maps the file and makes each tensor's view again.

An entry belongs to one version of one file (its real path, modification time and size) and
to this module's format; it is written whole or not at all, and an unreadable one is read
again from the file. ``$JAXPAGED_DISABLE_COMPILE_CACHE`` turns it off with the other caches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from collections.abc import Sequence

import numpy as np

from jaxpaged.atomic_file import write_text_atomically
from jaxpaged.gguf_file import GGUFFile, GGUFTensor, read_array

logger = logging.getLogger(__name__)

#: Changes whenever an entry's layout does (old entries are then never read).
FORMAT = 1


class LongArray(Sequence):
    """A long metadata array of a mapped file, read on first use (``len`` is free).

    Args:
        buf: the mapped file; offset: its first value's offset; length: its length.
    """

    def __init__(self, buf, offset: int, length: int):
        self._buf, self._offset, self._length, self._values = buf, offset, length, None

    def values(self) -> list:
        """The array as :func:`~jaxpaged.gguf_file.read_gguf` returns it (a list)."""
        if self._values is None:
            self._values = read_array(self._buf, self._offset)
        return self._values

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        return self.values()[index]

    def __eq__(self, other) -> bool:
        return self.values() == (other.values() if isinstance(other, LongArray) else other)

    __hash__ = None


def plain(value):
    """``value`` with a :class:`LongArray` read into its list (for code that needs lists)."""
    return value.values() if isinstance(value, LongArray) else value


def _entry_path(key: tuple[str, int, int]) -> str | None:
    from jaxpaged.constants import DISABLE_ENV, cache_root

    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    name = hashlib.sha256(repr((FORMAT, *key)).encode()).hexdigest()[:32]
    return os.path.join(cache_root(), "gguf-headers", f"{name}.json")


def store(key: tuple[str, int, int], opened: GGUFFile) -> None:
    """Keep ``opened`` (read from the file version ``key``: real path, mtime in ns, size);
    a failure to write is logged and ignored."""
    path = _entry_path(key)
    if path is None:
        return
    entry = {"digest": opened.metadata_digest,
             "metadata": {k: v for k, v in opened.metadata.items()
                          if k not in opened.long_arrays},
             "long_arrays": {k: [at[0], at[2]] for k, at in opened.long_arrays.items()},
             "keys": list(opened.metadata),
             "tensors": [[t.name, t.type_name, list(t.shape), t.offset, t.data.dtype.str,
                          list(t.data.shape)] for t in opened.tensors]}
    try:
        write_text_atomically(path, json.dumps(entry))
    except (OSError, TypeError, ValueError) as e:
        logger.warning("the GGUF header of %s is not cached (%s)", key[0], e)


def load(key: tuple[str, int, int]) -> GGUFFile | None:
    """The kept header of file version ``key`` with its tensors' views of the mapped file,
    or None (no entry, or one that cannot be read)."""
    path = _entry_path(key)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
        with open(key[0], "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        short, long = entry["metadata"], entry["long_arrays"]
        metadata = {k: short[k] if k in short else LongArray(buf, *long[k])
                    for k in entry["keys"]}
        tensors = []
        for name, type_name, shape, offset, dtype, view_shape in entry["tensors"]:
            count = int(np.prod(view_shape))
            tensors.append(GGUFTensor(name, type_name, tuple(shape), np.frombuffer(
                buf, np.dtype(dtype), count, offset).reshape(view_shape), offset))
        return GGUFFile(metadata, tensors, entry["digest"],
                        {k: (at[0], None, at[1]) for k, at in long.items()})
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring the cached GGUF header %s: %s", path, e)
        return None
