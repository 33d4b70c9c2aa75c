"""Multi-LoRA in the engine: prefix caching per adapter, the ``max_loras`` bound with its
``lora_requests_info`` report, the host LRU, no compilation while adapters come and go,
typed refusals, and tensor parallelism (tests/fixtures/lora/NOTES.md for the references)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest
from safetensors.numpy import load_file, save_file

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import ModelConfig
from jaxpaged.arg_utils import DEFAULT_MODEL, EngineArgs
from jaxpaged.lora.config import LoRAConfigError
from jaxpaged.lora.manager import LoRANotEnabledError
from jaxpaged.lora.peft import LoRAAdapterError, LoRAAdapterNotFoundError, load_adapter
from jaxpaged.lora.request import LoRARequest
from jaxpaged.lora.scheduling import LoRAScheduling
from jaxpaged.lora.targets import UnsupportedLoRATargetError
from jaxpaged.metrics.loggers import PrometheusStatLogger
from tests.conftest import FIXTURES
from tests.test_lora import GREEDY_16, LORA, lora, ref

A, B = "stories_all7_r8", "stories_qkvo_r16"
PROMPT = ref(A, "input_ids.npy")[:9].tolist()
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)


def greedy(llm, lora_request, prompt=PROMPT, n=1):
    outs = llm.generate([prompt] * n, GREEDY_16, lora_request=lora_request, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_no_prefix_cache_hit_across_adapters():
    llm = LLM(enable_lora=True, max_loras=2, enforce_eager=True, **SMALL)
    prompt = (PROMPT * 5)[:40]                  # two full 16-token pages
    hits = []
    for request in (lora(A, 1), lora(B, 2), lora(A, 1), None, None):
        before = llm.engine.stats().prefix_cache_hits
        llm.generate([prompt], SamplingParams(max_tokens=1), lora_request=request,
                     use_tqdm=False)
        hits.append(llm.engine.stats().prefix_cache_hits - before)
    assert hits == [0, 0, 32, 0, 32]


def test_max_loras_bounds_each_step_and_is_reported():
    llm = LLM(enable_lora=True, max_loras=1, enforce_eager=True, **SMALL)
    engine, steps, reports = llm.engine, [], []
    dispatch = engine.runner.dispatch

    def record(scheduler_output):
        steps.append({s.request.lora_request.lora_name for s in scheduler_output.scheduled
                      if s.request.lora_request is not None})
        return dispatch(scheduler_output)

    class Capture:
        def record(self, scheduler_stats, iteration_stats):
            reports.append(scheduler_stats.lora_info)

    engine.runner.dispatch = record
    prometheus = PrometheusStatLogger("m", 128)
    engine.stat_loggers += [Capture(), prometheus]
    requests = [lora(A, 1), lora(B, 2), lora(A, 1), None]
    outs = llm.generate([PROMPT] * 4, GREEDY_16, lora_request=requests, use_tqdm=False)
    assert max(len(s) for s in steps) == 1
    first_b = next(i for i, s in enumerate(steps) if B in s)
    assert all(A not in s for s in steps[first_b:])      # A's requests ran first (FCFS)
    assert reports[0] == (1, A, B) and reports[-1] == (1, "", "")
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == tokens[2] == ref(A, "greedy_tokens.npy").tolist()
    assert tokens[1] == ref(B, "greedy_tokens.npy").tolist()
    assert tokens[3] != tokens[0]
    samples = [s for f in text_string_to_metric_families(
        generate_latest(prometheus.registry).decode()) for s in f.samples
        if s.name == "jaxpaged:lora_requests_info"]
    assert [s.labels for s in samples] == [{"model_name": "m", "max_lora": "1",
                                           "running_lora_adapters": "",
                                           "waiting_lora_adapters": ""}]


def test_adapters_load_swap_and_unload_without_compiling():
    llm = LLM(enable_lora=True, max_loras=1, max_cpu_loras=1, max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=64)
    engine = llm.engine
    assert engine.wait_until_compiled()
    compiled = engine.stats().num_compilations
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None)
    assert engine.add_lora(lora(A, 1)) and engine.list_loras() == {1}
    assert greedy(llm, lora(A, 1)) == [ref(A, "greedy_tokens.npy").tolist()]
    assert greedy(llm, lora(B, 2)) == [ref(B, "greedy_tokens.npy").tolist()]   # slot swap
    assert engine.list_loras() == {2}                  # max_cpu_loras=1: A was dropped
    loads = engine.lora.cache.num_loads
    assert greedy(llm, lora(A, 1)) == [ref(A, "greedy_tokens.npy").tolist()]   # read again
    assert engine.lora.cache.num_loads == loads + 1
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    assert greedy(llm, None) != greedy(llm, lora(B, 2))
    assert engine.stats().num_compilations == compiled
    assert compiles == []


def test_typed_refusals(tmp_path):
    stories = ModelConfig.from_pretrained(DEFAULT_MODEL)
    with pytest.raises(LoRAAdapterError, match="r=16 is greater than max_lora_rank=8"):
        load_adapter(lora(B), stories, max_rank=8)
    with pytest.raises(LoRAAdapterError, match=r"layers\.0\.mlp\.down_proj lora_A \(8, 160\)"):
        load_adapter(lora("llama_all7_r8"), stories, max_rank=16)    # another model's shapes
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found"):
        load_adapter(LoRARequest("x", 1, str(tmp_path)), stories, 16)
    bad = tmp_path / "bad"
    shutil.copytree(os.path.join(LORA, A), bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    for field, value, error, match in (
            ("target_modules", ["q_proj", "lm_head"], UnsupportedLoRATargetError, "'lm_head'"),
            ("use_dora", True, LoRAAdapterError, "use_dora=True is not supported"),
            ("r", "8", LoRAAdapterError, "field 'r' must be int")):
        (bad / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(error, match=match):
            load_adapter(LoRARequest("bad", 1, str(bad)), stories, 16)
    (bad / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))
    with pytest.raises(LoRAAdapterError, match="lora_alpha must be finite"):
        load_adapter(LoRARequest("bad", 1, str(bad)), stories, 16)
    # Tensors of a module target_modules leaves out: refused (peft would not apply them).
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    with pytest.raises(LoRAAdapterError, match="which target_modules .'q_proj'. does not list"):
        load_adapter(LoRARequest("bad", 1, str(bad)), stories, 16)
    # One NaN in a lora_B would spread to every row of the batch (0 * NaN): refused.
    (bad / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = np.nan
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="non-finite"):
        load_adapter(LoRARequest("bad", 1, str(bad)), stories, 16)
    mixtral = ModelConfig.from_pretrained(os.path.join(FIXTURES, "mixtral_moe"))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["w1"]}))
    with pytest.raises(UnsupportedLoRATargetError, match="'w1'.*experts"):
        load_adapter(LoRARequest("bad", 1, str(bad)), mixtral, 16)
    with pytest.raises(LoRAConfigError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineArgs(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(LoRAConfigError, match="max_lora_rank must be a positive integer"):
        EngineArgs(max_lora_rank=0)


def test_lora_request_without_enable_lora_is_refused(stories_llm):
    with pytest.raises(LoRANotEnabledError, match="enable_lora=True"):
        stories_llm.generate([PROMPT], GREEDY_16, lora_request=lora(A))
    assert not stories_llm.engine.has_unfinished_requests()


def test_tensor_parallel_2_equals_tp_1():
    llm = LLM(os.path.join(FIXTURES, "llama_gqa_untied"), tokenizer=DEFAULT_MODEL,
              enable_lora=True, max_loras=2, enforce_eager=True, tensor_parallel_size=2,
              block_size=8, **SMALL)
    layer = llm.engine.runner._state["model"]["layers"][0]
    attn = layer["self_attn"]
    q_b, o_a = attn["q_proj"]["lora_b"][...], attn["o_proj"]["lora_a"][...]
    assert {s.data.shape for s in q_b.addressable_shards} == {(3, 16, q_b.shape[2] // 2)}
    assert {s.data.shape for s in o_a.addressable_shards} == {(3, o_a.shape[1] // 2, 16)}
    names = ["llama_all7_r8", "llama_qv_r4_rslora"]
    prompt = ref(names[0], "input_ids.npy")[:9].tolist()
    outs = llm.generate([prompt] * 2, GREEDY_16, lora_request=[lora(n, i + 1)
                                                               for i, n in enumerate(names)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref(n, "greedy_tokens.npy").tolist()
                                                      for n in names]


def test_slots_stay_with_running_adapters():
    """max_loras=2: C takes the slot of A (no running request) and never B's (running)."""
    class Cache:
        config = type("C", (), {"max_loras": 2})()

        def get(self, request):
            return request.lora_name

    class Req:
        def __init__(self, name, int_id):
            self.lora_request = LoRARequest(name, int_id, "/x")

    sched = LoRAScheduling(Cache())
    a, b, c = Req("a", 1), Req("b", 2), Req("c", 3)
    active = set()
    assert sched.admit(a, active) and sched.admit(b, active)
    assert not sched.admit(c, active)                  # a third adapter waits
    assert sched.take_step() == ([(1, "a"), (2, "b")], {1: 1, 2: 2})
    active = sched.adapter_ids([b])                    # a finished, b still runs
    assert sched.admit(c, active) and sched.admit(b, active)
    assert sched.take_step() == ([(1, "c")], {2: 2, 3: 1})
    assert sched.requests_info([b, c], [a]) == (2, "b,c", "a")
