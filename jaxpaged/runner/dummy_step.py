"""Steps of dummy data for a given padded shape: what the runner compiles ahead of time
(:meth:`~jaxpaged.runner.model_runner.ModelRunner.precompile`) and profiles memory with
(:meth:`~jaxpaged.runner.model_runner.ModelRunner.profile_peak_bytes`). Every token writes
to the null page, so running one leaves the serving pool's pages as they were.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpaged.layers.attention import AttentionBackend, BatchLayout
from jaxpaged.runner.input_batch import StepInputs, attention_metadata
from jaxpaged.sampling.logits_adjust import no_adjustment
from jaxpaged.sampling.sampler import SamplingMetadata
from jaxpaged.structured_output.manager import all_allowed, num_words


def dummy_layout(t_pad: int, b_pad: int, p_pad: int, decode_only: bool,
                 verify_block_q: int = 0) -> BatchLayout:
    """A layout of ``t_pad`` tokens, ``b_pad`` sequences and ``p_pad`` page-table columns (a
    decode-only step's when ``decode_only``, a verification step's with ``verify_block_q``)
    whose tokens all write to the null page."""
    n_tokens = 1 if decode_only else 2
    return BatchLayout(
        query_start_loc=np.full(b_pad + 1, n_tokens, np.int32),
        seq_lens=np.zeros(b_pad, np.int32), positions=np.zeros(t_pad, np.int32),
        slot_mapping=np.zeros(t_pad, np.int32),
        page_table=np.zeros((b_pad, p_pad), np.int32), num_seqs=1, num_tokens=n_tokens,
        verify_block_q=verify_block_q)


def dummy_inputs(layout: BatchLayout, backend: AttentionBackend, max_adjust_entries: int,
                 vocab_size: int, num_kv_groups: int = 1) -> StepInputs:
    """The step inputs of ``layout``: zero token ids, greedy rows (one per token of a
    verification step, else one per sequence), no logit adjustments (capacity
    ``max_adjust_entries`` a row), every one of ``vocab_size`` tokens allowed, no logprobs;
    with ``num_kv_groups`` > 1 KV cache groups (``jaxpaged.core.kv_groups``), the other
    groups' page tables and slots all on the null page too."""
    t_pad = layout.positions.shape[0]
    if num_kv_groups > 1:
        layout = dataclasses.replace(
            layout, group_page_tables=np.zeros((num_kv_groups - 1, *layout.page_table.shape),
                                               np.int32),
            group_slot_mappings=np.zeros((num_kv_groups - 1, t_pad), np.int32))
    b_pad = t_pad if layout.verify_block_q else layout.seq_lens.shape[0]   # rows
    k = max_adjust_entries
    return StepInputs(np.zeros(t_pad, np.int32), layout.positions, np.zeros(b_pad, np.int32),
                      attention_metadata(backend, layout),
                      SamplingMetadata.from_host([], b_pad), no_adjustment(b_pad, k, k),
                      all_allowed(b_pad, num_words(vocab_size)),
                      np.zeros(t_pad, np.int32), np.full(t_pad, -1, np.int32),
                      np.asarray(False), np.asarray(False), np.asarray(False),
                      np.asarray(b_pad, np.int32))
