"""`EngineArgs`: every engine setting, and the one argparse parser for them.

Flag names follow vLLM's CLI (``--model``, ``--block-size``, ``--max-num-seqs``, ...) so that
commands written for ``vllm`` carry over. ``jaxpaged generate`` and ``jaxpaged serve`` both
build their parsers with :meth:`EngineArgs.add_cli_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass

from jaxpaged.arg_checks import check_engine_args
from jaxpaged.config import QUANTIZATION_METHODS, ModelConfig
from jaxpaged.core.scheduler_config import SchedulerConfig
from jaxpaged.core.spec_decode.config import SpeculativeConfig
from jaxpaged.engine_config import CacheConfig, EngineConfig, LoadConfig, ParallelConfig
from jaxpaged.lora.config import LoRAConfig, add_lora_cli_args
from jaxpaged.constants import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES,  # noqa: F401
                                SCHEDULING_POLICIES)
from jaxpaged.pooling_params import CONVERTS, RUNNERS, PoolerConfig, resolve_pooler

#: The model shipped inside the package (stories260K, MIT licence); the default ``--model``.
DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "model_files",
                             "stories260K")
#: EngineArgs fields with no command-line flag (set by the server, not by a user's flag).
NOT_FLAGS = ("kv_cache_memory_share",)


@dataclass(kw_only=True)
class EngineArgs:
    """Engine configuration (vLLM's names).

    Attributes:
        model: Hugging Face model directory or ``.gguf`` file (default: the bundled
            stories260K).
        tokenizer: tokenizer directory (default: ``model``).
        trust_remote_code: let a tokenizer that ships its own Python code (``auto_map``)
            run it. Model code never runs: the architectures are jaxpaged's own and
            ``config.json`` is read as data.
        dtype: ``float32``, ``bfloat16`` or ``auto`` (the checkpoint's ``torch_dtype``:
            float32 stays float32, 16-bit floats become bfloat16, unspecified is float32).
        load_format: ``auto`` (safetensors) or ``dummy`` (random weights).
        quantization: weight-only quantization of the decoder's projections, ``int8`` or
            ``fp8`` (``jaxpaged.layers.quantization``) or 4-bit ``awq``
            (``jaxpaged.layers.awq``); None keeps the checkpoint's weights
            (an fp8 checkpoint stays fp8).
        seed: engine seed; requests without a ``seed`` draw theirs from it.
        block_size: tokens per KV page (a power of two), or ``"auto"``: chosen at start-up
            from the device's tuning table for the model's head shape and from
            ``max_model_len`` (``jaxpaged.runner.page_size``; the choice and its reason are
            logged).
        max_model_len: longest prompt + output (default: the model's trained context).
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most tokens in one step (longer prompts are chunked).
        num_gpu_blocks_override: exact KV page count (null page included); overrides budgets.
        kv_cache_memory_bytes: KV pool budget in bytes (sets the page count).
        kv_cache_memory_share: this engine's fraction (0, 1] of the CPU's default KV budget
            (``jaxpaged.runner.kv_sizing``) where no other budget is given; not a flag:
            ``--models-config`` sets it from a model's ``kv_cache_memory_share`` (which on
            a GPU scales ``gpu_memory_utilization`` and a given ``kv_cache_memory_bytes``).
        kv_cache_dtype: ``auto`` (K/V in the model's dtype), ``float16`` (two bytes an
            element, llama.cpp's default K/V type: half a float32 model's KV bytes) or
            ``fp8`` / ``fp8_e4m3`` (float8_e4m3fn with per-layer scales: one byte an element,
            so a byte budget holds twice the pages of a bfloat16 model's KV, four times a
            float32 model's).
        calculate_kv_scales: derive each layer's fp8 ``k_scale`` / ``v_scale`` from a short
            calibration prefill at start-up (``jaxpaged.runner.kv_scales``) instead of
            using 1.0; needs an fp8 ``kv_cache_dtype``.
        attention_backend: ``xla``, ``pallas``, ``cpu`` or ``auto`` (pallas on a GPU after
            a self-check; on a CPU ``cpu``, the C++ decode kernel, after its self-check, when
            it builds and reads the KV dtype; else xla).
        enable_prefix_caching: reuse KV pages of earlier requests with the same prefix.
        max_num_partial_prefills: most prompts mid-prefill (chunked) at once.
        long_prefill_token_threshold: most prompt tokens one request prefills per step
            (0: no cap beyond the step budget).
        scheduling_policy: ``fcfs``, ``priority`` (lower ``priority`` first; preemption
            takes the lowest-priority, newest request) or ``sjf`` (shortest job first, aged:
            ``jaxpaged.core.scheduler``).
        sjf_aging_requests: under ``sjf``, the most requests that arrived after a request
            and are scheduled before it (a request of ``max_model_len`` tokens is overtaken
            by at most this many later arrivals; 0 is fcfs).
        gpu_memory_utilization: fraction of GPU memory for weights, activations and KV pool.
        enforce_eager: skip the start-up precompile of every step shape (compile lazily).
        async_scheduling: schedule and dispatch each step while the previous one runs on
            the device, and apply that one's tokens and make its outputs while this one runs
            (``Engine.step``; vLLM's ``--async-scheduling``); the synchronous outputs, each
            returned one step later. On by default (a multi-host job, whose processes step
            in lockstep, schedules synchronously); off: each step waits for the previous.
        compilation_cache_dir: directory of the on-disk cache of compiled steps (JAX's
            persistent compilation cache; ``jaxpaged.runner.compile_cache``). None: the
            default, ``~/.cache/jaxpaged/compile_cache`` (``$XDG_CACHE_HOME`` and
            ``$JAXPAGED_CACHE_ROOT`` respected); ``""``: off (as is
            ``JAXPAGED_DISABLE_COMPILE_CACHE=1``).
        tensor_parallel_size: devices the model's heads and MLP columns are split over
            (``jaxpaged.distributed.tensor_parallel``).
        enable_expert_parallel: a mixture-of-experts model's experts split whole over those
            devices (each holds ``num_experts / tensor_parallel_size``) instead of each
            expert's intermediate columns (vLLM's ``--enable-expert-parallel``).
        pipeline_parallel_size: stages the decoder layers are split into, each on its own
            ``tensor_parallel_size`` devices (``pp x tp`` in all), a step's sequences run
            through them as micro-batches (``jaxpaged.runner.pipeline_runner``; vLLM's
            ``--pipeline-parallel-size``); not combinable with speculative decoding,
            calibrated KV scales, expert or data parallelism or several processes, and it
            turns async scheduling off.
        data_parallel_size: engine replicas, each on its own ``tensor_parallel_size``
            devices, sharing the requests (``jaxpaged.engine.data_parallel``).
        coordinator_address, num_processes, process_id: a multi-host job
            (``jaxpaged.distributed.multihost``): process 0's ``host:port``, the process
            count, and this process's index.
        runner, convert, pooler_config: what the model runs for (vLLM's ``--runner``,
            ``--convert``, ``--pooler-config``; ``jaxpaged.pooling_params``): ``generate``
            or ``pooling`` (embeddings only); ``convert="embed"`` or a pooler config (JSON
            text or a dict: ``pooling_type`` ``LAST`` / ``MEAN``, ``normalize``) make
            ``runner="auto"`` pooling; ``convert="classify"`` (or ``"score"``), or a
            sequence-classification model, pools through its classifier head (rerank and
            score; ``jaxpaged.classification``).
        hf_overrides: JSON text or a dict merged over ``config.json``'s top level (vLLM's
            ``--hf-overrides``), e.g. ``{"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}`` to
            run Qwen3-Reranker as a classifier.
        speculative_config: speculative decoding (``jaxpaged.core.spec_decode.config``): a dict
            or its JSON text with vLLM's fields (``method="ngram"`` with
            ``prompt_lookup_max``, ``prompt_lookup_min``; or ``method="draft_model"`` with
            ``model``, a smaller model of the same vocabulary, not combinable with LoRA,
            tensor parallelism or several processes; ``num_speculative_tokens``,
            ``disable_by_batch_size``); None: off. Verification steps are finished
            synchronously, other steps keep async scheduling
            (``docs/speculative_decoding.md``).
        enable_lora: serve LoRA adapters (``docs/lora.md``); max_loras: distinct adapters in
            one step (vLLM's default 1); max_lora_rank: the largest rank accepted (16);
            max_cpu_loras: adapters the host keeps loaded (None: max_loras).
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    seed: int = 0
    block_size: int | str = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_share: float = 1.0
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    sjf_aging_requests: int = 64
    gpu_memory_utilization: float = 0.92
    enforce_eager: bool = False
    async_scheduling: bool = True
    compilation_cache_dir: str | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int | None = None
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | dict | None = None
    hf_overrides: str | dict | None = None
    speculative_config: dict | str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_engine_args(self)     # every field's type and range (jaxpaged.arg_checks)

    def create_load_config(self) -> LoadConfig:
        """Where the model comes from and how it loads (``jaxpaged.engine_config``)."""
        return LoadConfig(model=self.model, tokenizer=self.tokenizer,
                          trust_remote_code=self.trust_remote_code,
                          load_format=self.load_format, dtype=self.dtype, seed=self.seed,
                          compilation_cache_dir=self.compilation_cache_dir)

    def create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits and policy, for the resolved ``max_model_len``."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len, max_num_partial_prefills=self.max_num_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy, sjf_aging_requests=self.sjf_aging_requests)

    def create_engine_config(self) -> EngineConfig:
        """Every typed config of the engine (vLLM's ``create_engine_config``): reads the
        model's ``config.json`` (or GGUF metadata) and resolves ``max_model_len``.

        Raises:
            ValueError: ``max_model_len`` beyond the model's ``max_position_embeddings``;
                what ``ModelConfig.from_pretrained`` and ``with_quantization`` raise.
        """
        cfg = ModelConfig.from_pretrained(self.model, self.hf_overrides).with_quantization(
            self.quantization)
        max_model_len = self.max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        return EngineConfig(
            model_config=cfg, load_config=self.create_load_config(),
            cache_config=CacheConfig(
                block_size=self.block_size, cache_dtype=self.kv_cache_dtype,
                calculate_kv_scales=self.calculate_kv_scales,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                kv_cache_memory_share=self.kv_cache_memory_share),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                coordinator_address=self.coordinator_address,
                num_processes=self.num_processes, process_id=self.process_id),
            scheduler_config=self.create_scheduler_config(max_model_len),
            attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
            lora_config=LoRAConfig.from_engine_args(self),
            speculative_config=SpeculativeConfig.from_dict(self.speculative_config))

    @property
    def pooler(self) -> PoolerConfig | None:
        """The engine's pooler (None: it generates); ``jaxpaged.pooling_params``."""
        return resolve_pooler(self.model, self.runner, self.convert, self.pooler_config,
                              self.hf_overrides)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM spelling) to ``parser``."""
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=d.model,
                       help="Hugging Face model directory or GGUF file (default: the bundled "
                            "stories260K)")
        g.add_argument("--tokenizer", default=None,
                       help="tokenizer directory (default: --model; a GGUF's own tokenizer)")
        g.add_argument("--trust-remote-code", action="store_true",
                       help="let a tokenizer that ships Python code run it (default: refused)")
        g.add_argument("--dtype", default=d.dtype, choices=DTYPES)
        g.add_argument("--load-format", default=d.load_format, choices=("auto", "safetensors", "dummy"))
        g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                       help="weight-only quantization of the decoder's projections "
                            "(default: the checkpoint's own weights)")
        g.add_argument("--seed", type=int, default=d.seed,
                       help="engine seed: requests without their own seed draw one from it")
        g.add_argument("--block-size", type=_block_size, default=d.block_size,
                       help="tokens per KV page (a power of two), or auto: chosen at start-up "
                            "from the device's tuning table and --max-model-len")
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="exact number of KV pages (overrides the memory budget)")
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="KV pool size in bytes")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                       help="KV cache element type: auto (the model's dtype) or fp8 / fp8_e4m3 "
                            "(float8_e4m3fn with per-layer scales; half a bfloat16 model's KV "
                            "bytes, so twice the pages in the same budget)")
        g.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction,
                       default=d.calculate_kv_scales,
                       help="fp8 KV cache: calibrate per-layer k/v scales on a short prefill at "
                            "start-up instead of using 1.0")
        g.add_argument("--attention-backend", default=d.attention_backend,
                       choices=ATTENTION_BACKENDS,
                       help="auto: pallas on a GPU, cpu (C++ decode kernel) on a CPU, "
                            "each after a self-check; else xla")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching, help="automatic prefix caching")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=d.async_scheduling,
                       help="schedule and dispatch each step while the device runs the "
                            "previous one (the same outputs, each one step later)")
        g.add_argument("--max-num-partial-prefills", type=int, default=d.max_num_partial_prefills)
        g.add_argument("--long-prefill-token-threshold", type=int,
                       default=d.long_prefill_token_threshold)
        g.add_argument("--scheduling-policy", default=d.scheduling_policy,
                       choices=SCHEDULING_POLICIES,
                       help="fcfs; priority (lower first); sjf: shortest job (remaining "
                            "prompt + max_tokens) first, aged by --sjf-aging-requests")
        g.add_argument("--sjf-aging-requests", type=int, default=d.sjf_aging_requests,
                       help="sjf: at most this many later arrivals overtake a request")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                       help="skip the start-up precompile of every step shape and compile "
                            "lazily (default: on for generate, which runs one batch; off for "
                            "serve)")
        g.add_argument("--compilation-cache-dir", default=None,
                       help="directory of the on-disk cache of compiled steps (default "
                            "~/.cache/jaxpaged/compile_cache; '' or "
                            "JAXPAGED_DISABLE_COMPILE_CACHE=1: off)")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="devices to split the model over (heads, MLP columns, KV pool)")
        g.add_argument("--enable-expert-parallel", action="store_true",
                       help="mixture-of-experts models: whole experts split over the "
                            "--tensor-parallel-size devices instead of every expert's columns")
        g.add_argument("--pipeline-parallel-size", "-pp", type=int,
                       default=d.pipeline_parallel_size,
                       help="stages the layers are split into, each on its own "
                            "--tensor-parallel-size devices; a step's sequences run through "
                            "them as micro-batches")
        g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                       help="engine replicas, each on its own --tensor-parallel-size devices, "
                            "sharing the requests")
        g.add_argument("--coordinator-address", default=None,
                       help="multi-host: HOST:PORT of process 0's coordinator")
        g.add_argument("--num-processes", type=int, default=d.num_processes,
                       help="multi-host: processes in the job (each runs the same command)")
        g.add_argument("--process-id", type=int, default=None,
                       help="multi-host: this process's index, 0 .. num_processes - 1")
        g.add_argument("--runner", default=d.runner, choices=RUNNERS,
                       help="generate, or pooling (serve /v1/embeddings, or /rerank and "
                            "/score for a classifier); auto: pooling with --convert, "
                            "--pooler-config or a *ForSequenceClassification model")
        g.add_argument("--convert", default=d.convert, choices=CONVERTS,
                       help="embed: run the decoder as an embedding model; classify (or "
                            "score): as a sequence classifier (rerank, score)")
        g.add_argument("--hf-overrides", default=None,
                       help='JSON merged over config.json, e.g. \'{"architectures": '
                            '["Qwen3ForSequenceClassification"], "classifier_from_token": '
                            '["no", "yes"], "is_original_qwen3_reranker": true}\'')
        g.add_argument("--pooler-config", default=None,
                       help='pooling override as JSON, e.g. \'{"pooling_type": "MEAN", '
                            '"normalize": true}\' (default: the checkpoint\'s '
                            'sentence-transformers modules.json, else LAST)')
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, vLLM\'s fields, e.g. \'{"method": '
                            '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
                            'or \'{"method": "draft_model", "model": "DRAFT_DIR", '
                            '"num_speculative_tokens": 4}\' (a smaller model with the same '
                            "vocabulary); verification steps run synchronously")
        add_lora_cli_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, enforce_eager_default: bool = False
                      ) -> "EngineArgs":
        """Build from a namespace parsed with :meth:`add_cli_args`' flags; an unset
        ``--[no-]enforce-eager`` takes the command's default."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.name not in NOT_FLAGS}
        if values["enforce_eager"] is None:
            values["enforce_eager"] = enforce_eager_default
        return cls(**values)


def _block_size(text: str) -> int | str:
    """``--block-size``'s value: ``auto`` or an integer."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {text!r}") from None


def cli_error_message(error: BaseException) -> str:
    """``error``'s message with engine settings named as command-line flags
    (``EngineArgs.max_num_seqs`` and ``max_num_seqs`` become ``--max-num-seqs``)."""
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - set(NOT_FLAGS)

    def flag(match: re.Match) -> str:
        name = match.group(1)
        return "--" + name.replace("_", "-") if name in fields else match.group(0)

    return re.sub(r"(?:EngineArgs\.)?\b([a-z]+_[a-z_]+)\b", flag, str(error))
