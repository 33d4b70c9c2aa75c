"""``jaxpaged.gguf_file.read_gguf`` against ``gguf.GGUFReader`` (the reference it
replaces on the start-up path): the same metadata values and types, and the same tensor names,
types, shapes and bytes, on a file holding every value type and every supported tensor type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jaxpaged.gguf_file import GGUFFormatError, read_gguf
from tests.test_gguf_loader import write_random_llama


def reference(path: str) -> tuple[dict, list]:
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, reader.tensors


def test_metadata_and_tensors_equal_gguf_readers(tmp_path):
    path = str(tmp_path / "model.gguf")
    write_random_llama(path, tokens=96, tied=False)
    w = gguf.GGUFWriter(str(tmp_path / "values.gguf"), "llama")
    w.add_string("s", "héllo")
    w.add_bool("b", True)
    w.add_int8("i8", -3)
    w.add_uint64("u64", 2**40)
    w.add_int64("i64", -2**40)
    w.add_float64("f64", 0.1)
    w.add_array("strings", ["a", "", "ü"])
    w.add_array("ints", [1, -2, 3])
    w.add_array("floats", [0.5, -1.25])
    w.add_array("bools", [True, False])
    w.add_tensor("t", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    for p in (path, str(tmp_path / "values.gguf")):
        want_meta, want_tensors = reference(p)
        got = read_gguf(p)
        assert list(got.metadata) == list(want_meta)
        for key, value in want_meta.items():
            assert got.metadata[key] == value and type(got.metadata[key]) is type(value), key
            if isinstance(value, list):
                assert [type(v) for v in got.metadata[key]] == [type(v) for v in value], key
        assert [t.name for t in got.tensors] == [t.name for t in want_tensors]
        for mine, theirs in zip(got.tensors, want_tensors):
            assert mine.tensor_type == theirs.tensor_type
            assert mine.shape == tuple(theirs.shape.tolist())
            assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
            np.testing.assert_array_equal(mine.data, theirs.data)
    assert read_gguf(path).metadata["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]


def test_bad_files_are_format_errors(tmp_path):
    path = tmp_path / "model.gguf"
    write_random_llama(str(path))
    data = path.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        read_gguf(str(tmp_path / "magic.gguf"))
    (tmp_path / "short.gguf").write_bytes(data[:-1000])
    with pytest.raises(GGUFFormatError, match="runs past the end of the file"):
        read_gguf(str(tmp_path / "short.gguf"))
    (tmp_path / "version.gguf").write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFFormatError, match="GGUF version 7"):
        read_gguf(str(tmp_path / "version.gguf"))
