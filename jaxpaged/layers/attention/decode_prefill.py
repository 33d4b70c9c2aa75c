"""Step metadata for the v2 Pallas kernels: decodes and prefill query blocks apart (numpy only).

The v2 kernels launch decodes and prefill chunks separately (``pallas_kernels.paged_attention``
and ``pallas_kernels.prefill_attention``), so the host splits a step's sequences in two:

- *decodes*: sequences with one new token this step (a decode, or a prefill chunk of one
  token, which attends exactly like one), one entry each;
- *prefill blocks*: the other sequences' new tokens cut into blocks of
  :data:`PREFILL_BLOCK_Q` consecutive tokens (the last block of a chunk partial).

Every array's shape depends only on the bucket (T, B and whether the step is decode-only, as
for the v1 query blocks), so the jitted step compiles once per bucket: at most ``B`` decodes
(``min(B, T)`` in a mixed step) and ``ceil(T / 32) + min(B, T // 2)`` prefill blocks (each
prefilling sequence has at least two tokens and leaves at most one partial block). A
decode-only step has no prefill blocks, so it is one kernel launch. Entries are sorted by
last position, longest first, so the GPU starts the longest work first; padding entries
(position -1) are last and do no work.
"""

from __future__ import annotations

import numpy as np

from jaxpaged.layers.attention.base import BatchLayout

#: Query tokens per prefill block of the v2 prefill kernel (x G heads = 128 rows at G = 4).
PREFILL_BLOCK_Q = 32


def num_decode_slots(num_tokens_padded: int, num_seqs_padded: int, decode_only: bool) -> int:
    """Decode entries of a bucket."""
    return num_seqs_padded if decode_only else min(num_seqs_padded, num_tokens_padded)


def num_prefill_blocks(num_tokens_padded: int, num_seqs_padded: int, decode_only: bool) -> int:
    """Prefill blocks of a bucket (0 for a decode-only step)."""
    if decode_only:
        return 0
    return -(-num_tokens_padded // PREFILL_BLOCK_Q) + min(num_seqs_padded,
                                                          num_tokens_padded // 2)


def build_decode_prefill_metadata(layout: BatchLayout) -> dict[str, np.ndarray]:
    """Decode and prefill-block arrays for ``layout``.

    Returns (all int32; T = padded token count, the index of a dropped output row):
        ``decode_tokens`` [ND] each decode's token index (T for padding),
        ``decode_seq`` [ND] its page-table row, ``decode_positions`` [ND] its position
        (-1 for padding), ``decode_kv_tokens`` [1] the sum of ``position + 1`` over the
        decodes (sizes the split-K), ``prefill_tokens`` [NP, 32] token index of each block
        row (T for padding), ``prefill_seq`` [NP], ``prefill_positions`` [NP, 32] (-1 for
        padding); ND and NP from :func:`num_decode_slots` and :func:`num_prefill_blocks`.
    """
    t_pad = layout.positions.shape[0]
    b_pad = layout.seq_lens.shape[0]
    decode_only = layout.is_decode_only
    qsl = layout.query_start_loc.astype(np.int64)
    n = layout.num_seqs
    lengths = qsl[1:n + 1] - qsl[:n]

    decoding = np.flatnonzero(lengths == 1)
    nd = num_decode_slots(t_pad, b_pad, decode_only)
    decode_tokens = np.full(nd, t_pad, np.int32)
    decode_seq = np.zeros(nd, np.int32)
    decode_positions = np.full(nd, -1, np.int32)
    positions = layout.positions[qsl[decoding]]
    order = np.argsort(-positions, kind="stable")
    decode_tokens[:len(decoding)] = qsl[decoding][order]
    decode_seq[:len(decoding)] = decoding[order]
    decode_positions[:len(decoding)] = positions[order]

    nbp = num_prefill_blocks(t_pad, b_pad, decode_only)
    prefill_tokens = np.full((nbp, PREFILL_BLOCK_Q), t_pad, np.int32)
    prefill_seq = np.zeros(nbp, np.int32)
    prefill_positions = np.full((nbp, PREFILL_BLOCK_Q), -1, np.int32)
    b = 0
    for i in np.flatnonzero(lengths > 1):
        for s in range(int(qsl[i]), int(qsl[i + 1]), PREFILL_BLOCK_Q):
            e = min(s + PREFILL_BLOCK_Q, int(qsl[i + 1]))
            prefill_tokens[b, :e - s] = np.arange(s, e)
            prefill_positions[b, :e - s] = layout.positions[s:e]
            prefill_seq[b] = i
            b += 1
    order = np.argsort(-prefill_positions.max(axis=1, initial=-1), kind="stable")
    return {"decode_tokens": decode_tokens, "decode_seq": decode_seq,
            "decode_positions": decode_positions,
            "decode_kv_tokens": np.array([int(positions.sum()) + len(decoding)], np.int32),
            "prefill_tokens": prefill_tokens[order], "prefill_seq": prefill_seq[order],
            "prefill_positions": prefill_positions[order]}
