"""One step's device inputs (`StepInputs`), assembled on the host from a `SchedulerOutput`.

The runner pads every array to the step's bucket (T tokens, B sequences, P pages per
sequence; ``jaxpaged.runner.model_runner``) and builds them with whole-array numpy operations:
one Python pass over the scheduled sequences reads their scalars, everything else (positions,
the page table, the slot mapping, the sampling rows) is computed from those columns, so the
host cost of a step grows with its sequences only through that one pass. The token ids and
page ids come from the ``SchedulerOutput`` alone: the KV cache manager is never consulted.
:func:`prepare_step` composes the pure builders of ``jaxpaged.runner.step_builders`` (the plan,
token layout, token ids, sampling rows, logit adjustments, grammar masks, prompt-logprob targets
and verification rows).

References: vLLM V1's ``InputBatch`` / ``GPUModelRunner._prepare_inputs``
(``vllm/v1/worker/gpu_model_runner.py``) for the same slot-mapping arithmetic:
``slot = page_table[seq, pos // page_size] * page_size + pos % page_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.layers.attention import AttentionBackend, BatchLayout
from jaxpaged.runner.step_builders import (grammar_masks, logit_adjustments, plan_step,
                                           prompt_targets, sampling_rows, token_ids,
                                           token_layout, verify_rows)
from jaxpaged.sampling.logits_adjust import LogitsAdjustment
from jaxpaged.sampling.sampler import SamplingMetadata

@dataclass(frozen=True)
class StepInputs:
    """Everything the jitted step takes besides the parameters and the KV pool (a pytree).

    Every field is data with a shape fixed by the step's bucket, the two flags included
    (0-d bool arrays the step branches on with ``lax.cond``), so one executable per bucket
    serves steps with and without logprobs, prompt logprobs and logit adjustments.

    Attributes:
        input_ids: [T] int32 token ids (0 for padding).
        positions: [T] int32 positions in their sequences.
        logits_indices: [B] int32; the token whose logits give each sampling row.
        attn_metadata: the backend's per-step arrays plus the layout's (``slot_mapping``,
            ``page_table``, ``seq_lens``, ``query_start_loc``, ``positions``).
        sampling: each row's sampling parameters.
        adjust: per-row logit adjustments ([B, K] entries; all padding when no row has any).
        token_bitmask: [B, ceil(V / 32)] int32 grammar masks of the rows of structured-output
            sequences (every bit set in the other rows).
        prompt_targets: [T] int32, each token's next prompt token, for a step that scores
            prompt logprobs (zeros otherwise).
        prev_token_index: [T] int32; for a token whose id the host does not know yet (async
            scheduling: a decode of the token the previous step samples), that step's
            sampling row; -1 for every other token (its id is in ``input_ids``).
        with_logprobs: [] bool; also return the sampled tokens' logprobs.
        with_prompt_logprobs: [] bool; also score ``prompt_targets``.
        with_pooling: [] bool; also return the hidden rows pooling requests need
            (``jaxpaged.runner.pooling``).
        num_rows: [] int32, the real sampling rows (the first ones of ``logits_indices``;
            padding rows' logits may be left zero: ``jaxpaged.layers.packed_linear``).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    attn_metadata: dict
    sampling: SamplingMetadata
    adjust: LogitsAdjustment
    token_bitmask: np.ndarray
    prompt_targets: np.ndarray
    prev_token_index: np.ndarray
    with_logprobs: np.ndarray
    with_prompt_logprobs: np.ndarray
    with_pooling: np.ndarray = field(default_factory=lambda: np.asarray(False))
    num_rows: np.ndarray = field(default_factory=lambda: np.asarray(0, np.int32))


jax.tree_util.register_dataclass(
    StepInputs, data_fields=["input_ids", "positions", "logits_indices", "attn_metadata",
                             "sampling", "adjust", "token_bitmask", "prompt_targets",
                             "prev_token_index", "with_logprobs", "with_prompt_logprobs",
                             "with_pooling", "num_rows"],
    meta_fields=[])


@dataclass(frozen=True)
class PreparedStep:
    """A step's inputs and what the runner needs to read its outputs back.

    Attributes:
        inputs: the device inputs.
        layout: the batch layout they were built from.
        row_starts: [num_seqs + 1] each scheduled sequence's first sampling row (a
            sequence has ``max(num_samples, 1)`` rows, plus one per speculative proposal;
            one of a non-sampling chunk is unused).
        draft_ids: speculative decoding only (else None): [B] int32, the proposal each
            row verifies (-1 for a row without one: a bonus row, a plain decode).
    """

    inputs: StepInputs
    layout: BatchLayout
    row_starts: list[int]
    draft_ids: np.ndarray | None = None


def attention_metadata(backend: AttentionBackend, layout: BatchLayout) -> dict:
    """The backend's metadata for ``layout`` plus the layout's own arrays (and, for KV cache
    groups, ``kv_groups``: the other groups' ``page_table`` [G-1, B, P] and ``slot_mapping``
    [G-1, T])."""
    metadata = backend.build_metadata(layout)
    metadata.update(slot_mapping=layout.slot_mapping, page_table=layout.page_table,
                    seq_lens=layout.seq_lens, query_start_loc=layout.query_start_loc,
                    positions=layout.positions)
    if layout.group_page_tables is not None:    # (jaxpaged.layers.kv_group_layers)
        metadata["kv_groups"] = {"page_table": layout.group_page_tables,
                                 "slot_mapping": layout.group_slot_mappings}
    # Every step carries it (a recurrent model's dummy steps too: one executable per bucket).
    metadata["state_slots"] = (np.full(layout.positions.shape[0], -1, np.int32)
                               if layout.state_slots is None else layout.state_slots)
    return metadata


def prepare_step(sched: SchedulerOutput, *, page_size: int, backend: AttentionBackend,
                 eos_token_ids: frozenset[int],
                 pad_sizes: Callable[[int, int, int, int, bool], tuple[int, int, int]],
                 prev_rows: Callable[[], dict[str, int]], bitmask_words: int,
                 free_bitmask: Callable[[int], object], adjust_capacity: int = 16,
                 verify_block_q: int = 0) -> PreparedStep:
    """Pad and pack one scheduled step.

    Args:
        sched: the step (at least one sequence).
        page_size: tokens per page.
        backend: the attention backend (its metadata).
        eos_token_ids: banned before a sequence's ``min_tokens``.
        pad_sizes: ``(num_tokens, num_seqs, num_rows, max_pages, decode_only, verify) ->
            (T, B, P)``.
        prev_rows: gives, by sequence id, the sampling row of each sequence in the step
            dispatched before this one (called only when a sequence decodes a token not on
            the host yet, see :attr:`StepInputs.prev_token_index`).
        bitmask_words: int32 words of a grammar bitmask row (``ceil(V / 32)``).
        free_bitmask: ``rows -> [rows, bitmask_words]`` int32 with every bit set, the mask of
            a step with no structured-output row (the runner keeps one on the device per row
            bucket, so such steps copy nothing to it).
        adjust_capacity: K and A of the logit adjustments (more only for a row that needs
            more entries, which makes a new step shape).
        verify_block_q: speculative decoding (0: off): fill :attr:`PreparedStep.draft_ids`
            (the runner verifies proposals), and lay a step whose sequences all decode one
            token plus their proposals (at most ``verify_block_q`` tokens each, one sampling
            row per token) out as a verification step (:attr:`BatchLayout.verify_block_q`;
            T = B * ``verify_block_q`` tokens and rows).
            A sequence with ``draft_token_ids`` = d_0 .. d_{m-1} gets rows 0 .. m: row j
            takes the logits of its chunk's token j (which predicts position start + j + 1),
            its seed unchanged and its logit adjustments computed as if d_0 .. d_{j-1}
            were already output (row j is used only when they are accepted).

    Raises:
        ValueError: the step exceeds the largest bucket.
        RuntimeError: a sequence decodes an unknown token the previous step did not sample.
    """
    plan = plan_step(sched.scheduled, pad_sizes, verify_block_q)
    layout = token_layout(plan, page_size, verify_block_q)
    input_ids, prev_token_index = token_ids(plan, prev_rows)
    logits_indices, sampling = sampling_rows(plan)
    inputs = StepInputs(
        input_ids=input_ids, positions=layout.positions, logits_indices=logits_indices,
        attn_metadata=attention_metadata(backend, layout), sampling=sampling,
        adjust=logit_adjustments(plan, eos_token_ids, adjust_capacity),
        token_bitmask=grammar_masks(plan, bitmask_words, free_bitmask),
        prompt_targets=prompt_targets(plan), prev_token_index=prev_token_index,
        with_logprobs=np.asarray(plan.with_logprobs),
        with_prompt_logprobs=np.asarray(plan.with_prompt),
        with_pooling=np.asarray(any(r.pooling is not None for r in plan.reqs)),
        num_rows=np.asarray(plan.num_rows, np.int32))
    return PreparedStep(inputs, layout, plan.cu_rows.tolist(), verify_rows(plan))
