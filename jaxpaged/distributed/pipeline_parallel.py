"""Pipeline parallelism (``--pipeline-parallel-size``): the decoder layers split into stages.

Stage ``s`` of ``pp`` owns a contiguous range of decoder layers, their weights and their KV
pool, on its own group of ``tensor_parallel_size`` devices (devices ``s * tp .. (s + 1) * tp
- 1``: ``pp x tp`` in all), with tensor parallelism inside the group
(:class:`~jaxpaged.distributed.tensor_parallel.TensorParallel`, one mesh per stage). The
embedding lives on the first stage, the final norm and the LM head on the last (a model
with tied embeddings keeps a second copy of the embedding there, as vLLM's last PP rank
does). Layers that ``pp`` does not divide go one each to the stages before the last, which
also carries the LM head (the split of vLLM's ``get_pp_indices``).

Each stage runs as its own jitted program on its own devices; activations ``[T, hidden]``
move between stages with ``jax.device_put`` (a cross-mesh copy). How a step's micro-batches
flow through the stages is :mod:`jaxpaged.runner.pipeline_runner`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.tensor_parallel import TensorParallel
from jaxpaged.errors import PipelineParallelError


def stage_layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the decoder layers of each of ``pp`` stages.

    Every stage gets ``num_layers // pp`` layers; the remainder goes one layer each to the
    stages just before the last (the last also runs the LM head), e.g. 5 layers over 2
    stages -> ``[(0, 3), (3, 5)]``, 10 over 4 -> ``[(0, 2), (2, 5), (5, 8), (8, 10)]``.

    Raises:
        PipelineParallelError: fewer layers than stages.
    """
    if num_layers < pp:
        raise PipelineParallelError(f"pipeline_parallel_size={pp} exceeds the model's "
                                    f"{num_layers} decoder layers (each stage needs one)")
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-2 - i] += 1
    starts = [sum(counts[:i]) for i in range(pp)]
    return [(a, a + n) for a, n in zip(starts, counts)]


@dataclass(frozen=True)
class PipelineParallel:
    """The stages of one engine and where every weight and KV layer lives.

    Duck-types :class:`TensorParallel` for the weight loader (``param_sharding``,
    ``repeat_kv_heads``, ``physical_config``, ``size``): a parameter goes to the stage of
    its layer, split by that stage's tensor-parallel rules.

    Attributes:
        stages: one :class:`TensorParallel` (mesh and rules) per stage, in order.
        layer_ranges: each stage's ``(start, end)`` decoder layers.
    """

    stages: tuple[TensorParallel, ...]
    layer_ranges: tuple[tuple[int, int], ...]

    @classmethod
    def create(cls, pp: int, tp: int, config: ModelConfig, devices: list | None = None
               ) -> "PipelineParallel":
        """Check ``pp x tp`` against the devices and the model and build the stages.

        Raises:
            PipelineParallelError: ``pp`` not a positive integer, more stages than layers,
                or fewer than ``pp x tp`` devices (naming both flags); TensorParallelError:
                ``tp`` does not fit the heads.
        """
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise PipelineParallelError(f"pipeline_parallel_size must be a positive integer, "
                                        f"got {pp!r}")
        ranges = stage_layer_ranges(config.num_layers, pp)
        devices = list(jax.devices() if devices is None else devices)
        if pp * tp > len(devices):
            raise PipelineParallelError(
                f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} needs {pp * tp} "
                f"devices but this process has {len(devices)}"
                + ("; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                   f"{pp * tp} before Python starts, or lower the sizes"
                   if devices[0].platform == "cpu" else ""))
        stages = tuple(TensorParallel.create(tp, config, devices[s * tp:(s + 1) * tp])
                       for s in range(pp))
        return cls(stages, tuple(ranges))

    @property
    def size(self) -> int:
        """The tensor-parallel degree inside a stage."""
        return self.stages[0].size

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> list:
        """Every stage's devices, stage by stage."""
        return [d for tp in self.stages for d in tp.mesh.devices.flat]

    def physical_config(self, config: ModelConfig) -> ModelConfig:
        """As :meth:`TensorParallel.physical_config` (the same in every stage)."""
        return self.stages[0].physical_config(config)

    def repeat_kv_heads(self, path: tuple, value, xp=np):
        """As :meth:`TensorParallel.repeat_kv_heads`."""
        return self.stages[0].repeat_kv_heads(path, value, xp)

    def stage_of_layer(self, layer: int) -> int:
        """The stage that runs decoder layer ``layer``."""
        return next(s for s, (a, b) in enumerate(self.layer_ranges) if a <= layer < b)

    def stage_of_param(self, path: tuple) -> int:
        """The stage that holds the parameter at NNX ``path``: a decoder layer's goes to its
        layer's stage, the embedding to the first, everything else (final norm, LM head) to
        the last."""
        names = [str(p) for p in path]
        if "layers" in names:
            return self.stage_of_layer(int(names[names.index("layers") + 1]))
        return 0 if "embed_tokens" in names else self.num_stages - 1

    def param_sharding(self, path: tuple, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
        """The parameter's sharding: its stage's mesh, split by that stage's rules."""
        return self.stages[self.stage_of_param(path)].param_sharding(path, shape)
