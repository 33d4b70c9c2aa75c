"""Files in the cache written whole or not at all, and digests of the source files an entry
depends on (no JAX: any floor may use it)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import BinaryIO


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path`` by ``write(f)`` (``f`` a binary file), creating its folder (mode
    0700): into a temporary file beside it, then renamed, so a reader never sees half of it
    and two writers both leave a whole file.

    Raises:
        OSError: the folder or the file cannot be written; whatever ``write`` raises (the
            temporary file is removed either way).
    """
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (:func:`write_atomically`).

    Raises:
        OSError: the folder or the file cannot be written.
    """
    write_atomically(path, lambda f: f.write(text.encode()))


def digest_files(paths: Iterable[str]) -> str:
    """SHA-256 hex digest of each file's base name and bytes, in the order given (what names
    a cache entry built from those sources).

    Raises:
        OSError: a file cannot be read.
    """
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()
