"""One step's device inputs (`StepInputs`), assembled on the host from a `SchedulerOutput`.

The runner pads every array to the step's bucket (T tokens, B sequences, P pages per
sequence; ``jaxpaged.runner.model_runner``) and builds them with whole-array numpy operations:
one Python pass over the scheduled sequences reads their scalars, everything else (positions,
the page table, the slot mapping, the sampling rows) is computed from those columns, so the
host cost of a step grows with its sequences only through that one pass. The token ids and
page ids come from the ``SchedulerOutput`` alone: the KV cache manager is never consulted.

References: vLLM V1's ``InputBatch`` / ``GPUModelRunner._prepare_inputs``
(``vllm/v1/worker/gpu_model_runner.py``) for the same slot-mapping arithmetic:
``slot = page_table[seq, pos // page_size] * page_size + pos % page_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import jax
import numpy as np

from jaxpaged.constants import NULL_PAGE
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.layers.attention import AttentionBackend, BatchLayout
from jaxpaged.sampling.logits_adjust import (LogitsAdjustment, needs_adjustment, no_adjustment,
                                             pack, row_adjustment)
from jaxpaged.sampling.sampler import SamplingMetadata
from jaxpaged.structured_output.manager import grammar_bitmask

_SEED_MASK = 0xFFFFFFFFFFFFFFFF
_UNKNOWN = [0]      # the stand-in id of a token not on the host yet


def _seed_bits(seeds: list[int]) -> np.ndarray:
    """Python int seeds modulo 2**64 as uint64 (two's complement of an int64 is that residue;
    seeds outside int64 take the slow path)."""
    try:
        return np.array(seeds, np.int64).view(np.uint64)
    except OverflowError:
        return np.array([s & _SEED_MASK for s in seeds], object).astype(np.uint64)


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
    """The backend's metadata for ``layout`` plus the layout's own arrays."""
    metadata = backend.build_metadata(layout)
    metadata.update(slot_mapping=layout.slot_mapping, page_table=layout.page_table,
                    seq_lens=layout.seq_lens, query_start_loc=layout.query_start_loc,
                    positions=layout.positions)
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
    seqs = sched.scheduled
    b = len(seqs)
    reqs = [s.request for s in seqs]
    starts_a = np.array([s.start for s in seqs], np.int64)
    counts_a = np.array([s.num_new_tokens for s in seqs], np.int64)
    speculative = verify_block_q > 0
    drafts_a = np.array([len(s.draft_token_ids or ()) for s in seqs], np.int64) \
        if speculative else np.zeros(b, np.int64)
    rows = [s.num_samples or 1 for s in seqs]
    rows_a = np.array(rows, np.int64) + drafts_a
    rows = rows_a.tolist()
    page_lens = [len(s.page_ids) for s in seqs]
    # Sampling parameters per distinct SamplingParams object (a batch often shares a few).
    index: dict[int, int] = {}
    param_of = np.array([index.setdefault(id(r.params), len(index)) for r in reqs], np.int64)
    distinct = list({id(r.params): r.params for r in reqs}.values())
    with_logprobs = any(p.logprobs is not None for p in distinct)
    with_prompt = any(p.prompt_logprobs is not None for p in distinct) and any(
        r.params.prompt_logprobs is not None and s.start < r.num_prompt_tokens - 1
        for s, r in zip(seqs, reqs))
    needs = [needs_adjustment(p) for p in distinct]
    adjusted = [i for i, s in enumerate(seqs) if s.samples and needs[param_of[i]]] \
        if any(needs) else []
    num_tokens, num_rows = int(counts_a.sum()), int(rows_a.sum())
    verify = (speculative and num_tokens > b and bool((counts_a == 1 + drafts_a).all())
              and num_rows == num_tokens)
    t_pad, b_pad, p_pad = pad_sizes(num_tokens, b, num_rows, max(page_lens), num_tokens == b,
                                    verify)
    r_pad = t_pad if verify else b_pad      # sampling rows

    cu_tokens = np.zeros(b + 1, np.int64)
    np.cumsum(counts_a, out=cu_tokens[1:])
    token_seq = np.repeat(np.arange(b), counts_a)
    token_pos = np.arange(num_tokens) - cu_tokens[token_seq] + starts_a[token_seq]
    page_table = np.full((b_pad, p_pad), NULL_PAGE, np.int32)
    page_rows = np.repeat(np.arange(b), page_lens)
    cu_pages = np.zeros(b + 1, np.int64)
    np.cumsum(page_lens, out=cu_pages[1:])
    page_table[page_rows, np.arange(cu_pages[-1]) - cu_pages[page_rows]] = np.fromiter(
        chain.from_iterable(s.page_ids for s in seqs), np.int32, int(cu_pages[-1]))

    input_ids = np.zeros(t_pad, np.int32)
    # A decode of a token still being sampled by the previous step (async scheduling): its
    # id comes from that step's device output; 0 stands in here.
    unknown = [i for i, (s, r) in enumerate(zip(seqs, reqs)) if s.start >= len(r.all_token_ids)]
    if num_tokens == b:     # decode-only: one token each
        input_ids[:b] = [r.all_token_ids[s.start] if s.start < len(r.all_token_ids) else 0
                         for s, r in zip(seqs, reqs)]
    else:
        input_ids[:num_tokens] = np.fromiter(
            chain.from_iterable(s.request.all_token_ids[s.start:s.end] + s.draft_token_ids
                                if s.draft_token_ids else
                                s.request.all_token_ids[s.start:s.end] or _UNKNOWN
                                for s in seqs), np.int32, num_tokens)
    prev_token_index = np.full(t_pad, -1, np.int32)
    if unknown:
        rows_before = prev_rows()
        try:
            prev_token_index[cu_tokens[unknown]] = [rows_before[reqs[i].request_id]
                                                    for i in unknown]
        except KeyError as e:
            raise RuntimeError(f"sequence {e.args[0]!r} decodes a token that the previous "
                               "step did not sample") from None
    positions = np.zeros(t_pad, np.int32)
    positions[:num_tokens] = token_pos
    slot_mapping = np.full(t_pad, NULL_PAGE * page_size, np.int32)
    slot_mapping[:num_tokens] = (page_table[token_seq, token_pos // page_size] * page_size
                                 + token_pos % page_size)
    seq_lens = np.zeros(b_pad, np.int32)
    seq_lens[:b] = starts_a + counts_a
    query_start_loc = np.full(b_pad + 1, num_tokens, np.int32)
    query_start_loc[:b] = cu_tokens[:b]
    layout = BatchLayout(query_start_loc=query_start_loc, seq_lens=seq_lens,
                         positions=positions, slot_mapping=slot_mapping, page_table=page_table,
                         num_seqs=b, num_tokens=num_tokens,
                         verify_block_q=verify_block_q if verify else 0)

    # Sampling rows: a sequence's rows are consecutive; row j of it draws with seed + j.
    owners = np.repeat(np.arange(b), rows_a)
    cu_rows = np.zeros(b + 1, np.int64)
    np.cumsum(rows_a, out=cu_rows[1:])
    local = np.arange(num_rows) - cu_rows[owners]   # a row's index within its sequence
    # A speculating sequence's row j reads its chunk's token j: ``back`` tokens before the
    # last one. Its rows keep one seed; the n rows of a parallel-sampling prompt add j.
    spec_rows = drafts_a[owners] > 0
    back = np.where(spec_rows, drafts_a[owners] - local, 0)
    logits_indices = np.zeros(r_pad, np.int32)
    logits_indices[:num_rows] = cu_tokens[1:][owners] - 1 - back
    row_seeds = (_seed_bits([r.seed for r in reqs])[owners]
                 + np.where(spec_rows, 0, local).astype(np.uint64))
    row_params = param_of[owners]
    sampling = SamplingMetadata.from_columns(
        *(np.array([getattr(p, name) for p in distinct])[row_params]
          for name in ("temperature", "top_k", "top_p", "min_p", "is_greedy")),
        row_seeds, (starts_a + counts_a)[owners] - back,
        padded=r_pad)
    adjust = None
    if adjusted:
        per_row = [None] * num_rows
        for i in adjusted:
            req, drafts = seqs[i].request, seqs[i].draft_token_ids
            thinking = req.thinking
            if drafts and speculative:
                per_row[cu_rows[i]:cu_rows[i + 1]] = [
                    row_adjustment(req.params, req.prompt_token_ids,
                                   req.output_token_ids + drafts[:j], eos_token_ids,
                                   req.bad_words_ids,
                                   thinking and thinking.forced(req.all_token_ids, drafts[:j]))
                    for j in range(len(drafts) + 1)]
                continue
            adj = row_adjustment(req.params, req.prompt_token_ids, req.output_token_ids,
                                 eos_token_ids, req.bad_words_ids,
                                 thinking and thinking.forced(req.all_token_ids))
            per_row[cu_rows[i]:cu_rows[i + 1]] = [adj] * rows[i]
        if any(a is not None for a in per_row):
            adjust = pack(per_row, r_pad, adjust_capacity)
    if adjust is None:
        adjust = no_adjustment(r_pad, adjust_capacity, adjust_capacity)

    constrained = [(s.request.structured_output_request, r) for i, s in enumerate(seqs)
                   if s.samples and s.request.structured_output_request is not None
                   for r in range(cu_rows[i], cu_rows[i + 1])]
    token_bitmask = (grammar_bitmask(constrained, r_pad, bitmask_words) if constrained
                     else free_bitmask(r_pad))

    prompt_targets = np.zeros(t_pad, np.int32)
    if with_prompt:     # each row's next prompt token (a chunk's last one: the next chunk's)
        for i, s in enumerate(seqs):
            following = s.request.all_token_ids[s.start + 1:s.end + 1]
            t = int(cu_tokens[i])
            prompt_targets[t:t + len(following)] = following
    inputs = StepInputs(input_ids, positions, logits_indices, attention_metadata(backend, layout),
                        sampling, adjust, token_bitmask, prompt_targets, prev_token_index,
                        np.asarray(with_logprobs), np.asarray(with_prompt),
                        np.asarray(any(r.pooling is not None for r in reqs)),
                        np.asarray(num_rows, np.int32))
    draft_ids = None
    if speculative:
        draft_ids = np.full(r_pad, -1, np.int32)
        for i in np.flatnonzero(drafts_a):
            first = int(cu_rows[i])
            draft_ids[first:first + drafts_a[i]] = seqs[i].draft_token_ids
    return PreparedStep(inputs, layout, cu_rows.tolist(), draft_ids)
