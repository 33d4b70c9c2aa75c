"""A sequence classifier's head, applied on the host to the pooled last hidden state.

A classify engine (``PoolerConfig.task == "classify"``) pools each prompt like an embedding
engine (``jaxpaged.core.pooling``: the final hidden state, after the final norm, of the
last prompt token, not normalised), then :class:`ClassifierHead` computes
``logits = W h (+ b)`` in float64 and its activation: a sigmoid for one label, a softmax over
several (vLLM's ``ClassifierPooler`` default; transformers' ``*ForSequenceClassification``
returns the logits, and sentence-transformers' ``CrossEncoder`` applies the same sigmoid to a
one-label model). ``W`` is ``[num_labels, hidden]``; it costs one small mat-vec per request, so
it runs beside the step instead of inside the compiled program (the hidden state is already
read back for pooling).

``W`` comes from (``jaxpaged.classification.ClassifierSpec``): the checkpoint's
``score.weight`` (and ``score.bias`` if present); or the LM-head rows (``lm_head.weight``, or
``model.embed_tokens.weight`` when the checkpoint ties them) of ``classifier_from_token``,
as vLLM's ``load_weights_using_from_2_way_softmax`` / ``load_weights_no_post_processing``
(``vllm/model_executor/models/adapters.py``) build them: ``row(b) - row(a)`` for
``from_2_way_softmax`` (``sigmoid(l_b - l_a)`` is the softmax probability of token ``b``
against ``a``), the rows as they are for ``no_post_processing``. ``--load-format dummy`` draws
``W`` like the other dummy weights (normal, std 0.02, from the seed). Numpy and safetensors
only (host code: no JAX).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads it)
import numpy as np
from safetensors import safe_open

from jaxpaged.classification import ClassifierSpec
from jaxpaged.config import ModelConfig, UnsupportedModelError

#: A checkpoint's weights: one file, or an index of shards (``jaxpaged.models.loader``'s).
_SAFETENSORS_FILE, _SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True, eq=False)
class ClassifierHead:
    """``logits = weight @ hidden (+ bias)`` and its activation.

    Attributes:
        weight: [num_labels, hidden] float64.
        bias: [num_labels] float64, or None.
    """

    weight: np.ndarray
    bias: np.ndarray | None = None

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def __call__(self, hidden: np.ndarray, use_activation: bool = True) -> np.ndarray:
        """hidden: [H] float -> [num_labels] float32: the sigmoid (one label) or softmax
        (several) of the logits, or the logits themselves when ``use_activation`` is False."""
        logits = self.weight @ np.asarray(hidden, np.float64)
        if self.bias is not None:
            logits = logits + self.bias
        if use_activation:
            if self.num_labels == 1:
                logits = 1.0 / (1.0 + np.exp(-logits))
            else:
                e = np.exp(logits - logits.max())
                logits = e / e.sum()
        return logits.astype(np.float32)


def load_classifier_head(model_dir: str, config: ModelConfig, tokenizer,
                         load_format: str = "auto", seed: int = 0) -> ClassifierHead:
    """The head of the classifier ``config.classifier`` describes (see the module docstring).

    Args:
        model_dir: the checkpoint directory.
        config: its :class:`ModelConfig` (``classifier`` set).
        tokenizer: the model's tokenizer (``classifier_from_token`` strings to ids).
        load_format: ``dummy`` draws the head at random.
        seed: the dummy draw's seed.

    Raises:
        ValueError: the config declares no classifier.
        UnsupportedModelError: a GGUF file (heads load from safetensors only); a
            ``classifier_from_token`` entry that is not one token of the tokenizer;
            ``score.weight`` (or the LM-head rows) missing or of the wrong shape.
    """
    spec: ClassifierSpec | None = config.classifier
    if spec is None:
        raise ValueError(f"{model_dir!r} declares no sequence classifier")
    hidden = config.hidden_size
    ids = [_token_id(tokenizer, t) for t in spec.from_tokens]
    if load_format == "dummy":
        rng = np.random.default_rng(seed)
        return ClassifierHead(rng.normal(0.0, 0.02, (spec.num_labels, hidden)))
    if os.path.isfile(model_dir):
        raise UnsupportedModelError("sequence classifiers load from safetensors checkpoints "
                                    "only, not GGUF files")
    tensors = _Tensors(model_dir)
    if not spec.from_tokens:
        weight = tensors.rows("score.weight", None)
        if weight is None:
            raise UnsupportedModelError(f"checkpoint {model_dir!r} has no score.weight (the "
                                        "classifier head of a *ForSequenceClassification model)")
        bias = tensors.rows("score.bias", None)
        if weight.shape != (spec.num_labels, hidden):
            raise UnsupportedModelError(f"score.weight is {weight.shape}, expected "
                                        f"({spec.num_labels}, {hidden}) (num_labels, hidden_size)")
        return ClassifierHead(weight.astype(np.float64),
                              None if bias is None else bias.astype(np.float64))
    name = "lm_head.weight" if tensors.has("lm_head.weight") else "model.embed_tokens.weight"
    rows = tensors.rows(name, ids)
    if rows is None or rows.shape[1:] != (hidden,):
        raise UnsupportedModelError(f"checkpoint {model_dir!r} lacks {name} [vocab, "
                                    f"{hidden}], whose rows make the classifier_from_token head")
    rows = rows.astype(np.float64)
    weight = rows[1:2] - rows[0:1] if spec.method == "from_2_way_softmax" else rows
    return ClassifierHead(weight)


def _token_id(tokenizer, token: str) -> int:
    """The id of ``token``, one piece of the tokenizer's vocabulary.

    Raises:
        UnsupportedModelError: it is not one.
    """
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        raise UnsupportedModelError(f"classifier_from_token entry {token!r} is not a token of "
                                    "this model's tokenizer (each entry must be one vocabulary "
                                    "piece)")
    return int(vocab[token])


class _Tensors:
    """Named tensors (or some of their rows) of a safetensors checkpoint, without reading
    the others."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, _SAFETENSORS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self._where = {k: os.path.join(model_dir, v)
                               for k, v in json.load(f)["weight_map"].items()}
        else:
            single = os.path.join(model_dir, _SAFETENSORS_FILE)
            with safe_open(single, framework="numpy") as f:
                self._where = {k: single for k in f.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def rows(self, name: str, ids: list[int] | None) -> np.ndarray | None:
        """Tensor ``name`` (None: absent), or only its rows ``ids``."""
        path = self._where.get(name)
        if path is None:
            return None
        with safe_open(path, framework="numpy") as f:
            if ids is None:
                return f.get_tensor(name)
            part = f.get_slice(name)
            return np.stack([np.asarray(part[i:i + 1])[0] for i in ids])
