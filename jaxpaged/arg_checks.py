"""The checks of :class:`jaxpaged.arg_utils.EngineArgs`: each field's type and range, and the
combinations the engine refuses, each raised with a typed error naming the field
(``EngineArgs.<field>``) when the arguments are built, before anything is loaded."""

from __future__ import annotations

from jaxpaged.config import QUANTIZATION_METHODS
from jaxpaged.constants import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES,
                                SCHEDULING_POLICIES)
from jaxpaged.core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from jaxpaged.errors import PipelineParallelError
from jaxpaged.lora.config import LoRAConfig
from jaxpaged.pooling_params import resolve_pooler


def check_engine_args(args) -> None:
    """Refuse an :class:`~jaxpaged.arg_utils.EngineArgs` that cannot run.

    Raises:
        ValueError: a field of the wrong type or out of range, or two that conflict (the
            message names ``EngineArgs.<field>``).
        PipelineParallelError: a feature pipeline parallelism does not support.
        SpeculativeConfigError / LoRAConfigError / jaxpaged.pooling_params' errors: from
            those configs' own checks.
    """
    def positive(name):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"EngineArgs.{name} must be a positive integer, got {value!r}")

    if args.block_size != "auto" and (not isinstance(args.block_size, int)
                                      or isinstance(args.block_size, bool)
                                      or args.block_size < 1):
        raise ValueError("EngineArgs.block_size must be a positive integer or 'auto', got "
                         f"{args.block_size!r}")
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "num_gpu_blocks_override", "kv_cache_memory_bytes",
                 "max_num_partial_prefills", "tensor_parallel_size", "data_parallel_size",
                 "num_processes", "pipeline_parallel_size"):
        positive(name)
    _check_pipeline_parallel(args)
    if not isinstance(args.seed, int) or isinstance(args.seed, bool) \
            or not 0 <= args.seed < 2**32:
        raise ValueError(f"EngineArgs.seed must be an integer in [0, 2**32), got {args.seed!r}")
    if args.tensor_parallel_size % args.num_processes:
        raise ValueError(f"EngineArgs.tensor_parallel_size={args.tensor_parallel_size} must be "
                         f"a multiple of num_processes={args.num_processes} (every process "
                         "holds the same number of devices)")
    if args.data_parallel_size > 1 and args.num_processes > 1:
        raise ValueError("EngineArgs.data_parallel_size > 1 runs in one process; it cannot "
                         "be combined with num_processes > 1")
    if not isinstance(args.trust_remote_code, bool):
        raise ValueError("EngineArgs.trust_remote_code must be True or False, got "
                         f"{args.trust_remote_code!r}")
    if args.block_size != "auto" and args.block_size & (args.block_size - 1):
        raise ValueError(f"EngineArgs.block_size must be a power of two, got {args.block_size}")
    if args.dtype not in DTYPES:
        raise ValueError(f"EngineArgs.dtype must be one of {DTYPES}, got {args.dtype!r}")
    if not isinstance(args.long_prefill_token_threshold, int) or \
            args.long_prefill_token_threshold < 0:
        raise ValueError("EngineArgs.long_prefill_token_threshold must be an integer >= 0, "
                         f"got {args.long_prefill_token_threshold!r}")
    if args.scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"EngineArgs.scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                         f"got {args.scheduling_policy!r}")
    if not isinstance(args.sjf_aging_requests, int) or args.sjf_aging_requests < 0:
        raise ValueError("EngineArgs.sjf_aging_requests must be an integer >= 0, got "
                         f"{args.sjf_aging_requests!r}")
    if not (isinstance(args.gpu_memory_utilization, (int, float))
            and 0 < args.gpu_memory_utilization <= 1):
        raise ValueError("EngineArgs.gpu_memory_utilization must be in (0, 1], "
                         f"got {args.gpu_memory_utilization!r}")
    if isinstance(args.kv_cache_memory_share, bool) or not (
            isinstance(args.kv_cache_memory_share, (int, float))
            and 0 < args.kv_cache_memory_share <= 1):
        raise ValueError("EngineArgs.kv_cache_memory_share must be in (0, 1], "
                         f"got {args.kv_cache_memory_share!r}")
    if args.quantization is not None and args.quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"EngineArgs.quantization must be one of {QUANTIZATION_METHODS} or "
                         f"None, got {args.quantization!r}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"EngineArgs.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"got {args.kv_cache_dtype!r}")
    if args.calculate_kv_scales and args.kv_cache_dtype == "auto":
        raise ValueError("EngineArgs.calculate_kv_scales needs an fp8 kv_cache_dtype (scales "
                         "only apply to an fp8 KV cache); set kv_cache_dtype to fp8")
    spec = SpeculativeConfig.from_dict(args.speculative_config)   # its own typed errors
    if spec is not None:
        spec.check_engine(enable_lora=args.enable_lora,
                          tensor_parallel_size=args.tensor_parallel_size,
                          num_processes=args.num_processes)
    if args.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"EngineArgs.attention_backend must be one of {ATTENTION_BACKENDS}, "
                         f"got {args.attention_backend!r}")
    pooler = resolve_pooler(args.model, args.runner, args.convert, args.pooler_config,
                            args.hf_overrides)
    if spec is not None and pooler is not None:
        raise SpeculativeConfigError("<config>", "a pooling engine (EngineArgs.runner="
                                     f"{args.runner!r}, convert or pooler_config) "
                                     "generates no tokens to speculate on")
    LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)   # typed errors


def _check_pipeline_parallel(args) -> None:
    """Refuse, by name, what pipeline parallelism does not support."""
    if args.pipeline_parallel_size == 1:
        return
    refused = [name for name, on in (
        ("speculative_config", args.speculative_config is not None),
        ("calculate_kv_scales", args.calculate_kv_scales),
        ("enable_expert_parallel", args.enable_expert_parallel),
        ("enable_lora", args.enable_lora),
        ("data_parallel_size > 1", args.data_parallel_size > 1),
        ("num_processes > 1", args.num_processes > 1)) if on]
    if refused:
        raise PipelineParallelError(
            f"EngineArgs.pipeline_parallel_size={args.pipeline_parallel_size} cannot be "
            f"combined with {refused[0]} (not supported with pipeline parallelism)")
