"""Sequence classifiers (cross-encoder rerankers) against transformers' scores.

References (``tests/fixtures/classifier/references.json``, made by
``tests/fixtures/make_classifier_reference.py``): a random ``LlamaForSequenceClassification``
(one label: ``sigmoid(logit)``) and a random ``Qwen3ForCausalLM`` scored as Qwen3-Reranker
(``softmax`` of the ``n`` / ``y`` logits at the last position under a template), served with
``hf_overrides`` as vLLM serves Qwen3-Reranker.
"""

import json
import os

import numpy as np
import pytest

from jaxpaged import LLM, PoolingParams
from jaxpaged.classification import ClassifierSpec, classifier_spec
from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.core.classifier_head import ClassifierHead, load_classifier_head
from jaxpaged.pooling_params import PoolerConfig, resolve_pooler
from jaxpaged.scoring import score_pairs
from jaxpaged.tokenizer import load_tokenizer
from tests.conftest import FIXTURES, STORIES

CLASSIFIERS = os.path.join(FIXTURES, "classifier")
SEQ_CLS = os.path.join(CLASSIFIERS, "llama_seq_cls")
RERANKER = os.path.join(CLASSIFIERS, "qwen3_reranker")
with open(os.path.join(CLASSIFIERS, "references.json")) as _f:
    REFERENCES = json.load(_f)
with open(os.path.join(RERANKER, "reranker_template.jinja")) as _f:
    TEMPLATE = _f.read()
#: How the generative reranker fixture is served (vLLM's hf_overrides for Qwen3-Reranker,
#: with this tokenizer's tokens).
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                      "classifier_from_token": REFERENCES["qwen3_reranker_tokens"],
                      "method": "from_2_way_softmax"}
TOLERANCE = 1e-4
QUERY = REFERENCES["llama_seq_cls"][0]["query"]
DOCUMENTS = [r["document"] for r in REFERENCES["llama_seq_cls"] if r["query"] == QUERY]


def reference(model: str, query: str | None = None) -> list[dict]:
    return [r for r in REFERENCES[model] if query is None or r["query"] == query]


@pytest.fixture(scope="module")
def seq_cls_llm():
    """16-token steps: every pair's prompt is prefilled in two or more chunks."""
    return LLM(model=SEQ_CLS, enforce_eager=True, max_model_len=128, max_num_batched_tokens=16,
               max_num_seqs=8, max_num_partial_prefills=4)


def test_cross_encoder_scores_equal_transformers(seq_cls_llm):
    assert seq_cls_llm.engine.args.pooler == PoolerConfig(normalize=False, task="classify")
    outs = seq_cls_llm.score(QUERY, DOCUMENTS, use_tqdm=False)     # one to many
    for out, ref in zip(outs, reference("llama_seq_cls", QUERY), strict=True):
        assert out.prompt_token_ids == ref["input_ids"]            # tokenizer(query, doc)
        assert abs(out.outputs.score - ref["score"]) < TOLERANCE
    refs = reference("llama_seq_cls")
    pairs = seq_cls_llm.score([r["query"] for r in refs], [r["document"] for r in refs],
                              use_tqdm=False)                      # one to one, all at once
    np.testing.assert_allclose([p.outputs.score for p in pairs], [r["score"] for r in refs],
                               atol=TOLERANCE, rtol=0)
    kv = seq_cls_llm.engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


def test_classify_gives_probabilities_or_logits(seq_cls_llm):
    refs = reference("llama_seq_cls")[:3]
    ids = [r["input_ids"] for r in refs]
    probs = seq_cls_llm.classify(ids, use_tqdm=False)
    assert [p.outputs.num_classes for p in probs] == [1, 1, 1]
    np.testing.assert_allclose([p.outputs.probs[0] for p in probs], [r["score"] for r in refs],
                               atol=TOLERANCE, rtol=0)
    logits = seq_cls_llm.classify(ids, PoolingParams(use_activation=False), use_tqdm=False)
    np.testing.assert_allclose([p.outputs.probs[0] for p in logits], [r["logit"] for r in refs],
                               atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="does not serve 'embed' requests"):
        seq_cls_llm.embed("Once upon a time", use_tqdm=False)
    with pytest.raises(ValueError, match="pair them one to one"):
        seq_cls_llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


def test_generative_reranker_with_hf_overrides_equals_yes_no_softmax():
    llm = LLM(model=RERANKER, hf_overrides=json.dumps(RERANKER_OVERRIDES), runner="pooling",
              convert="classify", enforce_eager=True, max_model_len=128)
    refs = reference("qwen3_reranker")
    outs = llm.score([r["query"] for r in refs], [r["document"] for r in refs],
                     chat_template=TEMPLATE, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert out.prompt_token_ids == ref["input_ids"]
        assert abs(out.outputs.score - ref["score"]) < TOLERANCE
    # Its head is row(y) - row(n) of the LM head: the sigmoid of that logit difference.
    head = llm.engine.classifier_head
    assert head.weight.shape == (1, 32) and head.bias is None


def test_classifier_configs_and_heads():
    cfg = ModelConfig.from_pretrained(SEQ_CLS)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.classifier == ClassifierSpec(1)
    assert cfg.tie_word_embeddings           # the decoder is built without an LM head
    assert classifier_spec({"architectures": ["Qwen3ForSequenceClassification"],
                            "is_original_qwen3_reranker": True}) == ClassifierSpec(
        1, ("no", "yes"), "from_2_way_softmax")
    assert classifier_spec({"architectures": ["Qwen3ForCausalLM"]}) is None
    with pytest.raises(ValueError, match="exactly two"):
        classifier_spec({"architectures": ["Qwen2ForSequenceClassification"],
                         "classifier_from_token": ["0", "1", "2"],
                         "method": "from_2_way_softmax"})
    tokenizer = load_tokenizer(RERANKER)
    original = ModelConfig.from_pretrained(RERANKER, {"architectures": [
        "Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True})
    with pytest.raises(UnsupportedModelError, match="'no' is not a token"):
        load_classifier_head(RERANKER, original, tokenizer)
    head = ClassifierHead(np.array([[1.0, -1.0], [0.5, 0.5]]), np.array([0.0, 1.0]))
    np.testing.assert_allclose(head(np.array([1.0, 2.0])), np.exp([-1, 2.5]) /
                               np.exp([-1, 2.5]).sum(), rtol=1e-6)   # softmax over labels


def test_runner_resolution_for_classifiers():
    assert resolve_pooler(SEQ_CLS, "auto", "auto", None) == PoolerConfig(
        normalize=False, task="classify")
    assert resolve_pooler(SEQ_CLS, "pooling", "embed", None) == PoolerConfig()
    assert resolve_pooler(RERANKER, "auto", "auto", None) is None        # a causal LM
    assert resolve_pooler(RERANKER, "auto", "score", None, RERANKER_OVERRIDES).task == \
        "classify"
    with pytest.raises(ValueError, match="needs a sequence-classification model"):
        resolve_pooler(STORIES, "pooling", "classify", None)
    with pytest.raises(ValueError, match="need EngineArgs.runner=pooling"):
        resolve_pooler(SEQ_CLS, "generate", "auto", None)
    assert score_pairs("q", ["a", "b"]) == [(0, 0), (0, 1)]
    assert score_pairs(["q", "r"], ["a", "b"]) == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="text_2 must hold at least one"):
        score_pairs("q", [])


def test_serve_flags_make_a_classify_engine():
    from jaxpaged.cli import build_parser
    from jaxpaged.arg_utils import EngineArgs

    args = build_parser().parse_args(["serve", "--model", RERANKER, "--convert", "classify",
                                      "--hf-overrides", json.dumps(RERANKER_OVERRIDES)])
    assert EngineArgs.from_cli_args(args).pooler == PoolerConfig(normalize=False,
                                                                 task="classify")
    args = build_parser().parse_args(["serve", "--model", SEQ_CLS])
    assert EngineArgs.from_cli_args(args).pooler.task == "classify"     # runner auto
