"""Per-request logit adjustments before sampling: logit bias, banned tokens, allowed tokens and
the repetition / frequency / presence penalties.

The host sends only sparse lists (a few token ids per row), padded to a bucket; the device
scatters them into the [B, V] logits. Order, as vLLM v1's sampler applies them
(``vllm/v1/sample/sampler.py``, ``vllm/model_executor/layers/utils.py::apply_penalties``):

A token forced by the thinking budget (``jaxpaged.core.thinking_budget``: the next token
of the end-of-think marker) is the row's only allowed token, and the row has no other entry.

1. allowed-token mask (``allowed_token_ids``), then additive ``pre`` terms: ``logit_bias`` and
   -inf for banned tokens (``bad_words`` completions, and EOS / ``stop_token_ids`` while fewer
   than ``min_tokens`` tokens exist);
2. repetition penalty over prompt + output tokens (Keskar et al., "CTRL", 2019, section 4.1):
   a positive logit is divided by the penalty, a negative one multiplied;
3. additive ``post`` terms over output tokens only: ``-frequency_penalty * count -
   presence_penalty`` (OpenAI's definition).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

#: Padding token id: out of range for any vocabulary, so scatters drop it.
_PAD_ID = 2**30


@jax.tree_util.register_dataclass
@dataclass
class LogitsAdjustment:
    """Sparse per-row adjustments, B rows, K and A entries per row (padded with ``_PAD_ID``).

    Attributes:
        ids: [B, K] int32 token ids with adjustments.
        pre: [B, K] float32 added before penalties (logit bias; -inf bans).
        repeat: [B, K] bool; the token is in the prompt or output (repetition penalty applies).
        post: [B, K] float32 added after the repetition penalty (frequency/presence).
        repetition_penalty: [B] float32 (1 = off).
        allowed_ids: [B, A] int32; only these may be sampled where ``has_allowed``.
        has_allowed: [B] bool.
    """

    ids: jax.Array
    pre: jax.Array
    repeat: jax.Array
    post: jax.Array
    repetition_penalty: jax.Array
    allowed_ids: jax.Array
    has_allowed: jax.Array


@dataclass
class RowAdjustment:
    """One row's adjustments on the host."""

    pre: dict[int, float]
    repeat: set[int]
    post: dict[int, float]
    repetition_penalty: float
    allowed: list[int] | None


def needs_adjustment(params) -> bool:
    """Whether ``params`` can adjust logits at all (cheap; checked before building a row)."""
    return bool(params.logit_bias or params.min_tokens or params.bad_words
                or params.allowed_token_ids or params.repetition_penalty != 1.0
                or params.frequency_penalty or params.presence_penalty
                or params.thinking_token_budget is not None)


def row_adjustment(params, prompt_ids: list[int], output_ids: list[int],
                   eos_ids: frozenset[int], bad_words_ids: list[list[int]],
                   forced: int | None = None) -> RowAdjustment | None:
    """The adjustments of one request's next token, or None if it has none.

    Args:
        params: the request's ``SamplingParams``.
        prompt_ids, output_ids: its tokens so far.
        eos_ids: the model's EOS ids (banned, with ``stop_token_ids``, before ``min_tokens``).
        bad_words_ids: token sequences of its bad words; a sequence's last token is banned
            when the output ends with the rest of it.
        forced: a token that must come next (the thinking budget's end-of-think marker,
            ``ThinkingBudget.forced``): the row allows only it, and nothing else applies
            (a bias, ban or penalty could only leave it without a finite logit).
    """
    if forced is not None:
        return RowAdjustment({}, set(), {}, 1.0, [int(forced)])
    pre: dict[int, float] = {}
    for token, bias in (params.logit_bias or {}).items():
        pre[int(token)] = pre.get(int(token), 0.0) + float(bias)
    banned = set()
    if len(output_ids) < params.min_tokens:
        banned |= set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_ids))
    for word in bad_words_ids:
        if len(word) <= len(output_ids) + 1 and output_ids[len(output_ids) - len(word) + 1:] == \
                word[:-1]:
            banned.add(word[-1])
    for token in banned:
        pre[token] = -np.inf
    repeat = set(prompt_ids) | set(output_ids) if params.repetition_penalty != 1.0 else set()
    post: dict[int, float] = {}
    if params.frequency_penalty or params.presence_penalty:
        for token, count in Counter(output_ids).items():
            post[token] = -params.frequency_penalty * count - params.presence_penalty
    allowed = list(params.allowed_token_ids) if params.allowed_token_ids else None
    if not (pre or repeat or post or allowed):
        return None
    return RowAdjustment(pre, repeat, post, float(params.repetition_penalty), allowed)


def _bucket(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def capacity(vocab_size: int, max_model_len: int) -> int:
    """Entries per row (K, and A allowed tokens) that every step is compiled for: the whole
    vocabulary, or 2 x ``max_model_len`` (rounded up to a power of two) when that is
    smaller, which holds a repetition penalty over a whole ``max_model_len`` sequence plus
    as many logit-bias and banned entries. A row needing more makes a new step shape."""
    return min(_bucket(vocab_size), 2 * _bucket(max_model_len))


def pack(rows: list[RowAdjustment | None], padded: int, capacity: int = 16) -> LogitsAdjustment:
    """Numpy arrays for ``padded`` rows, K and A entries per row: ``capacity`` (a power of
    two), or the next power of two above it when a row needs more (a new step shape)."""
    entries = []
    for r in rows:
        if r is None:
            entries.append([])
            continue
        tokens = sorted(set(r.pre) | r.repeat | set(r.post))
        entries.append([(t, r.pre.get(t, 0.0), t in r.repeat, r.post.get(t, 0.0)) for t in tokens])
    k = max(capacity, _bucket(max((len(e) for e in entries), default=0)))
    a = max(capacity, _bucket(max((len(r.allowed) for r in rows if r and r.allowed), default=0)))
    out = no_adjustment(padded, k, a, copy=True)
    ids, pre, repeat, post, penalty, allowed_ids, has_allowed = (
        out.ids, out.pre, out.repeat, out.post, out.repetition_penalty, out.allowed_ids,
        out.has_allowed)
    for i, (r, e) in enumerate(zip(rows, entries)):
        if r is None:
            continue
        for j, (t, p_, rep, po) in enumerate(e):
            ids[i, j], pre[i, j], repeat[i, j], post[i, j] = t, p_, rep, po
        penalty[i] = r.repetition_penalty
        if r.allowed:
            allowed_ids[i, :len(r.allowed)] = r.allowed
            has_allowed[i] = True
    return out


@functools.lru_cache(maxsize=64)
def _empty(padded: int, k: int, a: int) -> LogitsAdjustment:
    arrays = (np.full((padded, k), _PAD_ID, np.int32), np.zeros((padded, k), np.float32),
              np.zeros((padded, k), bool), np.zeros((padded, k), np.float32),
              np.ones(padded, np.float32), np.full((padded, a), _PAD_ID, np.int32),
              np.zeros(padded, bool))
    for x in arrays:
        x.flags.writeable = False
    return LogitsAdjustment(*arrays)


def no_adjustment(padded: int, k: int, a: int, copy: bool = False) -> LogitsAdjustment:
    """No adjustment for any of ``padded`` rows, as [padded, k] / [padded, a] arrays (a
    shared read-only set unless ``copy``): what a step without adjustments sends, so that it
    runs the same executable as one with them."""
    out = _empty(padded, k, a)
    return jax.tree.map(np.array, out) if copy else out


def apply(logits: jax.Array, adj: LogitsAdjustment) -> jax.Array:
    """logits: [B, V] float32 -> adjusted [B, V] float32 (see the module docstring)."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    allowed = jnp.zeros((b, v), bool).at[rows, adj.allowed_ids].set(True, mode="drop")
    logits = jnp.where(adj.has_allowed[:, None] & ~allowed, -jnp.inf, logits)
    logits = logits.at[rows, adj.ids].add(adj.pre, mode="drop")
    repeat = jnp.zeros((b, v), bool).at[rows, adj.ids].set(adj.repeat, mode="drop")
    r = adj.repetition_penalty[:, None]
    logits = jnp.where(repeat, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits.at[rows, adj.ids].add(adj.post, mode="drop")


def has_entries(adj: LogitsAdjustment, xp=np):
    """Whether any row of ``adj`` has an entry: a bool on the host (``xp`` numpy, numpy
    arrays), a [] bool array inside jit (``xp`` ``jax.numpy``)."""
    return xp.any(adj.ids != _PAD_ID) | xp.any(adj.has_allowed)


def apply_if_any(logits: jax.Array, adj: LogitsAdjustment) -> jax.Array:
    """:func:`apply` when any row of ``adj`` has an entry, else ``logits`` unchanged, decided
    on the device (``lax.cond``), so one executable serves steps with and without them."""
    return jax.lax.cond(has_entries(adj, jnp), apply, lambda x, _: x, logits, adj)
