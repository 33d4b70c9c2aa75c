"""New values for a runner's parameters, from Hugging Face tensor names, without recompiling.

A step program takes the model's parameters as arguments (``jaxpaged.runner.step_programs``),
so arrays of the same shapes, dtypes and shardings replace the old ones without a new
compilation: :func:`plan_update` builds the replacements and checks every one before
anything changes; :meth:`ModelRunner.replace_state` swaps them in.

Each parameter is derived from its checkpoint tensor the way the loader derives it
(``jaxpaged.models.loader``): a float projection's ``weight`` as it is (``[out, in]``), KV
heads repeated when tensor parallelism replicates them, an 8-bit projection's ``kernel`` and
``scale`` quantized per output channel from a float ``weight`` on the host
(``jaxpaged.layers.quantization``), AWQ parts likewise, a Mixtral layer's stacked experts
from every ``experts.{e}.wN.weight``. A float array is cast to the parameter's dtype. A jax
array already on the parameter's devices with its sharding is used as it is; another jax
array moves device to device (no host round trip); a numpy array is sent to the devices
shard by shard.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.layers.awq import AWQLinear
from jaxpaged.layers.layer_stack import distinct_leaves
from jaxpaged.layers.packed_linear import PackedEmbedding, PackedLinear
from jaxpaged.layers.quantization import QuantizedLinear
from jaxpaged.models import loader
from jaxpaged.models.mixtral import ExpertScales, ExpertWeights


class WeightUpdateError(ValueError):
    """A weight update that does not fit the model: unknown tensor names, wrong shapes or
    non-float arrays (every offending tensor is named); the old weights keep serving."""


class NamedTensors:
    """Tensors by Hugging Face name (``get``/``unread``, the loader's reader contract) from
    a mapping of arrays (numpy or jax) or an NNX state whose paths are the model's own
    (``model.layers.0.self_attn.q_proj.weight``)."""

    def __init__(self, weights):
        if isinstance(weights, nnx.State):
            weights = {loader._hf_name(path): var.get_value()
                       for path, var in nnx.to_flat_state(weights)
                       if isinstance(var, nnx.Param)}
        if not isinstance(weights, Mapping):
            raise TypeError("weights must be a mapping of Hugging Face tensor names to arrays, "
                            "an nnx.State, or a directory of safetensors files; got "
                            f"{type(weights).__name__}")
        for name, value in weights.items():
            if not isinstance(name, str):
                raise TypeError(f"weight names must be strings, got {name!r}")
            if not isinstance(value, (np.ndarray, jax.Array)):
                raise TypeError(f"tensor {name}: expected a numpy or jax array, got "
                                f"{type(value).__name__}")
        self._tensors = dict(weights)
        self._read: set[str] = set()

    def get(self, name: str):
        value = self._tensors.get(name)
        if value is not None:
            self._read.add(name)
        return value

    def unread(self) -> list[str]:
        return sorted(set(self._tensors) - self._read)


def tensor_reader(weights):
    """A reader (``get(name)``, ``unread()``) over ``weights``: a directory of safetensors
    files (``model.safetensors`` or an index of shards), a mapping of names to arrays, or an
    NNX state (:class:`NamedTensors`)."""
    if isinstance(weights, (str, os.PathLike)):
        return loader.SafetensorsReader(os.fspath(weights))
    return NamedTensors(weights)


@dataclass
class UpdatePlan:
    """The replacements one update makes.

    Attributes:
        state: the runner's new state (the untouched leaves the old arrays themselves).
        names: the checkpoint tensors the update read, sorted.
    """

    state: nnx.State
    names: list[str]


def plan_update(graphdef, state, weights, *, tp, quantization: str | None,
                group_size: int, tie_word_embeddings: bool) -> UpdatePlan:
    """The parameters ``weights`` gives, as arrays ready to replace ``state``'s.

    Args:
        graphdef, state: the runner's split model.
        weights: what :func:`tensor_reader` accepts; names not given keep their values.
        tp: the model's ``TensorParallel`` (KV-head repeats).
        quantization: the model's method (``int8``/``fp8``/``awq``) or None.
        group_size: AWQ's group size.
        tie_word_embeddings: an ``lm_head.weight`` is then ignored, as the loader does.
            The state's arrays may be deleted (a level-2 sleep): their shapes, dtypes and
            shardings are still read.

    Returns:
        The new leaves (:class:`UpdatePlan`).

    Raises:
        WeightUpdateError: names the model has no place for, wrong shapes, non-float
            tensors, experts given only in part, an update that names no tensor of the model
            (an empty one, or only a tied ``lm_head.weight``); every problem in one message.
        NotImplementedError: a model whose projections stay packed as a GGUF file stores
            them (no float tensor maps onto their blocks).
    """
    reader = tensor_reader(weights)
    modules = dict(nnx.iter_graph(nnx.merge(graphdef, state)))
    if any(isinstance(m, (PackedLinear, PackedEmbedding)) for m in modules.values()):
        raise NotImplementedError("a model whose GGUF projections stay packed cannot take "
                                  "weight updates; load it with --quantization or on a GPU")
    quantized = {p for p, m in modules.items() if isinstance(m, (QuantizedLinear, AWQLinear))}
    variables = dict(nnx.to_flat_state(state))
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    flat = [(loader.param_path(kp), variables[loader.param_path(kp)]) for kp, _ in with_paths]
    old = [leaf for _, leaf in with_paths]
    leaves, problems, derived = list(old), [], {}
    for i, (path, var) in enumerate(flat):
        name = loader._hf_name(path)
        try:
            arr, name = _derive(reader, path, var, name, old[i].shape[0], quantized,
                                quantization, group_size, derived)
        except (ValueError, TypeError) as e:      # the loader's own checks, re-labelled
            problems.append(str(e))
            continue
        if arr is None:
            continue
        arr = tp.repeat_kv_heads(path, arr, xp=jnp if isinstance(arr, jax.Array) else np)
        if tuple(arr.shape) != tuple(old[i].shape):
            problems.append(f"{name}: shape {tuple(arr.shape)} does not fit "
                            f"{tuple(old[i].shape)}")
            continue
        want = np.dtype(old[i].dtype)
        if np.dtype(arr.dtype) != want and not (_is_float(arr.dtype) and _is_float(want)):
            problems.append(f"{name}: dtype {np.dtype(arr.dtype).name} does not fit "
                            f"{want.name}")
            continue
        leaves[i] = _placed(arr, want, old[i].sharding)
    unexpected = [n for n in reader.unread() if not n.endswith(loader._IGNORED_SUFFIXES)
                  and not (tie_word_embeddings and n == "lm_head.weight")]
    if unexpected:
        problems.append(f"tensors the model has no place for: {unexpected[:20]}")
    names = sorted(set(getattr(reader, "_read", ())))
    if not names and not problems:        # (nothing would change: no new version either)
        problems.append("it names no tensor of the model" + (
            " (lm_head.weight is tied to model.embed_tokens.weight here: update that)"
            if tie_word_embeddings and "lm_head.weight" in reader.unread() else ""))
    if problems:
        raise WeightUpdateError("weight update refused, the old weights keep serving: "
                                + "; ".join(problems))
    return UpdatePlan(jax.tree.unflatten(treedef, leaves), names)


def _derive(reader, path, var, name, leading, quantized, method, group_size, derived):
    """The checkpoint-layout array for one state leaf (None: not in this update) and the
    name to report it by (``derived`` keeps a module's parts between its leaves)."""
    if isinstance(var, (ExpertWeights, ExpertScales)):
        key = (*path[:-1], str(path[-1]).removesuffix("_scale"))
        if key not in derived:
            derived[key] = _experts(reader, key, leading, method)
        label, parts = derived[key]
        return parts.get("scale" if isinstance(var, ExpertScales) else "kernel"), label
    if path[:-1] in quantized and path[-1] in loader._QUANTIZED_LEAVES:
        if name not in derived:
            derived[name] = _host_reader(reader, name, lambda r: loader._quantized_weight(
                r, name, method, group_size))
        return derived[name].get(path[-1]), name
    arr = reader.get(name)
    if arr is not None and not _is_float(arr.dtype):
        raise TypeError(f"{name}: dtype {np.dtype(arr.dtype).name} is not a float type")
    return arr, name


def _experts(reader, key, num_experts, method):
    """A stacked expert kernel's parts, or ``(label, {})`` when no expert of it is given.

    Raises:
        WeightUpdateError: some experts given and some not.
    """
    *prefix, leaf = (str(p) for p in key)
    names = [".".join(prefix + [str(e), leaf, "weight"]) for e in range(num_experts)]
    given = [n for n in names if reader.get(n) is not None]
    if not given:
        return ".".join(prefix + ["{e}", leaf, "weight"]), {}
    if len(given) != len(names):
        raise WeightUpdateError(f"experts are updated whole: {sorted(set(names) - set(given))} "
                                "missing beside the others")
    return _host_reader(reader, None, lambda r: loader._read_experts(r, key, num_experts,
                                                                      method))


def _host_reader(reader, name, read):
    """``read`` over host copies of ``reader``'s tensors (re-quantization runs in numpy)."""
    class Host:
        def get(self, n):
            value = reader.get(n)
            return None if value is None else np.asarray(jax.device_get(value))
    return read(Host())


def _is_float(dtype) -> bool:
    return jnp.issubdtype(np.dtype(dtype), jnp.floating)


def _placed(arr, dtype, sharding):
    """``arr`` as ``dtype`` with ``sharding``: as it is when it already is both."""
    if isinstance(arr, jax.Array):
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        return arr if arr.sharding == sharding else jax.device_put(arr, sharding)
    # A copy: on a CPU the device array may alias the host buffer, and a trainer that
    # later writes into its own array would change the served weights behind the engine.
    host = np.array(arr, dtype=dtype, copy=True)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class RunnerWeights:
    """Weight updates and sleep mode on the runner's device state, mixed into
    ``ModelRunner`` (the engine's ``jaxpaged.engine.rollout`` and ``jaxpaged.engine.sleep``
    call these; they keep the host side free of JAX).

    Attributes:
        tensor_parallel: the model's ``TensorParallel`` (set by the worker; None: one device).
    """

    tensor_parallel = None
    _host_weights = None

    @property
    def state(self) -> tuple:
        """``(graphdef, state)`` of the served model (``jaxpaged.runner.weight_update``)."""
        return self._graphdef, self._state

    def replace_state(self, state) -> None:
        """Serve from ``state``: the current one's structure, every array of the same shape,
        dtype and sharding (some may be deleted: a sleeping runner), so every compiled step
        stays valid and none is dropped (``jaxpaged.runner.weight_update``).

        Raises:
            ValueError: a different structure, shape, dtype or sharding.
        """
        leaves, _, index = distinct_leaves(state)
        if index != self._leaf_index or any(
                (a.shape, a.dtype, a.sharding) != (b.shape, b.dtype, b.sharding)
                for a, b in zip(leaves, self._state_leaves)):
            raise ValueError("replacement state differs from the served one in structure, "
                             "shapes, dtypes or shardings")
        with self._compile_lock:
            digest = self._model_digest()   # (avals and shardings only: unchanged)
            self._state, self._state_leaves = state, leaves
            self._digest = ((id(self._graphdef), id(state)), digest)

    @property
    def kv_pool(self) -> list[tuple]:
        """The serving pool, one ``(k_pages, v_pages)`` per layer."""
        return self._kv_caches

    def check_weights_updatable(self) -> None:
        """Raises NotImplementedError for pipeline stages (their state is split by stage)."""
        if self.pipeline is not None:
            raise NotImplementedError("weight updates and sleep mode with pipeline "
                                      "parallelism are not supported yet")

    def update_weights(self, weights, config) -> UpdatePlan:
        """Serve ``weights`` (:func:`plan_update`, checked whole first) for model ``config``
        (its quantization and tied embeddings); returns the plan carried out."""
        self.check_weights_updatable()
        graphdef, state = self.state
        tp = self.tensor_parallel
        if tp is None:
            from jaxpaged.distributed.tensor_parallel import TensorParallel
            tp = TensorParallel.create(1, config)
        plan = plan_update(graphdef, state, weights, tp=tp, quantization=config.quantization,
                           group_size=config.quantization_group_size,
                           tie_word_embeddings=config.tie_word_embeddings)
        self.replace_state(plan.state)
        return plan

    def free_device_memory(self, keep_weights: bool) -> None:
        """Delete the KV pool's and the weights' device arrays; with ``keep_weights`` the
        weights are copied to host memory first (:meth:`restore_weights`)."""
        self.check_weights_updatable()
        state = self.state[1]
        self._host_weights = jax.device_get(state) if keep_weights else None
        for k, v in self.kv_pool:
            k.delete()
            v.delete()
        for leaf in jax.tree.leaves(state):
            if not leaf.is_deleted():
                leaf.delete()

    def deleted_weights(self) -> list[str]:
        """Checkpoint names of the parameters whose device arrays are deleted, sorted."""
        return sorted({loader._hf_name(loader.param_path(kp))
                       for kp, leaf in jax.tree_util.tree_flatten_with_path(self.state[1])[0]
                       if leaf.is_deleted()})

    def restore_weights(self) -> None:
        """Put the host copy back on the devices where a weight is deleted (a weight an
        update gave meanwhile stays); no-op without a host copy."""
        if self._host_weights is None:
            return
        host, self._host_weights = self._host_weights, None
        self.replace_state(jax.tree.map(_restore, self.state[1], host))

def _restore(device, host):
    """``device`` if alive, else ``host`` placed with ``device``'s sharding."""
    if not device.is_deleted():
        return device
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, device.sharding, lambda index: host[index])
