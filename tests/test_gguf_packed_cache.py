"""A GGUF's packed weights kept for the next load (``jaxpaged.models.gguf_packed_cache``):
the second load reads them instead of decoding the file's blocks, equal array for array; a
changed file, no directory or a file over the size limit keeps nothing."""

from __future__ import annotations

import json
import os

import numpy as np
from gguf import GGMLQuantizationType as T

from jaxpaged.models import gguf_loader, gguf_packed_cache
from jaxpaged.models.gguf_loader import GGUFCheckpoint
from tests.test_gguf_loader import HEADS, KV_HEADS, write_random_llama
from tests.test_packed_linear import PACKED_TYPES

NAMES = [f"model.layers.{i}.{m}.weight" for i in range(2)
         for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")]


def _decoded(ckpt: GGUFCheckpoint) -> dict:
    return {name: ckpt.get_packed(name) for name in NAMES}


def test_second_load_reads_the_kept_arrays_and_they_are_equal(tmp_path, monkeypatch):
    path = str(tmp_path / "packed.gguf")
    write_random_llama(path, tied=False, types=PACKED_TYPES, embedding_type=T.Q8_0)
    cache = str(tmp_path / "cache")
    fresh = _decoded(GGUFCheckpoint(path, HEADS, KV_HEADS))              # not kept
    assert not os.path.exists(cache)
    first = _decoded(GGUFCheckpoint(path, HEADS, KV_HEADS, cache))       # kept as made
    (folder,) = os.listdir(cache)
    folder = os.path.join(cache, folder)
    assert sorted(os.listdir(folder)) == ["arrays.bin", "index.jsonl", "lock"]
    with open(os.path.join(folder, "index.jsonl")) as f:
        assert [json.loads(line)["name"] for line in f] == NAMES      # a line per tensor

    def no_decoding(*args):
        raise AssertionError("the blocks were decoded again")

    monkeypatch.setattr(gguf_loader, "decode_blocks", no_decoding)
    ckpt = GGUFCheckpoint(path, HEADS, KV_HEADS, cache)
    second = _decoded(ckpt)
    for name in NAMES:
        for leaf in ("blocks", "block_scale", "block_min"):
            for other in (first, second):
                got, want = other[name][leaf], fresh[name][leaf]
                assert got.dtype == want.dtype and got.shape == want.shape
                np.testing.assert_array_equal(got, want)
    assert "model.layers.0.self_attn.q_proj.weight" not in ckpt.unread()   # marked read


def test_a_changed_file_is_decoded_again(tmp_path, monkeypatch):
    path = str(tmp_path / "packed.gguf")
    write_random_llama(path, tied=False, types=PACKED_TYPES, embedding_type=T.Q8_0)
    cache = str(tmp_path / "cache")
    _decoded(GGUFCheckpoint(path, HEADS, KV_HEADS, cache))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    calls = []
    decode = gguf_loader.decode_blocks
    monkeypatch.setattr(gguf_loader, "decode_blocks",
                        lambda *a: calls.append(1) or decode(*a))
    _decoded(GGUFCheckpoint(path, HEADS, KV_HEADS, cache))
    assert len(calls) == len(NAMES) and len(os.listdir(cache)) == 2


def test_large_files_and_unwritable_folders_keep_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "packed.gguf")
    write_random_llama(path, tied=False, types=PACKED_TYPES, embedding_type=T.Q8_0)
    monkeypatch.setattr(gguf_packed_cache, "MAX_FILE_BYTES", os.path.getsize(path) - 1)
    _decoded(GGUFCheckpoint(path, HEADS, KV_HEADS, str(tmp_path / "cache")))
    assert not os.path.exists(tmp_path / "cache")
    monkeypatch.undo()
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    got = _decoded(GGUFCheckpoint(path, HEADS, KV_HEADS, str(blocked / "cache")))
    assert all(got[name]["blocks"].size for name in NAMES)     # loaded all the same


def test_a_torn_index_line_or_short_data_file_keeps_the_finished_tensors(tmp_path):
    """A load that stopped half-way: the tensors whose index line is whole and whose bytes
    are in the data file read back; the torn one is packed again."""
    path = str(tmp_path / "packed.gguf")
    write_random_llama(path, tied=False, types=PACKED_TYPES, embedding_type=T.Q8_0)
    cache = str(tmp_path / "cache")
    first = _decoded(GGUFCheckpoint(path, HEADS, KV_HEADS, cache))
    (folder,) = os.listdir(cache)
    index = os.path.join(cache, folder, "index.jsonl")
    with open(index) as f:
        lines = f.read().splitlines()
    with open(index, "w") as f:       # the last line torn, the one before it past the data
        entry = json.loads(lines[-2])
        entry["arrays"]["blocks"]["offset"] = 1 << 40
        f.write("\n".join(lines[:-2] + [json.dumps(entry), lines[-1][:20]]))
    ckpt = GGUFCheckpoint(path, HEADS, KV_HEADS, cache)
    kept = [name for name in NAMES if ckpt._packed_cache.get(name, ("blocks",))]
    assert kept == NAMES[:-2]
    for name, arrays in _decoded(ckpt).items():       # the two others are packed again
        for leaf, array in arrays.items():
            np.testing.assert_array_equal(array, first[name][leaf])
