"""Tensors of a Hugging Face safetensors checkpoint (one file or an index of shards), read
lazily by name as numpy arrays; the loader's checkpoint-reader interface (:meth:`get`,
:meth:`unread`), as ``jaxpaged.models.gguf_loader.GGUFCheckpoint`` is for GGUF files."""

from __future__ import annotations

import json
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads it)
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxpaged.errors import UnsupportedModelError
from jaxpaged.layers.quantization import QUANTIZED_DTYPES

#: safetensors dtypes its numpy reader cannot build (it looks them up on numpy itself).
_RAW_DTYPES = {"F8_E4M3": QUANTIZED_DTYPES["fp8"]}
#: A checkpoint directory's weights: one file, or an index of shards.
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs, or holds them with the wrong shape."""


class SafetensorsReader:
    """Tensors of a single-file or sharded safetensors checkpoint, read lazily by name."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, SAFETENSORS_INDEX)
        single = os.path.join(model_dir, SAFETENSORS_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._where = {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            with _open_safetensors(single) as f:
                self._where = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {model_dir!r}")
        self._open: dict[str, object] = {}
        self._read: set[str] = set()

    def unread(self) -> list[str]:
        """The checkpoint's tensors no :meth:`get` asked for, sorted."""
        return sorted(set(self._where) - self._read)

    def get(self, name: str) -> np.ndarray | None:
        path = self._where.get(name)
        if path is None:
            return None
        self._read.add(name)
        if path not in self._open:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint shard {path!r} (holding {name}) is missing")
            self._open[path] = _open_safetensors(path)
        try:
            stored = self._open[path].get_slice(name).get_dtype()
            dtype = _RAW_DTYPES.get(stored)
            return self._open[path].get_tensor(name) if dtype is None else \
                _read_raw(path, name, dtype)
        except SafetensorError as e:
            raise MissingWeightsError(f"cannot read tensor {name} from {path!r}: {e}") from e
        except (AttributeError, TypeError, ValueError) as e:   # a dtype numpy cannot hold
            raise UnsupportedModelError(f"tensor {name} in {path!r} is stored as {stored}, "
                                        f"which jaxpaged cannot load ({e})") from e


def _read_raw(path: str, name: str, dtype) -> np.ndarray:
    """Tensor ``name`` of the safetensors file ``path``, read from its bytes (the format: an
    8-byte little-endian header size, a JSON header giving each tensor's dtype, shape and
    ``data_offsets`` into the data that follows)."""
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_size))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + header_size + begin)
        return np.frombuffer(f.read(end - begin), dtype).reshape(entry["shape"])


def _open_safetensors(path: str):
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise MissingWeightsError(f"{path!r} is not a readable safetensors file: {e}") from e
