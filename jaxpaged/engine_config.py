"""The engine's typed configuration, built once by ``EngineArgs.create_engine_config``.

vLLM splits its engine arguments into frozen per-subsystem configs (``vllm/config/``:
``ModelConfig``, ``CacheConfig``, ``ParallelConfig``, ``LoadConfig``, ``SchedulerConfig``,
gathered in ``VllmConfig``), and each part of the engine takes only the configs it reads.
Same here: the worker (``jaxpaged.runner.worker.build_worker``) and the draft model
(``jaxpaged.spec_decode.draft_model``) take these, never the ``EngineArgs`` object, so what
a part depends on is visible in its signature. ``ModelConfig`` (``jaxpaged.config``) is the
checkpoint's own description (``config.json`` or GGUF metadata, with ``--hf-overrides`` and
``--quantization`` applied); the choices the engine makes about loading it (path, dtype,
seed) are in :class:`LoadConfig`. The scheduler's limits are
``jaxpaged.core.scheduler_config.SchedulerConfig``. A leaf: data only.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpaged.config import ModelConfig
from jaxpaged.core.scheduler_config import SchedulerConfig
from jaxpaged.core.spec_decode.config import SpeculativeConfig
from jaxpaged.lora.config import LoRAConfig


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """Where the model comes from and how its weights load (``EngineArgs``' fields of the
    same names).

    Attributes:
        model: Hugging Face model directory or ``.gguf`` file.
        tokenizer: tokenizer directory (None: ``model``).
        trust_remote_code: let a tokenizer's own Python code run.
        load_format: ``auto`` / ``safetensors`` or ``dummy`` (random weights).
        dtype: ``float32``, ``bfloat16`` or ``auto`` (``jaxpaged.runner.worker.resolve_dtype``).
        seed: the engine seed (dummy weights; requests without their own seed).
        compilation_cache_dir: the on-disk cache of compiled steps (None: the default,
            ``""``: off; ``jaxpaged.runner.compile_cache``).
    """

    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False
    load_format: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    compilation_cache_dir: str | None = None


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The KV cache: its pages, element type and size (vLLM's ``CacheConfig``).

    Attributes:
        block_size: tokens per page, or ``"auto"`` (``jaxpaged.runner.page_size``).
        cache_dtype: ``auto`` (the model's dtype), ``fp8`` or ``fp8_e4m3``
            (``--kv-cache-dtype``).
        calculate_kv_scales: calibrate the fp8 per-layer scales at start-up.
        enable_prefix_caching: automatic prefix caching.
        gpu_memory_utilization, num_gpu_blocks_override, kv_cache_memory_bytes,
            kv_cache_memory_share: the pool's size (``jaxpaged.runner.kv_sizing``).
    """

    block_size: int | str = 16
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.92
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_share: float = 1.0


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is split over devices and processes (vLLM's ``ParallelConfig``).

    Attributes:
        tensor_parallel_size: devices of one stage (heads, MLP columns, KV heads).
        pipeline_parallel_size: stages of the decoder layers.
        data_parallel_size: engine replicas.
        enable_expert_parallel: whole experts split over the tensor-parallel devices.
        coordinator_address, num_processes, process_id: a multi-host job.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int | None = None

    @property
    def world_size(self) -> int:
        """Devices of the whole job: ``tp x pp x dp``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * \
            self.data_parallel_size


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every config of one engine (vLLM's ``VllmConfig``).

    Attributes:
        model_config: the checkpoint's architecture (overrides and quantization applied).
        load_config, cache_config, parallel_config, scheduler_config: as named; the
            resolved ``max_model_len`` is ``scheduler_config.max_model_len``.
        attention_backend: ``--attention-backend`` (``auto``, ``xla``, ``pallas``, ``cpu``).
        enforce_eager: skip the start-up precompile.
        lora_config: multi-LoRA (None: off).
        speculative_config: speculative decoding (None: off).
    """

    model_config: ModelConfig
    load_config: LoadConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    attention_backend: str = "auto"
    enforce_eager: bool = False
    lora_config: LoRAConfig | None = None
    speculative_config: SpeculativeConfig | None = None

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) of one sequence, resolved."""
        return self.scheduler_config.max_model_len
