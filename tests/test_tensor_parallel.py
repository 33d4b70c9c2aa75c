"""Tensor parallelism on 8 host CPU devices (tests/conftest.py sets XLA_FLAGS)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import ModelConfig
from jaxpaged.distributed.tensor_parallel import TensorParallel, TensorParallelError
from tests.conftest import STORIES
from tests.helpers.random_llama import write_random_llama
from tests.test_continuous_batching import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def greedy_ids(model, tp, backend="xla", prompts=None, **kw):
    llm = LLM(model=model, tokenizer=STORIES, tensor_parallel_size=tp, attention_backend=backend,
              enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=64, **kw)
    prompts = prompts or random_prompts(5, 512, seed=3, max_len=40)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm


@pytest.fixture(scope="module")
def gqa8_model(tmp_path_factory):
    """A random Llama with 16 query heads and 8 KV heads (dummy weights from the seed)."""
    return write_random_llama(tmp_path_factory.mktemp("gqa8"))


def test_eight_host_devices_are_visible():
    assert jax.device_count() >= 8


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_bundled_model_greedy_identical_for_tp_1_2_4(backend):
    """4 KV heads: split 4, 2 and 1 per device."""
    prompts = random_prompts(3, 512, seed=1, max_len=30) if backend == "pallas" else None
    ref, _ = greedy_ids(STORIES, 1, backend, prompts)
    for tp in (2, 4):
        assert greedy_ids(STORIES, tp, backend, prompts)[0] == ref, f"tp={tp}"


def test_cpu_kernel_under_tp2_matches_xla_at_tp1(gqa8_model):
    """The C++ decode kernel inside shard_map (8 KV heads, 4 a device) gives xla's tokens."""
    kw = dict(load_format="dummy", seed=7)
    prompts = random_prompts(3, 512, seed=2, max_len=30)
    ref, _ = greedy_ids(gqa8_model, 1, "xla", prompts, **kw)
    out, llm = greedy_ids(gqa8_model, 2, "cpu", prompts, **kw)
    assert llm.engine.runner._backend.name == "cpu" and out == ref


def test_tp8_replicates_kv_heads_and_matches_tp1():
    """8 devices, 4 KV heads: each KV head lives on two devices."""
    ref, _ = greedy_ids(STORIES, 1)
    out, llm = greedy_ids(STORIES, 8)
    assert out == ref
    k_pages = llm.engine.runner._kv_caches[0][0]
    assert k_pages.shape[2] == 8                      # 4 checkpoint heads x 2 copies
    assert {s.data.shape[2] for s in k_pages.addressable_shards} == {1}


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_gqa8_greedy_identical_for_tp_1_2_4(gqa8_model, backend):
    kw = dict(load_format="dummy", seed=7)
    prompts = random_prompts(3, 512, seed=2, max_len=30)
    ref, _ = greedy_ids(gqa8_model, 1, backend, prompts, **kw)
    for tp in (2, 4):
        assert greedy_ids(gqa8_model, tp, backend, prompts, **kw)[0] == ref, f"tp={tp}"


def per_device_param_bytes(llm, device):
    from flax import nnx
    state = llm.engine.runner._state
    total = 0
    for path, var in nnx.to_flat_state(state):
        if "norm" in "/".join(str(p) for p in path):
            continue
        total += sum(s.data.nbytes for s in var.get_value().addressable_shards if s.device == device)
    return total


def test_per_device_parameter_bytes_quarter_at_tp4():
    _, one = greedy_ids(STORIES, 1)
    _, four = greedy_ids(STORIES, 4)
    full = per_device_param_bytes(one, jax.devices()[0])
    for device in jax.devices()[:4]:
        quarter = per_device_param_bytes(four, device)
        assert abs(quarter / (full / 4) - 1) <= 0.10, (device, quarter, full)


def test_kv_pool_split_by_head_at_tp2():
    _, llm = greedy_ids(STORIES, 2)
    k_pages = llm.engine.runner._kv_caches[0][0]
    assert k_pages.shape[2] == 4
    assert {s.data.shape[2] for s in k_pages.addressable_shards} == {2}
    assert len(k_pages.addressable_shards) == 2


def test_clear_errors():
    cfg = ModelConfig.from_pretrained(STORIES)
    with pytest.raises(TensorParallelError, match="does not divide the model's 8 attention heads"):
        TensorParallel.create(3, cfg)
    with pytest.raises(TensorParallelError, match="needs 16 devices.*xla_force_host_platform"):
        TensorParallel.create(16, cfg)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tensor_parallel_size=0)
    six_kv = ModelConfig.from_dict({**json.load(open(os.path.join(STORIES, "config.json"))),
                                    "num_attention_heads": 12, "num_key_value_heads": 6})
    with pytest.raises(TensorParallelError, match="multiples of one another"):
        TensorParallel.create(4, six_kv)


def test_kv_head_replication_order():
    cfg = ModelConfig.from_pretrained(STORIES)     # 4 KV heads, head_dim 8
    tp = TensorParallel.create(8, cfg)
    kernel = np.arange(2 * 32).reshape(2, 32)      # [in, 4 heads x 8]
    out = tp.repeat_kv_heads(("layers", 0, "self_attn", "k_proj", "kernel"), kernel)
    heads = out.reshape(2, 8, 8)
    for j in range(8):
        np.testing.assert_array_equal(heads[:, j], kernel.reshape(2, 4, 8)[:, j // 2])
    q = tp.repeat_kv_heads(("layers", 0, "self_attn", "q_proj", "kernel"), kernel)
    assert q is kernel
    weight = kernel.T                              # a float projection's [out, in]
    out = tp.repeat_kv_heads(("layers", 0, "self_attn", "v_proj", "weight"), weight)
    assert out.shape == (64, 2)
    for j in range(8):
        np.testing.assert_array_equal(out[8 * j:8 * j + 8], weight[8 * (j // 2):8 * (j // 2) + 8])


def test_projection_shardings_split_the_right_axis():
    cfg = ModelConfig.from_pretrained(STORIES)     # hidden 64, intermediate 172, vocab 512
    tp = TensorParallel.create(2, cfg)
    spec = lambda *path, shape: tp.param_sharding(("layers", 0) + path, shape).spec  # noqa
    assert spec("self_attn", "q_proj", "weight", shape=(64, 64)) == P("tp", None)
    assert spec("self_attn", "o_proj", "weight", shape=(64, 64)) == P(None, "tp")
    assert spec("mlp", "down_proj", "weight", shape=(64, 172)) == P(None, "tp")
    assert spec("self_attn", "q_proj", "bias", shape=(64,)) == P("tp")
    assert spec("input_layernorm", "weight", shape=(64,)) == P()
    assert tp.param_sharding(("lm_head", "weight"), (512, 64)).spec == P("tp", None)


def test_cli_splits_the_host_cpu_by_itself():
    """No XLA_FLAGS: ``--tensor-parallel-size 2`` asks XLA for 2 host devices; the text
    equals the committed single-device reference."""
    with open(os.path.join(STORIES, "reference",
                           "expected_greedy_prompt_OnceUponATime_n64.txt")) as f:
        expected = f.read()
    prompt = "Once upon a time"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.cli", "generate", "--tensor-parallel-size", "2",
         "--temperature", "0", "--max-tokens", "60", "-v", prompt],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected[len(prompt):]
    assert "tensor parallel 2" in proc.stderr
