"""Embeddings (pooling requests) of the bundled model against transformers' hidden states.

The reference (``tests/fixtures/embeddings/stories260K_hidden.npz``, made by
``tests/fixtures/make_embedding_reference.py``) holds ``LlamaModel``'s final hidden states
(after the final norm) of four prompts; the expected embeddings are their numpy pooling.
"""

import json
import os

import numpy as np
import pytest

from jaxpaged import LLM, PoolingParams
from jaxpaged.pooling_params import PoolerConfig, resolve_pooler, sentence_transformers_config
from tests.conftest import FIXTURES, STORIES

REFERENCE = np.load(os.path.join(FIXTURES, "embeddings", "stories260K_hidden.npz"))
NUM_PROMPTS = len([k for k in REFERENCE.files if k.startswith("ids_")])
TOLERANCE = 1e-5


def prompts() -> list[list[int]]:
    return [REFERENCE[f"ids_{i}"].tolist() for i in range(NUM_PROMPTS)]


def pooled(i: int, pooling_type: str) -> np.ndarray:
    """The numpy pooling of reference prompt i, L2-normalised."""
    hidden = REFERENCE[f"hidden_{i}"].astype(np.float64)
    vec = hidden[-1] if pooling_type == "LAST" else hidden.mean(axis=0)
    return vec / np.linalg.norm(vec)


@pytest.fixture(scope="module")
def last_llm():
    """LAST pooling (the default), 16-token steps: the long prompts take 3-4 chunks."""
    return LLM(runner="pooling", max_num_batched_tokens=16, max_num_seqs=8,
               max_num_partial_prefills=4)


@pytest.fixture(scope="module")
def mean_llm():
    """MEAN pooling on a pool of 5 usable pages (80 tokens), 8 prompt tokens per request a
    step: the long prompts prefill side by side and preempt each other."""
    return LLM(convert="embed", pooler_config='{"pooling_type": "MEAN"}', enforce_eager=True,
               max_num_batched_tokens=16, max_num_seqs=8, max_num_partial_prefills=4,
               long_prefill_token_threshold=8,
               max_model_len=64, num_gpu_blocks_override=6)


def test_text_prompts_tokenize_as_the_reference_and_embed_to_its_last_token(last_llm):
    texts = ["Once upon a time", "The cat saw a mouse"]
    outs = last_llm.embed(texts)
    for out, i in zip(outs, (0, 2)):
        assert out.prompt_token_ids == prompts()[i]
        assert len(out.outputs.embedding) == 64
        np.testing.assert_allclose(out.outputs.embedding, pooled(i, "LAST"), atol=TOLERANCE,
                                   rtol=0)


def test_last_pooling_batch_equals_reference_and_single_requests(last_llm):
    assert last_llm.engine.wait_until_compiled()
    before = last_llm.engine.stats().num_compilations
    batch = last_llm.embed(prompts())
    for i, out in enumerate(batch):
        np.testing.assert_allclose(out.outputs.embedding, pooled(i, "LAST"), atol=TOLERANCE,
                                   rtol=0)
        assert np.linalg.norm(out.outputs.embedding) == pytest.approx(1.0, abs=1e-6)
    singles = [last_llm.embed(p)[0] for p in prompts()]
    for one, many in zip(singles, batch):
        # Equal to float32 rounding: alone, a prompt's chunks are cut at other tokens, and
        # the cpu attention kernel sums a block of few real queries in another order than
        # a fuller one (csrc/paged_attention_cpu.cc: its two paths); the xla backend gives
        # bit-equal embeddings here.
        np.testing.assert_allclose(one.outputs.embedding, many.outputs.embedding, atol=2e-7,
                                   rtol=0)
    stats = last_llm.engine.stats()
    assert stats.num_compilations == before      # the pooling pass reuses the step programs
    assert stats.num_free_pages == stats.num_pages and stats.num_running == 0


def test_unnormalized_last_pooling_is_the_raw_hidden_state(last_llm):
    out = last_llm.embed(prompts()[1], PoolingParams(normalize=False))[0]
    np.testing.assert_allclose(out.outputs.embedding, REFERENCE["hidden_1"][-1],
                               atol=TOLERANCE, rtol=0)


def test_mean_pooling_under_preemption_equals_reference(mean_llm):
    engine = mean_llm.engine
    outs = mean_llm.embed(prompts())
    for i, out in enumerate(outs):
        np.testing.assert_allclose(out.outputs.embedding, pooled(i, "MEAN"), atol=TOLERANCE,
                                   rtol=0)
        # (last and mean differ by far more than the tolerance: the test tells them apart)
        assert np.abs(pooled(i, "MEAN") - pooled(i, "LAST")).max() > 100 * TOLERANCE
    assert engine.num_preemptions > 0
    stats = engine.stats()
    assert stats.num_free_pages == stats.num_pages and stats.num_waiting == 0


def test_a_pooling_engine_refuses_generation_and_dimensions(last_llm):
    with pytest.raises(ValueError, match="runner='generate'"):
        last_llm.generate("Once upon a time")
    with pytest.raises(ValueError, match="dimensions: this model does not support"):
        last_llm.embed("Once upon a time", PoolingParams(dimensions=32))
    assert not last_llm.engine.has_unfinished_requests()


def test_a_generating_engine_refuses_embeddings(stories_llm):
    with pytest.raises(ValueError, match="--runner pooling"):
        stories_llm.embed("Once upon a time")
    assert not stories_llm.engine.has_unfinished_requests()


def _write_st(root, pooling: dict, normalize: bool) -> str:
    """A sentence-transformers checkpoint's modules.json and pooling config under ``root``."""
    root.mkdir()
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, **pooling}))
    return str(root)


def test_sentence_transformers_files_choose_the_pooling(tmp_path):
    mean = _write_st(tmp_path / "a", {"pooling_mode_mean_tokens": True}, normalize=True)
    assert sentence_transformers_config(mean) == PoolerConfig(pooling_type="MEAN",
                                                              normalize=True)
    last = _write_st(tmp_path / "b", {"pooling_mode_lasttoken": True}, normalize=False)
    assert resolve_pooler(last, "pooling", "auto", None) == PoolerConfig(pooling_type="LAST",
                                                                         normalize=False)
    # the --pooler-config override wins over the checkpoint's files
    assert resolve_pooler(last, "auto", "auto", {"pooling_type": "mean"}) == PoolerConfig(
        pooling_type="MEAN", normalize=True)
    cls = _write_st(tmp_path / "c", {"pooling_mode_cls_token": True}, normalize=True)
    with pytest.raises(ValueError, match="pooling_mode_cls_token"):
        sentence_transformers_config(cls)


def test_runner_resolution_and_bad_pooler_configs():
    assert resolve_pooler(STORIES, "auto", "auto", None) is None          # generate
    assert resolve_pooler(STORIES, "auto", "embed", None) == PoolerConfig()
    assert resolve_pooler(STORIES, "pooling", "auto", None) == PoolerConfig()
    with pytest.raises(ValueError, match="need EngineArgs.runner=pooling"):
        resolve_pooler(STORIES, "generate", "embed", None)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig.parse('{"pooling_type": "CLS"}')
    with pytest.raises(ValueError, match="unknown keys"):
        PoolerConfig.parse({"pooling": "MEAN"})
    with pytest.raises(ValueError, match="not valid JSON"):
        PoolerConfig.parse("{mean")


def test_a_failed_step_fails_its_pooling_requests_and_frees_their_pages(last_llm):
    engine = last_llm.engine

    def fail(step_index, request_ids):
        raise RuntimeError("injected")

    engine.fault_injector = fail
    try:
        with pytest.raises(RuntimeError, match="failed: the model step running this request "
                                               "failed: RuntimeError: injected"):
            last_llm.embed(prompts()[:2])
    finally:
        engine.fault_injector = None
    stats = engine.stats()
    assert stats.num_free_pages == stats.num_pages and not engine.has_unfinished_requests()
    out = last_llm.embed(prompts()[0])[0]     # the engine carries on
    np.testing.assert_allclose(out.outputs.embedding, pooled(0, "LAST"), atol=TOLERANCE, rtol=0)
