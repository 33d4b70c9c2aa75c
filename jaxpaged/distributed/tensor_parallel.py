"""Tensor parallelism over a one-axis device mesh (``--tensor-parallel-size``).

Layout (Megatron-LM: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", 2019, section 3):

- ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``: column-parallel (the output
  features, i.e. whole heads / intermediate columns, split over the ``tp`` axis);
- ``o_proj``, ``down_proj``: row-parallel (input features split), so each decoder block
  needs one all-reduce after attention and one after the MLP; XLA's SPMD partitioner inserts
  them from the parameter shardings;
- ``embed_tokens`` and ``lm_head``: vocab-parallel (rows of the vocabulary split); logits
  are gathered before sampling;
- mixture-of-experts kernels (``experts.w1|w3`` [E, H, I], ``experts.w2`` [E, I, H]): every
  expert's intermediate columns split like a dense MLP's (w1/w3 column-, w2 row-parallel),
  as vLLM's fused MoE layer does without expert parallelism; with expert parallelism
  (``--enable-expert-parallel``) the expert dimension is split instead, each device holding
  E / tp whole experts and their scales (``jaxpaged.models.mixtral``); the router is
  replicated;
- norms, and the biases and quantization scales (``--quantization``) of row-parallel
  projections: replicated (a column-parallel projection's split with its output features);
  so is any weight whose split dimension the mesh does not divide (e.g. an intermediate
  size of 172 over 8 devices);
- the KV pool: split over KV heads, ``[num_pages, page_size, KVH / tp, head_dim]`` per device.
  When ``tp`` exceeds the KV head count, each KV head is replicated ``tp / KVH`` times (as
  vLLM does) so that every device holds exactly the KV head its query heads use.

Attention itself runs under ``shard_map`` (``TensorParallelAttention``): every device calls
the ordinary paged-attention backend on its own heads and its own slice of the pool.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import jax
from jax._src import xla_bridge
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpaged.config import ModelConfig
from jaxpaged.errors import TensorParallelError

#: The mesh axis tensor parallelism splits over.
TP_AXIS = "tp"

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


def request_host_devices(n: int) -> None:
    """Ask XLA to split the host CPU into ``n`` devices, if JAX has not started its backends
    yet and nobody chose a count (``--xla_force_host_platform_device_count`` in
    ``XLA_FLAGS``). The flag only concerns the CPU platform, so this is harmless on a GPU
    machine; it is what lets ``--tensor-parallel-size N`` run on a CPU without setup."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags \
            and not xla_bridge.backends_are_initialized():
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


@dataclass(frozen=True)
class TensorParallel:
    """The mesh and the sharding rules of one engine.

    Attributes:
        mesh: a 1-D mesh of ``size`` devices, axis :data:`TP_AXIS`.
        size: the tensor-parallel degree.
        kv_head_repeats: copies of each checkpoint KV head (1 unless ``size`` exceeds the
            model's KV head count).
        head_dim: the model's head width (to replicate KV-head columns).
        expert_parallel: experts split whole over the mesh (see the module docstring).
    """

    mesh: Mesh
    size: int
    kv_head_repeats: int
    head_dim: int
    expert_parallel: bool = False

    @classmethod
    def create(cls, size: int, config: ModelConfig, devices: list | None = None,
               expert_parallel: bool = False) -> "TensorParallel":
        """Check ``size`` against the devices and the model, and build the mesh.

        Raises:
            TensorParallelError: fewer than ``size`` devices; query heads not divisible by
                ``size``; KV heads and ``size`` not multiples of one another; with
                ``expert_parallel``, a model without experts or an expert count ``size``
                does not divide. (A vocabulary that ``size`` does not divide is no error: its
                weights are replicated.)
        """
        if expert_parallel and not config.num_experts:
            raise TensorParallelError("enable_expert_parallel needs a mixture-of-experts "
                                      f"model; {config.architecture} has no experts")
        if expert_parallel and config.num_experts % size:
            raise TensorParallelError(f"enable_expert_parallel: tensor_parallel_size={size} "
                                      f"does not divide the model's {config.num_experts} "
                                      "experts")
        devices = list(jax.devices() if devices is None else devices)
        if not isinstance(size, int) or size < 1:
            raise TensorParallelError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if size > len(devices):
            processes = jax.process_count()
            where = (f"this process has {len(devices)}" if processes == 1 else
                     f"the {processes} processes have {len(devices)} in all")
            hint, per_process = "", size // processes
            if devices[0].platform == "cpu" and "host_platform_device_count" in os.environ.get(
                    "XLA_FLAGS", ""):
                hint = (f"; XLA_FLAGS sets the host device count: make it "
                        f"--xla_force_host_platform_device_count={per_process} or leave it out")
            elif devices[0].platform == "cpu":
                hint = (f"; a CPU is split into {per_process} host devices per process only if "
                        "tensor parallelism is the first use of JAX in the process (start a new "
                        "Python process, or set XLA_FLAGS=--xla_force_host_platform_device_count"
                        f"={per_process} before starting it)")
            raise TensorParallelError(f"tensor_parallel_size={size} needs {size} devices but "
                                      f"{where}{hint}")
        if config.num_heads % size:
            raise TensorParallelError(f"tensor_parallel_size={size} does not divide the model's "
                                      f"{config.num_heads} attention heads")
        kvh = config.num_kv_heads
        if kvh % size and size % kvh:
            raise TensorParallelError(f"tensor_parallel_size={size} and the model's {kvh} KV heads "
                                      "must be multiples of one another")
        if jax.process_count() > 1 and size != len(devices):
            raise TensorParallelError(
                f"tensor_parallel_size={size} must equal the {len(devices)} devices of the "
                f"{jax.process_count()} processes (each process runs the same step on its own "
                "devices of one mesh)")
        repeats = max(1, size // kvh)
        return cls(Mesh(np.array(devices[:size]), (TP_AXIS,)), size, repeats, config.head_dim,
                   expert_parallel and size > 1)

    def physical_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with the KV head count the devices hold together (replicas counted)."""
        return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * self.kv_head_repeats)

    @property
    def replicated(self) -> NamedSharding:
        """Every device holds the whole array."""
        return NamedSharding(self.mesh, P())

    @property
    def kv_pool_sharding(self) -> NamedSharding:
        """One layer's ``[num_pages, page_size, KVH, head_dim]`` K or V pages, split by head."""
        return NamedSharding(self.mesh, P(None, None, TP_AXIS, None))

    def param_sharding(self, path: tuple, shape: tuple[int, ...]) -> NamedSharding:
        """Sharding of the parameter at NNX ``path`` (e.g. ``(..., 'q_proj', 'weight')``)
        with ``shape`` (a float projection's ``weight`` is ``[out, in]``, an 8-bit one's
        ``kernel`` ``[in, out]``, embeddings ``[vocab, hidden]``). A dimension the mesh does
        not divide evenly (e.g. an intermediate size of 172 over 8 devices) is replicated
        instead of split."""
        names = [str(p) for p in path]
        module, leaf = names[-2], names[-1]
        axis = None
        if module in _COLUMN_PARALLEL and leaf == "weight":
            axis = 0                              # weight [out, in] -> out
        elif module in _COLUMN_PARALLEL:
            axis = len(shape) - 1                 # kernel [in, out] -> out; bias, scale [out]
        elif module in _ROW_PARALLEL and leaf == "weight":
            axis = 1
        elif module in _ROW_PARALLEL and leaf == "kernel":
            axis = 0
        elif module == "experts" and self.expert_parallel:
            axis = 0                              # whole experts (and their scales)
        elif module == "experts":                 # the intermediate dimension
            axis = {"w1": 2, "w3": 2, "w2": 1, "w1_scale": 1, "w3_scale": 1}.get(leaf)
        elif module == "embed_tokens":
            axis = 0                              # vocab rows
        elif module == "lm_head" and leaf == "weight":
            axis = 0                              # vocab rows of [vocab, hidden]
        if axis is None or shape[axis] % self.size:
            return self.replicated
        spec = [None] * len(shape)
        spec[axis] = TP_AXIS
        return NamedSharding(self.mesh, P(*spec))

    def repeat_kv_heads(self, path: tuple, value, xp=np):
        """Replicate a ``k_proj``/``v_proj`` weight's head rows (``weight`` [out, in]) or
        kernel's, bias's or scale's head columns (``[..., out]``) ``kv_head_repeats`` times
        (head j of the result is checkpoint head ``j // kv_head_repeats``), and so a
        ``k_norm`` over all KV heads (OLMo 2's, [kv_heads * head_dim]: the mean square over
        the copies is the original's); other parameters are returned unchanged.

        ``xp`` is ``numpy`` for host arrays or ``jax.numpy`` inside jit.
        """
        module = str(path[-2])
        if self.kv_head_repeats == 1 or module not in ("k_proj", "v_proj", "k_norm"):
            return value
        if module == "k_norm" and value.shape[-1] == self.head_dim:
            return value                  # a per-head norm (Qwen3): shared by every head
        if str(path[-1]) == "weight":
            return self.repeat_kv_heads(path[:-1] + ("kernel",), value.T, xp).T
        lead = value.shape[:-1]
        heads = value.reshape(*lead, -1, self.head_dim)
        return xp.repeat(heads, self.kv_head_repeats, axis=-2).reshape(*lead, -1)
