"""The Flax model's logits against the bundled reference and transformers' torch Llama."""

import contextlib
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import BatchLayout, allocate_kv_pool, get_attention_backend
from jaxpaged.models.loader import load_model
from tests.conftest import FIXTURES, STORIES, STORIES_REFERENCE


def full_sequence_logits(model_dir: str, ids: np.ndarray, dtype=jnp.float32,
                         page_size: int = 16, backend: str = "xla",
                         quantization: str | None = None, prepare=None) -> np.ndarray:
    """Logits at every position of one prefill of ``ids`` through a paged attention backend
    (``prepare(model, cfg, num_tokens)``, when given, may change the loaded model and returns
    the context the forward runs in)."""
    cfg = ModelConfig.from_pretrained(model_dir).with_quantization(quantization)
    backend = get_attention_backend(backend)
    model = load_model(model_dir, cfg, dtype=dtype, backend=backend)
    context = contextlib.nullcontext() if prepare is None else prepare(model, cfg, len(ids))
    t = len(ids)
    num_pages = -(-t // page_size)
    pages = np.arange(1, num_pages + 1, dtype=np.int32)
    positions = np.arange(t, dtype=np.int32)
    layout = BatchLayout(
        query_start_loc=np.array([0, t], np.int32), seq_lens=np.array([t], np.int32),
        positions=positions,
        slot_mapping=(pages[positions // page_size] * page_size + positions % page_size).astype(np.int32),
        page_table=pages[None], num_seqs=1, num_tokens=t)
    meta = {k: jnp.asarray(v) for k, v in backend.build_metadata(layout).items()}
    meta.update(slot_mapping=jnp.asarray(layout.slot_mapping), page_table=jnp.asarray(layout.page_table))
    kv = allocate_kv_pool(cfg.num_layers, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    with context:
        hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(positions), kv, meta)
    return np.asarray(model.compute_logits(hidden))


def test_bundled_model_matches_reference_logits():
    ids = np.load(os.path.join(STORIES_REFERENCE, "reference_input_ids_bos_plus_63_greedy.npy"))
    ref = np.load(os.path.join(STORIES_REFERENCE, "reference_logits_bos_plus_63_greedy.npy"))
    logits = full_sequence_logits(STORIES, ids)
    assert logits.shape == ref.shape == (64, 512)
    assert np.abs(logits - ref).max() < 1e-4


@pytest.mark.parametrize("name", ["llama_gqa_untied", "llama_mqa_tied_bias"])
def test_matches_transformers_llama(name):
    """Committed fixtures from transformers' LlamaForCausalLM (tests/fixtures/NOTES.md):
    GQA 8q/2kv, untied lm_head, head_dim 16 != hidden/heads, rope_parameters theta 5e5;
    and MQA with tied embeddings, q/k/v/o biases and a sharded safetensors checkpoint."""
    d = os.path.join(FIXTURES, name)
    ids = np.load(os.path.join(d, "input_ids.npy"))
    ref = np.load(os.path.join(d, "logits.npy"))
    logits = full_sequence_logits(d, ids, page_size=8)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() < 1e-4


def test_bfloat16_close_to_float32():
    ids = np.load(os.path.join(STORIES_REFERENCE, "reference_input_ids_bos_plus_63_greedy.npy"))
    ref = np.load(os.path.join(STORIES_REFERENCE, "reference_logits_bos_plus_63_greedy.npy"))
    logits = full_sequence_logits(STORIES, ids, dtype=jnp.bfloat16)
    top1 = (logits.argmax(-1) == ref.argmax(-1)).mean()
    assert np.abs(logits - ref).max() < 0.5
    assert top1 >= 0.9
