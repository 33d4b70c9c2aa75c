"""``EngineArgs.create_engine_config``: the flags as frozen typed configs (vLLM's split)."""

import dataclasses

import pytest

from jaxpaged.arg_utils import EngineArgs
from jaxpaged.core.scheduler_config import SchedulerConfig
from jaxpaged.engine_config import CacheConfig, LoadConfig, ParallelConfig


def test_every_flag_lands_in_its_config():
    args = EngineArgs(max_model_len=128, max_num_seqs=5, max_num_batched_tokens=96, seed=3,
                      dtype="float32", load_format="dummy", block_size=8,
                      kv_cache_dtype="fp8", num_gpu_blocks_override=40,
                      enable_prefix_caching=False, scheduling_policy="priority",
                      long_prefill_token_threshold=32, attention_backend="xla",
                      enforce_eager=True, enable_lora=True, max_loras=2,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    c = args.create_engine_config()
    assert c.model_config.num_layers == 5 and c.model_config.vocab_size == 512
    assert c.max_model_len == 128
    assert c.load_config == LoadConfig(model=args.model, load_format="dummy", dtype="float32",
                                       seed=3)
    assert c.cache_config == CacheConfig(block_size=8, cache_dtype="fp8",
                                         enable_prefix_caching=False,
                                         num_gpu_blocks_override=40)
    assert c.parallel_config == ParallelConfig() and c.parallel_config.world_size == 1
    assert c.scheduler_config == SchedulerConfig(
        max_num_seqs=5, max_num_batched_tokens=96, max_model_len=128,
        long_prefill_token_threshold=32, policy="priority")
    assert (c.attention_backend, c.enforce_eager) == ("xla", True)
    assert c.lora_config.max_loras == 2
    assert c.speculative_config.num_speculative_tokens == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cache_config.block_size = 16


def test_max_model_len_defaults_to_the_model_and_is_bounded_by_it():
    assert EngineArgs().create_engine_config().max_model_len == 512   # stories260K's
    with pytest.raises(ValueError, match="max_model_len=1024 exceeds the model's "
                                         "max_position_embeddings=512"):
        EngineArgs(max_model_len=1024).create_engine_config()
