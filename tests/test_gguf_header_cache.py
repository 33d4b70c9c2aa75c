"""A GGUF header read once is kept for the next start-up (``jaxpaged.gguf_header_cache``): the
next open of the same file version reads no header, and gives the same metadata (long arrays
read on first use), digest and tensors; a changed file, a broken entry or the caches turned
off read the file again."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxpaged import gguf_config, gguf_header_cache
from jaxpaged.constants import DISABLE_ENV
from jaxpaged.gguf_file import read_gguf
from tests.test_gguf_loader import write_random_llama
from tests.test_packed_linear import PACKED_TYPES


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has opened no GGUF file yet; counts the headers it reads."""
    monkeypatch.setenv("JAXPAGED_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    reads = []
    monkeypatch.setattr(gguf_config, "read_gguf", lambda p: reads.append(p) or read_gguf(p))

    def start():
        gguf_config.forget_gguf_files()
        gguf_config._DIGESTS.clear()
        return gguf_config.open_gguf

    yield start, reads
    gguf_config.forget_gguf_files()


def _headers(tmp_path) -> list[str]:
    return glob.glob(str(tmp_path / "root" / "gguf-headers" / "*.json"))


def test_the_second_start_reads_the_kept_header_and_it_is_equal(tmp_path, fresh):
    start, reads = fresh
    path = str(tmp_path / "m.gguf")
    write_random_llama(path, tokens=600, tied=False, types=PACKED_TYPES, embedding_type=T.Q8_0)
    first = start()(path)
    assert len(reads) == 1 and len(_headers(tmp_path)) == 1
    kept = start()(path)
    assert len(reads) == 1                              # no second read of the file
    assert kept.metadata_digest == first.metadata_digest
    assert list(kept.metadata) == list(first.metadata)
    tokens = kept.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gguf_header_cache.LongArray) and len(tokens) == 600
    for key, value in first.metadata.items():
        assert gguf_header_cache.plain(kept.metadata[key]) == value, key
    assert tokens[5] == first.metadata["tokenizer.ggml.tokens"][5]
    assert [(t.name, t.type_name, t.shape, t.offset) for t in kept.tensors] == \
        [(t.name, t.type_name, t.shape, t.offset) for t in first.tensors]
    for mine, theirs in zip(kept.tensors, first.tensors):
        assert mine.data.dtype == theirs.data.dtype and mine.tensor_type == theirs.tensor_type
        np.testing.assert_array_equal(mine.data, theirs.data)


def test_a_changed_file_a_broken_entry_or_caches_off_read_the_file(tmp_path, fresh,
                                                                   monkeypatch):
    start, reads = fresh
    path = str(tmp_path / "m.gguf")
    write_random_llama(path, tied=False)
    start()(path)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    start()(path)
    assert len(reads) == 2 and len(_headers(tmp_path)) == 2      # another version
    for entry in _headers(tmp_path):
        with open(entry, "w") as f:
            f.write('{"digest": ')
    start()(path)
    assert len(reads) == 3
    monkeypatch.setenv(DISABLE_ENV, "1")
    start()(path)
    start()(path)
    assert len(reads) == 5
