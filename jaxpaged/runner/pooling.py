"""What a step returns for pooling (embedding) requests: per sequence, two hidden-state rows.

Inside the forward program (``jaxpaged.runner.step_programs``), when the step runs a pooling
request (``StepInputs.with_pooling``, a 0-d bool the program branches on, so no step shape is
added), :func:`pool_rows` takes the model's final hidden states (after its final norm)
``hidden [T, H]`` and returns ``[2, B, H]`` float32: row 0 is the hidden state of each
sequence's last token in the step (the token its sampling row reads, ``logits_indices`` at
the sequence's first row), row 1 the sum of the hidden states of the sequence's tokens in the
step (a segment sum over ``query_start_loc``). Zeros otherwise. The host
(:func:`read_pooled`) hands each pooling sequence its two rows, and
``jaxpaged.core.pooling`` pools across chunks (vLLM's ``LastPool`` / ``MeanPool``,
``vllm/model_executor/layers/pooler.py``, compute the same from the flat hidden states).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling.sampler import when

if TYPE_CHECKING:
    from jaxpaged.core.scheduler_output import SchedulerOutput
    from jaxpaged.runner.input_batch import PreparedStep


def pool_rows(hidden: jax.Array, logits_indices: jax.Array, query_start_loc: jax.Array,
              with_pooling: jax.Array) -> jax.Array:
    """Each sequence's last hidden row and hidden-row sum of the step.

    Args:
        hidden: [T, H] final hidden states (any float dtype).
        logits_indices: [B] int32; row r's token (a sequence's first row reads its last).
        query_start_loc: [B + 1] int32 cumulative token counts (padding sequences empty,
            padding tokens at or past the last entry).
        with_pooling: [] bool; False gives zeros without computing anything.

    Returns:
        [2, B, H] float32: ``[0, r]`` = ``hidden[logits_indices[r]]``; ``[1, i]`` = the sum
        of sequence i's rows (in batch order; the padding tokens belong to none).
    """
    def pooled():
        h = hidden.astype(jnp.float32)
        b = logits_indices.shape[0]
        token_seq = jnp.searchsorted(query_start_loc, jnp.arange(h.shape[0]), side="right",
                                     method="compare_all") - 1
        sums = jax.ops.segment_sum(h, token_seq, num_segments=b)   # padding ids >= b dropped
        return jnp.stack([h[logits_indices], sums])

    return when(with_pooling, pooled)


def read_pooled(sched: SchedulerOutput, prepared: PreparedStep, pooled: np.ndarray
                ) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per scheduled sequence, in batch order: ``(last hidden row [H], chunk's hidden sum
    [H])`` float32 for a pooling request, None for others. ``pooled``: the step's [2, B, H]
    result on the host."""
    starts = prepared.row_starts
    return [(pooled[0, starts[i]], pooled[1, i]) if s.request.pooling is not None else None
            for i, s in enumerate(sched.scheduled)]
