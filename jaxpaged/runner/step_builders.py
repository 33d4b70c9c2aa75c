"""The pure builders :func:`jaxpaged.runner.input_batch.prepare_step` composes: each turns the
step's plan (:class:`StepPlan`, the scheduled sequences' columns and the padded sizes) into one
group of device inputs: the token layout, the token ids, the sampling rows, the logit
adjustments, the grammar masks, the prompt-logprob targets and the rows a verification step
checks. Whole-array numpy over the plan's columns; no builder reads the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from jaxpaged.constants import NULL_PAGE
from jaxpaged.core.request import Request
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.layers.attention import BatchLayout
from jaxpaged.sampling.logits_adjust import (LogitsAdjustment, needs_adjustment, no_adjustment,
                                             pack, row_adjustment)
from jaxpaged.sampling.sampler import SamplingMetadata
from jaxpaged.sampling_params import SamplingParams
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


@dataclass(slots=True)
class StepPlan:
    """One step's sequences as columns, and its padded sizes.

    Attributes:
        seqs, reqs: the scheduled sequences and their requests (``b`` of each).
        starts, counts, drafts, rows: [b] int64: first position, tokens, proposals (zeros
            unless speculating) and sampling rows (``max(num_samples, 1)`` + proposals).
        page_lens: each sequence's page count.
        cu_tokens, cu_rows: [b + 1] int64 prefix sums of ``counts`` and ``rows``.
        param_of: [b] int64 index of each sequence's params in ``distinct``.
        distinct: the step's distinct ``SamplingParams`` objects (a batch shares a few).
        num_tokens, num_rows: real tokens and sampling rows.
        verify: laid out as a verification step (``BatchLayout.verify_block_q``).
        speculative: the runner verifies proposals (``verify_block_q`` > 0).
        with_logprobs, with_prompt: some row returns logprobs / some token scores its prompt.
        t_pad, b_pad, p_pad: the bucket (tokens, sequences, pages per sequence).
        r_pad: padded sampling rows (``t_pad`` for a verification step, else ``b_pad``).
    """

    seqs: list[ScheduledRequest]
    reqs: list[Request]
    starts: np.ndarray
    counts: np.ndarray
    drafts: np.ndarray
    rows: np.ndarray
    page_lens: list[int]
    cu_tokens: np.ndarray
    cu_rows: np.ndarray
    param_of: np.ndarray
    distinct: list[SamplingParams]
    num_tokens: int
    num_rows: int
    verify: bool
    speculative: bool
    with_logprobs: bool
    with_prompt: bool
    t_pad: int
    b_pad: int
    p_pad: int
    r_pad: int


def plan_step(seqs: list[ScheduledRequest],
              pad_sizes: Callable[..., tuple[int, int, int]],
              verify_block_q: int) -> StepPlan:
    """The step's columns (one pass over ``seqs``) and its bucket from ``pad_sizes``
    (``prepare_step``'s argument)."""
    b, reqs = len(seqs), [s.request for s in seqs]
    starts = np.array([s.start for s in seqs], np.int64)
    counts = np.array([s.num_new_tokens for s in seqs], np.int64)
    speculative = verify_block_q > 0
    drafts = np.array([len(s.draft_token_ids or ()) for s in seqs], np.int64) \
        if speculative else np.zeros(b, np.int64)
    rows = np.array([s.num_samples or 1 for s in seqs], np.int64) + drafts
    page_lens = [len(s.page_ids) for s in seqs]
    index: dict[int, int] = {}
    param_of = np.array([index.setdefault(id(r.params), len(index)) for r in reqs], np.int64)
    distinct = list({id(r.params): r.params for r in reqs}.values())
    with_prompt = any(p.prompt_logprobs is not None for p in distinct) and any(
        r.params.prompt_logprobs is not None and s.start < r.num_prompt_tokens - 1
        for s, r in zip(seqs, reqs))
    num_tokens, num_rows = int(counts.sum()), int(rows.sum())
    verify = (speculative and num_tokens > b and bool((counts == 1 + drafts).all())
              and num_rows == num_tokens)
    t_pad, b_pad, p_pad = pad_sizes(num_tokens, b, num_rows, max(page_lens), num_tokens == b,
                                    verify)
    cu_tokens, cu_rows = np.zeros(b + 1, np.int64), np.zeros(b + 1, np.int64)
    np.cumsum(counts, out=cu_tokens[1:])
    np.cumsum(rows, out=cu_rows[1:])
    return StepPlan(seqs, reqs, starts, counts, drafts, rows, page_lens, cu_tokens, cu_rows,
                    param_of, distinct, num_tokens, num_rows, verify, speculative,
                    any(p.logprobs is not None for p in distinct), with_prompt,
                    t_pad, b_pad, p_pad, t_pad if verify else b_pad)


def token_layout(plan: StepPlan, page_size: int, verify_block_q: int) -> BatchLayout:
    """The padded page table, positions, slot mapping, sequence lengths and query starts
    (and KV cache groups' page tables and slot mappings where the sequences carry them)."""
    b, seqs = len(plan.seqs), plan.seqs
    token_seq = np.repeat(np.arange(b), plan.counts)
    token_pos = np.arange(plan.num_tokens) - plan.cu_tokens[token_seq] + plan.starts[token_seq]
    page_table = np.full((plan.b_pad, plan.p_pad), NULL_PAGE, np.int32)
    page_rows = np.repeat(np.arange(b), plan.page_lens)
    cu_pages = np.zeros(b + 1, np.int64)
    np.cumsum(plan.page_lens, out=cu_pages[1:])
    page_table[page_rows, np.arange(cu_pages[-1]) - cu_pages[page_rows]] = np.fromiter(
        chain.from_iterable(s.page_ids for s in seqs), np.int32, int(cu_pages[-1]))
    positions = np.zeros(plan.t_pad, np.int32)
    positions[:plan.num_tokens] = token_pos
    slot_mapping = np.full(plan.t_pad, NULL_PAGE * page_size, np.int32)
    slot_mapping[:plan.num_tokens] = (page_table[token_seq, token_pos // page_size] * page_size
                                      + token_pos % page_size)
    groups = seqs[0].group_page_ids
    group_tables = group_slots = None
    if groups is not None:       # every group's table as long as page_ids
        group_tables = np.full((len(groups), plan.b_pad, plan.p_pad), NULL_PAGE, np.int32)
        group_slots = np.full((len(groups), plan.t_pad), NULL_PAGE * page_size, np.int32)
        for k in range(len(groups)):
            group_tables[k, page_rows, np.arange(cu_pages[-1]) - cu_pages[page_rows]] = \
                np.fromiter(chain.from_iterable(s.group_page_ids[k] for s in seqs), np.int32,
                            int(cu_pages[-1]))
            group_slots[k, :plan.num_tokens] = (
                group_tables[k, token_seq, token_pos // page_size] * page_size
                + token_pos % page_size)
    state_slots = None
    if seqs[0].state_slot >= 0:       # (jaxpaged.core.state_slots: recurrent layers)
        state_slots = np.full(plan.t_pad, -1, np.int32)
        state_slots[:plan.num_tokens] = np.repeat([s.state_slot for s in seqs], plan.counts)
    seq_lens = np.zeros(plan.b_pad, np.int32)
    seq_lens[:b] = plan.starts + plan.counts
    query_start_loc = np.full(plan.b_pad + 1, plan.num_tokens, np.int32)
    query_start_loc[:b] = plan.cu_tokens[:b]
    return BatchLayout(query_start_loc=query_start_loc, seq_lens=seq_lens,
                       positions=positions, slot_mapping=slot_mapping, page_table=page_table,
                       num_seqs=b, num_tokens=plan.num_tokens,
                       verify_block_q=verify_block_q if plan.verify else 0,
                       group_page_tables=group_tables, group_slot_mappings=group_slots,
                       state_slots=state_slots)


def token_ids(plan: StepPlan, prev_rows: Callable[[], dict[str, int]]
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, prev_token_index)``, [T] int32 each: a decode of a token still being
    sampled by the previous step (async scheduling) reads it from that step's row (0 stands
    in for its id here). Raises RuntimeError when the previous step did not sample it."""
    seqs, reqs, b = plan.seqs, plan.reqs, len(plan.seqs)
    input_ids = np.zeros(plan.t_pad, np.int32)
    unknown = [i for i, (s, r) in enumerate(zip(seqs, reqs)) if s.start >= len(r.all_token_ids)]
    if plan.num_tokens == b:     # decode-only: one token each
        input_ids[:b] = [r.all_token_ids[s.start] if s.start < len(r.all_token_ids) else 0
                         for s, r in zip(seqs, reqs)]
    else:
        input_ids[:plan.num_tokens] = np.fromiter(
            chain.from_iterable(s.request.all_token_ids[s.start:s.end] + s.draft_token_ids
                                if s.draft_token_ids else
                                s.request.all_token_ids[s.start:s.end] or _UNKNOWN
                                for s in seqs), np.int32, plan.num_tokens)
    prev_token_index = np.full(plan.t_pad, -1, np.int32)
    if unknown:
        rows_before = prev_rows()
        try:
            prev_token_index[plan.cu_tokens[unknown]] = [rows_before[reqs[i].request_id]
                                                         for i in unknown]
        except KeyError as e:
            raise RuntimeError(f"sequence {e.args[0]!r} decodes a token that the previous "
                               "step did not sample") from None
    return input_ids, prev_token_index


def sampling_rows(plan: StepPlan) -> tuple[np.ndarray, SamplingMetadata]:
    """``(logits_indices [R] int32, SamplingMetadata)``: a sequence's rows are consecutive;
    row j of a parallel-sampling prompt draws with seed + j, and a speculating sequence's row
    j reads its chunk's token j (``back`` tokens before the last one) with one seed."""
    owners = np.repeat(np.arange(len(plan.seqs)), plan.rows)
    local = np.arange(plan.num_rows) - plan.cu_rows[owners]   # a row's index in its sequence
    spec_rows = plan.drafts[owners] > 0
    back = np.where(spec_rows, plan.drafts[owners] - local, 0)
    logits_indices = np.zeros(plan.r_pad, np.int32)
    logits_indices[:plan.num_rows] = plan.cu_tokens[1:][owners] - 1 - back
    row_seeds = (_seed_bits([r.seed for r in plan.reqs])[owners]
                 + np.where(spec_rows, 0, local).astype(np.uint64))
    row_params = plan.param_of[owners]
    sampling = SamplingMetadata.from_columns(
        *(np.array([getattr(p, name) for p in plan.distinct])[row_params]
          for name in ("temperature", "top_k", "top_p", "min_p", "is_greedy")),
        row_seeds, (plan.starts + plan.counts)[owners] - back,
        padded=plan.r_pad)
    return logits_indices, sampling


def logit_adjustments(plan: StepPlan, eos_token_ids: frozenset[int],
                      capacity: int) -> LogitsAdjustment:
    """Each sampling row's logit adjustments (penalties, bad words, ``min_tokens``, logit
    bias, a thinking budget's forced token); a speculating sequence's row j as if its first
    j proposals were already output. All padding when no row has any."""
    needs = [needs_adjustment(p) for p in plan.distinct]
    adjusted = [i for i, s in enumerate(plan.seqs) if s.samples and needs[plan.param_of[i]]] \
        if any(needs) else []
    if not adjusted:
        return no_adjustment(plan.r_pad, capacity, capacity)
    per_row, cu_rows, rows = [None] * plan.num_rows, plan.cu_rows, plan.rows.tolist()
    for i in adjusted:
        req, drafts = plan.seqs[i].request, plan.seqs[i].draft_token_ids
        thinking = req.thinking
        if drafts and plan.speculative:
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
        return pack(per_row, plan.r_pad, capacity)
    return no_adjustment(plan.r_pad, capacity, capacity)


def grammar_masks(plan: StepPlan, bitmask_words: int, free_bitmask: Callable[[int], object]):
    """[R, bitmask_words] int32: each structured-output row's grammar mask, every bit set in
    the other rows (``free_bitmask(R)``, kept on the device, when no row has a grammar)."""
    constrained = [(s.request.structured_output_request, r) for i, s in enumerate(plan.seqs)
                   if s.samples and s.request.structured_output_request is not None
                   for r in range(plan.cu_rows[i], plan.cu_rows[i + 1])]
    return (grammar_bitmask(constrained, plan.r_pad, bitmask_words) if constrained
            else free_bitmask(plan.r_pad))


def prompt_targets(plan: StepPlan) -> np.ndarray:
    """[T] int32: each token's next prompt token (a chunk's last one: the next chunk's first)
    when the step scores prompt logprobs; zeros otherwise."""
    targets = np.zeros(plan.t_pad, np.int32)
    if plan.with_prompt:
        for i, s in enumerate(plan.seqs):
            following = s.request.all_token_ids[s.start + 1:s.end + 1]
            t = int(plan.cu_tokens[i])
            targets[t:t + len(following)] = following
    return targets


def verify_rows(plan: StepPlan) -> np.ndarray | None:
    """[R] int32, the proposal each sampling row verifies (-1 for a row without one), or
    None when the runner does not speculate."""
    if not plan.speculative:
        return None
    draft_ids = np.full(plan.r_pad, -1, np.int32)
    for i in np.flatnonzero(plan.drafts):
        first = int(plan.cu_rows[i])
        draft_ids[first:first + plan.drafts[i]] = plan.seqs[i].draft_token_ids
    return draft_ids
