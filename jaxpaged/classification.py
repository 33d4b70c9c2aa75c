"""Sequence-classification models (cross-encoder rerankers) as ``config.json`` describes them.

Two kinds of checkpoint score a prompt with a classifier head on its last token's final
hidden state (vLLM's ``as_seq_cls_model``, ``vllm/model_executor/models/adapters.py``):

* a ``*ForSequenceClassification`` checkpoint (transformers' ``LlamaForSequenceClassification``,
  ``Qwen3ForSequenceClassification``, ...): the decoder plus a ``score`` linear layer
  ``[num_labels, hidden]`` (no bias) instead of the LM head;
* a generative reranker (Qwen3-Reranker, mxbai-rerank-v2) turned into one by vLLM's
  ``hf_overrides``: ``{"architectures": ["Qwen3ForSequenceClassification"],
  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}``. The head is
  built from LM-head rows of those tokens: ``method`` ``from_2_way_softmax`` (two tokens,
  one label: ``row(yes) - row(no)``, so that its sigmoid is the softmax probability of the
  second token against the first) or ``no_post_processing`` (one label per token: the rows
  as they are). ``is_original_qwen3_reranker`` means ``from_2_way_softmax`` over
  ``["no", "yes"]`` (vLLM's ``Qwen3ForSequenceClassificationConfig``).

The decoder is the family's causal-LM module (``jaxpaged.models.llama``); the head runs on
the host (``jaxpaged.core.classifier_head``). ``hf_overrides`` (vLLM's ``--hf-overrides``:
JSON merged over ``config.json``'s top level) is parsed here too. Pure Python (no JAX).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: ``*ForSequenceClassification`` architectures and the causal-LM module that runs their
#: decoder.
SEQ_CLS_ARCHITECTURES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
#: How a head is made from ``classifier_from_token`` rows (vLLM's ``SEQ_CLS_LOAD_METHODS``).
FROM_TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")


@dataclass(frozen=True)
class ClassifierSpec:
    """A sequence classifier's head, as its config declares it.

    Attributes:
        num_labels: outputs of the head (1: a relevance score, read through a sigmoid).
        from_tokens: token strings whose LM-head rows make the head (empty: the
            checkpoint's own ``score.weight``).
        method: with ``from_tokens``, one of :data:`FROM_TOKEN_METHODS`; else None.
    """

    num_labels: int
    from_tokens: tuple[str, ...] = ()
    method: str | None = None


def json_object(value: str | dict, name: str) -> dict:
    """A flag's JSON-object value (JSON text or a dict) as a new dict.

    Raises:
        ValueError: not valid JSON, or not a JSON object (naming the flag ``name``).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return dict(value)


def parse_hf_overrides(value: str | dict | None) -> dict:
    """``--hf-overrides``: JSON text or a dict (None: no overrides) as a dict.

    Raises:
        ValueError: not valid JSON, or not a JSON object.
    """
    return {} if value is None else json_object(value, "hf_overrides")


def classifier_spec(cfg: dict) -> ClassifierSpec | None:
    """The classifier a parsed (and overridden) ``config.json`` declares, or None for a
    model without one (a causal LM).

    Raises:
        ValueError: ``classifier_from_token`` that is not a list of strings, an unknown
            ``method``, ``from_2_way_softmax`` without exactly two tokens, or a
            ``*ForSequenceClassification`` config with fewer than one label.
    """
    archs = cfg.get("architectures") or []
    if not any(a in SEQ_CLS_ARCHITECTURES for a in archs):
        return None
    tokens = cfg.get("classifier_from_token")
    method = cfg.get("method")
    if cfg.get("is_original_qwen3_reranker"):
        tokens, method = tokens or ["no", "yes"], "from_2_way_softmax"
    if tokens is None:
        labels = cfg.get("id2label")
        num_labels = len(labels) if isinstance(labels, dict) and labels else \
            cfg.get("num_labels", 2)
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"config.json's num_labels must be a positive integer, got "
                             f"{num_labels!r}")
        return ClassifierSpec(num_labels)
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_token must be a list of token strings, got "
                         f"{tokens!r}")
    method = method or ("from_2_way_softmax" if len(tokens) == 2 else "no_post_processing")
    if method not in FROM_TOKEN_METHODS:
        raise ValueError(f"method must be one of {FROM_TOKEN_METHODS} with "
                         f"classifier_from_token, got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError("method from_2_way_softmax needs exactly two classifier_from_token "
                         f"entries (the negative, then the positive), got {tokens!r}")
    return ClassifierSpec(1 if method == "from_2_way_softmax" else len(tokens), tuple(tokens),
                          method)


def causal_architectures(archs: list) -> list:
    """``archs`` with each ``*ForSequenceClassification`` name replaced by the causal-LM
    architecture whose module runs its decoder."""
    return [SEQ_CLS_ARCHITECTURES.get(a, a) for a in archs]
