"""Device assembly in one place: a `ModelRunner` for one engine, built once.

What a vLLM worker (``vllm/v1/worker/gpu_worker.py``) does before serving, in order: pick the
tensor-parallel mesh, the attention backend and the KV cache dtype; load the weights onto
their shards; with ``--calculate-kv-scales``, calibrate per-layer fp8 KV scales on one prefill
into a pool in the model's dtype (``jaxpaged.runner.kv_scales``); size the KV pool (override,
byte budget, or GPU utilization after one profiling step, ``jaxpaged.runner.kv_sizing``); then
allocate the serving pool. The engine gets the runner and the figures the host side needs
(page count, bytes per page); nothing else on the host touches the device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.core.kv_groups import KVLayout, kv_layout, max_concurrency
from jaxpaged.distributed.pipeline_parallel import PipelineParallel
from jaxpaged.distributed.tensor_parallel import TensorParallel
from jaxpaged.engine_config import EngineConfig, LoadConfig
from jaxpaged.family_settings import with_max_model_len
from jaxpaged.runner.kv_scales import KVScales, calibrate_kv_scales, calibration_token_ids
from jaxpaged.runner.kv_sizing import check_pool_fits, num_kv_pages
from jaxpaged.layers.attention import (allocate_kv_pool, get_attention_backend,
                                       kv_bytes_per_page, resolve_kv_cache_dtype)
from jaxpaged.layers.attention.tensor_parallel import TensorParallelAttention
from jaxpaged.layers.cpu_build import cpu_flags
from jaxpaged.layers.kv_group_layers import set_kv_layout
from jaxpaged.core.state_slots import num_cached_states
from jaxpaged.layers.recurrent_pool import (num_kv_layers, recurrent_layers, recurrent_pool,
                                           refuse_unsupported, state_bytes)
from jaxpaged.lora.device import LoRASlotWriter, add_lora_slots
from jaxpaged.models.mixtral import use_expert_parallelism
from jaxpaged.gguf_config import is_gguf
from jaxpaged.models.gguf_loader import keeps_packed
from jaxpaged.models.loader import load_model
from jaxpaged.runner.compile_cache import configure_compilation_cache, resolve_cache_dir
from jaxpaged.runner.model_runner import ModelRunner, RunnerLimits
from jaxpaged.runner.page_size import DEFAULT_PAGE_SIZE, choose_page_size
from jaxpaged.sampling.logits_adjust import capacity as adjust_capacity

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Worker:
    """A built runner and the facts about it the engine needs.

    Attributes:
        runner: the model runner holding the weights and the serving KV pool.
        dtype: the model's compute dtype (a jnp dtype).
        kv_cache_dtype: the KV pool's element type.
        kv_scales: each layer's ``(k_scale, v_scale)`` (1.0 unless calibrated).
        num_pages: KV pages in the pool, the null page included.
        page_size: tokens per page (``--block-size``, resolved when ``auto``).
        kv_bytes_per_page: bytes of one page on one device (all layers, K and V; with KV
            cache groups, ``kv_layout.slots`` layers).
        tensor_parallel_size: devices the model is split over (in each pipeline stage).
        kv_layout: the pool's KV cache groups (``jaxpaged.core.kv_groups``), None when every
            layer has a page per token.
        max_concurrency: ``max_model_len``-token requests the pool holds at once, as logged
            (``jaxpaged.core.kv_groups.max_concurrency``).
    """

    runner: ModelRunner
    dtype: object
    kv_cache_dtype: object
    kv_scales: KVScales
    num_pages: int
    page_size: int
    kv_bytes_per_page: int
    tensor_parallel_size: int
    kv_layout: KVLayout | None = None
    max_concurrency: float = 0.0


def resolve_dtype(name: str, checkpoint_dtype: str):
    """``--dtype`` to a jnp dtype (``auto``: float32 for a float32/float64 checkpoint, else
    bfloat16)."""
    if name == "auto":
        name = "float32" if checkpoint_dtype in ("float32", "float64") else "bfloat16"
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def gguf_auto_dtype(packed: bool, platform: str) -> str:
    """What ``--dtype auto`` means for a GGUF file (whose metadata names no float dtype):
    float32 when its projections stay packed (:func:`keeps_gguf_packed`: the packed kernel
    reads and writes float32, so a narrower dtype would only round the activations between
    its calls), else bfloat16 on a GPU and on a CPU with AVX-512 BF16 (``avx512_bf16`` in
    ``/proc/cpuinfo``: XLA's bfloat16 dots run there at about twice float32's rate,
    ``docs/measurements.md``, "Worker"), else float32."""
    if packed:
        return "float32"
    if platform != "cpu" or "avx512_bf16" in cpu_flags().split():
        return "bfloat16"
    return "float32"


def auto_kv_cache_dtype(cache_dtype: str, packed: bool, dtype) -> str:
    """What ``--kv-cache-dtype auto`` means: ``float16`` for a float32 model whose GGUF
    projections stay packed (llama.cpp's default K/V type for the same file: half the pool's
    bytes, and decode attention, which reads the pool from memory, ~10% of a 16-user SmolLM2
    step faster, ``docs/measurements.md``, "CPU attention kernel"), else the model's dtype
    (``auto``); any other ``cache_dtype`` as given (``resolve_kv_cache_dtype`` checks it)."""
    if cache_dtype == "auto" and packed and jnp.dtype(dtype) == jnp.float32:
        return "float16"
    return cache_dtype


def keeps_gguf_packed(load: LoadConfig, cfg: ModelConfig, num_devices: int,
                      platform: str) -> bool:
    """Whether a GGUF model's projections, embedding and LM head stay packed as the file
    stores them (:class:`jaxpaged.layers.packed_linear.PackedLinear`) rather than dequantized
    on load: on one CPU device, without ``--quantization``, when every one of those tensors
    is of a packable block type (``jaxpaged.models.gguf_loader.keeps_packed``). On a GPU, or
    split over devices, the file loads dequantized (``docs/quantization.md``). ``load``:
    its ``model`` and ``load_format`` are read."""
    return (is_gguf(load.model) and load.load_format != "dummy" and cfg.quantization is None
            and num_devices == 1 and platform == "cpu" and keeps_packed(load.model))


def build_worker(config: EngineConfig, *, tokenizer: Callable[[], Any],
                 devices: list | None = None,
                 extra_bytes_per_page: Callable[[int], int] | None = None) -> Worker:
    """Load the model onto its devices and build its one :class:`ModelRunner`.

    Args:
        config: the engine's typed configs (``jaxpaged.engine_config``): the model's
            (``--quantization`` applied), loading, cache, parallel and scheduler limits
            (the resolved ``max_model_len`` among them), attention backend, LoRA.
        tokenizer: returns the model's tokenizer (called only to make the fp8 KV-scale
            calibration prompt; the engine loads it on another thread meanwhile).
        devices: the ``tensor_parallel_size`` devices to use (default: the first ones).
        extra_bytes_per_page: ``page_size ->`` bytes a page of another pool of the same
            page count takes on the first device (a draft model's,
            ``jaxpaged.spec_decode.draft_model``): a byte budget then holds both pools.

    Raises:
        TensorParallelError / MissingWeightsError / UnsupportedModelError: as
            :class:`jaxpaged.engine.engine.Engine` documents; ValueError: a pool that does
            not fit the devices or cannot hold one ``max_model_len`` request.
    """
    load, cache, par = config.load_config, config.cache_config, config.parallel_config
    sched, cfg, max_model_len = config.scheduler_config, config.model_config, \
        config.max_model_len
    cache_dir = resolve_cache_dir(load.compilation_cache_dir)
    configure_compilation_cache(cache_dir)
    cfg = dataclasses.replace(cfg, family=with_max_model_len(cfg.family, max_model_len))
    pipeline = None
    if par.pipeline_parallel_size > 1:
        pipeline = PipelineParallel.create(par.pipeline_parallel_size,
                                           par.tensor_parallel_size, cfg, devices)
        tp = pipeline.stages[0]      # every stage has the same tensor-parallel layout
    else:
        tp = TensorParallel.create(par.tensor_parallel_size, cfg, devices,
                                   par.enable_expert_parallel)
    kv_heads = tp.physical_config(cfg).num_kv_heads
    refuse_unsupported(cfg, pipeline=pipeline is not None,
                       speculative=config.speculative_config is not None,
                       calculate_kv_scales=cache.calculate_kv_scales)
    platform = tp.mesh.devices.flat[0].platform
    packed = keeps_gguf_packed(load, cfg, tp.size * par.pipeline_parallel_size, platform)
    checkpoint_dtype = cfg.checkpoint_dtype
    if is_gguf(load.model) and load.dtype == "auto":
        checkpoint_dtype = gguf_auto_dtype(packed, platform)
        logger.info("dtype auto: %s for this GGUF (%s)", checkpoint_dtype,
                    "packed projections" if packed else f"dequantized on load, {platform}")
    dtype = resolve_dtype(load.dtype, checkpoint_dtype)
    kv_cache_dtype = resolve_kv_cache_dtype(
        auto_kv_cache_dtype(cache.cache_dtype, packed, dtype), dtype)
    if kv_cache_dtype != jnp.dtype(dtype):
        logger.info("KV cache dtype: %s (--kv-cache-dtype %s)", jnp.dtype(kv_cache_dtype).name,
                    cache.cache_dtype)
    backend = get_attention_backend(
        config.attention_backend, num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        page_size=DEFAULT_PAGE_SIZE if cache.block_size == "auto" else cache.block_size,
        dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    page_size = cache.block_size
    if page_size == "auto":
        device = tp.mesh.devices.flat[0]
        choice = choose_page_size(platform=device.platform, device_kind=device.device_kind,
                                  backend=backend.name, head_dim=cfg.head_dim,
                                  dtype=np.dtype(kv_cache_dtype).name,
                                  max_model_len=max_model_len)
        page_size = choice.page_size
        logger.info("block_size auto: %d tokens per page (%s)", page_size, choice.reason)
    if tp.size > 1 and pipeline is None:    # (each stage wraps its own layers)
        backend = TensorParallelAttention(backend, tp.mesh)
    if packed:
        cfg = dataclasses.replace(cfg, quantization="gguf")
        logger.info("GGUF projections and embedding kept packed as stored (CPU, one device)")
    model = load_model(load.model, cfg, dtype=dtype, backend=backend,
                       load_format=load.load_format, seed=load.seed, tp=pipeline or tp,
                       packed_cache_dir=cache_dir and os.path.join(cache_dir, "gguf-packed"))
    if tp.expert_parallel:
        use_expert_parallelism(model, tp.mesh)
    lora_config = config.lora_config
    lora = None if lora_config is None else LoRASlotWriter(
        add_lora_slots(model, cfg, lora_config, tp, dtype), tp)
    pages_per_seq = -(-max_model_len // page_size)
    layout = kv_layout(cfg.sliding_windows, enabled=pipeline is None
                       and config.speculative_config is None
                       and not cache.calculate_kv_scales)
    if layout is not None and not set_kv_layout(model, layout):
        layout = None       # (a model without the grouped decoder)

    # Live state slots, then cached ones (prefix caching: jaxpaged.core.state_slots).
    num_cached = num_cached_states(sched.max_num_seqs,
                                   cache.enable_prefix_caching and layout is None)
    num_state_slots = sched.max_num_seqs + num_cached

    def pool(num_pages, pool_dtype=kv_cache_dtype):
        if pipeline is not None:    # each stage's layers on its own devices
            return [pair for (a, b), stage in zip(pipeline.layer_ranges, pipeline.stages)
                    for pair in allocate_kv_pool(b - a, num_pages, page_size, kv_heads,
                                                 cfg.head_dim, pool_dtype,
                                                 stage.kv_pool_sharding)]
        if recurrent_layers(cfg):   # (per layer: KV pages or recurrent state slots)
            return recurrent_pool(
                cfg, lambda n: allocate_kv_pool(n, num_pages, page_size, kv_heads, cfg.head_dim,
                                                pool_dtype, tp.kv_pool_sharding),
                num_state_slots, dtype, tp.replicated)
        return allocate_kv_pool(layout.slots if layout else cfg.num_layers, num_pages,
                                page_size, kv_heads, cfg.head_dim, pool_dtype,
                                tp.kv_pool_sharding)

    # Calibration reads the exact K/V, so it runs on an unquantized scratch pool first.
    runner = ModelRunner(
        model, pool(2, dtype if cache.calculate_kv_scales else kv_cache_dtype), backend,
        page_size=page_size, replicated=tp.replicated, pipeline=pipeline,
        executable_dir=cache_dir and os.path.join(cache_dir, "steps"), lora=lora,
        limits=RunnerLimits(max_num_tokens=sched.max_num_batched_tokens,
                            max_num_seqs=sched.max_num_seqs, max_pages_per_seq=pages_per_seq,
                            vocab_size=cfg.vocab_size,
                            max_adjust_entries=adjust_capacity(cfg.vocab_size, max_model_len)))
    runner.tensor_parallel = pipeline or tp     # (weight updates repeat KV heads as loading)
    scales = [(1.0, 1.0)] * cfg.num_layers
    if cache.calculate_kv_scales:
        scales = calibrate_kv_scales(runner, calibration_token_ids(
            tokenizer(), cfg.max_position_embeddings, cfg.vocab_size))
        runner.set_kv_scales(scales)
        runner.set_kv_pool(pool(2))
        logger.info("calibrated fp8 KV scales: k_scale %s; v_scale %s",
                    " ".join(f"{k:.3g}" for k, _ in scales),
                    " ".join(f"{v:.3g}" for _, v in scales))
    # Budgets are per device: each holds kv_heads / tp heads of every page, of its stage's
    # layers (the largest stage's count bounds the page count).
    # With KV cache groups a page spans layout.slots layers, and a sequence holds each group's
    # real need (its window's pages in a sliding group).
    layers_per_device = max(b - a for a, b in pipeline.layer_ranges) if pipeline \
        else layout.slots if layout else num_kv_layers(cfg)
    seq_pages = layout.pages_per_seq(max_model_len, page_size, sched.max_num_batched_tokens) \
        if layout else pages_per_seq
    bytes_per_page = kv_bytes_per_page(layers_per_device, page_size, kv_heads // tp.size,
                                       cfg.head_dim, kv_cache_dtype)
    num_devices = tp.size * par.pipeline_parallel_size * par.data_parallel_size
    extra = extra_bytes_per_page(page_size) if extra_bytes_per_page else 0
    num_pages = num_kv_pages(
        bytes_per_page=bytes_per_page + extra, pages_per_seq=seq_pages,
        max_num_seqs=sched.max_num_seqs, num_gpu_blocks_override=cache.num_gpu_blocks_override,
        kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        profile_peak_bytes=runner.profile_peak_bytes, num_devices=num_devices,
        device=tp.mesh.devices.flat[0], kv_cache_memory_share=cache.kv_cache_memory_share)
    check_pool_fits(num_pages, bytes_per_page + extra, num_devices)
    if num_pages - 1 < seq_pages:     # page 0 is the null page
        raise ValueError(
            f"the KV pool ({num_pages - 1} usable pages of {page_size} tokens) cannot hold one "
            f"request of max_model_len={max_model_len} tokens; give more KV memory or lower "
            "max_model_len")
    runner.set_kv_pool(pool(num_pages))
    concurrency = max_concurrency(num_pages, max_model_len, page_size,
                                  sched.max_num_batched_tokens, layout)
    logger.info("KV cache: %d pages of %d tokens in %s, %d bytes per page (%.1f MiB in all); "
                "maximum concurrency for %d-token requests: %.2fx", num_pages, page_size,
                np.dtype(kv_cache_dtype).name, bytes_per_page,
                num_pages * bytes_per_page / 2**20, max_model_len,
                concurrency)
    if recurrent_layers(cfg):
        logger.info("recurrent state: %d live slots (max_num_seqs) and %d cached-state slots "
                    "(prefix caching) in each of %d recurrent layers, %.2f MiB besides the KV "
                    "pages (%.2f MiB of them cached states)", sched.max_num_seqs, num_cached,
                    sum(recurrent_layers(cfg)), state_bytes(cfg, num_state_slots, dtype) / 2**20,
                    (state_bytes(cfg, num_state_slots, dtype)
                     - state_bytes(cfg, sched.max_num_seqs, dtype)) / 2**20)
    if layout is not None:
        logger.info("KV cache groups: %s, a page spanning %d layers; a %d-token request holds "
                    "%s pages of them", ", ".join(
                        f"{len(g.layers)} {'full' if g.window is None else f'window-{g.window}'}"
                        for g in layout.groups), layout.slots, max_model_len,
                    "+".join(map(str, layout.group_pages_per_seq(
                        max_model_len, page_size, sched.max_num_batched_tokens))))
    logger.info("model %s (%s, %d layers), dtype %s, quantization %s (weights %.1f MiB), "
                "max_model_len %d, attention %s, tensor parallel %d, pipeline stages %s",
                load.model, cfg.architecture, cfg.num_layers, np.dtype(dtype).name,
                cfg.quantization, runner.weight_bytes / 2**20, max_model_len,
                runner.backend.name, tp.size,
                pipeline.layer_ranges if pipeline else 1)
    return Worker(runner=runner, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_scales=scales,
                  num_pages=num_pages, page_size=page_size, kv_bytes_per_page=bytes_per_page,
                  tensor_parallel_size=tp.size, kv_layout=layout,
                  max_concurrency=concurrency)
