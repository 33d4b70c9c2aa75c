"""Score and rerank inputs: which (query, document) pairs, and each pair's prompt.

vLLM's rules (``vllm/entrypoints/pooling/score/utils.py``, ``LLM.score``):

* pairs: ``text_1`` and ``text_2`` (each a string or a list of strings) pair one to one
  (equal lengths), one to many (one ``text_1``, any number of ``text_2``) or as ``N:N``;
  any other shape, or an empty side, is refused.
* a classifier (cross-encoder) scores one prompt per pair: the score template rendered as a
  chat template over the messages ``[{"role": "query", "content": q}, {"role": "document",
  "content": d}]`` when the server has one (``--chat-template``; vLLM applies only an
  explicit template, never the tokenizer's own), else the tokenizer's sentence-pair
  encoding ``tokenizer(q, d)`` (what transformers and sentence-transformers' ``CrossEncoder``
  feed a ``*ForSequenceClassification`` model), or, for a reranker converted from a
  generative model (``classifier_from_token``), the plain concatenation ``q + d`` (vLLM's
  ``use_pad_token`` false); special tokens are added as the tokenizer adds them. The score
  is the head's single output (a one-label model).
* an embedding model (bi-encoder) embeds each text on its own and scores a pair by the
  cosine similarity of the two embeddings.

Pure Python and numpy (no JAX).
"""

from __future__ import annotations

import numpy as np


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[int, int]]:
    """The (index in ``text_1``, index in ``text_2``) of each pair to score, in output order.

    Raises:
        ValueError: an empty side, or lengths that are neither 1:N nor N:N.
    """
    n1 = 1 if isinstance(text_1, str) else len(text_1)
    n2 = 1 if isinstance(text_2, str) else len(text_2)
    if n1 == 0:
        raise ValueError("text_1 must hold at least one text")
    if n2 == 0:
        raise ValueError("text_2 must hold at least one text")
    if n1 > 1 and n1 != n2:
        raise ValueError(f"text_1 has {n1} texts and text_2 {n2}: pair them one to one (equal "
                         "lengths) or one to many (a single text_1)")
    return [(0 if n1 == 1 else j, j) for j in range(n2)]


def as_list(text: str | list[str]) -> list[str]:
    return [text] if isinstance(text, str) else list(text)


def cross_encoder_prompt(tokenizer, query: str, document: str, template: str | None = None,
                         concatenate: bool = False) -> list[int]:
    """The token ids a classifier scores for (``query``, ``document``), as the module
    docstring says: the rendered ``template`` (a Jinja chat template over the roles
    ``query`` and ``document``), else ``q + d`` when ``concatenate``, else the tokenizer's
    sentence-pair encoding.

    Raises:
        ValueError: the template does not render.
    """
    if template is not None:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        except Exception as e:   # noqa: BLE001 - jinja's errors are of many kinds
            raise ValueError(f"the score template (--chat-template) does not render: {e}"
                             ) from None
        return list(tokenizer(text)["input_ids"])
    if concatenate:
        return list(tokenizer(query + document)["input_ids"])
    return list(tokenizer(query, document)["input_ids"])


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b) in float64, each norm clamped at 1e-8 (``torch.nn.CosineSimilarity``)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (max(np.linalg.norm(a), 1e-8) * max(np.linalg.norm(b), 1e-8)))
