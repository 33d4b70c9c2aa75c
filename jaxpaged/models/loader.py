"""Load a Hugging Face model directory (or dummy weights) into a Flax NNX model.

A parameter at NNX path ``a.b.c.<leaf>`` comes from the safetensors tensor ``a.b.c.weight``
(or ``.bias``): ``nnx.Linear`` kernels are stored transposed ([in, out]) relative to torch's
``[out, in]``; embeddings and norm scales are taken as they are. Stacked expert kernels
(:class:`jaxpaged.models.mixtral.ExpertWeights` at ``a.experts.w1``) come from the per-expert
tensors ``a.experts.{e}.w1.weight``, each transposed.

Every tensor goes straight to its devices with its tensor-parallel sharding
(:mod:`jaxpaged.distributed.tensor_parallel`), so a device receives only its own slice (and a
process only its own devices' slices); the whole model exists once, on the host, one tensor
at a time.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads it)
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.distributed.tensor_parallel import TensorParallel
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.models.mixtral import ExpertWeights
from jaxpaged.models.registry import model_class

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs, or holds them with the wrong shape."""


def load_model(model_dir: str, config: ModelConfig, *, dtype, backend: AttentionBackend,
               load_format: str = "auto", seed: int = 0,
               tp: TensorParallel | None = None) -> nnx.Module:
    """Build the model for ``config`` and fill its parameters.

    Args:
        model_dir: Hugging Face directory with ``model.safetensors`` or
            ``model.safetensors.index.json`` plus shards (ignored for ``dummy``).
        config: parsed ``config.json``.
        dtype: parameter dtype; checkpoint tensors are cast to it.
        backend: attention backend the model's layers call.
        load_format: ``auto``/``safetensors`` read the checkpoint; ``dummy`` draws random
            weights (normal, std 0.02; norms at 1) from ``seed``, as vLLM's ``--load-format dummy``.
        tp: the tensor-parallel mesh and rules (default: one device); the model is built
            with ``tp.physical_config(config)`` (KV heads replicated when needed).

    Raises:
        UnsupportedModelError: no model class for the architecture.
        ValueError: unknown ``load_format``.
        FileNotFoundError: no safetensors files in ``model_dir``.
        MissingWeightsError: tensors missing or of the wrong shape (all are named).
    """
    cls = model_class(config.architecture)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {list(LOAD_FORMATS)}")
    tp = tp or TensorParallel.create(1, config)
    physical = tp.physical_config(config)
    abstract = nnx.eval_shape(lambda: cls(physical, backend, dtype, nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    if load_format == "dummy":
        return nnx.merge(graphdef, _dummy_state(cls, config, backend, dtype, seed, tp,
                                                abstract_state))
    flat = nnx.to_flat_state(abstract_state)
    reader = _SafetensorsReader(model_dir)
    missing, bad_shapes = [], []
    for path, var in flat:
        name, transpose = _hf_name(path)
        if isinstance(var, ExpertWeights):
            name, arr = _read_experts(reader, path, var.shape[0], missing)
        else:
            arr = reader.get(name)
            if arr is None:
                missing.append(name)
        if arr is None:
            continue
        if transpose:
            arr = np.swapaxes(arr, -1, -2)
        if tp.repeat_kv_heads(path, arr).shape != var.shape:
            bad_shapes.append(f"{name}: checkpoint {arr.shape} does not fit {var.shape}")
            continue
        arr = tp.repeat_kv_heads(path, arr).astype(dtype)
        var.set_value(jax.make_array_from_callback(arr.shape, tp.param_sharding(path, arr.shape),
                                                   lambda index, arr=arr: arr[index]))
    if missing or bad_shapes:
        raise MissingWeightsError(
            f"checkpoint {model_dir!r} does not match the {config.architecture} config: "
            + (f"missing tensors {missing}" if missing else "")
            + ("; " if missing and bad_shapes else "")
            + (f"wrong shapes {bad_shapes}" if bad_shapes else ""))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _dummy_state(cls, config, backend, dtype, seed, tp, abstract_state):
    """Random weights of the checkpoint-shaped model, KV heads replicated, each array
    created directly with its sharding."""
    def names(key_path):
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in key_path]
        return tuple(keys[:-1] if keys and keys[-1] == "value" else keys)

    def init():
        state = nnx.split(cls(config, backend, dtype, nnx.Rngs(seed)))[1]
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: tp.repeat_kv_heads(names(kp), x, xp=jnp), state)

    shardings = jax.tree_util.tree_map_with_path(
        lambda kp, x: tp.param_sharding(names(kp), x.shape), abstract_state)
    return jax.jit(init, out_shardings=shardings)()


def _read_experts(reader, path: tuple, num_experts: int, missing: list
                  ) -> tuple[str, np.ndarray | None]:
    """Stack ``<prefix>.{e}.<leaf>.weight`` for every expert: ([E, out, in] or None when a
    tensor is missing; missing names are appended to ``missing``)."""
    *prefix, leaf = (str(p) for p in path)
    names = [".".join(prefix + [str(e), leaf, "weight"]) for e in range(num_experts)]
    arrs = [reader.get(n) for n in names]
    missing.extend(n for n, a in zip(names, arrs) if a is None)
    label = ".".join(prefix + ["{e}", leaf, "weight"])
    return label, None if any(a is None for a in arrs) else np.stack(arrs)


def _hf_name(path: tuple) -> tuple[str, bool]:
    """NNX parameter path -> (safetensors tensor name, whether to transpose)."""
    *prefix, leaf = (str(p) for p in path)
    base = ".".join(prefix)
    if leaf == "kernel" or prefix[-1:] == ["experts"]:
        return f"{base}.weight", True
    if leaf == "bias":
        return f"{base}.bias", False
    return f"{base}.weight", False   # "embedding" (nnx.Embed) and "weight" (RMSNorm)


class _SafetensorsReader:
    """Tensors of a single-file or sharded safetensors checkpoint, read lazily by name."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
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

    def get(self, name: str) -> np.ndarray | None:
        path = self._where.get(name)
        if path is None:
            return None
        if path not in self._open:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint shard {path!r} (holding {name}) is missing")
            self._open[path] = _open_safetensors(path)
        try:
            return self._open[path].get_tensor(name)
        except SafetensorError as e:
            raise MissingWeightsError(f"cannot read tensor {name} from {path!r}: {e}") from e


def _open_safetensors(path: str):
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise MissingWeightsError(f"{path!r} is not a readable safetensors file: {e}") from e
