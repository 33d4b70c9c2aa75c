"""What a dispatched step leaves behind until its results are read (:class:`PendingStep`),
and the padded page-copy indices a step's copy-on-write runs with (:func:`copy_indices`);
shared by :class:`~jaxpaged.runner.model_runner.ModelRunner` and the pipeline runner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from jaxpaged.constants import NULL_PAGE
from jaxpaged.distributed.multihost import to_host
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.runner.buckets import bucket_sizes, pick_bucket
from jaxpaged.runner.input_batch import PreparedStep
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.runner.pooling import read_pooled
from jaxpaged.runner.read_output import read_output
from jaxpaged.sampling.sampler import SamplerOutput


@dataclass(frozen=True)
class PendingStep:
    """A dispatched step whose device outputs may not be ready yet (``pooled``: the
    forward's pooling rows, read only for a step with a pooling request)."""

    scheduler_output: SchedulerOutput
    prepared: PreparedStep
    out: SamplerOutput
    pooled: jax.Array
    accepted: jax.Array | None = None   # speculative decoding: [B] bool per row

    def result(self) -> ModelRunnerOutput:
        """Wait for the device and read the step's results back to the host (logprobs only
        when the step asked for them)."""
        inputs = self.prepared.inputs
        out = dataclasses.replace(
            self.out, logprobs=self.out.logprobs if inputs.with_logprobs else None,
            prompt_logprobs=self.out.prompt_logprobs if inputs.with_prompt_logprobs else None)
        result = read_output(self.scheduler_output, self.prepared, jax.tree.map(to_host, out),
                             None if self.accepted is None else to_host(self.accepted))
        if not inputs.with_pooling:
            return result
        return dataclasses.replace(result, pooled=read_pooled(
            self.scheduler_output, self.prepared, to_host(self.pooled)))


def copy_indices(copies: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` int32 page ids of ``copies`` padded to a bucket with null-page
    copies (one executable per bucket)."""
    n = pick_bucket(bucket_sizes(4, max(4, len(copies))), len(copies))
    src = np.full(n, NULL_PAGE, np.int32)
    dst = np.full(n, NULL_PAGE, np.int32)
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    return src, dst
