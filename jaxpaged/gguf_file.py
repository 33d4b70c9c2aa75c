"""A GGUF file's header, read in one pass: its metadata as Python values and its tensor table
as memory-mapped numpy views.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value, which makes a
large vocabulary's header slow to read at every start-up (``docs/measurements.md``, "GGUF").
This reader walks the same layout (GGUF v2/v3, little-endian: llama.cpp's
``gguf-py/gguf/gguf_reader.py`` and ``docs/gguf.md``) with ``struct`` over the mapped bytes and
keeps ``gguf``'s conventions for what it returns: strings decoded as UTF-8, numbers as Python
ints / floats / bools, arrays as lists, and each tensor's ``data`` shaped as ``GGUFReader``
shapes it (float and integer types by element, block-quantized ones as
``[..., bytes per row]`` uint8).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass

import numpy as np

#: ``GGUF`` in the file's first four bytes, read as a little-endian uint32.
GGUF_MAGIC = 0x46554747
#: The format versions this reader knows (``gguf.READER_SUPPORTED_VERSIONS``).
SUPPORTED_VERSIONS = (2, 3)
#: Tensor data alignment when ``general.alignment`` is absent (``gguf.GGUF_DEFAULT_ALIGNMENT``).
DEFAULT_ALIGNMENT = 32
#: GGUF metadata value type ids -> struct format of a scalar (``gguf.GGUFValueType``).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
#: Metadata arrays of at least this many values are located in :attr:`GGUFFile.long_arrays`.
LONG_ARRAY = 256
#: ggml types stored element by element -> their numpy dtype (others are byte blocks).
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                   "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF file this reader can walk (no magic, an unknown version or
    value type, a big-endian file, or a table running past the end of the file)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table.

    Attributes:
        name: llama.cpp's tensor name (e.g. ``blk.0.attn_q.weight``).
        type_name: its ggml type's name (``Q4_K``; :attr:`tensor_type` is the enum).
        shape: the dimensions as ggml lists them, fastest first (``[in, out]`` for a weight).
        data: a read-only view of its bytes in the mapped file: ``reversed(shape)`` elements of
            ``_ELEMENT_DTYPES`` types, else ``[..., bytes per row]`` uint8.
        offset: where ``data`` starts in the file (bytes).
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int

    @property
    def tensor_type(self):
        """The ``gguf.GGMLQuantizationType`` of :attr:`type_name` (imports ``gguf``, which a
        warm start that reads the header from ``jaxpaged.gguf_header_cache`` skips)."""
        import gguf

        return gguf.GGMLQuantizationType[self.type_name]


@dataclass(frozen=True)
class GGUFFile:
    """A read GGUF file.

    Attributes:
        metadata: every key/value pair (``general.architecture``, ``tokenizer.ggml.tokens``,
            ...) as Python values.
        tensors: the tensor table in file order.
        metadata_digest: SHA-256 (hex) of the file's bytes up to the end of the metadata: it
            names what is derived from the metadata alone (the tokenizer's cache entry).
        long_arrays: see below.
    """

    metadata: dict
    tensors: list[GGUFTensor]
    metadata_digest: str
    #: Where each metadata array of at least :data:`LONG_ARRAY` values lies: key ->
    #: (offset of its first value, item type id, length) (``jaxpaged.gguf_header_cache``).
    long_arrays: dict[str, tuple[int, int, int]]


class _Cursor:
    """Reads little-endian values from ``buf`` at a moving offset."""

    def __init__(self, buf, offset: int = 0):
        self.buf, self.offset = buf, offset

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        end = self.offset + n
        if end > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes at offset {self.offset} runs past "
                                  f"the end of the file ({len(self.buf)} bytes)")
        value = str(self.buf[self.offset:end], "utf-8")
        self.offset = end
        return value

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown GGUF value type {kind} at offset {self.offset}")
        item, n = self.take("I"), self.take("Q")
        if item in _SCALARS and item != 7:      # numbers: one numpy read (bool stays per item)
            dtype = np.dtype("<" + _SCALARS[item])
            if self.offset + n * dtype.itemsize > len(self.buf):
                raise GGUFFormatError(f"an array of {n} values at offset {self.offset} runs "
                                      f"past the end of the file")
            out = np.frombuffer(self.buf, dtype, n, self.offset).tolist()
            self.offset += n * dtype.itemsize
            return out
        return [self.value(item) for _ in range(n)]


def read_gguf(path: str) -> GGUFFile:
    """Map the GGUF file at ``path`` and read its metadata and tensor table.

    Raises:
        OSError: the file cannot be opened or mapped.
        GGUFFormatError: see the class; also a tensor of an unknown ggml type id (the message
            says ``unknown ggml type`` and the id).
        struct.error / UnicodeDecodeError: a header cut short or holding invalid UTF-8.
    """
    import gguf     # the type enum and block sizes (no GGUFReader)

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if cur.take("I") != GGUF_MAGIC:
        raise GGUFFormatError("no GGUF magic at the start of the file")
    version = cur.take("I")
    if version & 0xFFFF == 0:
        raise GGUFFormatError("a big-endian GGUF file, which this reader does not read")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version}; supported: {list(SUPPORTED_VERSIONS)}")
    num_tensors, num_kv = cur.take("Q"), cur.take("Q")
    metadata, long_arrays = {}, {}
    for _ in range(num_kv):
        key = cur.string()
        kind = cur.take("I")
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", buf, cur.offset)
            if n >= LONG_ARRAY:
                long_arrays[key] = (cur.offset + 12, item, n)
        metadata[key] = cur.value(kind)
    metadata_digest = hashlib.sha256(buf[:cur.offset]).hexdigest()
    table = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        type_id, offset = cur.take("I"), cur.take("Q")
        try:
            tensor_type = gguf.GGMLQuantizationType(type_id)
        except ValueError as e:
            raise GGUFFormatError(f"tensor {name}: unknown ggml type ({e})") from e
        table.append((name, dims, tensor_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    start = -(-cur.offset // alignment) * alignment
    data = np.frombuffer(buf, np.uint8)
    tensors, names = [], set()
    for name, dims, tensor_type, offset in table:
        if name in names:
            raise GGUFFormatError(f"tensor {name} appears twice")
        names.add(name)
        n_elements = int(np.prod(dims))
        block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * type_size // block
        begin = start + offset
        if begin + n_bytes > len(data):
            raise GGUFFormatError(f"tensor {name} ({n_bytes} bytes at offset {begin}) runs past "
                                  f"the end of the file ({len(data)} bytes)")
        raw = data[begin:begin + n_bytes]
        np_dims = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPES.get(tensor_type.name)
        view = (raw.view(dtype).reshape(np_dims) if dtype is not None else
                raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, tensor_type)))
        tensors.append(GGUFTensor(name, tensor_type.name, dims, view, begin))
    return GGUFFile(metadata, tensors, metadata_digest, long_arrays)


def read_array(buf, offset: int) -> list:
    """The metadata array whose first value is at ``offset`` of ``buf`` (as
    :attr:`GGUFFile.long_arrays` locates it), read as :func:`read_gguf` reads it."""
    return _Cursor(buf, offset - 12).value(_ARRAY)
