"""The padded shapes of a model step, so that the step compiles a bounded number of times.

- decode-only steps: T = B = a sequence bucket (8, 16, ... up to ``max_num_seqs``);
- steps with prefill chunks: T = a token bucket (16, 32, ... up to ``max_num_batched_tokens``,
  with 1.5x steps from :data:`TOKEN_MIDPOINTS_FROM` on: 1536, 3072, ...)
  (both ladders skip buckets where the model is so small that padding costs less than
  a compilation: :data:`PADDING_BUDGET_FLOPS`; the bundled model has sequence buckets 8 and
  256 and token buckets 16 and 2048)
  and B = the sequence bucket of min(T, ``max_num_seqs``); a step with more sampling rows
  than that (``n > 1`` prompts fork their samples from one sequence) takes the first wider
  token bucket whose B holds them instead of a new (T, B) pair;
- pages per sequence P: the widest bucket, ``max_model_len / page_size``, alone when the
  attention backend's work follows the real sequence lengths (``xla``: its chunk loop stops
  at the longest sequence, so a wider page table costs nothing), else 4, 8, ... up to it
  (``pallas``: the decode kernel's split-K grid follows the table's width).

:meth:`ShapeBuckets.step_shapes` lists every shape a run can meet, which is what the
start-up precompiles. (vLLM pads decode batches to its CUDA-graph capture sizes the same way,
``vllm/config/compilation.py``.)
"""

from __future__ import annotations


#: Extra matmul FLOPs a padded step may cost over its real size before a smaller bucket is
#: worth its compilation (:func:`padding_budget_tokens`). Every bucket is one more XLA
#: compilation at start-up, while padding a tiny model costs little (``docs/measurements.md``,
#: "Buckets"). W1's 110 M-parameter model gets 9 tokens of slack, so its ladders stay powers
#: of two.
PADDING_BUDGET_FLOPS = 2e9

#: Token buckets from this size on have a bucket half-way to the next power of two too
#: (1536 between 1024 and 2048): a prompt step of 1025-1536 tokens otherwise pads up to 1023
#: tokens. W1's last prompt step holds 1382 tokens, and padding it to 1536 instead of 2048
#: shortened W1's run (``docs/measurements.md``, "Buckets").
TOKEN_MIDPOINTS_FROM = 1024


def padding_budget_tokens(num_params: int) -> int:
    """Tokens (or rows) a step may be padded by within :data:`PADDING_BUDGET_FLOPS` for a
    model of ``num_params`` parameters (2 FLOPs per parameter per token)."""
    return int(PADDING_BUDGET_FLOPS // (2 * max(num_params, 1)))


def bucket_sizes(smallest: int, largest: int, max_padding: int = 0,
                 midpoints_from: int | None = None) -> list[int]:
    """Powers of two times ``smallest`` up to (and ending exactly at) ``largest``, with
    ``midpoints_from`` also 1.5 times each of them >= ``midpoints_from``; with
    ``max_padding``, each next bucket is the widest of them no more than ``max_padding``
    above the one before (at least the next one), so fewer buckets cover the same range when
    padding is cheap."""
    ladder, s = [], smallest
    while s < largest:
        ladder.append(s)
        if midpoints_from is not None and s >= midpoints_from and s * 3 // 2 < largest:
            ladder.append(s * 3 // 2)
        s *= 2
    ladder.append(largest)
    sizes = [smallest]
    while sizes[-1] < largest:
        above = [c for c in ladder if c > sizes[-1]]
        within = [c for c in above if c - sizes[-1] <= max_padding]
        sizes.append(within[-1] if within else above[0])
    return sizes


def pick_bucket(sizes: list[int], n: int) -> int:
    """The smallest bucket >= n.

    Raises:
        ValueError: ``n`` exceeds the largest bucket.
    """
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


class ShapeBuckets:
    """The token, sequence and page buckets of one runner.

    Args:
        max_num_tokens: tokens per step (``max_num_batched_tokens``).
        max_num_seqs: sequences (and sampling rows) per step.
        max_pages_per_seq: pages of a ``max_model_len`` sequence.
        page_buckets_by_width: one page bucket per power of two (else the widest only).
        max_padding: tokens (and sequences) a step may be padded by beyond the next power
            of two (:func:`bucket_sizes`; :func:`padding_budget_tokens` of the model).
        verify_block_q: 0, or (speculative decoding) ``1 + num_speculative_tokens``: then
            verification steps get their own shapes, one per sequence bucket B:
            T = B * ``verify_block_q`` tokens and as many sampling rows, one query block
            of ``verify_block_q`` tokens per sequence (``docs/speculative_decoding.md``,
            "The verify step").
    """

    def __init__(self, *, max_num_tokens: int, max_num_seqs: int, max_pages_per_seq: int,
                 page_buckets_by_width: bool, max_padding: int = 0, verify_block_q: int = 0):
        self.max_num_seqs = max_num_seqs
        self.verify_block_q = verify_block_q
        self.token_buckets = bucket_sizes(16, max(16, max_num_tokens), max_padding,
                                          TOKEN_MIDPOINTS_FROM)
        self.seq_buckets = bucket_sizes(8, max(8, max_num_seqs), max_padding)
        self.page_buckets = bucket_sizes(4, max(4, max_pages_per_seq))
        if not page_buckets_by_width:
            self.page_buckets = self.page_buckets[-1:]

    def pad_sizes(self, num_tokens: int, num_seqs: int, num_rows: int, max_pages: int,
                  decode_only: bool, verify: bool = False) -> tuple[int, int, int]:
        """(T, B, P) of a step of ``num_tokens`` tokens over ``num_seqs`` sequences with
        ``num_rows`` sampling rows, its longest page table ``max_pages`` pages; ``verify``:
        a verification step (T = B * ``verify_block_q``, as many rows).

        Raises:
            ValueError: the step exceeds the largest buckets.
        """
        if verify:
            b_pad = pick_bucket(self.seq_buckets, num_seqs)
            t_pad = b_pad * self.verify_block_q
        elif decode_only:
            t_pad = b_pad = pick_bucket(self.seq_buckets, num_rows)
        else:
            t_pad = pick_bucket(self.token_buckets, num_tokens)
            wider = [t for t in self.token_buckets
                     if t >= t_pad and self.mixed_seq_bucket(t) >= num_rows]
            t_pad = wider[0] if wider else self.token_buckets[-1]
            b_pad = pick_bucket(self.seq_buckets, max(num_rows, self.mixed_seq_bucket(t_pad)))
        return t_pad, b_pad, pick_bucket(self.page_buckets, max_pages)

    def mixed_seq_bucket(self, t_pad: int) -> int:
        """The sequence bucket of a step with prefill chunks padded to ``t_pad`` tokens."""
        return pick_bucket(self.seq_buckets, min(t_pad, self.max_num_seqs))

    def step_shapes(self) -> list[tuple]:
        """Every ``(T, B, P, decode_only)`` :meth:`pad_sizes` can return: decode steps of
        each sequence bucket, steps with prefill chunks of each token bucket (with the wider
        sequence buckets n > 1 prompts can need when the widest token bucket holds fewer
        than ``max_num_seqs`` rows), each with every page bucket, and with
        ``verify_block_q`` the verification steps ``(B * verify_block_q, B, P, False,
        verify_block_q)``; sorted."""
        t_max = self.token_buckets[-1]
        shapes = {(b, b, p, True) for b in self.seq_buckets for p in self.page_buckets}
        for t in self.token_buckets:
            seqs = [self.mixed_seq_bucket(t)]
            if t == t_max:
                seqs += [b for b in self.seq_buckets if b > seqs[0]]
            shapes.update((t, b, p, False) for b in seqs for p in self.page_buckets)
        if self.verify_block_q:
            q = self.verify_block_q
            shapes.update((b * q, b, p, False, q) for b in self.seq_buckets
                          for p in self.page_buckets)
        return sorted(shapes)
