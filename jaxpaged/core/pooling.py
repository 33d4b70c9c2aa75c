"""Pooling requests on the host: admission, the pooled value across prefill chunks, the output.

A pooling request (an embedding) is a prompt that is only prefilled: the scheduler runs it
like any prompt (chunked prefill, preemption by recompute), its last chunk samples nothing
(``ScheduledRequest.num_samples`` 0), and when that chunk's result arrives the request
finishes and its KV pages are freed (vLLM V1 finishes a pooling request in
``Scheduler.update_from_output`` the same way, once its ``pooler_output`` is in). Each chunk
the device step returns, per sequence, the final hidden state (after the final norm) of the
chunk's last token and the sum of its tokens' hidden states (``jaxpaged.runner.pooling``);
:class:`PoolingState` keeps what the pooling type needs and makes the embedding: ``LAST`` the
last prompt token's state, ``MEAN`` the sum over all prompt tokens divided by their count,
then (``normalize``) divided by its L2 norm (``torch.nn.functional.normalize``'s rule, as
vLLM's ``PoolerNormalize``: ``x / max(||x||, 1e-12)``). On a classify engine the pooled
vector then goes through the classifier head (``jaxpaged.core.classifier_head``): the
result is its ``[num_labels]`` probabilities (or logits).

Pooling requests never take prefix-cache hits (the mean needs every token's hidden state, and
a hit skips computing them). Pure Python and numpy (no JAX).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.outputs import PoolingOutput, PoolingRequestOutput
from jaxpaged.pooling_params import PoolerConfig, PoolingParams
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jaxpaged.core.classifier_head import ClassifierHead

#: The sampling parameters a pooling request carries through the scheduler and the runner
#: (it is never sampled: its one sampling row computes nothing that is read).
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0,
                                  output_kind=RequestOutputKind.FINAL_ONLY)
_NORM_EPS = 1e-12


@dataclass(slots=True, eq=False)
class PoolingState:
    """One pooling request's pooling: its settings and what its chunks computed so far.

    Attributes:
        pooling_type: ``"LAST"`` or ``"MEAN"``.
        normalize: L2-normalise the result.
        hidden_sum: [H] float64 running sum of the prompt tokens' hidden states (MEAN).
        last_hidden: [H] float32 hidden state of the last token seen.
        embedding: [H] float32 result, once the prompt's last chunk is in; with a ``head``,
            [num_labels] float32 (the head's output).
        head: a classify engine's classifier head (None: embed).
        use_activation: the head's sigmoid / softmax (False: raw logits).
    """

    pooling_type: str
    normalize: bool
    hidden_sum: np.ndarray | None = None
    last_hidden: np.ndarray | None = None
    embedding: np.ndarray | None = None
    head: ClassifierHead | None = None
    use_activation: bool = True

    def add_chunk(self, start: int, end: int, num_prompt_tokens: int,
                  pooled: tuple[np.ndarray, np.ndarray]) -> bool:
        """Take the device's result for chunk ``[start, end)`` of the prompt: ``pooled`` =
        ([H] float32 last token's hidden state, [H] float32 sum of the chunk's hidden
        states). A chunk from position 0 starts over (a recomputation after preemption).
        Returns True when the chunk ends the prompt (:attr:`embedding` is then set)."""
        last, chunk_sum = pooled
        if start == 0 or self.hidden_sum is None:
            self.hidden_sum = np.zeros(chunk_sum.shape, np.float64)
        self.hidden_sum += chunk_sum
        self.last_hidden = last
        if end < num_prompt_tokens:
            return False
        vec = (self.last_hidden.astype(np.float64) if self.pooling_type == "LAST"
               else self.hidden_sum / num_prompt_tokens)
        if self.normalize:
            vec = vec / max(float(np.linalg.norm(vec)), _NORM_EPS)
        self.embedding = (vec.astype(np.float32) if self.head is None
                          else self.head(vec, self.use_activation))
        return True


def pooling_state(params, pooler: PoolerConfig | None,
                  head: ClassifierHead | None = None) -> PoolingState | None:
    """The pooling state of a request with ``params`` on an engine with ``pooler`` (None:
    a generating engine; ``head``: a classify engine's classifier head), or None for a
    generation request on a generating engine.

    Raises:
        ValueError: a pooling request on a generating engine, a generation request on a
            pooling engine, a request for another pooling task than the engine's, or
            ``dimensions`` set (no loaded model supports Matryoshka dimensions).
    """
    if pooler is None:
        if isinstance(params, PoolingParams):
            raise ValueError("this model runs for generation (runner 'generate') and does not "
                             "support embeddings; start the engine with runner='pooling' "
                             "(--runner pooling, or --convert embed) to embed with it")
        return None
    if not isinstance(params, PoolingParams):
        if params is None:
            params = PoolingParams()
        else:
            raise ValueError("this model runs for embeddings (runner 'pooling') and does not "
                             "generate; start the engine with runner='generate' to generate")
    if params.task is not None and params.task != pooler.task:
        raise ValueError(f"this model runs for the pooling task {pooler.task!r} and does not "
                         f"serve {params.task!r} requests ("
                         + ("a sequence classifier: score, rerank or classify with it; start it "
                            "with convert='embed' to embed" if pooler.task == "classify" else
                            "an embedding model: embed with it, or score by cosine "
                            "similarity") + ")")
    if pooler.task == "classify":
        return PoolingState(pooler.pooling_type, False, head=head,
                            use_activation=params.use_activation is not False)
    if params.dimensions is not None:
        raise ValueError("dimensions: this model does not support Matryoshka embeddings "
                         "(its output size is fixed at its hidden size); leave dimensions "
                         "unset")
    normalize = pooler.normalize if params.normalize is None else params.normalize
    return PoolingState(pooler.pooling_type, bool(normalize))


def pooling_output(request_id: str, prompt_token_ids: list[int], state: PoolingState,
                   error: str | None) -> PoolingRequestOutput:
    """The finished output of a pooling request (its embedding, or the error that ended
    it)."""
    data = None if state.embedding is None else PoolingOutput(state.embedding)
    return PoolingRequestOutput(request_id, data, prompt_token_ids, error=error)
