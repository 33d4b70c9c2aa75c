"""Small files in the cache written whole or not at all (no JAX: any floor may use it)."""

from __future__ import annotations

import os


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path``, creating its folder (mode 0700): into a temporary file
    beside it, then renamed, so a reader never sees half of it and two writers both leave a
    whole file.

    Raises:
        OSError: the folder or the file cannot be written.
    """
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
