"""Batched on-device token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Order of the transforms follows vLLM's sampler (``vllm/v1/sample/sampler.py``): a
structured-output grammar's token bitmask first (vLLM applies it to the logits before its
sampler), then logit adjustments (allowed tokens, logit bias, bans, penalties:
``logits_adjust``), and greedy decoding takes the argmax after them; then logits are divided
by the temperature, then top-k and top-p (Holtzman et al., "The Curious Case of Neural
Text Degeneration", ICLR 2020, section 3.1) truncate the distribution, then min-p, then a
token is drawn. Every request carries its own PRNG key derived from its seed and the position
of the token being sampled, so its draw never depends on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling.logits_adjust import LogitsAdjustment, apply_if_any
from jaxpaged.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    """Per-request sampling parameters for one step, each [B] (B = padded sequence count).

    Attributes:
        temperature: float32; ignored where ``greedy``.
        top_k: int32; 0 keeps the whole vocabulary.
        top_p: float32 in (0, 1].
        min_p: float32 in [0, 1].
        greedy: bool; argmax decoding.
        seed_lo, seed_hi: uint32 halves of each request's 64-bit seed.
        position: int32; position of the token being sampled (its index in prompt + output).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    greedy: jax.Array
    seed_lo: jax.Array
    seed_hi: jax.Array
    position: jax.Array

    @classmethod
    def from_host(cls, rows: list[tuple[float, int, float, float, bool, int, int]],
                  padded: int) -> "SamplingMetadata":
        """Pack ``(temperature, top_k, top_p, min_p, greedy, seed, position)`` rows into
        numpy arrays of length ``padded`` (padding rows are greedy)."""
        columns = list(zip(*rows)) if rows else [()] * 7
        columns[5] = [s & 0xFFFFFFFFFFFFFFFF for s in columns[5]]
        return cls.from_columns(*columns, padded=padded)

    @classmethod
    def from_columns(cls, temperature, top_k, top_p, min_p, greedy, seed, position, *,
                     padded: int) -> "SamplingMetadata":
        """Pack per-row sequences (floats, ints, bools; ``seed`` 64-bit unsigned values) into
        numpy arrays of length ``padded`` (padding rows are greedy)."""
        n = len(temperature)

        def column(values, dtype, fill):
            out = np.full(padded, fill, dtype)
            out[:n] = values
            return out

        seeds = column(seed, np.uint64, 0)
        return cls(column(temperature, np.float32, 1.0),
                   column(np.minimum(np.asarray(top_k, np.int64), 2**31 - 1), np.int32, 0),
                   column(top_p, np.float32, 1.0), column(min_p, np.float32, 0.0),
                   column(greedy, bool, True),
                   (seeds & 0xFFFFFFFF).astype(np.uint32), (seeds >> 32).astype(np.uint32),
                   column(position, np.int32, 0))


@jax.tree_util.register_dataclass
@dataclass
class TokenLogprobs:
    """Raw-distribution log-probabilities of N scored tokens (device or host arrays).

    Attributes:
        logprobs: [N] float32, of each scored token.
        ranks: [N] int32, its rank (1 = most likely).
        top_ids: [N, MAX_LOGPROBS] int32, the most likely ids, best first.
        top_logprobs: [N, MAX_LOGPROBS] float32, their log-probabilities.
    """

    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    """One step's sampled tokens (vLLM's ``SamplerOutput``).

    Attributes:
        token_ids: [B] int32, one token per row.
        logprobs: the sampled tokens' :class:`TokenLogprobs`, or None when not asked.
        prompt_logprobs: for a step that scores prompts, every input token's distribution
            over the next prompt token (:class:`TokenLogprobs` of [T] rows); else None.
    """

    token_ids: jax.Array
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


#: Candidates (the largest scaled logits of a row, ``lax.top_k``) in which a row's filters
#: look for their cut, then :data:`DEEP_CANDIDATES`, before sorting the row.
CANDIDATES, DEEP_CANDIDATES = 128, 1024


def processed_logits(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Temperature, then min-p, top-k and top-p (in vLLM's order): [B, V] float32 logits ->
    [B, V] float32 with every excluded token at -inf. Sampling draws from
    ``softmax`` of the result. Rows marked greedy are returned unscaled (unused); rows with no
    filter (top_k 0 or >= V, top_p 1, min_p 0) keep every token.

    What survives a filter is every token at or above a per-row threshold
    (:func:`_sorted_threshold` defines it on the sorted row). Sorting a large vocabulary is
    most of a sampled step on XLA:CPU (``docs/measurements.md``, "Sampling on XLA:CPU"), so
    the cut is searched row by row, only in rows that filter (not in greedy or padding rows), first
    among the row's :data:`CANDIDATES` largest logits (``lax.top_k``), which holds whenever
    top-k <= CANDIDATES, min-p cuts inside them, or top-p's nucleus ends inside them (its
    mass measured against the whole kept vocabulary), then among its
    :data:`DEEP_CANDIDATES` largest, and only then in the sorted row. (FlashInfer avoids the
    sort by rejection sampling, which changes the draws; this keeps them.)
    """
    vocab = logits.shape[-1]
    temperature = jnp.where(meta.greedy, 1.0, meta.temperature)
    scaled = logits / temperature[:, None]
    filtered = ~meta.greedy & (((meta.top_k > 0) & (meta.top_k < vocab)) | (meta.top_p < 1.0)
                               | (meta.min_p > 0.0))

    def threshold(row):
        row_logits, row_meta, row_filtered = row
        one = jax.tree.map(lambda a: a[None], (row_logits, row_meta))
        return jax.lax.cond(row_filtered, lambda: _row_threshold(*one),
                            lambda: jnp.float32(-jnp.inf))

    def cut(scaled):
        thresholds = jax.lax.map(threshold, (scaled, meta, filtered))
        return jnp.where(scaled >= thresholds[:, None], scaled, -jnp.inf)

    return jax.lax.cond(jnp.any(filtered), cut, lambda s: s, scaled)


def _row_threshold(row: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """One row's threshold (``row`` [1, V], ``meta`` of [1] arrays -> [] float32): among its
    :data:`CANDIDATES` largest logits, else its :data:`DEEP_CANDIDATES` largest, else its
    sorted row."""
    vocab = row.shape[-1]
    first, found = _candidate_threshold(row, meta, min(CANDIDATES, vocab))

    def deeper():
        deep, ok = _candidate_threshold(row, meta, min(DEEP_CANDIDATES, vocab))
        return jax.lax.cond(ok[0], lambda: deep, lambda: _sorted_threshold(row, meta))

    return jax.lax.cond(found[0], lambda: first, deeper)[0]


def _kept_mass(desc: jax.Array, meta: SamplingMetadata, vocab: int,
               total: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Min-p, top-k and top-p on ``desc`` [B, N], each row's N largest scaled logits in
    descending order, ``total`` [B] the softmax denominator of the tokens min-p and top-k
    keep (None: they all lie in ``desc``) -> (each row's count of kept ranks, at least 1;
    whether min-p and top-k keep only ranks inside ``desc``)."""
    rank = jnp.arange(desc.shape[-1])[None, :]
    floor = desc[:, :1] + jnp.log(jnp.maximum(meta.min_p, 1e-30))[:, None]  # p >= min_p p_max
    keep = jnp.where(meta.min_p[:, None] > 0, desc >= floor, True)
    k = jnp.where(meta.top_k > 0, jnp.minimum(meta.top_k, vocab), vocab)
    keep &= rank < k[:, None]
    inside = (k <= desc.shape[-1]) | ~keep[:, -1]
    weights = jnp.where(keep, jnp.exp(desc - desc[:, :1]), 0.0)
    denominator = jnp.sum(weights, axis=-1) if total is None else \
        jnp.where(inside, jnp.sum(weights, axis=-1), total)
    probs = weights / denominator[:, None]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < meta.top_p[:, None]          # smallest prefix with mass >= top_p
    return jnp.maximum(jnp.sum(keep, axis=-1), 1), inside


def _sorted_threshold(scaled: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Each row's threshold [B] from its whole sorted row: the smallest kept logit, where
    min-p keeps p >= min_p * p_max, top-k the k best ranks and top-p the smallest prefix of
    the min-p/top-k survivors whose renormalised mass reaches top_p."""
    desc = -jnp.sort(-scaled, axis=-1)
    num_keep, _ = _kept_mass(desc, meta, scaled.shape[-1])
    return jnp.take_along_axis(desc, (num_keep - 1)[:, None], axis=-1)[:, 0]


def _candidate_threshold(scaled: jax.Array, meta: SamplingMetadata,
                         n: int) -> tuple[jax.Array, jax.Array]:
    """:func:`_sorted_threshold` from the ``n`` largest logits of each row -> (thresholds
    [B], [B] bool whether the row's threshold lies among them; where not, the threshold is
    meaningless). Top-p's denominator, when min-p and top-k keep ranks beyond the ``n``,
    is the sum over the whole row of the tokens min-p keeps (top-k then keeps at least
    ``n + 1``; the row is found only where top-k keeps all: top_k 0 or >= V)."""
    vocab = scaled.shape[-1]
    # The barrier keeps XLA:CPU's TopK call: without it, XLA (jaxlib 0.12) rewrites this
    # top_k, whose values feed the slices below, into a sort of the whole row, ~15x slower
    # (docs/measurements.md, "Sampling on XLA:CPU").
    desc, _ = jax.lax.optimization_barrier(jax.lax.top_k(scaled, n))
    floor = desc[:, :1] + jnp.log(jnp.maximum(meta.min_p, 1e-30))[:, None]
    above = jnp.where(meta.min_p[:, None] > 0, scaled >= floor, True)
    total = jnp.sum(jnp.where(above, jnp.exp(scaled - desc[:, :1]), 0.0), axis=-1)
    num_keep, inside = _kept_mass(desc, meta, vocab, total)
    no_top_k = (meta.top_k <= 0) | (meta.top_k >= vocab)
    found = inside | (no_top_k & (num_keep < n))
    threshold = jnp.take_along_axis(desc, (num_keep - 1)[:, None], axis=-1)[:, 0]
    return threshold, found


def when(flag, fn, *args):
    """``fn(*args)`` where ``flag`` holds. A Python bool decides while tracing (False gives
    None); a bool array decides on the device (``lax.cond``; False gives zeros of
    ``fn``'s result shapes), so one executable serves both cases."""
    if isinstance(flag, bool):
        return fn(*args) if flag else None
    shapes = jax.eval_shape(fn, *args)
    return jax.lax.cond(flag, fn, lambda *_: jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype), shapes), *args)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Grammar-disallowed tokens at -inf: logits [B, V] float32, bitmask [B, ceil(V / 32)]
    int32 (token ``t`` allowed where bit ``t % 32`` of word ``t // 32`` is set, llguidance's
    layout; bits past V are ignored) -> [B, V] float32. A mask with every bit set (no
    constrained row) skips the unpacking on the device (``lax.cond``)."""

    def masked(x, m):
        bits = (m[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1   # arithmetic shift:
        allowed = bits.reshape(m.shape[0], -1)[:, :x.shape[-1]] != 0    # bit 31 reads right
        return jnp.where(allowed, x, -jnp.inf)

    return jax.lax.cond(jnp.all(bitmask == -1), lambda x, _: x, masked, logits, bitmask)


def sample(logits: jax.Array, meta: SamplingMetadata, with_logprobs: bool | jax.Array = False,
           adjust: LogitsAdjustment | None = None,
           token_bitmask: jax.Array | None = None) -> SamplerOutput:
    """Draw one token per row.

    Args:
        logits: [B, V] float32.
        meta: the rows' sampling parameters.
        token_bitmask: [B, ceil(V / 32)] int32 grammar masks (structured outputs,
            :func:`apply_token_bitmask`), applied before everything else as vLLM applies its
            grammar bitmask to the logits before its sampler; None: no grammar.
        adjust: per-row logit bias, bans, allowed tokens and penalties (None: none; rows
            without entries are left as they are, and a step with none skips them on the
            device).
        with_logprobs: also return log-probabilities (a bool array: decided on the device,
            zeros where false; see :func:`when`). They are those of the raw model
            distribution, ``log_softmax(logits)`` before temperature, top-k/top-p/min-p and
            adjustments and penalties (vLLM's default ``logprobs_mode="raw_logprobs"``), but
            after the grammar mask: a token the grammar forbids has logprob -inf.

    Returns:
        A :class:`SamplerOutput`: ``token_ids`` [B] int32 and, with logprobs, the sampled
        tokens' :class:`TokenLogprobs`.
    """
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    adjusted = logits if adjust is None else apply_if_any(logits, adjust)
    greedy_tokens = argmax_first(adjusted)

    def gumbel(row):
        lo, hi, pos, greedy = row
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(lo), hi), pos)
        return jax.lax.cond(greedy, lambda: jnp.zeros(adjusted.shape[-1:], adjusted.dtype),
                            lambda: jax.random.gumbel(key, adjusted.shape[-1:], adjusted.dtype))

    def with_sampling():
        # jax.random.categorical's draw, argmax(logits + Gumbel noise), with the argmax of
        # argmax_first (the same token; jnp.argmax's variadic reduction is slow on XLA:CPU).
        # Row by row, so that greedy and padding rows draw no noise (a third of the vmapped
        # form's time for one sampled row of 8: docs/measurements.md, "Sampling on XLA:CPU").
        noise = jax.lax.map(gumbel, (meta.seed_lo, meta.seed_hi, meta.position, meta.greedy))
        sampled = argmax_first(processed_logits(adjusted, meta) + noise)
        return jnp.where(meta.greedy, greedy_tokens, sampled)

    # An all-greedy step skips the vocabulary sort and the random draws at run time.
    tokens = jax.lax.cond(jnp.all(meta.greedy), lambda: greedy_tokens, with_sampling)
    return SamplerOutput(tokens, when(with_logprobs, token_logprobs, logits, tokens))


def argmax_first(logits: jax.Array) -> jax.Array:
    """Each row's argmax, exactly as ``jnp.argmax(logits, axis=-1)``: the first index of the
    row's largest value, or of its first NaN (NaN counts as the largest).

    Computed as a max, then the smallest index holding it: two plain reductions that XLA:CPU
    vectorises. ``jnp.argmax`` lowers to one variadic (value, index) reduction, which is
    several times slower on XLA:CPU (jaxlib 0.12; ``docs/benchmarks.md``, "W1 step profile
    (CPU)").

    Args:
        logits: [B, V] float.

    Returns:
        [B] int32 token ids.
    """
    vocab = logits.shape[-1]
    best = jnp.max(logits, axis=-1, keepdims=True)   # XLA:CPU's max may skip NaNs
    nan = jnp.isnan(logits)
    hit = jnp.where(nan.any(axis=-1, keepdims=True), nan, logits == best)
    ids = jnp.arange(vocab, dtype=jnp.int32)
    return jnp.min(jnp.where(hit, ids, vocab), axis=-1)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """Raw-distribution log-probabilities of ``tokens`` [N] under ``logits`` [N, V] float32,
    with the ``MAX_LOGPROBS`` best ids and logprobs of every row."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    return TokenLogprobs(chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)
