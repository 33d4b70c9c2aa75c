"""Load a Hugging Face model directory, a GGUF file (or dummy weights) into a Flax NNX model.

A parameter at NNX path ``a.b.c.<leaf>`` comes from the safetensors tensor ``a.b.c.weight``
(or ``.bias``), taken as it is: a float projection's ``weight`` keeps torch's ``[out, in]``
(:class:`jaxpaged.layers.linear.Linear`), as do embeddings and norm scales. Stacked expert
kernels (:class:`jaxpaged.models.mixtral.ExpertWeights` at ``a.experts.w1``) come from the
per-expert tensors ``a.experts.{e}.w1.weight``, each transposed (and quantized, with its
scales in ``a.experts.w1_scale``, as a ``QuantizedLinear``'s are).
An ``AWQLinear``'s ``qweight``, ``qzeros`` and ``scales`` come from the tensors of
those names (AutoAWQ's layout, ``[in, ...]`` already: not transposed), or are quantized from a
float ``a.b.c.weight``. A ``QuantizedLinear``'s
``kernel`` and ``scale`` both come from ``a.b.c.weight``: a float tensor is transposed and
quantized on the host (``jaxpaged.layers.quantization``); an fp8 one (a checkpoint stored in
fp8) is taken as it is, with its ``a.b.c.weight_scale``. An 8-bit tensor never loads into a
float parameter. A ``PackedLinear``'s or ``PackedEmbedding``'s ``blocks``, ``block_scale``
and ``block_min`` come from a GGUF tensor's blocks (``GGUFCheckpoint.get_packed``), in the
shapes and dtypes of its own block type.

Every tensor goes straight to its devices with its tensor-parallel sharding
(:mod:`jaxpaged.distributed.tensor_parallel`), so a device receives only its own slice (and a
process only its own devices' slices); the whole model exists once, on the host, one tensor
at a time.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads it)
import numpy as np
from flax import nnx

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.distributed.tensor_parallel import TensorParallel
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.layers.awq import DEFAULT_GROUP_SIZE, AWQLinear, quantize_awq
from jaxpaged.layers.packed_layout import LANES, PACKED_LEAVES
from jaxpaged.layers.packed_linear import PackedEmbedding, PackedLinear
from jaxpaged.layers.quantization import (QUANTIZED_DTYPES, QuantizedLinear, per_channel_scale,
                                          quantize_weight)
from jaxpaged.gguf_config import forget_gguf_files, is_gguf
from jaxpaged.models.gguf_loader import GGUFCheckpoint
from jaxpaged.models.checkpoint_names import checkpoint_view
from jaxpaged.models.mixtral import ExpertScales, ExpertWeights
from jaxpaged.models.registry import model_class
from jaxpaged.models.safetensors_reader import (SAFETENSORS_FILE, SAFETENSORS_INDEX,
                                                MissingWeightsError, SafetensorsReader)

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
#: An :class:`AWQLinear`'s parameters, all read from ``<projection>.{qweight,qzeros,scales}``.
_AWQ_LEAVES = ("qweight", "qzeros", "scales")
_QUANTIZED_LEAVES = ("kernel", "scale") + _AWQ_LEAVES
#: Parameters stored under their own name, not ``.weight`` (Qwen3-Next's DeltaNet vectors).
_OWN_NAME_LEAVES = ("A_log", "dt_bias")
#: Checkpoint tensors no model reads, as vLLM skips them: rotary caches, and the activation
#: and KV-cache scales of fp8 checkpoints (jaxpaged quantizes weights only and takes KV
#: scales from ``--calculate-kv-scales``).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                     ".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")

#: Tensors a sequence classifier's head is made from, read by
#: ``jaxpaged.core.classifier_head`` instead of the model (which has no LM head then).
_CLASSIFIER_TENSORS = ("score.weight", "score.bias", "lm_head.weight")


def load_model(model_dir: str, config: ModelConfig, *, dtype, backend: AttentionBackend,
               load_format: str = "auto", seed: int = 0,
               tp: TensorParallel | None = None,
               packed_cache_dir: str | None = None) -> nnx.Module:
    """Build the model for ``config`` and fill its parameters.

    Args:
        model_dir: Hugging Face directory with ``model.safetensors`` or
            ``model.safetensors.index.json`` plus shards, or a ``.gguf`` file
            (:class:`jaxpaged.models.gguf_loader.GGUFCheckpoint`: tensors dequantized on the
            host); ignored for ``dummy``.
        config: parsed ``config.json``; its ``quantization`` makes the decoder's projections
            :class:`QuantizedLinear` (float checkpoint tensors are quantized while loading).
        dtype: parameter dtype; checkpoint tensors are cast to it (quantized kernels and
            their scales keep their own dtypes).
        backend: attention backend the model's layers call.
        load_format: ``auto``/``safetensors`` read the checkpoint; ``dummy`` draws random
            weights (normal, std 0.02; norms at 1) from ``seed``, as vLLM's ``--load-format dummy``.
        tp: the tensor-parallel mesh and rules (default: one device); the model is built
            with ``tp.physical_config(config)`` (KV heads replicated when needed).
        packed_cache_dir: where a GGUF's packed weights are kept for the next load
            (:mod:`jaxpaged.models.gguf_packed_cache`); None: not kept.

    Raises:
        UnsupportedModelError: no model class for the architecture; an 8-bit tensor where a
            float one (or an fp8 one for an fp8 model) is expected.
        ValueError: unknown ``load_format``.
        FileNotFoundError: no safetensors files in ``model_dir``.
        MissingWeightsError: tensors missing, of the wrong shape, or that the config has no
            place for (extra layers or experts; all are named; an ``lm_head.weight`` beside
            ``tie_word_embeddings`` is skipped with a warning, as vLLM does, and a sequence
            classifier's head tensors silently); an fp8 weight
            without a usable ``weight_scale`` (absent, or NaN, infinite or negative).
    """
    cls = model_class(config.architecture)
    if config.quantization == "awq" and tp is not None and tp.size > 1:
        raise UnsupportedModelError("AWQ weights with tensor parallelism are not supported yet")
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
    reader = (GGUFCheckpoint(model_dir, config.num_heads, config.num_kv_heads,
                             packed_cache_dir)
              if is_gguf(model_dir) else SafetensorsReader(model_dir))
    reader = checkpoint_view(reader, config)
    quantized_modules = {p for p, node in nnx.iter_graph(abstract)
                         if isinstance(node, (QuantizedLinear, AWQLinear))}
    packed_modules = {p: node for p, node in nnx.iter_graph(abstract)
                      if isinstance(node, (PackedLinear, PackedEmbedding))}
    quantized = {}   # checkpoint name -> kernel and scale, from a module's kernel to its scale
    missing, bad_shapes = {}, []   # missing: an ordered set of names
    for path, var in flat:
        name = _hf_name(path)
        if isinstance(var, (ExpertWeights, ExpertScales)):
            key = (*path[:-1], str(path[-1]).removesuffix("_scale"))
            if key not in quantized:
                quantized = {key: _read_experts(reader, key, var.shape[0], config.quantization)}
            name, parts = quantized[key]
            arr = parts.get("scale" if isinstance(var, ExpertScales) else "kernel")
        elif path[:-1] in packed_modules and path[-1] in PACKED_LEAVES:
            if name not in quantized:
                quantized = {name: reader.get_packed(name) or {}}
            arr = quantized[name].get(path[-1])
            if arr is not None:     # shapes and dtypes are the tensor's own (its block type)
                problem = _packed_shape_problem(packed_modules[path[:-1]], path[-1], arr)
                if problem:
                    bad_shapes.append(f"{name}: {problem}")
                    continue
                var.set_value(jax.make_array_from_callback(
                    arr.shape, tp.param_sharding(path, arr.shape),
                    lambda index, arr=arr: arr[index]))
                continue
        elif path[:-1] in quantized_modules and path[-1] in _QUANTIZED_LEAVES:
            if name not in quantized:
                quantized = {name: _quantized_weight(reader, name, config.quantization,
                                                     config.quantization_group_size)}
            arr = quantized[name].get(path[-1])
        else:
            arr = reader.get(name)
            if arr is not None and arr.dtype.itemsize == 1:
                raise UnsupportedModelError(
                    f"tensor {name} is stored in 8 bits ({arr.dtype}) but loads into a float "
                    "parameter; only a checkpoint whose config.json has a supported "
                    "quantization_config may store its projections in fp8")
        if arr is None:
            missing[name] = None
            continue
        if tp.repeat_kv_heads(path, arr).shape != var.shape:
            bad_shapes.append(f"{name}: checkpoint {arr.shape} does not fit {var.shape}")
            continue
        arr = tp.repeat_kv_heads(path, arr).astype(var.dtype)
        var.set_value(jax.make_array_from_callback(arr.shape, tp.param_sharding(path, arr.shape),
                                                   lambda index, arr=arr: arr[index]))
    unexpected = [n for n in reader.unread() if not n.endswith(_IGNORED_SUFFIXES)]
    if config.classifier is not None:   # its head loads on the host (engine.classifier_head)
        unexpected = [n for n in unexpected if n not in _CLASSIFIER_TENSORS]
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")
        logger.warning("the checkpoint has lm_head.weight but config.json ties the LM head to "
                       "the embeddings (tie_word_embeddings): lm_head.weight is not used")
    if missing or bad_shapes or unexpected:
        problems = [f"missing tensors {list(missing)}"] if missing else []
        problems += [f"wrong shapes {bad_shapes}"] if bad_shapes else []
        problems += [f"tensors the config has no place for {unexpected[:20]}"
                     + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
                     ] if unexpected else []
        raise MissingWeightsError(f"checkpoint {model_dir!r} does not match the "
                                  f"{config.architecture} config: " + "; ".join(problems))
    if is_gguf(model_dir):
        del reader
        forget_gguf_files()     # every tensor is copied out: unmap the file
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _packed_shape_problem(module, leaf: str, arr: np.ndarray) -> str | None:
    """Why a packed leaf (:mod:`jaxpaged.layers.packed_layout`) does not fit ``module`` (a
    :class:`PackedLinear` or :class:`PackedEmbedding`), or None when it does."""
    din, dout = ((module.din, module.dout) if isinstance(module, PackedLinear)
                 else (module.features, module.num_embeddings))
    vectors = -(-dout // LANES)
    if arr.ndim != 3 or arr.shape[0] != vectors or arr.shape[2] != LANES:
        return f"checkpoint [{arr.shape[0] * LANES}, ...] does not fit [{dout}, {din}]"
    if leaf == "blocks" and arr.shape[1] != (din // 2 if arr.dtype == np.uint8 else din):
        return f"checkpoint rows of {arr.shape[1]} blocks do not fit {din} input features"
    return None


def param_path(key_path) -> tuple:
    """The NNX path (``('model', 'layers', 0, 'self_attn', 'q_proj', 'weight')``) of a
    state leaf's JAX key path."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in key_path]
    return tuple(keys[:-1] if keys and keys[-1] == "value" else keys)


def _dummy_state(cls, config, backend, dtype, seed, tp, abstract_state):
    """Random weights of the checkpoint-shaped model, KV heads replicated, each array
    created directly with its sharding (one jitted draw per device set: the stages of
    pipeline parallelism live on different devices, and one program runs on one set)."""
    def init():
        state = nnx.split(cls(config, backend, dtype, nnx.Rngs(seed)))[1]
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: tp.repeat_kv_heads(param_path(kp), x, xp=jnp), state)

    shardings, treedef = jax.tree.flatten(jax.tree_util.tree_map_with_path(
        lambda kp, x: tp.param_sharding(param_path(kp), x.shape), abstract_state))
    groups: dict[frozenset, list[int]] = {}
    for i, sharding in enumerate(shardings):
        groups.setdefault(frozenset(sharding.device_set), []).append(i)
    leaves = [None] * len(shardings)
    for idx in groups.values():
        def draw(idx=idx):       # the model is built once per trace, not once per leaf
            state = jax.tree.leaves(init())
            return [state[i] for i in idx]

        part = jax.jit(draw, out_shardings=[shardings[i] for i in idx])()
        for i, x in zip(idx, part):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def _read_experts(reader, path: tuple, num_experts: int, method: str | None
                  ) -> tuple[str, dict[str, np.ndarray]]:
    """The stacked kernels of the experts at ``path`` (``(..., 'experts', 'w1')``), from
    ``<prefix>.{e}.<leaf>.weight`` ([out, in] each), as (a name for messages, parts): parts
    ``kernel`` [E, in, out] and, with a quantization ``method``, ``scale`` [E, out] (each
    expert as :func:`_quantized_weight`); parts are empty and the name lists the missing
    tensors when any is absent."""
    *prefix, leaf = (str(p) for p in path)
    names = [".".join(prefix + [str(e), leaf, "weight"]) for e in range(num_experts)]
    if method is None:
        weights = [reader.get(n) for n in names]
        experts = [{} if w is None else {"kernel": w.T} for w in weights]
    else:
        experts = [_quantized_weight(reader, n, method) for n in names]
    absent = [n for n, parts in zip(names, experts) if not parts]
    if absent:
        return ", ".join(absent), {}
    label = ".".join(prefix + ["{e}", leaf, "weight"])
    shapes = [e["kernel"].shape for e in experts]
    common = max(set(shapes), key=shapes.count)
    odd = [f"{n}: checkpoint {s[::-1]}" for n, s in zip(names, shapes) if s != common]
    if odd:
        raise MissingWeightsError(f"wrong shapes {odd}: the other experts of {label} are "
                                  f"{common[::-1]}")
    return label, {part: np.stack([e[part] for e in experts]) for part in experts[0]}


def _hf_name(path: tuple) -> str:
    """NNX parameter path -> safetensors tensor name."""
    *prefix, leaf = (str(p) for p in path)
    base = ".".join(prefix)
    if leaf in _AWQ_LEAVES:
        return f"{base}.qweight"
    if leaf in ("bias",) + _OWN_NAME_LEAVES:
        return f"{base}.{leaf}"
    # "weight" (Linear, RMSNorm), "embedding" (nnx.Embed), "kernel" and "scale"
    # (QuantizedLinear, from its weight), stacked experts (from their per-expert weights)
    return f"{base}.weight"


def _quantized_weight(reader: "SafetensorsReader", name: str, method: str,
                      group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, np.ndarray]:
    """``kernel`` [in, out] and ``scale`` [out] of the :class:`QuantizedLinear` whose
    checkpoint weight ([out, in]) is ``name``, or for ``awq`` the :class:`AWQLinear` parts of
    ``<base>.qweight`` (:func:`_awq_weight`); empty if the checkpoint lacks it.

    A float weight is quantized by ``method``; an fp8 weight is taken as stored, with its
    per-tensor or per-channel ``<name>_scale``.

    Raises:
        UnsupportedModelError: an 8-bit weight that is not fp8 for an fp8 model.
        MissingWeightsError: an fp8 weight without a usable ``<name>_scale``.
    """
    if method == "awq":
        return _awq_weight(reader, name.removesuffix(".qweight"), group_size)
    weight = reader.get(name)
    if weight is None:
        return {}
    if weight.dtype.itemsize > 1:
        kernel, scale = quantize_weight(weight.T, method)
        return {"kernel": kernel, "scale": scale}
    if weight.dtype != QUANTIZED_DTYPES["fp8"] or method != "fp8":
        raise UnsupportedModelError(f"tensor {name} is stored as {weight.dtype}: 8-bit checkpoint "
                                    "weights load only as float8_e4m3fn into an fp8 model "
                                    f"(this model: {method})")
    weight_scale = reader.get(f"{name}_scale")
    if weight_scale is None:
        raise MissingWeightsError(f"{name} is stored in fp8 but the checkpoint has no "
                                  f"{name}_scale")
    try:
        return {"kernel": weight.T, "scale": per_channel_scale(weight_scale, weight.shape[0])}
    except ValueError as e:
        raise MissingWeightsError(f"{name}_scale: {e}") from e


def _awq_weight(reader, base: str, group_size: int) -> dict[str, np.ndarray]:
    """``qweight``, ``qzeros`` and float32 ``scales`` of projection ``base``: as stored by an
    AutoAWQ checkpoint, or quantized from a float ``<base>.weight`` ([out, in]) by
    :func:`jaxpaged.layers.awq.quantize_awq`; empty if the checkpoint has neither.

    Raises:
        MissingWeightsError: ``qweight`` without int32 ``qzeros`` and finite ``scales``.
        UnsupportedModelError: an 8-bit ``<base>.weight``.
    """
    qweight = reader.get(f"{base}.qweight")
    if qweight is None:
        weight = reader.get(f"{base}.weight")
        if weight is None:
            return {}
        if weight.dtype.itemsize == 1:
            raise UnsupportedModelError(f"tensor {base}.weight is stored in 8 bits "
                                        f"({weight.dtype}); --quantization awq needs float weights")
        return dict(zip(_AWQ_LEAVES, quantize_awq(weight.T, group_size)))
    qzeros, scales = reader.get(f"{base}.qzeros"), reader.get(f"{base}.scales")
    if qzeros is None or scales is None or {qweight.dtype, qzeros.dtype} != {np.dtype(np.int32)}:
        raise MissingWeightsError(f"{base}.qweight needs int32 {base}.qweight and {base}.qzeros "
                                  f"and {base}.scales (AutoAWQ's GEMM layout)")
    if not np.isfinite(scales).all():
        raise MissingWeightsError(f"{base}.scales holds NaN or infinite values; the checkpoint "
                                  "is corrupt")
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.astype(np.float32)}


def has_weights(path: str) -> bool:
    """Whether ``path`` is a GGUF file or a directory holding :data:`SAFETENSORS_FILE` or
    :data:`SAFETENSORS_INDEX` (what :func:`load_model` reads outside ``dummy``)."""
    return is_gguf(path) or any(os.path.isfile(os.path.join(path, name))
                                for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX))
